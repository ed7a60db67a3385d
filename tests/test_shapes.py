"""Issue 14: config.json as transformers' own `save_pretrained` writes it, for every published geometry.

The per_layer_config dialect comes from the producer (scripts/matrix/resave.py: AutoConfig.from_pretrained +
save_pretrained), in this venv's transformers and, in the vLLM envs, under 5.14.1 and the newest 5.x. It must
read, inspect and convert exactly like the published (legacy) file: same geometry, same output tensors, same
geometry keys. Presets have 12 layers so transformers' zero-padded keys ("05", "11") appear.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from _checkpoints import load_tensors, read_config, text_config
from converter.gemma4 import FULL, read_spec
from matrix.synthetic import (assistant_config, modelopt_nvfp4_config, scaled_preset, target_config,
                                         tiny_preset, write_pair)
from _vllm_envs import find_env

PRESET_NAMES = ("31b", "26b-a4b", "e2b", "e4b")
LAYERS = 12
GEOMETRY = ("head_dim", "global_head_dim", "num_key_value_heads", "num_global_key_value_heads", "attention_k_eq_v",
            "layer_types")


def _preset(name: str):
    return scaled_preset(name, width_divisor=16, num_layers=LAYERS, vocab_size=256)


# ------------------------------------------------------------------------------------ the producer itself

@pytest.mark.parametrize("name", PRESET_NAMES)
def test_factory_dialect_is_what_the_transformers_config_classes_write(name, tmp_path):
    """The re-saved file == Gemma4Config(text_config=Gemma4TextConfig(**kwargs), ...).save_pretrained()."""
    from transformers import Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig
    p = _preset(name)
    factory = target_config(p, dialect="per_layer_config", multimodal=True)
    hub = target_config(p, dialect="legacy", multimodal=True)
    strip = ("model_type", "dtype", "architectures", "transformers_version")
    top = {k: v for k, v in hub.items() if k not in (*strip, "text_config", "vision_config")}
    Gemma4Config(text_config=Gemma4TextConfig(**{k: v for k, v in hub["text_config"].items() if k != "model_type"}),
                 vision_config=Gemma4VisionConfig(**{k: v for k, v in hub["vision_config"].items()
                                                     if k != "model_type"}),
                 architectures=hub["architectures"], dtype="bfloat16", **top).save_pretrained(tmp_path)
    assert factory == read_config(tmp_path)
    saved = factory["text_config"]
    width = len(str(max(i for i, t in enumerate(p.layer_types) if t == FULL)))
    override = {"head_dim": p.global_head_dim, **({"num_key_value_heads": p.num_global_kv_heads} if p.k_eq_v else {})}
    assert saved["per_layer_config"] == {str(i).zfill(width): override for i, t in enumerate(p.layer_types) if t == FULL}
    assert "global_head_dim" not in saved and "num_global_key_value_heads" not in saved


def test_full_size_31b_keys_are_zero_padded_and_the_vision_rope_is_axial():
    """docs/DESIGN.md "Gemma 4 checkpoints in the wild", at the real 60 layers (config only, no tensors)."""
    config = target_config(scaled_preset("31b"), dialect="per_layer_config", multimodal=True)
    assert list(text_config(config)["per_layer_config"]) == [f"{i:02d}" for i in range(5, 60, 6)]
    assert config["vision_config"]["rope_parameters"]["rope_type"] == "axial"
    assert read_spec(config, source="config.json").attention == read_spec(
        target_config(scaled_preset("31b"), dialect="legacy", multimodal=True), source="config.json").attention


@pytest.mark.parametrize("name", PRESET_NAMES)
@pytest.mark.parametrize("role", ["target", "assistant"])
def test_resaved_config_reads_like_the_published_one(name, role):
    p = _preset(name)
    make = (lambda d: target_config(p, dialect=d, multimodal=True)) if role == "target" else (
        lambda d: assistant_config(p, dialect=d))
    legacy, resaved = read_spec(make("legacy"), source="legacy"), read_spec(make("per_layer_config"), source="new")
    assert resaved.dialect == "per_layer_config"
    assert (resaved.attention, resaved.role, resaved.multimodal, resaved.backbone_hidden_size) == (
        legacy.attention, legacy.role, legacy.multimodal, legacy.backbone_hidden_size)


# ------------------------------------------------------------------------------------ through the CLI

def _digests(directory: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(directory.glob("*.safetensors"))}


def _same_conversion(run_cli, legacy: Path, resaved: Path, out: Path, layout: str) -> None:
    """Both sources convert to byte-identical tensors and identical geometry keys; inspect agrees on geometry."""
    for name, src in (("legacy", legacy), ("resaved", resaved)):
        result = run_cli("convert", "--target", src / "target", "--assistant", src / "assistant",
                         "--out", out / name, "--layout", layout)
        assert result.code == 0, result.err
    for role in ("target", "assistant"):
        a, b = out / "legacy" / role, out / "resaved" / role
        assert _digests(a) == _digests(b), role
        assert {k: text_config(read_config(a))[k] for k in GEOMETRY} == \
            {k: text_config(read_config(b))[k] for k in GEOMETRY}
        assert "per_layer_config" not in text_config(read_config(b))
        reports = [json.loads(run_cli("inspect", "--json", src / role).out) for src in (legacy, resaved)]
        assert reports[0]["geometry"] == reports[1]["geometry"]
        assert reports[0]["layers"] == reports[1]["layers"] and not reports[1]["problems"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """preset -> (legacy pair, pair re-saved by this venv's transformers); same seed, so the same tensors."""
    root = tmp_path_factory.mktemp("shapes")
    built = {}
    for name in PRESET_NAMES:
        multimodal = name != "e2b"  # one text-only target among them
        for dialect in ("legacy", "per_layer_config"):
            write_pair(root / name / dialect, preset=_preset(name), dialect=dialect, multimodal=multimodal)
        built[name] = (root / name / "legacy", root / name / "per_layer_config")
    return built


@pytest.mark.parametrize("layout", ["per-layer", "pad-global"])
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_resaved_pair_converts_exactly_like_the_published_one(sources, run_cli, tmp_path, name, layout):
    legacy, resaved = sources[name]
    keys = list(text_config(read_config(resaved / "target"))["per_layer_config"])
    assert keys[0].startswith("0") and {len(k) for k in keys} == {2}, keys  # "05", "11" (zero-padded)
    _same_conversion(run_cli, legacy, resaved, tmp_path, layout)


@pytest.mark.parametrize("env_name", ["5.14.1", "newest"])
def test_every_transformers_version_in_the_env_matrix(sources, run_cli, tmp_path, env_name):
    """Configs re-saved by the vLLM envs' transformers: 5.14.1 keeps the legacy keys, >= 5.15 writes
    per_layer_config; either converts like the published file."""
    env = find_env("vllm", "0.27.0", env_name)  # any env's python carries one transformers release
    dialect = "legacy" if env.transformers == "5.14.1" else "per_layer_config"
    for name in PRESET_NAMES:
        saved = tmp_path / name / "saved"
        write_pair(saved, preset=_preset(name), dialect=dialect, multimodal=name != "e2b", saved_by=str(env.python))
        assert read_config(saved / "target")["transformers_version"] == env.transformers
        assert read_spec(read_config(saved / "target"), source="t").dialect == dialect
        for layout in ("per-layer", "pad-global"):
            _same_conversion(run_cli, sources[name][0], saved, tmp_path / name / layout, layout)


# ------------------------------------------------------------------------------------ 26B-A4B MoE block

MOE_TENSORS = ("router.proj.weight", "router.scale", "router.per_expert_scale", "experts.gate_up_proj",
               "experts.down_proj", "post_feedforward_layernorm_1.weight", "post_feedforward_layernorm_2.weight",
               "pre_feedforward_layernorm_2.weight")


@pytest.mark.parametrize("layout", ["per-layer", "pad-global"])
def test_every_layout_copies_the_moe_block_raw(sources, run_cli, tmp_path, layout):
    src = sources["26b-a4b"][0]
    result = run_cli("convert", "--target", src / "target", "--assistant", src / "assistant", "--out", tmp_path / "out",
                     "--layout", layout)
    assert result.code == 0, result.err
    source, output = load_tensors(src / "target"), load_tensors(tmp_path / "out" / "target")
    moe = [n for n in source if n.split(".layers.")[-1].split(".", 1)[-1] in MOE_TENSORS]
    assert len(moe) == LAYERS * len(MOE_TENSORS)
    assert all(output[n].dtype == source[n].dtype and torch.equal(output[n], source[n]) for n in moe)
    manifest = json.loads((tmp_path / "out" / "target" / "conversion.json").read_text())
    assert {t["action"] for t in manifest["tensors"] if t["name"] in moe} == {"kept"}


# ------------------------------------------------------------------------------------ Model Optimizer NVFP4

@pytest.fixture(scope="module")
def nvfp4_pair(tmp_path_factory):
    """Like nvidia/Gemma-4-31B-IT-NVFP4: MLPs NVFP4 (group 16), every self_attn module excluded (bf16)."""
    root = tmp_path_factory.mktemp("nvfp4")
    write_pair(root, preset=tiny_preset("31b"), num_shards=2, quantization=modelopt_nvfp4_config())
    return root


def test_nvfp4_pad_global_transforms_bf16_attention_and_copies_fp4_raw(nvfp4_pair, run_cli, tmp_path):
    out = tmp_path / "out"
    result = run_cli("convert", "--target", nvfp4_pair / "target", "--assistant", nvfp4_pair / "assistant",
                     "--out", out, "--layout", "pad-global")
    assert result.code == 0, result.err
    source, output = load_tensors(nvfp4_pair / "target"), load_tensors(out / "target")
    quantized = [n for n, t in source.items() if ".mlp." in n and n.endswith(("weight_scale", "weight_scale_2",
                                                                                  "input_scale"))]
    packed = [n for n, t in source.items() if t.dtype == torch.uint8]
    assert len(packed) == 3 * 6 and len(quantized) == 3 * 3 * 6  # gate/up/down in each of the 6 layers
    assert all(torch.equal(output[n], source[n]) for n in packed + quantized)
    q = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert source[q].dtype == torch.bfloat16 and output[q].shape[0] == 2 * source[q].shape[0]
    assert (out / "target" / "hf_quant_config.json").read_bytes() == \
        (nvfp4_pair / "target" / "hf_quant_config.json").read_bytes()
    assert read_config(out / "target")["quantization_config"] == read_config(nvfp4_pair / "target")[
        "quantization_config"]
    verified = run_cli("verify", "--target", nvfp4_pair / "target", "--assistant", nvfp4_pair / "assistant",
                       "--converted", out, "--device", "cpu")
    assert verified.code == 0, verified.out


def test_inspect_shows_nvfp4_mlp_and_bf16_attention(nvfp4_pair, run_cli):
    report = json.loads(run_cli("inspect", "--json", nvfp4_pair / "target").out)
    assert report["quantization"]["method"] == "modelopt"
    assert report["quantization"]["attention_schemes"] == []
    assert report["quantization"]["mlp_schemes"] == ["modelopt NVFP4 group 16"]
    assert set(report["layers"][0]["quantization"].values()) == {"unquantized (ignored)"}
    assert not report["problems"]


def test_hf_quant_config_alone_is_read_like_vllm_does(nvfp4_pair, tmp_path, run_cli):
    """vLLM 0.27 falls back to hf_quant_config.json when config.json has no quantization_config."""
    import shutil
    target = tmp_path / "target"
    shutil.copytree(nvfp4_pair / "target", target)
    document = read_config(target)
    del document["quantization_config"]
    (target / "config.json").write_text(json.dumps(document))
    report = json.loads(run_cli("inspect", "--json", target).out)
    assert report["quantization"]["method"] == "modelopt"
    assert report["quantization"]["ignore"] == list(modelopt_nvfp4_config()["ignore"])


# ------------------------------------------------------------------------------------ gemma4_unified

@pytest.mark.parametrize("layout", ["per-layer", "pad-global"])
def test_unified_pair_converts_like_gemma4(tmp_path, run_cli, layout):
    """Same text geometry and attention names as gemma4 (vLLM 0.27 serves it with the same Gemma4ForCausalLM and
    Gemma4MTP); the encoder-free vision embedder (released names: model.vision_embedder.*) is copied raw."""
    src = tmp_path / "src"
    write_pair(src, preset=tiny_preset("31b"), num_shards=2, unified=True)
    report = json.loads(run_cli("inspect", "--json", src / "target").out)
    assert report["model_type"] == "gemma4_unified" and report["multimodal"] and not report["problems"]
    assert json.loads(run_cli("inspect", "--json", src / "assistant").out)["model_type"] == "gemma4_unified_assistant"
    result = run_cli("convert", "--target", src / "target", "--assistant", src / "assistant", "--out",
                     tmp_path / "out", "--layout", layout)
    assert result.code == 0, result.err
    source, output = load_tensors(src / "target"), load_tensors(tmp_path / "out" / "target")
    vision = [n for n in source if n.startswith(("model.vision_embedder.", "model.embed_vision."))]
    assert "model.vision_embedder.patch_dense.weight" in vision
    assert all(torch.equal(output[n], source[n]) for n in vision)
    text = text_config(read_config(tmp_path / "out" / "target"))
    assert text["model_type"] == "gemma4_unified_text" and "per_layer_config" not in text

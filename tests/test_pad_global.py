"""`convert --layout pad-global` structure: shapes, config, exact transforms, pairing rules, recognition.

Numerical equivalence of the padded model is proven in test_equivalence.py.
"""

import hashlib
import json

import pytest
import torch

from _checkpoints import load_tensors, read_config, text_config
from converter.transforms import pad_head_columns, pad_head_norm, pad_head_rows, replicate_kv_heads


def _convert(run_cli, out, *, target=None, assistant=None, expect=0):
    args = ["convert", "--out", out, "--layout", "pad-global"]
    args += ["--target", target] if target else []
    args += ["--assistant", assistant] if assistant else []
    result = run_cli(*args)
    assert result.code == expect, result.err
    return result


@pytest.mark.parametrize("preset, options", [("31b", {"num_shards": 2}), ("e2b", {"multimodal": False}),
                                             ("26b-a4b", {"multimodal": False, "dialect": "per_layer_config"}),
                                             ("31b", {"fused_qkv": True, "multimodal": False})])
def test_every_tensor_is_its_exact_transform(synthetic_cache, tmp_path, run_cli, preset, options):
    src = synthetic_cache(preset, "pair", **options)
    out = tmp_path / "out"
    _convert(run_cli, out, target=src / "target", assistant=src / "assistant")
    for role in ("target", "assistant"):
        source_text = text_config(read_config(src / role))
        config = text_config(read_config(out / role))
        d, big = source_text["head_dim"], config["global_head_dim"]
        kv, heads = source_text["num_key_value_heads"], source_text["num_attention_heads"]
        global_kv = source_text.get("num_global_key_value_heads") or \
            next(iter(source_text.get("per_layer_config", {}).values()), {}).get("num_key_value_heads", kv)
        k_eq_v = source_text["attention_k_eq_v"]
        assert (config["head_dim"], config["global_head_dim"]) == (big, big)
        assert config["num_global_key_value_heads"] == config["num_key_value_heads"] == kv
        assert config["attention_k_eq_v"] == k_eq_v and "per_layer_config" not in config
        assert config["layer_types"] == source_text["layer_types"]
        source, output = load_tensors(src / role), load_tensors(out / role)
        prefix = "model.language_model." if read_config(src / role)["model_type"] == "gemma4" else "model."
        for name, tensor in output.items():
            marker = ".self_attn."
            if not name.startswith(prefix + "layers.") or marker not in name:
                assert torch.equal(tensor, source[name]), name
                continue
            layer = int(name[len(prefix + "layers."):].split(".")[0])
            full = config["layer_types"][layer] == "full_attention"
            module = name.split(marker)[1].split(".")[0]
            original = _source_tensor(source, name, module, heads=heads, d=big if full else d,
                                      kv=global_kv if (full and k_eq_v) else kv, has_v=not (full and k_eq_v))
            if full:
                reps = kv // global_kv if k_eq_v else 1
                want = replicate_kv_heads(original, num_heads=global_kv, head_dim=big, repeats=reps) \
                    if module == "k_proj" and reps > 1 else original
            elif module in ("q_proj", "k_proj", "v_proj"):
                want = pad_head_rows(original, num_heads=heads if module == "q_proj" else kv, head_dim=d,
                                     target_head_dim=big)
            elif module in ("q_norm", "k_norm"):
                want = pad_head_norm(original, head_dim=d, target_head_dim=big)
            else:
                want = pad_head_columns(original, num_heads=heads, head_dim=d, target_head_dim=big)
            assert want.dtype == tensor.dtype and torch.equal(tensor, want), name


def _source_tensor(source, name, module, *, heads, d, kv, has_v):
    if name in source:
        return source[name]
    fused = source[name.replace(f"{module}.", "qkv_proj.")]  # a fused source: take this module's rows
    q, k = heads * d, kv * d
    return {"q_proj": fused[:q], "k_proj": fused[q:q + k], "v_proj": fused[q + k:q + 2 * k] if has_v else None}[module]


def test_output_geometry_is_homogeneous_and_the_pair_checks(pair, tmp_path, run_cli):
    out = tmp_path / "out"
    result = _convert(run_cli, out, target=pair / "target", assistant=pair / "assistant")
    assert "--attention-backend TRITON_ATTN" in result.out
    assert "KV cache per token (every layer holds the full context): 5.5 KiB -> 12.0 KiB (x2.18)" in result.out
    report = json.loads(run_cli("inspect", "--json", out / "target").out)
    assert report["geometry"]["homogeneous"] and report["conversion"]["layout"] == "pad-global"
    assert report["conversion"]["recognized"] is True
    assert {(row["head_dim"], row["kv_heads"]) for row in report["layers"]} == {(32, 16)}
    assert report["vllm_0_27"]["transformers>=5.15"]["outcome"] == "loads"
    assert run_cli("check-pair", out / "target", out / "assistant").code == 0


def test_one_sided_conversion_warns_and_the_mismatch_is_flagged(pair, tmp_path, run_cli):
    out = tmp_path / "target-only"
    result = _convert(run_cli, out, target=pair / "target")
    assert "pad-global converted only the target" in result.err
    manifest = json.loads((out / "target" / "conversion.json").read_text())
    assert manifest["converted_with_pair"] is False
    assert any("MUST get the same pad-global conversion" in w for w in manifest["warnings"])
    clash = run_cli("check-pair", out / "target", pair / "assistant")
    assert clash.code == 1 and "MISMATCH" in clash.out and "layouts differ" in clash.out
    # the original pair passes; a per-layer pair passes
    assert run_cli("check-pair", pair / "target", pair / "assistant").code == 0


def test_non_integer_ratio_is_refused(synthetic_cache, tmp_path, run_cli):
    from matrix.synthetic import tiny_preset, write_pair
    from dataclasses import replace
    preset = replace(tiny_preset("31b"), global_head_dim=24)
    src = tmp_path / "src"
    write_pair(src, preset=preset, multimodal=False)
    result = _convert(run_cli, tmp_path / "out", target=src / "target", assistant=src / "assistant", expect=3)
    assert "global_head_dim (24) to be an integer multiple of an even head_dim (16)" in result.err
    assert not (tmp_path / "out").exists()


def test_mismatched_pair_is_refused_before_writing(synthetic_cache, tmp_path, run_cli):
    target = synthetic_cache("31b", "pair") / "target"
    assistant = synthetic_cache("e2b", "pair", multimodal=False) / "assistant"
    result = _convert(run_cli, tmp_path / "out", target=target, assistant=assistant, expect=3)
    assert "cannot serve with" in result.err and "backbone_hidden_size" in result.err
    assert not (tmp_path / "out").exists()


def test_converting_the_output_again_is_refused(pair, tmp_path, run_cli):
    out = tmp_path / "out"
    _convert(run_cli, out, target=pair / "target", assistant=pair / "assistant")
    again = _convert(run_cli, tmp_path / "again", target=out / "target", assistant=out / "assistant", expect=3)
    assert "already an output of gemma4-convert (layout pad-global)" in again.err


def test_growth_matches_the_geometry(pair, tmp_path, run_cli):
    """Extra bytes = sliding q/k/v/o doubled + full k_proj replicated (+ norms), for both checkpoints."""
    out = tmp_path / "out"
    _convert(run_cli, out, target=pair / "target", assistant=pair / "assistant")
    config = text_config(read_config(pair / "target"))
    hidden, heads, kv, gkv, d = (config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                     "num_global_key_value_heads", "head_dim"))
    sliding = config["layer_types"].count("sliding_attention")
    full = len(config["layer_types"]) - sliding
    grown = sliding * (2 * heads * d * hidden + 2 * kv * d * hidden + 2 * d) + full * (kv - gkv) * 2 * d * hidden
    size = lambda p: sum(f.stat().st_size for f in p.glob("*.safetensors"))  # noqa: E731
    index = json.loads((out / "target" / "model.safetensors.index.json").read_text())
    source_index = json.loads((pair / "target" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] - source_index["metadata"]["total_size"] == grown * 2  # bf16
    assert size(out / "target") > size(pair / "target")


@pytest.mark.parametrize("max_shard_size", [None, "20MB"], ids=["default-shards", "sources-split"])
def test_every_recorded_sha256_is_the_file_s(pair, tmp_path, run_cli, max_shard_size):
    """Rewritten shards, sources hashed by readers of their own beside them (also when one source is split across
    output shards): conversion.json records every file's real sha256, on both sides."""
    out = tmp_path / "out"
    extra = ["--max-shard-size", max_shard_size] if max_shard_size else []
    assert run_cli("convert", "--target", pair / "target", "--assistant", pair / "assistant", "--out", out,
                   "--layout", "pad-global", *extra).code == 0
    for role in ("target", "assistant"):
        manifest = json.loads((out / role / "conversion.json").read_text())
        assert "written" in manifest["output"]["made"].values()
        for side, root in (("source", pair / role), ("output", out / role)):
            for name, digest in manifest[side]["files"].items():
                assert hashlib.sha256((root / name).read_bytes()).hexdigest() == digest, (side, name)

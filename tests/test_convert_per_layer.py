"""`convert --layout per-layer`: explicit keys, bit-identical tensors, copied files, index, refusals."""

import hashlib
import json
import shutil

import pytest
import torch

from _checkpoints import load_tensors, read_config, text_config
from converter.gemma4 import ALLOW_GLOBAL_ACCESS, DUAL_KEYS, GEOMETRY_KEYS, GLOBAL_ALIASES, Role

PRESET_CASES = [("31b", {"num_shards": 2}), ("26b-a4b", {"multimodal": False}), ("e2b", {"multimodal": False}),
                ("e4b", {"multimodal": False, "num_shards": 3})]


def _convert(run_cli, src, out, layout="per-layer", *options):
    result = run_cli("convert", "--target", src / "target", "--assistant", src / "assistant", "--out", out,
                     "--layout", layout, *options)
    assert result.code == 0, result.err
    return result


FLAT_ONLY_CASES = [("31b", {"num_shards": 2}, "legacy"), ("e2b", {"multimodal": False}, "per_layer_config")]


@pytest.mark.parametrize("dialect", ["legacy", "per_layer_config", "both"])
@pytest.mark.parametrize("preset, options", PRESET_CASES)
def test_per_layer_output_has_explicit_keys_and_identical_tensors(synthetic_cache, tmp_path, run_cli, preset,
                                                                   options, dialect):
    _check_per_layer_output(synthetic_cache, tmp_path, run_cli, preset, options, dialect, flat_only=False)


@pytest.mark.parametrize("preset, options, dialect", FLAT_ONLY_CASES)
def test_flat_keys_only_writes_bare_flat_keys(synthetic_cache, tmp_path, run_cli, preset, options, dialect):
    _check_per_layer_output(synthetic_cache, tmp_path, run_cli, preset, options, dialect, flat_only=True)


def _check_per_layer_output(synthetic_cache, tmp_path, run_cli, preset, options, dialect, *, flat_only):
    src = synthetic_cache(preset, "pair", dialect=dialect, **options)
    out = tmp_path / "out"
    result = _convert(run_cli, src, out, "per-layer", *(["--flat-keys-only"] if flat_only else []))
    assert "vllm serve" in result.out and '"method": "mtp"' in result.out
    assert ("--flat-keys-only needs transformers<5.15 where vLLM runs" in result.out) == flat_only
    added = set(GEOMETRY_KEYS) | (set() if flat_only else set(DUAL_KEYS))
    for role in ("target", "assistant"):
        source_config, output_config = read_config(src / role), read_config(out / role)
        source_text, output_text = text_config(source_config), text_config(output_config)
        assert "per_layer_config" not in output_text
        assert set(output_text) == (set(source_text) - {"per_layer_config"}) | added
        for key in set(source_text) - {"per_layer_config", *GEOMETRY_KEYS}:
            assert output_text[key] == source_text[key], key
        if not flat_only:  # the aliases vLLM reads carry the same values transformers >= 5.15 pops
            assert output_text[ALLOW_GLOBAL_ACCESS] is True and output_text["attribute_map"] == GLOBAL_ALIASES
            for name, alias in GLOBAL_ALIASES.items():
                assert output_text[alias] == output_text[name], alias
        assert json.loads((out / role / "conversion.json").read_text())["layout_options"] == \
            {"keys": "flat" if flat_only else "dual"}
        if "text_config" in source_config:  # the wrapper's own keys are untouched, but for the vision rope name
            rope = (source_config.get("vision_config") or {}).get("rope_parameters")
            # transformers >= 5.15 re-saves it as "axial", which 5.14.1 cannot build; "default" reads everywhere
            want = {**rope, "rope_type": "default"} if rope and rope["rope_type"] == "axial" else rope
            assert (output_config.get("vision_config") or {}).get("rope_parameters") == want
            assert {k: v for k, v in output_config.items() if k not in ("text_config", "vision_config")} == \
                {k: v for k, v in source_config.items() if k not in ("text_config", "vision_config")}
        full = source_text["layer_types"].index("full_attention")
        full_q = load_tensors(src / role)[_q_name(source_config, full)]
        assert output_text["global_head_dim"] * output_text["num_attention_heads"] == full_q.shape[0]
        assert output_text["head_dim"] == source_text["head_dim"]
        source_tensors, output_tensors = load_tensors(src / role), load_tensors(out / role)
        assert source_tensors.keys() == output_tensors.keys()
        for name, tensor in source_tensors.items():
            assert output_tensors[name].dtype == tensor.dtype and torch.equal(output_tensors[name], tensor), name


def _q_name(config, layer):
    prefix = "model.language_model." if config["model_type"] == "gemma4" else "model."
    return f"{prefix}layers.{layer}.self_attn.q_proj.weight"


def test_fused_qkv_is_split_into_exact_row_ranges(synthetic_cache, tmp_path, run_cli):
    src = synthetic_cache("31b", "target", fused_qkv=True, multimodal=False)
    out = tmp_path / "out"
    assert run_cli("convert", src, "--out", out, "--layout", "per-layer").code == 0
    source, output = load_tensors(src), load_tensors(out)
    config = text_config(read_config(out))
    for layer, layer_type in enumerate(config["layer_types"]):
        fused = source[f"model.layers.{layer}.self_attn.qkv_proj.weight"]
        full = layer_type == "full_attention"
        head_dim = config["global_head_dim"] if full else config["head_dim"]
        kv = config["num_global_key_value_heads"] if full else config["num_key_value_heads"]
        q_rows, kv_rows = config["num_attention_heads"] * head_dim, kv * head_dim
        base = f"model.layers.{layer}.self_attn."
        assert torch.equal(output[base + "q_proj.weight"], fused[:q_rows])
        assert torch.equal(output[base + "k_proj.weight"], fused[q_rows:q_rows + kv_rows])
        if full:  # k_eq_v: no v_proj
            assert base + "v_proj.weight" not in output and fused.shape[0] == q_rows + kv_rows
        else:
            assert torch.equal(output[base + "v_proj.weight"], fused[q_rows + kv_rows:])
        assert base + "qkv_proj.weight" not in output
    manifest = json.loads((out / "conversion.json").read_text())
    split = [t for t in manifest["tensors"] if t["action"] == "split"]
    assert len(split) == 5 * 3 + 2 and all("rows" in t for t in split)


def test_index_metadata_and_side_files(pair, tmp_path, run_cli):
    out = tmp_path / "out"
    _convert(run_cli, pair, out)
    target = out / "target"
    index = json.loads((target / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in target.glob("*.safetensors"))
    assert shards == sorted(p.name for p in (pair / "target").glob("*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == shards
    tensors = load_tensors(target)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    from safetensors import safe_open
    with safe_open(str(target / shards[0]), "pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (target / name).read_bytes() == (pair / "target" / name).read_bytes()
    # the source's card is kept beside this tool's, which is the output's README.md (an uploadable repo)
    assert (target / "README.source.md").read_bytes() == (pair / "target" / "README.md").read_bytes()
    assert (target / "README.md").read_text().startswith("---\n") and "gemma4-convert" in (target / "README.md").read_text()
    assert not (out / "assistant" / "model.safetensors.index.json").exists()  # single file stays single
    manifest = json.loads((target / "conversion.json").read_text())
    for name, digest in manifest["output"]["files"].items():
        assert hashlib.sha256((target / name).read_bytes()).hexdigest() == digest, name
    for name, digest in manifest["source"]["files"].items():
        assert hashlib.sha256((pair / "target" / name).read_bytes()).hexdigest() == digest, name
    assert manifest["layout"] == "per-layer" and manifest["converted_with_pair"] is True
    assert {t["action"] for t in manifest["tensors"]} == {"kept"}


def test_dry_run_writes_nothing(pair, tmp_path, run_cli):
    out = tmp_path / "out"
    result = run_cli("convert", "--target", pair / "target", "--out", out, "--layout", "per-layer", "--dry-run")
    assert result.code == 0 and "dry run: nothing written" in result.out
    assert "model-00001-of-00002.safetensors" in result.out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_existing_output_is_refused_then_replaced_with_force(pair, tmp_path, run_cli):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run_cli("convert", "--assistant", pair / "assistant", "--out", out, "--layout", "per-layer")
    assert result.code == 4 and "already exists" in result.err and (out / "keep.txt").exists()
    # --force never deletes a directory this tool did not write
    result = run_cli("convert", "--assistant", pair / "assistant", "--out", out, "--layout", "per-layer", "--force")
    assert result.code == 4 and "refusing to --force-replace" in result.err and (out / "keep.txt").exists()
    (out / "keep.txt").unlink()
    assert run_cli("convert", "--assistant", pair / "assistant", "--out", out, "--layout", "per-layer").code == 4
    first = run_cli("convert", "--assistant", pair / "assistant", "--out", out, "--layout", "per-layer", "--force")
    assert first.code == 0 and (out / "assistant" / "conversion.json").exists()
    again = run_cli("convert", "--assistant", pair / "assistant", "--out", out, "--layout", "pad-global", "--force")
    assert again.code == 0
    assert json.loads((out / "assistant" / "conversion.json").read_text())["layout"] == "pad-global"


def test_reconverting_an_output_is_detected(pair, tmp_path, run_cli):
    out = tmp_path / "out"
    _convert(run_cli, pair, out)
    result = run_cli("convert", out / "target", "--out", tmp_path / "again", "--layout", "per-layer")
    assert result.code == 3
    assert "already an output of gemma4-convert (layout per-layer)" in result.err
    assert str((pair / "target").resolve()) in result.err
    assert not (tmp_path / "again").exists()


def test_single_source_converts_straight_into_out(pair, tmp_path, run_cli):
    out = tmp_path / "single"
    result = run_cli("convert", pair / "assistant", "--out", out, "--layout", "per-layer")
    assert result.code == 0
    assert (out / "model.safetensors").exists() and not (out / "assistant").exists()
    assert "per-layer converted only the assistant: convert its target the same way" in result.err
    target_only = run_cli("convert", "--target", pair / "target", "--out", tmp_path / "t", "--layout", "per-layer")
    assert target_only.code == 0 and "converted only" not in target_only.err


def test_role_mismatch_is_a_usage_error(pair, tmp_path, run_cli):
    result = run_cli("convert", "--target", pair / "assistant", "--out", tmp_path / "o", "--layout", "per-layer")
    assert result.code == 2 and "--target" in result.err and "assistant" in result.err


def test_max_shard_size_reshards_by_bytes(pair, tmp_path, run_cli):
    out = tmp_path / "out"
    result = run_cli("convert", pair / "target", "--out", out, "--layout", "per-layer", "--max-shard-size", "4MB")
    assert result.code == 0, result.err
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) >= 4 and shards[0].name.endswith(f"-of-{len(shards):05d}.safetensors")
    sizes = [p.stat().st_size for p in shards]
    assert all(size <= 4_000_000 + 100_000 for size in sizes[:-1])  # header bytes on top of the tensor budget
    assert load_tensors(out).keys() == load_tensors(pair / "target").keys()


def test_source_is_untouched(pair, tmp_path, run_cli):
    before = {p: p.read_bytes() for p in pair.rglob("*") if p.is_file()}
    _convert(run_cli, pair, tmp_path / "a")
    _convert(run_cli, pair, tmp_path / "b", layout="pad-global")
    assert {p: p.read_bytes() for p in pair.rglob("*") if p.is_file()} == before


def test_untouched_tensors_are_never_decoded(pair, tmp_path, monkeypatch):
    """Only the tensors a layout changes go through torch; the rest are byte copies."""
    from converter import pipeline, transforms
    calls = []
    original = transforms.render_transform
    monkeypatch.setattr(transforms, "render_transform", lambda tensor, raw, out=None, companions=(): calls.append(tensor.name)
                        or original(tensor, raw, out, companions))
    plan = pipeline.plan_conversion(pipeline.ConvertRequest(out=tmp_path / "o", layout="pad-global",
                                                            sources={Role.TARGET: pair / "target",
                                                                     Role.ASSISTANT: pair / "assistant"}))
    pipeline.execute(plan)
    transformed = sorted(t.name for item in plan.items for t in item.plan.tensors if not t.is_copy)
    assert sorted(calls) == transformed and 0 < len(calls) < sum(len(i.plan.tensors) for i in plan.items) / 3


@pytest.mark.parametrize("flat_only", [False, True])
def test_verify_replans_with_the_recorded_key_style(synthetic_cache, tmp_path, run_cli, flat_only):
    src = synthetic_cache("31b", "target", multimodal=False)
    out = tmp_path / "out"
    assert run_cli("convert", src, "--out", out, "--layout", "per-layer",
                   *(["--flat-keys-only"] if flat_only else [])).code == 0
    assert run_cli("verify", src, out, "--device", "cpu").code == 0
    # the other key style recorded for the same config is a config mismatch verify must name
    manifest_path = out / "conversion.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["layout_options"] = {"keys": "dual" if flat_only else "flat"}
    manifest_path.write_text(json.dumps(manifest))
    result = run_cli("verify", src, out, "--device", "cpu")
    assert result.code == 1 and "config.json differs from what per-layer requires" in result.out + result.err


def test_manifest_without_layout_options_means_bare_flat_keys(synthetic_cache, tmp_path, run_cli):
    """Outputs written before per-layer had options carry bare flat keys and no `layout_options`."""
    src = synthetic_cache("31b", "target", multimodal=False)
    out = tmp_path / "out"
    assert run_cli("convert", src, "--out", out, "--layout", "per-layer", "--flat-keys-only").code == 0
    manifest = json.loads((out / "conversion.json").read_text())
    del manifest["layout_options"]
    (out / "conversion.json").write_text(json.dumps(manifest))
    assert run_cli("verify", src, out, "--device", "cpu").code == 0
    assert json.loads(run_cli("inspect", out, "--json").out)["conversion"]["recognized"] is True


def test_flat_keys_only_is_refused_for_pad_global(synthetic_cache, tmp_path, run_cli):
    src = synthetic_cache("31b", "pair")
    result = run_cli("convert", "--target", src / "target", "--assistant", src / "assistant",
                     "--out", tmp_path / "out", "--layout", "pad-global", "--flat-keys-only")
    assert result.code == 2 and "--flat-keys-only applies to --layout per-layer only" in result.err
    assert not (tmp_path / "out").exists()


def test_pad_global_drops_dual_keys_of_its_source(synthetic_cache, tmp_path, run_cli):
    """A dual-keys source re-laid out by pad-global must not keep aliases vLLM would read over the padded keys."""
    src = synthetic_cache("31b", "pair")
    zero_cost = tmp_path / "zero-cost"
    _convert(run_cli, src, zero_cost)
    staged = tmp_path / "staged"
    for role in ("target", "assistant"):  # a foreign dual-keys checkpoint: same files, no conversion.json
        shutil.copytree(zero_cost / role, staged / role, ignore=shutil.ignore_patterns("conversion.json"))
    out = tmp_path / "padded"
    _convert(run_cli, staged, out, "pad-global")
    for role in ("target", "assistant"):
        text = text_config(read_config(out / role))
        assert not set(DUAL_KEYS) & set(text)
        assert text["global_head_dim"] == text["head_dim"]

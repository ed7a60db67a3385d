"""`verify` passes real conversions and catches real mistakes, naming the layer at fault."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file



@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny 31B pair converted both ways (module-scoped: tests copy before corrupting)."""
    from converter.gemma4 import Role
    from converter.pipeline import ConvertRequest, execute, plan_conversion
    from matrix.synthetic import tiny_preset, write_pair
    root = tmp_path_factory.mktemp("verify")
    target, assistant = write_pair(root / "src", preset=tiny_preset("31b"), num_shards=2)
    for layout in ("pad-global", "per-layer"):
        execute(plan_conversion(ConvertRequest(out=root / layout, layout=layout,
                                               sources={Role.TARGET: target, Role.ASSISTANT: assistant})))
    return root


def _verify(run_cli, root, converted_dir, *extra):
    return run_cli("verify", "--target", root / "src" / "target", "--assistant", root / "src" / "assistant",
                   "--converted", converted_dir, "--device", "cpu", *extra)


def _copy(converted, tmp_path, layout="pad-global"):
    out = tmp_path / "copy"
    shutil.copytree(converted / layout, out)
    return out


@pytest.mark.parametrize("layout", ["pad-global", "per-layer"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_good_conversions_pass_and_write_the_report(converted, tmp_path, run_cli, layout, dtype):
    out = _copy(converted, tmp_path, layout)
    result = _verify(run_cli, converted, out, "--dtype", dtype, "--json", tmp_path / "report.json")
    assert result.code == 0, result.out + result.err
    report = json.loads((out / "verification.json").read_text())
    assert json.loads((tmp_path / "report.json").read_text()) == report
    assert (out / "target" / "verification.json").exists() and (out / "assistant" / "verification.json").exists()
    assert report["passed"] and report["structural"]["passed"] and report["device"] == "cpu"
    assert report["dtype"] == dtype and report["torch"] == torch.__version__ and report["seed"] == 0
    names = [layer["name"] for layer in report["layers"]]
    assert names == [f"target layer {i} ({'full' if i == 5 else 'sliding'}_attention)" for i in range(6)] + \
        ["assistant hidden", "assistant logits"]
    for layer in report["layers"]:
        assert layer["passed"] and layer["rel_rms"] <= layer["factor"] * layer["noise_floor"]
        assert layer["ratio"] == pytest.approx(layer["rel_rms"] / layer["noise_floor"])
        assert layer["cosine"] > 0.999
    if dtype == "fp32":  # exact up to summation order: relative error at fp32 rounding level
        assert max(layer["max_rel"] for layer in report["layers"]) < 1e-5


def _rewrite(path, name, change):
    tensors = load_file(str(path))
    tensors[name] = change(tensors[name].clone())
    save_file(tensors, str(path), metadata={"format": "pt"})


def _shard_of(directory, name):
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return directory / index["weight_map"][name]


PREFIX = "model.language_model.layers."


def test_one_corrupted_element_is_caught(converted, tmp_path, run_cli):
    out = _copy(converted, tmp_path)
    name = PREFIX + "2.self_attn.v_proj.weight"

    def bump(weight):
        weight[3, 7] = weight[3, 7] * 1.5 + 0.01
        return weight
    _rewrite(_shard_of(out / "target", name), name, bump)
    result = _verify(run_cli, converted, out)
    assert result.code == 1
    assert f"target layer 2: {name}: bytes differ from pad_head_rows" in result.err


def test_swapped_kv_heads_are_caught_numerically_too(converted, tmp_path, run_cli):
    out = _copy(converted, tmp_path)
    name = PREFIX + "5.self_attn.k_proj.weight"  # full k_eq_v layer: 4 global heads replicated to 16

    def swap(weight):
        heads = weight.reshape(16, -1, weight.shape[-1]).clone()
        heads[[0, 15]] = heads[[15, 0]]
        return heads.reshape(weight.shape)
    _rewrite(_shard_of(out / "target", name), name, swap)
    result = _verify(run_cli, converted, out)
    assert result.code == 1 and "target layer 5:" in result.err
    report = json.loads((out / "verification.json").read_text())
    failed = [layer["name"] for layer in report["layers"] if not layer["passed"]]
    assert "target layer 5 (full_attention)" in failed


def test_wrong_padding_placement_is_caught(converted, tmp_path, run_cli):
    """End padding (original dims first, copies after) instead of interleaved-per-half: O(1) wrong under RoPE."""
    out = _copy(converted, tmp_path)
    source = load_file(str(converted / "src" / "target" / "model-00001-of-00002.safetensors"))
    for module, heads in (("q_proj", 32), ("k_proj", 16), ("v_proj", 16)):
        name = PREFIX + f"1.self_attn.{module}.weight"
        original = source[name] if name in source else load_file(
            str(converted / "src" / "target" / "model-00002-of-00002.safetensors"))[name]

        def end_pad(_, original=original, heads=heads):
            per_head = original.reshape(heads, 16, -1)
            return torch.cat([per_head, per_head], dim=1).reshape(heads * 32, -1)
        _rewrite(_shard_of(out / "target", name), name, end_pad)
    result = _verify(run_cli, converted, out)
    assert result.code == 1 and "target layer 1:" in result.err
    report = json.loads((out / "verification.json").read_text())
    layer = next(layer for layer in report["layers"] if layer["name"].startswith("target layer 1 "))
    assert not layer["passed"] and layer["ratio"] > 10


def test_padded_target_with_unconverted_assistant_fails(converted, tmp_path, run_cli):
    out = tmp_path / "mixed"
    out.mkdir()
    shutil.copytree(converted / "pad-global" / "target", out / "target")
    shutil.copytree(converted / "src" / "assistant", out / "assistant")
    result = _verify(run_cli, converted, out)
    assert result.code == 1 and "assistant" in result.err
    report = json.loads((out / "verification.json").read_text())
    assert any("layouts differ" in p or "MISMATCH" in p or "expects (head_dim, KV heads)" in p
               for p in report["structural"]["problems"])
    assistant = next(layer for layer in report["layers"] if layer["name"].startswith("assistant"))
    assert not assistant["passed"] and "K/V" in assistant["note"]


def test_assistant_alone_is_checked_against_placed_kv(converted, tmp_path, run_cli):
    """Without its target, the assistant is fed random K/V placed as a pad-global target would cache them."""
    result = run_cli("verify", converted / "src" / "assistant", converted / "pad-global" / "assistant", "--device",
                     "cpu", "--json", tmp_path / "r.json")
    assert result.code == 0, result.out
    report = json.loads((tmp_path / "r.json").read_text())
    assert [layer["name"] for layer in report["layers"]] == ["assistant hidden", "assistant logits"]



def test_an_assistant_alone_without_its_conversion_json_is_judged_not_refused(converted, tmp_path, run_cli):
    """No conversion.json to name the layout: the K/V are placed by the layout that writes the output's geometry, the
    numbers are computed, and the verdict names the missing file (exit 1), not an unknown layout (exit 2)."""
    out = tmp_path / "assistant"
    shutil.copytree(converted / "pad-global" / "assistant", out)
    (out / "conversion.json").unlink()
    result = run_cli("verify", converted / "src" / "assistant", out, "--device", "cpu", "--json", tmp_path / "r.json")
    assert result.code == 1, result.out + result.err
    assert "has no conversion.json" in result.err
    report = json.loads((tmp_path / "r.json").read_text())
    assert [layer["name"] for layer in report["layers"]] == ["assistant hidden", "assistant logits"]
    assert all(layer["passed"] for layer in report["layers"]), report["layers"]

def test_tp_checks_the_pair_at_the_sizes_served(converted, tmp_path, run_cli):
    """--tp N: the pair's per-rank KV geometry at N, and a size vLLM refuses for the target (31B: 32 heads, 16 / 4 KV
    heads, so 3 divides nothing) fails verify by name; a size it serves passes."""
    out = _copy(converted, tmp_path, "per-layer")
    assert _verify(run_cli, converted, out, "--dtype", "fp32", "--tp", "2", "--tp", "8").code == 0
    result = _verify(run_cli, converted, out, "--dtype", "fp32", "--tp", "3", "--json", tmp_path / "r.json")
    assert result.code == 1, result.out + result.err
    problems = json.loads((tmp_path / "r.json").read_text())["structural"]["problems"]
    assert any("--tensor-parallel-size 3 does not divide the 32 attention heads" in p for p in problems), problems
    assert "tensor-parallel-size 3" in result.err


@pytest.mark.parametrize("layout", ["pad-global", "per-layer"])
def test_the_layouts_cache_placement_is_where_the_converted_target_caches(converted, layout):
    """Layout.cache_placement (what an assistant verified alone is fed) puts the original target's K and V exactly
    where the converted target's own weights cache them, for every layer type."""
    from converter.layouts.base import layout_from_manifest
    from converter.proof.numerics import _as_converted, _placement, check_target_layers
    from converter.proof.reference import text_spec_from_config
    from converter.gemma4 import text_config_of
    from converter.read.checkpoint import read_checkpoint
    source, output = read_checkpoint(converted / "src" / "target"), read_checkpoint(converted / layout / "target")
    _, kv_runs = check_target_layers(source, output, device=torch.device("cpu"), check="fp32", seed=0, seq_len=16,
                                     factor=4.0, on_layer=lambda name: None)
    placed_layout = [layout_from_manifest(output.manifest)]
    before = text_spec_from_config(text_config_of(source.config)).layers
    after = text_spec_from_config(text_config_of(output.config)).layers
    checked = 0
    for layer_type, (key, value) in kv_runs["truth"].items():
        b = next(layer for layer in before if layer.layer_type == layer_type)
        a = next(layer for layer in after if layer.layer_type == layer_type)
        for states, cached, is_key in ((key, kv_runs["converted"][layer_type][0], True),
                                       (value, kv_runs["converted"][layer_type][1], False)):
            placed = _as_converted(states, _placement(placed_layout, b, a, key=is_key), head_dim=a.head_dim)
            assert placed.shape == cached.shape, (layer_type, is_key)
            torch.testing.assert_close(placed.to(cached.dtype), cached, rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked == 4  # K and V of the sliding and the full layer type

"""Google's QAT W4A16 layout (compressed-tensors pack-quantized int4, group 32, weight-only), written by
compressed-tensors' own PackedQuantizationCompressor: per-layer keeps every byte; pad-global moves the codes and
scales exactly where groups of 32 fit half a head (the real 256/512 head sizes) and refuses by name where they do not
(the tiny 32-wide heads). The stock vLLM loader rows for it are in converter/testing/cases.py ("31b-w4a16") and the
ledger."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from conftest import load_tensors, read_config
from converter.testing.synthetic import _w4a16_scheme, tiny_preset, w4a16_quantization_config, write_pair


@pytest.fixture(scope="module")
def w4a16_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("w4a16")
    write_pair(root, preset=tiny_preset("31b", width_divisor=8), num_shards=2, multimodal=False,
               quantization=w4a16_quantization_config())
    return root


def test_the_factory_writes_what_the_qat_checkpoints_hold(w4a16_pair):
    tensors = load_tensors(w4a16_pair / "target")
    q = "model.layers.0.self_attn.q_proj"
    assert tensors[q + ".weight_packed"].dtype.is_floating_point is False
    assert tuple(tensors[q + ".weight_packed"].shape) == (1024, 672 // 8)  # 8 int4 values per int32
    assert tuple(tensors[q + ".weight_scale"].shape) == (1024, 672 // 32)  # one scale per 32 input columns
    assert tensors[q + ".weight_shape"].tolist() == [1024, 672]
    assert "model.layers.5.self_attn.v_proj.weight_packed" not in tensors  # k_eq_v full layer: no v_proj
    weights = read_config(w4a16_pair / "target")["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"]) == (4, 32, True)


def test_per_layer_keeps_every_tensor_and_the_quantization_config(w4a16_pair, tmp_path, run_cli):
    out = tmp_path / "out"
    result = run_cli("convert", "--target", w4a16_pair / "target", "--assistant", w4a16_pair / "assistant",
                     "--out", out, "--layout", "per-layer")
    assert result.code == 0, result.err
    source, output = load_tensors(w4a16_pair / "target"), load_tensors(out / "target")
    assert set(source) == set(output)
    for name, tensor in source.items():
        assert output[name].dtype == tensor.dtype and output[name].equal(tensor), name
    assert read_config(out / "target")["quantization_config"] == read_config(w4a16_pair / "target")[
        "quantization_config"]
    verified = run_cli("verify", "--target", w4a16_pair / "target", "--assistant", w4a16_pair / "assistant",
                       "--converted", out, "--device", "cpu")
    assert verified.code == 0, verified.err
    assert json.loads((out / "verification.json").read_text())["passed"] is True


def test_pad_global_refuses_groups_that_straddle_half_a_head(w4a16_pair, tmp_path, run_cli):
    """32-wide heads: a group of 32 input columns of o_proj spans both halves of a head, so after padding one group
    would mix codes of two source groups; refused by name, nothing written."""
    result = run_cli("convert", "--target", w4a16_pair / "target", "--assistant", w4a16_pair / "assistant",
                     "--out", tmp_path / "out", "--layout", "pad-global")
    assert result.code == 3 and "o_proj is quantized as int4 group 32 (pack-quantized)" in result.err, result.err
    assert "groups of 32 input columns straddle two halves of a 32-wide head" in result.err
    assert "--layout per-layer" in result.err and result.err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def real_heads_pair(tmp_path_factory):
    """The W4A16 pair with the real head sizes (256 sliding, 512 full): 31B's counts, 672-wide hidden (a multiple of
    the group), codes and scales from compressed-tensors."""
    root = tmp_path_factory.mktemp("w4a16-real-heads")
    preset = replace(tiny_preset("31b", width_divisor=8), head_dim=256, global_head_dim=512)
    write_pair(root, preset=preset, num_shards=2, multimodal=False, quantization=w4a16_quantization_config())
    return root


def _dequantized(tensors: dict, stem: str) -> torch.Tensor:
    """compressed-tensors' own decompressor (fp32 scales: code x scale exact in both)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    parts = {p: tensors[f"{stem}.{p}"] for p in ("weight_packed", "weight_scale", "weight_shape")}
    parts["weight_scale"] = parts["weight_scale"].float()
    return PackedQuantizationCompressor.decompress(parts, _w4a16_scheme(32))["weight"]


def test_pad_global_moves_int4_codes_and_scales_exactly(real_heads_pair, tmp_path, run_cli):
    """Dequantized output == the exact pad-global transform of the dequantized source, bit for bit, for every
    projection it changes (sliding q/k/v rows and o_proj columns, the full layer's replicated k); the padding
    codes dequantize to exactly zero; nothing is re-quantized; verify passes."""
    from converter.transforms import pad_head_columns, pad_head_rows, replicate_kv_heads

    out = tmp_path / "out"
    result = run_cli("convert", "--target", real_heads_pair / "target", "--assistant", real_heads_pair / "assistant",
                     "--out", out, "--layout", "pad-global")
    assert result.code == 0, result.err
    source, output = load_tensors(real_heads_pair / "target"), load_tensors(out / "target")
    text = read_config(real_heads_pair / "target")
    heads, kv, kv_full, d, big = (text[k] for k in ("num_attention_heads", "num_key_value_heads",
                                                   "num_global_key_value_heads", "head_dim", "global_head_dim"))
    expected = {"q_proj": lambda w: pad_head_rows(w, num_heads=heads, head_dim=d, target_head_dim=big),
                "k_proj": lambda w: pad_head_rows(w, num_heads=kv, head_dim=d, target_head_dim=big),
                "v_proj": lambda w: pad_head_rows(w, num_heads=kv, head_dim=d, target_head_dim=big),
                "o_proj": lambda w: pad_head_columns(w, num_heads=heads, head_dim=d, target_head_dim=big)}
    for module, transform in expected.items():  # layer 0: sliding
        stem = f"model.layers.0.self_attn.{module}"
        want, got = transform(_dequantized(source, stem)), _dequantized(output, stem)
        assert got.shape == want.shape and got.equal(want), module
        assert output[f"{stem}.weight_shape"].tolist() == list(want.shape)
    stem = "model.layers.5.self_attn.k_proj"  # full, k_eq_v: its global KV heads replicated to the sliding count
    want = replicate_kv_heads(_dequantized(source, stem), num_heads=kv_full, head_dim=big, repeats=kv // kv_full)
    assert _dequantized(output, stem).equal(want)
    assert output["model.layers.5.self_attn.o_proj.weight_packed"].equal(
        source["model.layers.5.self_attn.o_proj.weight_packed"])  # a full layer's o_proj needs no padding
    o_proj = _dequantized(output, "model.layers.0.self_attn.o_proj")
    assert not o_proj.reshape(o_proj.shape[0], -1, 2)[..., 1].any()  # every padding column dequantizes to 0
    assert read_config(out / "target")["quantization_config"] == text["quantization_config"]
    verified = run_cli("verify", "--target", real_heads_pair / "target", "--assistant", real_heads_pair / "assistant",
                       "--converted", out, "--device", "cpu", "--dtype", "fp32")
    assert verified.code == 0, verified.err


def test_verify_unpacks_int4_like_compressed_tensors_itself(w4a16_pair):
    """verify's numerical check dequantizes int4 with its own unpack; it equals compressed-tensors' decompressor."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    from converter.proof.numerics import dequantize
    from converter.testing.synthetic import _w4a16_scheme

    tensors = load_tensors(w4a16_pair / "target")
    stem = "model.layers.3.self_attn.o_proj"
    parts = {p: tensors[f"{stem}.{p}"] for p in ("weight_packed", "weight_scale", "weight_shape")}
    # their arithmetic runs in the scale's dtype: fp32 scales make both exact products of code and scale
    theirs = PackedQuantizationCompressor.decompress({**parts, "weight_scale": parts["weight_scale"].float()},
                                                     _w4a16_scheme(32))["weight"]
    ours = dequantize({f"o_proj.{p}": t for p, t in parts.items()})["o_proj.weight"]
    assert ours.shape == theirs.shape and ours.equal(theirs)

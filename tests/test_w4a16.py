"""Google's QAT W4A16 layout (compressed-tensors pack-quantized int4, group 32, weight-only), written by
compressed-tensors' own PackedQuantizationCompressor: per-layer keeps every byte, pad-global refuses it by name.
The stock vLLM loader rows for it are in converter/testing/cases.py ("31b-w4a16") and the ledger."""

from __future__ import annotations

import json

import pytest

from conftest import load_tensors, read_config
from converter.testing.synthetic import tiny_preset, w4a16_quantization_config, write_pair


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


def test_pad_global_refuses_int4_by_name(w4a16_pair, tmp_path, run_cli):
    result = run_cli("convert", "--target", w4a16_pair / "target", "--assistant", w4a16_pair / "assistant",
                     "--out", tmp_path / "out", "--layout", "pad-global")
    assert result.code == 3 and "int4 group 32 (pack-quantized)" in result.err
    assert "--layout per-layer" in result.err and result.err.count("\n") == 1
    assert not (tmp_path / "out").exists()


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

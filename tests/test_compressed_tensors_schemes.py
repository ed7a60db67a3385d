"""Every compressed-tensors scheme the published Gemma 4 checkpoints use, written by compressed-tensors itself
(its preset schemes, its format inference, its compressors: matrix.synthetic.preset_quantization_config /
compress_weight), on 31B geometry with the real head sizes (256 sliding, 512 full; k_eq_v full layers without
v_proj): per-layer keeps every byte; pad-global moves codes and scales so that the dequantized output equals the
exact transform of the dequantized source, bit for bit, with padding that dequantizes to exactly zero and nothing
re-quantized; verify passes and dequantizes like compressed-tensors' own decompressors.

Schemes (llm-compressor preset names): W4A16 (Google's QAT, int4 group 32, pack-quantized), W8A16 (int8 per channel,
weight-only, pack-quantized: llm-compressor's W8A16 preset), W8A8 (int8 per channel with dynamic per-token int8
activations, int-quantized), FP8_DYNAMIC (fp8 per channel, dynamic per-token fp8 activations, float-quantized: RedHatAI's
FP8-dynamic). FP8_BLOCK is tests/test_fp8.py's.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from _checkpoints import load_tensors, read_config, same_bytes
from converter.proof.numerics import dequantize
from matrix.synthetic import (config_scheme, fp8_quantization_config, int8_quantization_config,
                                         tiny_preset, w4a16_quantization_config, write_pair)
from converter.transforms import pad_head_columns, pad_head_rows, replicate_kv_heads

SCHEMES = {
    "W4A16": (w4a16_quantization_config, "pack-quantized", torch.int32),
    "W8A16": (lambda: int8_quantization_config("W8A16"), "pack-quantized", torch.int32),
    "W8A8": (lambda: int8_quantization_config("W8A8"), "int-quantized", torch.int8),
    "FP8_DYNAMIC": (lambda: fp8_quantization_config("channel"), "float-quantized", torch.float8_e4m3fn),
}
SLIDING, FULL = 0, 5  # layer indices of the 31B pattern's first sliding and first full layer


@pytest.fixture(scope="module", params=list(SCHEMES))
def scheme_pair(request, tmp_path_factory):
    make_config, _, _ = SCHEMES[request.param]
    root = tmp_path_factory.mktemp(request.param.lower())
    preset = replace(tiny_preset("31b", width_divisor=8), head_dim=256, global_head_dim=512)
    write_pair(root, preset=preset, num_shards=2, multimodal=False, quantization=make_config())
    return request.param, root


def _parts(tensors: dict, stem: str) -> dict[str, torch.Tensor]:
    return {name[len(stem) + 1:]: t for name, t in tensors.items() if name.startswith(stem + ".weight")}


def _theirs(tensors: dict, stem: str, config: dict) -> torch.Tensor:
    """compressed-tensors' own decompressor for the config's format (fp32 scales: code x scale exact in both)."""
    from compressed_tensors.compressors import BaseCompressor
    parts = _parts(tensors, stem)
    parts["weight_scale"] = parts["weight_scale"].float()
    compressor = BaseCompressor.get_value_from_registry(config["format"])
    return compressor.decompress(parts, config_scheme(config))["weight"].float()


def test_the_factory_writes_what_compressed_tensors_writes(scheme_pair):
    name, root = scheme_pair
    _, fmt, dtype = SCHEMES[name]
    config = read_config(root / "target")["quantization_config"]
    assert config["format"] == fmt
    tensors = load_tensors(root / "target")
    q = f"model.layers.{SLIDING}.self_attn.q_proj"
    codes = tensors.get(q + ".weight_packed", tensors.get(q + ".weight"))
    assert codes.dtype == dtype
    rows = 32 * 256
    per_channel = config["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    assert tuple(tensors[q + ".weight_scale"].shape) == ((rows, 1) if per_channel else (rows, 672 // 32))
    assert f"model.layers.{FULL}.self_attn.v_proj.weight_scale" not in tensors  # k_eq_v: no v_proj
    assert "model.layers.0.mlp.gate_proj.weight_scale" in tensors and "lm_head.weight" not in tensors


def test_per_layer_keeps_every_byte(scheme_pair, tmp_path, run_cli):
    _, root = scheme_pair
    out = tmp_path / "out"
    result = run_cli("convert", "--target", root / "target", "--assistant", root / "assistant", "--out", out,
                     "--layout", "per-layer")
    assert result.code == 0, result.err
    assert_serve_line_reads_the_quantization_from_the_config(result.out, out)
    for part in ("target", "assistant"):
        source, output = load_tensors(root / part), load_tensors(out / part)
        assert set(source) == set(output)
        for key, tensor in source.items():
            assert same_bytes(output[key], tensor), key
    assert read_config(out / "target")["quantization_config"] == read_config(root / "target")["quantization_config"]
    verified = run_cli("verify", "--target", root / "target", "--assistant", root / "assistant", "--converted", out,
                       "--device", "cpu")
    assert verified.code == 0, verified.err
    assert json.loads((out / "verification.json").read_text())["passed"] is True


def assert_serve_line_reads_the_quantization_from_the_config(printed: str, out) -> None:
    """vLLM reads the scheme from config.json: the `vllm serve` line convert prints and the card upload writes carry
    no --quantization flag (one would force a method onto the bf16 assistant too)."""
    from converter.hub.card import render_card
    from converter.read.checkpoint import MANIFEST_NAME
    line = next(line for line in printed.splitlines() if "vllm serve" in line)
    manifest = json.loads((out / "target" / MANIFEST_NAME).read_text())
    card = render_card(manifest=manifest, verification=None, repo_id="me/t", target_repo="me/t",
                       assistant_repo="me/a", base_model=None)
    assert "--speculative-config" in line and "vllm serve me/t --speculative-config" in card
    assert "--quantization" not in line and "--quantization" not in card


def test_pad_global_moves_codes_and_scales_exactly(scheme_pair, tmp_path, run_cli):
    """Dequantized output == the exact pad-global transform of the dequantized source, bit for bit, for every
    projection it changes (sliding q/k/v rows and o_proj columns, the full layer's replicated k); the padding
    dequantizes to exactly zero; verify passes."""
    name, root = scheme_pair
    out = tmp_path / "out"
    result = run_cli("convert", "--target", root / "target", "--assistant", root / "assistant", "--out", out,
                     "--layout", "pad-global")
    assert result.code == 0, result.err
    source, output = load_tensors(root / "target"), load_tensors(out / "target")
    text = read_config(root / "target")
    config = text["quantization_config"]
    heads, kv, kv_full, d, big = (text[k] for k in ("num_attention_heads", "num_key_value_heads",
                                                   "num_global_key_value_heads", "head_dim", "global_head_dim"))
    expected = {"q_proj": lambda w: pad_head_rows(w, num_heads=heads, head_dim=d, target_head_dim=big),
                "k_proj": lambda w: pad_head_rows(w, num_heads=kv, head_dim=d, target_head_dim=big),
                "v_proj": lambda w: pad_head_rows(w, num_heads=kv, head_dim=d, target_head_dim=big),
                "o_proj": lambda w: pad_head_columns(w, num_heads=heads, head_dim=d, target_head_dim=big)}
    for module, transform in expected.items():
        stem = f"model.layers.{SLIDING}.self_attn.{module}"
        want, got = transform(_theirs(source, stem, config)), _theirs(output, stem, config)
        assert got.shape == want.shape and got.equal(want), f"{name} {module}"
    stem = f"model.layers.{FULL}.self_attn.k_proj"  # k_eq_v: its global KV heads replicated to the sliding count
    want = replicate_kv_heads(_theirs(source, stem, config), num_heads=kv_full, head_dim=big, repeats=kv // kv_full)
    assert _theirs(output, stem, config).equal(want), name
    full_o = f"model.layers.{FULL}.self_attn.o_proj"  # a full layer's o_proj needs no padding: byte-identical
    assert all(same_bytes(output[full_o + "." + p], t) for p, t in _parts(source, full_o).items())
    o_proj = _theirs(output, f"model.layers.{SLIDING}.self_attn.o_proj", config)
    assert not o_proj.reshape(o_proj.shape[0], -1, 2)[..., 1].any()  # every padding column dequantizes to 0
    assert read_config(out / "target")["quantization_config"] == config
    verified = run_cli("verify", "--target", root / "target", "--assistant", root / "assistant", "--converted", out,
                       "--device", "cpu", "--dtype", "fp32")
    assert verified.code == 0, verified.err


def test_verify_dequantizes_like_compressed_tensors_itself(scheme_pair):
    """verify's numerical check dequantizes with its own unpacking (converter.proof.numerics.dequantize); it equals
    compressed-tensors' decompressor for every scheme."""
    _, root = scheme_pair
    tensors, config = load_tensors(root / "target"), read_config(root / "target")["quantization_config"]
    for stem in (f"model.layers.{SLIDING}.self_attn.o_proj", f"model.layers.{FULL}.self_attn.k_proj"):
        parts = {f"m.{p}": t.float() if p == "weight_scale" else t for p, t in _parts(tensors, stem).items()}
        ours = dequantize(parts)["m.weight"]
        theirs = _theirs(tensors, stem, config)
        assert ours.shape == theirs.shape and ours.equal(theirs), stem

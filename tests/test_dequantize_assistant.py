"""`convert --dequantize-assistant` (issue 53): a quantized assistant written in its unquantized dtype, each weight
bit-identical to compressed-tensors' own decompression, proven like any other output (verify's structure and
numerics here; the stock vLLM loader and engine rows in the ledger).

The pairs are the ledger's (cases.py "31b-w4a16-assistant": a bf16 31B target beside a W4A16 assistant written by
compressed-tensors' own compressor) and an fp8 per-channel assistant from the same factory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from converter.advice.ledger import load_ledger
from matrix.cases import CONVERSIONS, DEQUANTIZE_ASSISTANT, build_loader_case
from matrix.synthetic import config_scheme, fp8_quantization_config, tiny_preset, write_pair

CASE = "31b-w4a16-assistant"


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    return build_loader_case(CASE, tmp_path_factory.mktemp("dequantize"), variants=())["original"]


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fp8-assistant")
    write_pair(root, preset=tiny_preset("31b"), multimodal=False, num_shards=1,
               assistant_quantization=fp8_quantization_config("channel"))
    return root


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def _decompressed_by_compressed_tensors(assistant: Path) -> dict[str, torch.Tensor]:
    """Every quantized module's weight as compressed-tensors' own decompressor gives it, in the scale's dtype."""
    from compressed_tensors.compressors import BaseCompressor

    quantization = json.loads((assistant / "config.json").read_text())["quantization_config"]
    scheme = config_scheme(quantization)
    compressor = BaseCompressor.get_value_from_registry(quantization["format"])
    stored = _tensors(assistant)
    weights = {}
    for module in sorted(n[:-len(".weight_scale")] for n in stored if n.endswith(".weight_scale")):
        parts = {k: stored[f"{module}.{k}"] for k in ("weight_packed", "weight", "weight_scale", "weight_shape")
                 if f"{module}.{k}" in stored}
        weights[f"{module}.weight"] = compressor.decompress(parts, scheme)["weight"]
    return weights


def _convert(run_cli, pair: Path, out: Path, *extra: str):
    return run_cli("convert", "--target", pair / "target", "--assistant", pair / "assistant", "--out", out, *extra)


@pytest.mark.parametrize("which", ["w4a16", "fp8"])
def test_each_weight_is_compressed_tensors_own_decompression_bit_for_bit(pair, fp8_pair, run_cli, tmp_path, which):
    source = pair if which == "w4a16" else fp8_pair
    result = _convert(run_cli, source, tmp_path / "out", "--dequantize-assistant")
    assert result.code == 0, result.err
    want = _decompressed_by_compressed_tensors(source / "assistant")
    got = _tensors(tmp_path / "out" / "assistant")
    assert want and set(want) <= set(got)
    for name, weight in want.items():
        assert got[name].dtype == torch.bfloat16 and weight.dtype == torch.bfloat16, name
        assert torch.equal(got[name].view(torch.int16), weight.view(torch.int16)), name
    leftovers = [n for n in got if n.endswith(("_packed", "_scale", "_shape"))]
    assert not leftovers
    source_names = {n for n in _tensors(source / "assistant") if not n.endswith(("_packed", "_scale", "_shape"))}
    assert source_names - set(want) == set(got) - set(want)  # every other tensor carried under its own name
    config = json.loads((tmp_path / "out" / "assistant" / "config.json").read_text())
    assert "quantization_config" not in config and "quantization_config" not in config["text_config"]
    target_source = json.loads((source / "target" / "config.json").read_text())
    assert "quantization_config" not in target_source  # the target is bf16: nothing of it is dequantized


def test_convert_prints_the_serve_line_and_verify_proves_it(pair, run_cli, tmp_path):
    out = tmp_path / "out"
    result = _convert(run_cli, pair, out, "--dequantize-assistant")
    assert result.code == 0, result.err
    assert "vllm serve" in result.out and "no serve line" not in result.out, result.out
    assert "dequantized" in result.out and "refuses such a pair" not in result.out + result.err
    assert "already serve as they are" not in result.out  # not with a quantized assistant, dequantized or not
    manifest = json.loads((out / "assistant" / "conversion.json").read_text())
    assert manifest["dequantized"] is True
    records = [t for t in manifest["tensors"] if t["action"] == "dequantized"]
    assert len(records) == 20 and all(t["transform"] == "dequantize_packed" and len(t["companions"]) == 2
                                      for t in records)
    assert "dequantized" not in json.loads((out / "target" / "conversion.json").read_text())
    checked = run_cli("verify", "--converted", out, "--target", pair / "target", "--assistant", pair / "assistant")
    assert checked.code == 0 and "PASSED" in checked.out, checked.out + checked.err


def test_verify_catches_a_changed_dequantized_weight(pair, run_cli, tmp_path):
    out = tmp_path / "out"
    assert _convert(run_cli, pair, out, "--dequantize-assistant").code == 0
    shard = out / "assistant" / "model.safetensors"
    header = json.loads(shard.read_bytes()[8:8 + int.from_bytes(shard.read_bytes()[:8], "little")])
    name = "model.layers.0.self_attn.q_proj.weight"
    start = 8 + int.from_bytes(shard.read_bytes()[:8], "little") + header[name]["data_offsets"][0]
    data = bytearray(shard.read_bytes())
    data[start] ^= 0x01
    shard.write_bytes(bytes(data))
    checked = run_cli("verify", "--converted", out, "--target", pair / "target", "--assistant", pair / "assistant")
    assert checked.code == 1, checked.out + checked.err
    assert f"{name}: bytes differ from dequantize_packed" in checked.out + checked.err


def test_verify_of_the_quantized_assistant_itself_runs(pair, run_cli, tmp_path):
    """Before: verify of a per-layer output with a quantized assistant stopped at exit 70 (KeyError on q_proj.weight:
    the reference looked for the float weight a quantized checkpoint does not store)."""
    out = tmp_path / "out"
    assert _convert(run_cli, pair, out, "--layout", "per-layer").code == 0
    checked = run_cli("verify", "--converted", out, "--target", pair / "target", "--assistant", pair / "assistant")
    assert checked.code == 0 and "PASSED" in checked.out, checked.out + checked.err


@pytest.mark.parametrize("given, code, words", [
    ("target-only", 2, "no assistant to dequantize"),
    ("bf16-assistant", 2, "is not quantized (no quantization_config); drop the flag"),
])
def test_bad_requests_get_one_line(pair, run_cli, tmp_path, given, code, words):
    if given == "target-only":
        result = run_cli("convert", "--target", pair / "target", "--out", tmp_path / "out", "--dequantize-assistant")
    else:
        write_pair(tmp_path / "bf16", preset=tiny_preset("31b"), multimodal=False, num_shards=1)
        result = _convert(run_cli, tmp_path / "bf16", tmp_path / "out", "--dequantize-assistant")
    assert result.code == code and words in result.err, result.err
    assert "Traceback" not in result.err and len(result.err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_the_ledger_proves_the_dequantized_assistant_where_the_quantized_one_fails():
    layout, option = CONVERSIONS[DEQUANTIZE_ASSISTANT]
    rows = [r for r in load_ledger() if r.case == CASE]
    dequantized = [r for r in rows if r.options == option]
    assert dequantized and all(r.layout == layout and r.verdict == "pass" == r.expected for r in dequantized)
    assert {r.vllm for r in dequantized} >= {"0.27.0", "0.34.0"}
    refused = {(r.vllm, r.transformers) for r in rows if r.options == "" and r.verdict == "fail"}
    assert {(r.vllm, r.transformers) for r in dequantized if r.vllm == "0.27.0"} <= refused

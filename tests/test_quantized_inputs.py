"""Malformed quantized inputs are refused before anything is written (converter/validate/quantized_weights.py).

The valid inputs come from the real producers (compressed-tensors' own PackedQuantizationCompressor for W4A16, its
FP8 config classes; scripts/matrix/cases.py); each test breaks ONE thing the way a hand-edited or half-converted
checkpoint is broken, and `inspect` and `convert` (both layouts: per-layer copies bytes, so it must check the
headers) must name the tensor and the mismatch in one line and exit 3.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from matrix.cases import build_loader_case
from matrix.synthetic import w4a16_quantization_config


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    return {name: build_loader_case(name, root, variants=())["original"]
            for name in ("31b-w4a16", "31b-fp8", "31b-fp8-block", "e2b")}


def _copy(originals, name: str, tmp_path: Path) -> Path:
    pair = tmp_path / name
    shutil.copytree(originals[name], pair)
    return pair


def _edit_tensor(target: Path, name: str, edit) -> None:
    for shard in sorted(target.glob("*.safetensors")):
        tensors = load_file(str(shard))
        if name in tensors:
            tensors[name] = edit(tensors[name]).contiguous()
            save_file(tensors, str(shard), metadata={"format": "pt"})
            return
    raise AssertionError(f"{name} not in {target}")


def _edit_quantization(target: Path, edit) -> None:
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = edit(config.get("quantization_config"))
    (target / "config.json").write_text(json.dumps(config, indent=2))


def _first_group_weights(config: dict) -> dict:
    return next(iter(config["config_groups"].values()))["weights"]


Q0 = "model.layers.0.self_attn.q_proj"
O0 = "model.layers.0.self_attn.o_proj"


def _scale_off_grid(pair: Path) -> None:
    _edit_tensor(pair / "target", f"{Q0}.weight_scale", lambda s: s[:, :-1])


def _shape_contradicts_packing(pair: Path) -> None:
    _edit_tensor(pair / "target", f"{O0}.weight_shape", lambda s: s + torch.tensor([0, 64], dtype=s.dtype))


def _bits_the_tensors_lack(pair: Path) -> None:
    def eight_bits(q):
        _first_group_weights(q)["num_bits"] = 8
        return q
    _edit_quantization(pair / "target", eight_bits)


def _fp8_said_int8(pair: Path) -> None:
    def int8(q):
        _first_group_weights(q)["type"] = "int"
        return q
    _edit_quantization(pair / "target", int8)


def _fp8_said_packed(pair: Path) -> None:
    _edit_quantization(pair / "target", lambda q: w4a16_quantization_config())


def _bf16_said_packed(pair: Path) -> None:
    _edit_quantization(pair / "target", lambda q: w4a16_quantization_config())


def _block_scale_off_grid(pair: Path) -> None:
    _edit_tensor(pair / "target", f"{O0}.weight_scale", lambda s: s[:-1])


CASES = {
    "w4a16 scale off its group grid": ("31b-w4a16", _scale_off_grid, f"{Q0}.weight_scale has shape"),
    "w4a16 weight_shape contradicts the packing": ("31b-w4a16", _shape_contradicts_packing,
                                                   f"{O0}.weight_packed has shape"),
    "w4a16 config says 8 bits": ("31b-w4a16", _bits_the_tensors_lack, "packs 4 8-bit values per int32"),
    "fp8 config says int8": ("31b-fp8", _fp8_said_int8, "but the quantization_config says int8 channel"),
    "fp8 tensors under a pack-quantized config": ("31b-fp8", _fp8_said_packed, "which stores"),
    "bf16 tensors under a pack-quantized config": ("e2b", _bf16_said_packed, "no tensor is quantized that way"),
    "fp8 block scale off its block grid": ("31b-fp8-block", _block_scale_off_grid, f"{O0}.weight_scale has shape"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_quantized_input_is_refused_by_inspect_and_both_layouts(originals, tmp_path, run_cli, case):
    name, breaks, fragment = CASES[case]
    pair = _copy(originals, name, tmp_path)
    breaks(pair)
    inspected = run_cli("inspect", pair / "target")
    assert inspected.code == 3, inspected.out
    assert fragment in inspected.err and len(inspected.err.strip().splitlines()) == 1, inspected.err
    for layout in ("per-layer", "pad-global"):
        out = tmp_path / f"out-{layout}"
        result = run_cli("convert", "--target", pair / "target", "--assistant", pair / "assistant", "--out", out,
                         "--layout", layout)
        assert result.code == 3, (layout, result.out, result.err)
        assert len(result.err.strip().splitlines()) == 1 and "Traceback" not in result.err
        assert not out.exists(), f"{layout} wrote {out} for a malformed input"
    if name != "e2b":  # the message names the tensor (the e2b case has none to name: the whole config is wrong)
        assert "model.layers." in inspected.err


@pytest.mark.parametrize("name", ["31b-w4a16", "31b-fp8", "31b-fp8-block"])
def test_the_producers_own_outputs_pass(originals, run_cli, name):
    result = run_cli("inspect", originals[name] / "target", "--json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["problems"] == []

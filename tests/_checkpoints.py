"""Reading checkpoints in tests: every tensor, byte-exact comparison, config.json and its text config."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from converter.gemma4 import text_config_of


def load_tensors(directory: Path) -> dict:
    """Every tensor of a checkpoint directory (test sizes only)."""
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name)
    return tensors


def same_bytes(a, b) -> bool:
    """The same dtype, shape and bytes (fp8 and packed codes included, -0.0 and NaN payloads told apart)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.contiguous().view(torch.uint8).equal(
        b.contiguous().view(torch.uint8))


def read_config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


text_config = text_config_of  # the product's one helper (converter/gemma4.py), under the name the tests use

"""Edits that break a converted checkpoint while keeping every shape: the negative controls of the engine and
per-rank checks (a check that cannot tell these from a good conversion proves nothing)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from converter.gemma4 import text_config_of


def _text_prefix(target: Path) -> tuple[dict, str]:
    config = json.loads((target / "config.json").read_text())
    return text_config_of(config), "model.language_model." if "text_config" in config else "model."


def edit_tensors(target: Path, names: list[str], edit) -> None:
    """Rewrites the shard holding every one of names with edit(tensor) applied to each (shapes kept)."""
    for shard in sorted(target.glob("*.safetensors")):
        tensors = load_file(str(shard))
        if all(n in tensors for n in names):
            for name in names:
                tensors[name] = edit(tensors[name]).contiguous()
            save_file(tensors, str(shard), metadata={"format": "pt"})
            return
    raise AssertionError(f"no shard of {target} holds {names}")


def swap_kv_heads(target: Path, layer: int = 0, head_dim: int | None = None) -> None:
    """Swaps KV heads 0 and 1 of one layer's k_proj and v_proj (q untouched; a k_eq_v layer has no v_proj): shapes
    unchanged, meaning broken. head_dim: the layer's (default the sliding head_dim). A pack-quantized projection
    swaps the rows of its int4 codes and of its scales alike."""
    text, prefix = _text_prefix(target)
    d = head_dim or text["head_dim"]
    names = [f"{prefix}layers.{layer}.self_attn.{p}.{t}" for p in ("k_proj", "v_proj")
             for t in ("weight", "weight_packed", "weight_scale")]
    present = set()
    for shard in target.glob("*.safetensors"):
        present |= set(load_file(str(shard)))
    edit_tensors(target, [n for n in names if n in present], lambda w: torch.cat([w[d:2 * d], w[:d], w[2 * d:]]))


def swap_experts(target: Path, layer: int = 0) -> None:
    """Swaps experts 0 and 1 of one layer's fused gate_up_proj [E, 2I, H] (down_proj and router untouched)."""
    _, prefix = _text_prefix(target)
    edit_tensors(target, [f"{prefix}layers.{layer}.experts.gate_up_proj"], lambda w: w[[1, 0, *range(2, len(w))]])

"""Does a bf16 checkpoint sit on ggml's Q4_0 grid (Google's QAT "unquantized" repos)? Read from a few rows.

Q4_0 stores each block of 32 input values as 4-bit codes times one scale, so a weight trained for it (QAT) and
stored dequantized holds at most 16 distinct values in every block of 32 (ggml-quants.c quantize_row_q4_0_ref;
docs/DESIGN.md section 17). Such a checkpoint re-quantizes to Q4_0 losslessly; an output whose
blocks mix values of two source blocks with zeros (pad-global's spread o_proj columns) no longer does.
"""

from __future__ import annotations

import torch

from ..gemma4 import FULL
from ..read.checkpoint import Checkpoint
from ..read.safetensors_header import DTYPES
from ..read.tensor_reader import read_range

Q4_0_BLOCK = 32
Q4_0_LEVELS = 16
SAMPLED_ROWS = 4
_FLOATS = ("BF16", "F16", "F32")


def sits_on_q4_0_grid(checkpoint: Checkpoint) -> bool:
    """True when the first rows of one sliding layer's o_proj hold at most 16 distinct values in every block of 32
    input columns (and not all blocks a single value): the QAT checkpoints' signature."""
    ref = _sampled_o_proj(checkpoint)
    if ref is None:
        return False
    rows = min(SAMPLED_ROWS, ref.shape[0])
    raw = read_range(ref.file, ref.offset, rows * ref.nbytes // ref.shape[0])
    values = torch.frombuffer(raw, dtype=getattr(torch, DTYPES[ref.dtype][0])).reshape(rows, -1, Q4_0_BLOCK)
    distinct = torch.tensor([len(torch.unique(block)) for block in values.reshape(-1, Q4_0_BLOCK)])
    return bool((distinct <= Q4_0_LEVELS).all() and (distinct > 1).any())


def _sampled_o_proj(checkpoint: Checkpoint):
    spec = checkpoint.spec
    if spec.quantization:
        return None
    types = spec.attention.layer_types
    sliding = next((i for i, t in enumerate(types) if t != FULL), None)
    if sliding is None:
        return None
    name = f"{spec.weight_prefix}layers.{sliding}.self_attn.o_proj.weight"
    ref = checkpoint.tensors.get(name)
    if ref is None or ref.dtype not in _FLOATS or len(ref.shape) != 2 or ref.shape[1] % Q4_0_BLOCK:
        return None
    return ref

"""Does a bf16 checkpoint sit on ggml's Q4_0 grid (Google's QAT "unquantized" repos)? Read from a few rows.

Q4_0 stores each block of 32 input values as 4-bit codes times one scale, so a weight trained for it (QAT) and stored
dequantized holds at most 16 distinct values in every block of 32 (ggml-quants.c quantize_row_q4_0_ref; docs/DESIGN.md
"Which rows speak for a checkpoint, and the forms Google ships beyond the first three"). Such a checkpoint re-quantizes
to Q4_0 losslessly; an output whose blocks mix values of two source blocks with zeros (pad-global's spread o_proj
columns) no longer does.
"""

from __future__ import annotations

from ..gemma4 import FULL
from ..read.checkpoint import Checkpoint
from ..read.tensor_reader import read_range

Q4_0_BLOCK = 32
Q4_0_LEVELS = 16
SAMPLED_ROWS = 4
_WORD_OF = {"BF16": "H", "F16": "H", "F32": "I"}  # the stored element as an unsigned word


def sits_on_q4_0_grid(checkpoint: Checkpoint) -> bool:
    """True when the first rows of one sliding layer's o_proj hold at most 16 distinct values in every block of 32
    input columns (and not all blocks a single value): the QAT checkpoints' signature. False where the weights
    are not on disk (a Hub source planned from its headers: nothing is downloaded to tell)."""
    ref = _sampled_o_proj(checkpoint)
    if ref is None or not ref.file.is_file():  # a Hub source read from its headers alone: its weights are not here
        return False
    rows = min(SAMPLED_ROWS, ref.shape[0])
    raw = memoryview(read_range(ref.file, ref.offset, rows * ref.nbytes // ref.shape[0]))
    # distinct stored bit patterns are distinct values (a block's zeros share one sign: one scale per block); no
    # torch: inspect, a light verb, runs this
    words = raw.cast(_WORD_OF[ref.dtype])
    blocks = [len(set(words[i:i + Q4_0_BLOCK])) for i in range(0, len(words), Q4_0_BLOCK)]
    return all(count <= Q4_0_LEVELS for count in blocks) and any(count > 1 for count in blocks)


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
    if ref is None or ref.dtype not in _WORD_OF or len(ref.shape) != 2 or ref.shape[1] % Q4_0_BLOCK:
        return None
    return ref

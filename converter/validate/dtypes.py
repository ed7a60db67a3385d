"""The dtypes of an unquantized checkpoint's attention weights: one dtype, as vLLM loads them."""

from __future__ import annotations

from collections import Counter

from ..read.checkpoint import Checkpoint
from .attention import AttentionTensor


def dtype_problems(checkpoint: Checkpoint, tensors: list[AttentionTensor]) -> list[str]:
    """Attention weights of an unquantized checkpoint in more than one dtype (vLLM casts all to the model dtype)."""
    if checkpoint.spec.quantization:
        return []  # fp8 weights beside bf16 norms and scales are the scheme, not a fault
    dtypes = Counter(t.source.ref.dtype for t in tensors)
    if len(dtypes) < 2:
        return []
    rare = min(dtypes, key=lambda d: dtypes[d])
    example = next(t.source.ref.name for t in tensors if t.source.ref.dtype == rare)
    counts = ", ".join(f"{d} x{n}" for d, n in dtypes.most_common())
    return [f"{checkpoint.path}: attention tensors mix dtypes ({counts}; e.g. {example} is {rare}); vLLM 0.27 "
            f"casts each to the model dtype on load (param.data.copy_), so they do not keep their precision"]

"""What a layout costs: KV-cache bytes per token of a geometry before and after (pure arithmetic on the geometry)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .gemma4 import AttentionConfig

CONTEXTS = (8192, 131072)


def homogeneous(attention: AttentionConfig) -> AttentionConfig:
    """Every layer head_dim = global_head_dim with num_key_value_heads KV heads (the pad-global layout's output)."""
    return replace(attention, head_dim=attention.global_head_dim, num_global_kv_heads=attention.num_kv_heads)


def kv_bytes_per_token(attention: AttentionConfig, *, dtype_bytes: int = 2, context: int | None = None) -> float:
    """KV-cache bytes one token costs across the layers that own a cache (KV-shared layers own none).

    Args:
        attention: the geometry.
        dtype_bytes: cache element size (2 for bf16).
        context: when given, sliding layers keep only min(sliding_window, context) tokens, amortized per token
            of a request of this length (what vLLM's sliding-window manager does); None counts every layer in full.
    """
    total = 0.0
    for layer in attention.layers:
        if layer.kv_shared:
            continue
        per_token = 2 * layer.num_kv_heads * layer.head_dim * dtype_bytes  # K and V (k_eq_v still caches both)
        if context and not layer.is_full and attention.sliding_window:
            per_token *= min(attention.sliding_window, context) / context
        total += per_token
    return total


@dataclass(frozen=True)
class KvCost:
    before: float
    after: float
    context: int | None

    @property
    def ratio(self) -> float | None:
        """after / before; None for a checkpoint that owns no KV cache (an assistant reads its target's)."""
        return self.after / self.before if self.before else None


def kv_costs(attention: AttentionConfig, after: AttentionConfig, *, dtype_bytes: int = 2) -> tuple[KvCost, ...]:
    """Before (`attention`) / after (a layout's output geometry, Layout.output_attention): every layer in full, then
    with sliding windows at each of CONTEXTS."""
    return tuple(KvCost(before=kv_bytes_per_token(attention, dtype_bytes=dtype_bytes, context=context),
                        after=kv_bytes_per_token(after, dtype_bytes=dtype_bytes, context=context), context=context)
                 for context in (None, *CONTEXTS))


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{count:.0f} B"
        count /= 1024
    return f"{count:.1f} TiB"

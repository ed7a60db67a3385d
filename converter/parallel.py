"""What one tensor-parallel rank of vLLM holds of each attention layer (pure arithmetic on the geometry).

vLLM 0.27.0's rules (docs/DESIGN.md "Tensor parallelism in vLLM 0.27.0"): every rank gets num_heads / tp query heads (it
asserts the division); KV heads are split when there are at least as many as ranks (tp must divide them) and replicated
otherwise, each rank holding one KV head shared by tp / num_kv_heads ranks (tp must be a multiple of num_kv_heads; rank
r loads KV head r // replicas). The MTP draft's layers follow the same formulas from the ASSISTANT's config, and nothing
in vLLM checks that they equal the target layer's whose cache the draft reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from .gemma4 import FULL, AttentionConfig

DEFAULT_TP_SIZES = (1, 2, 4, 8)
LAYER_TYPES = (("sliding", "sliding_attention"), ("full", FULL))


@dataclass(frozen=True)
class RankGeometry:
    """One layer type's attention on one tensor-parallel rank."""

    heads_per_rank: float
    kv_heads_per_rank: int
    kv_head_replicas: int  # ranks holding the same KV head (1: split, no replication)
    head_dim: int

    def document(self) -> dict[str, float | int]:
        return {"heads_per_rank": self.heads_per_rank, "kv_heads_per_rank": self.kv_heads_per_rank,
                "kv_head_replicas": self.kv_head_replicas, "head_dim": self.head_dim}


def rank_geometry(num_heads: int, num_kv_heads: int, head_dim: int, tp: int) -> RankGeometry:
    """vLLM's per-rank split of one attention layer (QKVParallelLinear / Attention)."""
    kv = num_kv_heads // tp if num_kv_heads >= tp else 1
    replicas = tp // num_kv_heads if num_kv_heads < tp else 1
    return RankGeometry(heads_per_rank=num_heads / tp, kv_heads_per_rank=kv, kv_head_replicas=replicas,
                        head_dim=head_dim)


def layer_type_geometry(attention: AttentionConfig, tp: int) -> dict[str, RankGeometry]:
    """{"sliding": ..., "full": ...} for the layer types the config has."""
    found: dict[str, RankGeometry] = {}
    for name, layer_type in LAYER_TYPES:
        layers = [g for g in attention.layers if g.layer_type == layer_type]
        if layers:
            found[name] = rank_geometry(attention.num_heads, layers[0].num_kv_heads, layers[0].head_dim, tp)
    return found


def tp_problems(attention: AttentionConfig, tp: int, *, what: str = "the target") -> list[str]:
    """One line per division vLLM refuses at start-up for this tensor-parallel size (empty: it starts)."""
    if tp < 1:
        return [f"tensor-parallel size {tp} is not a positive integer"]
    problems = []
    if attention.num_heads % tp:
        problems.append(f"--tensor-parallel-size {tp} does not divide the {attention.num_heads} attention heads of "
                        f"{what}: vLLM refuses to start")
    for name, layer_type in LAYER_TYPES:
        kv = {g.num_kv_heads for g in attention.layers if g.layer_type == layer_type}
        for count in sorted(kv):
            if count >= tp and count % tp:
                problems.append(f"--tensor-parallel-size {tp} does not divide the {count} KV heads of {what}'s {name} "
                                "layers: vLLM refuses to start")
            elif count < tp and tp % count:
                problems.append(f"--tensor-parallel-size {tp} is not a multiple of the {count} KV heads of {what}'s "
                                f"{name} layers (replication needs it): vLLM refuses to start")
    return problems


def kv_bytes_per_token_per_rank(attention: AttentionConfig, tp: int, *, dtype_bytes: int = 2) -> float:
    """KV-cache bytes one token costs on one rank, every layer in full (replicated heads cost each rank)."""
    total = 0.0
    for layer in attention.layers:
        if not layer.kv_shared:
            kv = rank_geometry(attention.num_heads, layer.num_kv_heads, layer.head_dim, tp).kv_heads_per_rank
            total += 2 * kv * layer.head_dim * dtype_bytes
    return total

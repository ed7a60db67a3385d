"""`per-layer`: the explicit per-layer-type keys stock vLLM 0.27 reads; tensors unchanged (fused qkv split).

Serves with transformers < 5.15 only: newer transformers rejects any heterogeneous Gemma 4 config.
"""

from __future__ import annotations

from typing import Any

from ..gemma4 import DIALECT_LEGACY, AttentionConfig, ModelSpec
from ..plan import TensorPlan
from .base import AttentionTensor, Layout, explicit_geometry, kept, register_layout


@register_layout("per-layer")
class PerLayerLayout(Layout):
    description = ("flat head_dim/global_head_dim/KV-head keys, no per_layer_config; tensors unchanged "
                   "(serve with transformers < 5.15)")

    def plan_attention(self, tensor: AttentionTensor, spec: ModelSpec, out_name: str) -> TensorPlan:
        return kept(tensor, out_name)

    def geometry_keys(self, attention: AttentionConfig) -> dict[str, Any]:
        return explicit_geometry(attention)

    def matches(self, spec: ModelSpec) -> bool:
        return spec.dialect == DIALECT_LEGACY

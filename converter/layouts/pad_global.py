"""`pad-global`: every layer gets head_dim = global_head_dim and num_key_value_heads KV heads, exactly.

Sliding layers grow d -> D with the interleaved-per-half duplicate placement; full k_eq_v layers
replicate their global KV heads (FACTS.md section 4). The config becomes homogeneous, so no
transformers version has a per-layer attribute to reject, and vLLM 0.27 builds every layer alike.
"""

from __future__ import annotations

from typing import Any

from ..errors import InputError
from ..gemma4 import DIALECT_LEGACY, AttentionConfig, ModelSpec
from ..plan import TensorPlan
from .base import AttentionTensor, Layout, explicit_geometry, kept, register_layout, transformed

_QUANTIZED_REFUSAL = ("pad-global does not support quantized checkpoints yet (quantization_config {method}); "
                      "convert the bf16 checkpoint or use --layout per-layer")


@register_layout("pad-global")
class PadGlobalLayout(Layout):
    description = ("homogeneous geometry (head_dim = global_head_dim, uniform KV heads) by exact padding; "
                   "serves with any transformers version; convert target and assistant together")

    def check(self, spec: ModelSpec, *, source: str) -> list[str]:
        a = spec.attention
        if a.global_head_dim % a.head_dim or a.head_dim % 2:
            raise InputError(f"{source}: pad-global needs global_head_dim ({a.global_head_dim}) to be an integer "
                             f"multiple of an even head_dim ({a.head_dim})")
        if a.k_eq_v and a.num_kv_heads % a.num_global_kv_heads:
            raise InputError(f"{source}: pad-global needs num_key_value_heads ({a.num_kv_heads}) to be a multiple "
                             f"of num_global_key_value_heads ({a.num_global_kv_heads})")
        if spec.quantization:
            raise InputError(f"{source}: " + _QUANTIZED_REFUSAL.format(
                method=spec.quantization.get("quant_method", "unknown")))
        return []

    def plan_attention(self, tensor: AttentionTensor, spec: ModelSpec, out_name: str) -> TensorPlan:
        a, layer, shape = spec.attention, tensor.layer, tensor.source.shape
        target = a.global_head_dim
        if layer.head_dim != target:
            ratio = target // layer.head_dim
            if tensor.module in ("q_proj", "k_proj", "v_proj"):
                heads = a.num_heads if tensor.module == "q_proj" else layer.num_kv_heads
                return transformed(tensor, out_name, action="padded", transform="pad_head_rows",
                                   shape=(shape[0] * ratio, *shape[1:]), num_heads=heads,
                                   head_dim=layer.head_dim, target_head_dim=target)
            if tensor.module in ("q_norm", "k_norm"):
                return transformed(tensor, out_name, action="padded", transform="pad_head_norm",
                                   shape=(target,), head_dim=layer.head_dim, target_head_dim=target)
            if tensor.module == "o_proj" and tensor.param == "weight":
                return transformed(tensor, out_name, action="padded-columns", transform="pad_head_columns",
                                   shape=(shape[0], shape[1] * ratio), num_heads=a.num_heads,
                                   head_dim=layer.head_dim, target_head_dim=target)
        elif layer.num_kv_heads != a.num_kv_heads and tensor.module == "k_proj":
            repeats = a.num_kv_heads // layer.num_kv_heads
            return transformed(tensor, out_name, action="replicated", transform="replicate_kv_heads",
                               shape=(shape[0] * repeats, *shape[1:]), num_heads=layer.num_kv_heads,
                               head_dim=layer.head_dim, repeats=repeats)
        return kept(tensor, out_name)

    def geometry_keys(self, attention: AttentionConfig) -> dict[str, Any]:
        # num_global_key_value_heads stays written: transformers 5.14.1 fails on None (FACTS.md section 4)
        return explicit_geometry(attention, head_dim=attention.global_head_dim,
                                 num_global_key_value_heads=attention.num_kv_heads)

    def matches(self, spec: ModelSpec) -> bool:
        return spec.attention.is_homogeneous and spec.dialect == DIALECT_LEGACY

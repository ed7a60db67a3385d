"""`per-layer`: the flat per-layer-type geometry keys stock vLLM reads (every release up to 0.27 only these); tensors unchanged (fused qkv split). Zero cost.

Default (`keys: dual`): the flat keys plus the config-only "dual keys" (gemma4.py, docs/DESIGN.md section 7), so the
output loads under transformers 5.14 AND >= 5.15 (which would otherwise rebuild per_layer_config and raise
AmbiguousGlobalPerLayerAttributeError in vLLM 0.27). `keys: flat` (`convert --flat-keys-only`) writes the bare flat
keys: serves with transformers < 5.15 only.
"""

from __future__ import annotations

from typing import Any

from ..gemma4 import DIALECT_LEGACY, AttentionConfig, ModelSpec, with_dual_keys
from ..plan import TensorPlan
from ..validate.attention import AttentionTensor
from .base import Layout, explicit_geometry, kept, register_layout

KEYS_DUAL = "dual"
KEYS_FLAT = "flat"


@register_layout("per-layer")
class PerLayerLayout(Layout):
    description = ("tensors and KV cache unchanged (zero cost); flat head_dim/global_head_dim/KV-head keys, no "
                   "per_layer_config, plus config-only dual keys so any transformers 5.x serves it "
                   "(--flat-keys-only: bare flat keys, transformers < 5.15 only)")
    option_choices = {"keys": (KEYS_DUAL, (KEYS_DUAL, KEYS_FLAT))}
    recorded_before_options = {"keys": KEYS_FLAT}

    @property
    def flat_only(self) -> bool:
        return self.options["keys"] == KEYS_FLAT

    def plan_attention(self, tensor: AttentionTensor, spec: ModelSpec, out_name: str) -> TensorPlan:
        return kept(tensor, out_name)

    def geometry_keys(self, attention: AttentionConfig) -> dict[str, Any]:
        return explicit_geometry(attention)

    def rewrite_text_config(self, text: dict[str, Any], attention: AttentionConfig) -> dict[str, Any]:
        flat = self.geometry_keys(attention)
        if self.flat_only:
            text.update(flat)
            return text
        return with_dual_keys(text, flat)

    def matches(self, spec: ModelSpec) -> bool:
        return spec.dialect == DIALECT_LEGACY and spec.dual_keys != self.flat_only

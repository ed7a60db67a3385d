"""`per-layer`: the flat per-layer-type geometry keys stock vLLM reads (every release up to 0.27 only these); tensors unchanged (fused qkv split). Zero cost.

Default (`keys: dual`): the flat keys plus the config-only "dual keys" (gemma4.py; docs/DESIGN.md
"Zero-cost serving with the dual-keys recipe"), so the output loads under transformers 5.14 AND >=
PER_LAYER_TRANSFORMERS (which would otherwise rebuild per_layer_config and raise AmbiguousGlobalPerLayerAttributeError
in vLLM 0.27). `keys: flat` (`convert --flat-keys-only`) writes the bare flat keys: serves with transformers <
PER_LAYER_TRANSFORMERS only.
"""

from __future__ import annotations

from typing import Any

from ..gemma4 import (DIALECT_LEGACY, FORM_DUAL_KEYS, FORM_FLAT, PER_LAYER_TRANSFORMERS, AttentionConfig, ModelSpec,
                      with_dual_keys)
from ..plan import TensorPlan
from ..validate.attention import AttentionTensor
from .base import Layout, explicit_geometry, kept, register_layout

KEYS_DUAL = "dual"
KEYS_FLAT = "flat"


@register_layout("per-layer")
class PerLayerLayout(Layout):
    description = ("tensors and KV cache unchanged (zero cost); flat head_dim/global_head_dim/KV-head keys, no "
                   "per_layer_config, plus config-only dual keys so any transformers 5.x serves it "
                   f"(--flat-keys-only: bare flat keys, transformers < {PER_LAYER_TRANSFORMERS} only)")
    option_choices = {"keys": (KEYS_DUAL, (KEYS_DUAL, KEYS_FLAT))}
    recorded_before_options = {"keys": KEYS_FLAT}
    preference = 0
    cost_note = "at zero cost (same tensors, same KV cache)"
    caveat = "a newer transformers could change the undocumented behaviour per-layer's dual keys rest on"
    advice_why = "--layout per-layer is exact and free (same tensors, same KV cache; config keys only)"
    kv_note = "zero cost: the layout changes no geometry, and every weight is a byte-identical copy of the source"
    _CARD_DUAL = (
        "Zero cost: every tensor is a byte-identical copy of the source, the KV cache is unchanged. Stock vLLM 0.27 "
        "reads only the flat `head_dim`, `global_head_dim`, `num_key_value_heads` and `num_global_key_value_heads` "
        f"keys; transformers {PER_LAYER_TRANSFORMERS} and later pop the global ones into a `per_layer_config` and "
        f"raise "
        "`AmbiguousGlobalPerLayerAttributeError` when vLLM reads `head_dim`. This config carries the flat keys plus "
        "`allow_global_per_layer_attribute_access: true` and an `attribute_map` aliasing `global_head_dim` / "
        "`num_global_key_value_heads` to `gemma4_global_head_dim` / `gemma4_num_global_key_value_heads`: vLLM reads "
        f"the right geometry under transformers 5.14 and {PER_LAYER_TRANSFORMERS}+ (no remote code), and "
        f"transformers still builds its "
        "own per-layer config, so its Gemma 4 classes keep the right shapes.")
    _CARD_FLAT = (
        "Stock vLLM 0.27 reads only the flat `head_dim`, `global_head_dim`, `num_key_value_heads` and "
        "`num_global_key_value_heads` keys and knows nothing of `per_layer_config`. This checkpoint's config carries "
        "exactly those keys and no `per_layer_config`; every tensor is a byte-identical copy of the source. It needs "
        f"**transformers<{PER_LAYER_TRANSFORMERS}** where vLLM runs: {PER_LAYER_TRANSFORMERS} and later rebuild "
        f"`per_layer_config` from the flat keys and "
        "raise `AmbiguousGlobalPerLayerAttributeError` on the target config before any weight is read.")

    @property
    def flat_only(self) -> bool:
        return self.options["keys"] == KEYS_FLAT

    @property
    def variant(self) -> str:
        return f"{self.name} --flat-keys-only" if self.flat_only else self.name

    @property
    def card_text(self) -> str:
        return self._CARD_FLAT if self.flat_only else self._CARD_DUAL

    @property
    def serve_note(self) -> str:
        if self.flat_only:
            return f"Run it with `pip install 'transformers<{PER_LAYER_TRANSFORMERS}'` in vLLM's environment."
        return ("Any transformers 5.x in vLLM's environment (no `--trust-remote-code`); see *Proven with stock "
                "vLLM* below for the releases it was measured on.")

    def ledger_shape(self, kv_heads: str) -> tuple[str, str]:
        return (FORM_FLAT if self.flat_only else FORM_DUAL_KEYS), kv_heads

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

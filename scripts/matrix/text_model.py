"""The Gemma 4 target's whole text forward (embedding, every decoder layer, LM head) on the layers of
converter/proof/reference.py: the proof's end-to-end reference. tests/test_reference.py holds it equal to
transformers' Gemma4ForCausalLM; tests/test_equivalence.py runs original and converted pairs through it. `verify`
does not need it: it checks layer by layer (converter/proof/numerics.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from converter.proof.reference import (TextSpec, Weights, as_positions, named_linear, causal_mask, decoder_layer,
                                       rms_norm, sub_weights)


@dataclass(frozen=True)
class TextOutput:
    """Target forward results.

    hidden: [batch, length, hidden] after the final norm. logits: after lm_head and final softcapping.
    layer_hidden: each decoder layer's output (index i = layer i). shared_kv: layer type -> (key, value) of the
    last non-shared layer of that type, the dict an assistant consumes.
    """

    hidden: torch.Tensor
    logits: torch.Tensor
    layer_hidden: tuple[torch.Tensor, ...]
    shared_kv: dict[str, tuple[torch.Tensor, torch.Tensor]]


def scaled_embedding(ids: torch.Tensor, table: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Gemma4TextScaledWordEmbedding (:1428-1440): lookup times scale, the scale rounded to the table's dtype."""
    return F.embedding(ids, table) * torch.tensor(scale, dtype=torch.float32).to(table.dtype).to(table.device)


def per_layer_inputs(weights: Weights, *, spec: TextSpec, input_ids: torch.Tensor, embeds: torch.Tensor
                     ) -> torch.Tensor:
    """Per-layer embeddings (E2B/E4B), [batch, length, layers, ple_dim] (get/project_per_layer_inputs :1723-1800)."""
    n, ple = len(spec.layers), spec.hidden_size_per_layer_input
    token = scaled_embedding(input_ids, weights["embed_tokens_per_layer.weight"], scale=ple ** 0.5)
    token = token.reshape(*input_ids.shape, n, ple)
    context = named_linear(embeds, weights, "per_layer_model_projection") * spec.hidden_size ** -0.5
    context = rms_norm(context.reshape(*embeds.shape[:-1], n, ple), weights["per_layer_projection_norm.weight"],
                       eps=spec.eps)
    return (context + token) * 2.0 ** -0.5


@torch.no_grad()
def text_forward(weights: Weights, *, spec: TextSpec, input_ids: torch.Tensor,
                 positions: torch.Tensor | None = None) -> TextOutput:
    """The Gemma 4 text model plus LM head on a fresh sequence (no cache, no padding).

    Mirrors Gemma4TextModel.forward (:1605-1720) and Gemma4ForCausalLM.forward (:1872-1930).

    Args:
        weights: text-model tensors named as Gemma4TextModel's state_dict (embed_tokens.weight, layers.N...,
            norm.weight), optionally lm_head.weight (else tied to embed_tokens).
        spec: from text_spec_from_config.
        input_ids: [batch, length] token ids.
        positions: [length] or [batch, length]; default 0..length-1.

    Returns:
        TextOutput.
    """
    table = weights["embed_tokens.weight"]
    hidden = scaled_embedding(input_ids, table, scale=spec.hidden_size ** 0.5)
    per_layer = (per_layer_inputs(weights, spec=spec, input_ids=input_ids, embeds=hidden)
                 if spec.hidden_size_per_layer_input else None)
    positions = as_positions(positions, input_ids.shape[1], hidden.device)
    producers, stored, layer_hidden = spec.kv_producers, {}, []
    for i, layer in enumerate(spec.layers):
        mask = causal_mask(positions, positions, sliding_window=layer.sliding_window)
        hidden, attn = decoder_layer(
            hidden, sub_weights(weights, f"layers.{i}."), layer=layer, spec=spec, positions=positions,
            kv=stored.get(layer.layer_type) if layer.kv_shared else None, mask=mask,
            per_layer_input=per_layer[:, :, i] if per_layer is not None else None)
        if producers.get(layer.layer_type) == i:
            stored[layer.layer_type] = (attn.key, attn.value)
        layer_hidden.append(hidden)
    hidden = rms_norm(hidden, weights["norm.weight"], eps=spec.eps)
    logits = F.linear(hidden, weights.get("lm_head.weight", table))
    if spec.final_logit_softcapping is not None:
        logits = torch.tanh(logits / spec.final_logit_softcapping) * spec.final_logit_softcapping
    return TextOutput(hidden=hidden, logits=logits, layer_hidden=tuple(layer_hidden), shared_kv=stored)

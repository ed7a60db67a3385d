"""Serving pitfalls users of the Gemma 4 pair have hit, recognised from one checkpoint's config (pure, no I/O).

Each is a warning that names the fix, never an error: the checkpoint serves, but not as the user expects. The
reports behind them: a quantized assistant drafts at ~0 % acceptance (vLLM #47091); with an FP8 KV cache the draft,
which reads the target's cache, used KV scales of 1.0 (vLLM #49262: acceptance 65-77 % -> 34-46 %); an assistant
whose `model_type` or `num_kv_shared_layers` was edited by hand is no longer routed to vLLM's MTP drafter or no
longer reads every layer's K/V from the target.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..gemma4 import ASSISTANT_MODEL_TYPES, ROLE_ASSISTANT, ROLE_TARGET, ModelSpec, text_config_of


def serving_pitfalls(config: Mapping[str, Any], spec: ModelSpec) -> list[str]:
    """The warnings for one checkpoint (its config.json and the spec read from it), each naming the fix."""
    warnings = []
    if spec.role == ROLE_ASSISTANT:
        warnings += _assistant_pitfalls(config, spec)
    if spec.role == ROLE_TARGET:
        warnings += _target_pitfalls(config, spec)
    return warnings


def _assistant_pitfalls(config: Mapping[str, Any], spec: ModelSpec) -> list[str]:
    warnings = []
    if spec.quantization:
        method = spec.quantization.get("quant_method", "?")
        warnings.append(f"the assistant is quantized ({method}): a quantized MTP draft accepts ~0 % of its tokens "
                        "(vLLM #47091); serve the bf16 assistant beside the quantized target, and leave "
                        "speculative_config's quantization unset")
    text = text_config_of(config)
    layers, shared = text.get("num_hidden_layers"), text.get("num_kv_shared_layers")
    if isinstance(layers, int) and isinstance(shared, int) and shared != layers:
        warnings.append(f"the assistant's text_config has num_kv_shared_layers={shared} of {layers} layers: every "
                        "assistant layer reads the target's K/V (Gemma4AssistantConfig sets it to the layer count); "
                        "restore the published value instead of editing it")
    return warnings


def _target_pitfalls(config: Mapping[str, Any], spec: ModelSpec) -> list[str]:
    warnings = []
    architectures = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    if any("Assistant" in a for a in architectures):
        warnings.append(f"architectures {architectures} name an assistant but model_type is {spec.model_type!r}: "
                        f"vLLM routes only {' / '.join(ASSISTANT_MODEL_TYPES)} to its MTP drafter; restore the "
                        "assistant's own model_type")
    if _fp8_kv_cache(spec.quantization):
        warnings.append("this target declares a quantized KV cache: the MTP assistant reads the target's cache and "
                        "has no KV scales of its own, and vLLM served it with scales of 1.0 (vLLM #49262: acceptance "
                        "65-77 % -> 34-46 %); measure acceptance with and without --kv-cache-dtype fp8 before "
                        "keeping it")
    return warnings


def _fp8_kv_cache(quantization: Mapping[str, Any] | None) -> bool:
    """compressed-tensors `kv_cache_scheme` or Model Optimizer `kv_cache_quant_algo` set to something."""
    return bool(quantization and (quantization.get("kv_cache_scheme") or quantization.get("kv_cache_quant_algo")))

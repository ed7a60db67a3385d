"""Serving pitfalls users of the Gemma 4 pair have hit, recognised from one checkpoint's config (pure, no I/O).

Each is a warning that names the fix, never an error: the checkpoint serves, but not as the user expects. The
reports behind them: a quantized assistant drafts at ~0 % acceptance (vLLM #47091); with an FP8 KV cache the draft,
which reads the target's cache, used KV scales of 1.0 (vLLM #49262: acceptance 65-77 % -> 34-46 %); an assistant
whose `model_type` or `num_kv_shared_layers` was edited by hand is no longer routed to vLLM's MTP drafter or no
longer reads every layer's K/V from the target.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import InputError, UnsupportedLayoutError
from ..gemma4 import ASSISTANT_MODEL_TYPES, ModelSpec, Role, text_config_of
from ..layouts import layouts_in_preference
from .ledger import FAIL, SCOPE_ASSISTANT, load_ledger, version_key
from ..read.checkpoint import Checkpoint
from ..validate.attention import find_attention_tensors
from ..validate.q4_0_grid import sits_on_q4_0_grid


def serving_pitfalls(config: Mapping[str, Any], spec: ModelSpec) -> list[str]:
    """The warnings for one checkpoint (its config.json and the spec read from it), each naming the fix."""
    warnings = []
    if spec.role == Role.ASSISTANT:
        warnings += _assistant_pitfalls(config, spec)
    if spec.role == Role.TARGET:
        warnings += _target_pitfalls(config, spec)
    return warnings


def _assistant_pitfalls(config: Mapping[str, Any], spec: ModelSpec) -> list[str]:
    warnings = []
    if spec.quantization:
        method = spec.quantization.get("quant_method", "?")
        refusal = quantized_assistant_refusal(spec)
        warnings.append(f"the assistant is quantized ({method}): "
                        + (f"{refusal}; where it loads, " if refusal else "")
                        + "a quantized MTP draft accepts ~0 % of its tokens (vLLM #47091); serve the bf16 assistant "
                        "beside the quantized target (or write this one in bf16: convert --dequantize-assistant), "
                        "and leave speculative_config's quantization unset")
    text = text_config_of(config)
    layers, shared = text.get("num_hidden_layers"), text.get("num_kv_shared_layers")
    if isinstance(layers, int) and isinstance(shared, int) and shared != layers:
        warnings.append(f"the assistant's text_config has num_kv_shared_layers={shared} of {layers} layers: every "
                        "assistant layer reads the target's K/V (Gemma4AssistantConfig sets it to the layer count); "
                        "restore the published value instead of editing it")
    return warnings


def quantized_assistant_refusal(spec: ModelSpec) -> str | None:
    """What stock vLLM measurably does with a quantized assistant of `spec`'s scheme (ledger rows of scope
    SCOPE_ASSISTANT that fail: the original and every layout alike), or None where no such row fails."""
    if spec.role != Role.ASSISTANT or not spec.quantization:
        return None
    failing = [r for r in load_ledger() if r.scope == SCOPE_ASSISTANT and r.verdict == FAIL
               and r.detail.startswith("load_draft")]
    if not failing:
        return None
    releases = sorted({r.vllm for r in failing}, key=version_key)
    words = failing[0].detail.split("; ")[0]
    return (f"stock vLLM {', '.join(releases)}'s loader refuses such a pair, converted or not (measured: "
            f"{words.split('. ')[0]})")


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


def q4_0_grid_notes(checkpoint: Checkpoint, only: str | None = None) -> list[str]:
    """Where the checkpoint sits on ggml's Q4_0 grid (QAT, validate/q4_0_grid.py): one note per layout (or the one
    named `only`) that takes tensors off it, naming them and the layouts that keep every tensor as it is."""
    spreading: dict[str, list[str]] = {}
    tensors = list(find_attention_tensors(checkpoint))
    for layout in layouts_in_preference():
        try:
            layout.check(checkpoint.spec, source=str(checkpoint.path))
        except (InputError, UnsupportedLayoutError):  # a layout that refuses the checkpoint writes nothing
            continue
        spreading[layout.name] = [t.source.ref.name for t in tensors
                                  if layout.plan_attention(t, checkpoint.spec, t.source.ref.name).spreads_input_columns]
    if not any(spreading.values()) or not sits_on_q4_0_grid(checkpoint):
        return []
    keeping = [name for name, spread in spreading.items() if not spread]
    notes = []
    for name, spread in spreading.items():
        if not spread or (only is not None and name != only):
            continue
        shown = ", ".join(spread[:2]) + (f" and {len(spread) - 2} more" if len(spread) > 2 else "")
        notes.append(f"{checkpoint.path}: its weights sit on ggml's Q4_0 grid (a QAT checkpoint); {name} spreads the "
                     f"input columns of {len(spread)} tensor{'s' if len(spread) != 1 else ''} ({shown}) with zeros "
                     "between, so their blocks of 32 leave the grid: the values stay exact, but a later Q4_0 "
                     "quantization of the output is no longer lossless"
                     + (f"; {' and '.join(keeping)} keep{'s' if len(keeping) == 1 else ''} every tensor as it is"
                        if keeping else ""))
    return notes

"""Is this checkpoint what its config says? Every such check, in one room between read and plan.

`checkpoint_problems` is the one entry point: every problem of a checkpoint, one line each, in one order. `inspect`
reports the list; `convert` (pipeline.py) refuses on its first item before anything is written; so inspect exits 3
exactly when convert refuses, with the same first message (tests/test_validate.py). A new check is a function that
returns one-line problems, in the module of its concern, called from `checkpoint_problems`:

- attention.py: attention tensors against the per-layer geometry (shapes, missing, unexpected);
- quantized.py: quantized attention against its schemes (Model Optimizer attention, fp8 scales);
- quantized_weights.py: every compressed-tensors quantized weight against the quantization_config;
- moe.py: stored experts and router against the MoE sizes;
- dtypes.py: one dtype across an unquantized checkpoint's attention weights.

What a checkpoint's config alone must satisfy is checked where it is parsed (gemma4.read_spec); whether a layout can
take a valid checkpoint is the layout's own `check` (layouts/), and a pair's shared geometry is pairing.py's.
"""

from __future__ import annotations

from ..errors import InputError
from ..gemma4 import ModelSpec
from ..read.checkpoint import Checkpoint
from .attention import AttentionProblem, AttentionTensor, attention_problems, expected_shape, find_attention_tensors
from .dtypes import dtype_problems
from .moe import moe_problems
from .quantized import attention_scale_problems, quantized_attention_problems
from .quantized_weights import quantized_weight_problems


def config_problems(spec: ModelSpec, *, source: str) -> list[str]:
    """What the config alone declares that cannot be converted (the head of checkpoint_problems): a layout's own
    capability check comes after these and before the tensors' (layouts/base.py Layout.plan)."""
    return quantized_attention_problems(spec, source=source)


def checkpoint_problems(checkpoint: Checkpoint, tensors: list[AttentionTensor] | None = None) -> list[str]:
    """Every way the checkpoint contradicts its config, in the order convert meets them (empty: sound).

    Args:
        checkpoint: read from headers (read.read_checkpoint or hub.open_checkpoint).
        tensors: its attention tensors when the caller already found them (find_attention_tensors).

    Raises:
        InputError: an attention tensor names a layer the config lacks, or a fused qkv_proj cannot be split (nothing
            else can be checked then).
    """
    spec, source = checkpoint.spec, str(checkpoint.path)
    tensors = list(find_attention_tensors(checkpoint)) if tensors is None else tensors
    found = (config_problems(spec, source=source) + quantized_weight_problems(checkpoint)
             + [p.message for p in attention_problems(tensors, spec, source=source)]
             + attention_scale_problems(tensors, spec, source=source) + moe_problems(checkpoint)
             + dtype_problems(checkpoint, tensors))
    return list(dict.fromkeys(found))


def refuse_invalid_config(spec: ModelSpec, *, source: str) -> None:
    """Raises InputError: the first of config_problems."""
    _raise_first(config_problems(spec, source=source))


def refuse_invalid(checkpoint: Checkpoint) -> None:
    """convert's refusal: the first of checkpoint_problems.

    Raises:
        InputError: the checkpoint has a problem (the first one's message).
    """
    _raise_first(checkpoint_problems(checkpoint))


def _raise_first(problems: list[str]) -> None:
    if problems:
        raise InputError(problems[0])


__all__ = ["AttentionProblem", "AttentionTensor", "attention_problems", "checkpoint_problems", "config_problems",
           "expected_shape", "find_attention_tensors", "refuse_invalid", "refuse_invalid_config"]

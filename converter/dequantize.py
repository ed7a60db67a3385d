"""`--dequantize-assistant`: which stored tensors of a quantized checkpoint become one plain float weight, decided from
config + headers alone (the plan stage; the arithmetic is transforms.dequantize_packed / dequantize_scaled).

Stock vLLM builds a quantized assistant's layers from its `quantization_config` and fails to load the ones the
published checkpoints keep in bf16 (the ledger's quantized-assistant rows); where one loads, a quantized MTP draft
accepts ~0 % of its tokens. The assistant is small, so the offline fix is to write it in plain float: each weight is
its codes times its scales, as compressed-tensors' own decompressor computes it, in the dtype of the checkpoint's
unquantized tensors, and the config loses its `quantization_config` (docs/QUANTIZED.md "Dequantized assistants").
"""

from __future__ import annotations

import copy
import math
from typing import Any, Iterable, Mapping

from .errors import InputError, UsageError
from .gemma4 import ModelSpec, text_config_of
from .plan import TensorPlan, Transform
from .quantization import COMPRESSED_TENSORS, PACK_QUANTIZED, weight_scheme
from .read.checkpoint import Checkpoint

ACTION_DEQUANTIZED = "dequantized"
PACKED, SCALE, SHAPE, ZERO_POINT, G_IDX, INPUT_SCALE = ("weight_packed", "weight_scale", "weight_shape",
                                                        "weight_zero_point", "weight_g_idx", "input_scale")
_FLOATS = ("BF16", "F16", "F32")
_SCALED_DTYPES = ("F8_E4M3", "F8_E5M2", "I8")  # one code per element in `weight` itself: float8 or int8


def refuse_undequantizable(spec: ModelSpec, *, source: str) -> None:
    """Raises UsageError for a checkpoint with nothing to dequantize, InputError for a scheme this cannot rewrite."""
    config = spec.quantization
    if not config:
        raise UsageError(f"--dequantize-assistant: {source} is not quantized (no quantization_config); drop the flag")
    if config.get("quant_method") != COMPRESSED_TENSORS:
        raise InputError(f"{source}: --dequantize-assistant rewrites compressed-tensors checkpoints; this one is "
                         f"{config.get('quant_method')!r} (dequantize it with its own tools first)")


def dequantized(tensors: Iterable[TensorPlan], checkpoint: Checkpoint, *, layout: str) -> list[TensorPlan]:
    """`tensors` (a layout's plan of `checkpoint`) with each quantized module's stored tensors replaced by one
    `X.weight` that dequantizes them; activation scales are dropped with the quantization_config.

    Raises:
        UsageError: the layout rewrites a quantized tensor itself (its codes must be read as stored).
        InputError: a scheme whose dequantization is not one multiplication (zero points, activation order).
    """
    tensors = list(tensors)
    config, source = checkpoint.spec.quantization, str(checkpoint.path)
    modules: dict[str, dict[str, TensorPlan]] = {}
    for tensor in tensors:
        module, _, param = tensor.name.rpartition(".")
        if weight_scheme(config, module) is not None:
            modules.setdefault(module, {})[param] = tensor
    dtype = _plain_dtype(checkpoint)
    replaced: dict[str, TensorPlan] = {}
    for module, parts in modules.items():
        if not ({PACKED, SCALE} <= parts.keys() or (SCALE in parts and parts.get("weight") is not None)):
            continue
        for tensor in parts.values():
            if not tensor.is_copy or not tensor.source.is_whole:
                raise UsageError(f"--dequantize-assistant: --layout {layout} rewrites {tensor.name}'s quantized "
                                 "values itself; dequantize with a layout that keeps every tensor as it is")
        for unsupported in (ZERO_POINT, G_IDX):
            if unsupported in parts:
                raise InputError(f"{source}: {module}.{unsupported}: --dequantize-assistant takes symmetric schemes "
                                 "without activation order (a code times its scale)")
        weight = _packed_weight(module, parts, config, dtype, source) if PACKED in parts else \
            _scaled_weight(module, parts, dtype, source)
        replaced.update({tensor.name: weight for tensor in parts.values()})
    kept = [t for t in tensors if t.name not in replaced]
    return kept + list({id(w): w for w in replaced.values()}.values())


def _packed_weight(module: str, parts: Mapping[str, TensorPlan], config: Mapping[str, Any], dtype: str,
                   source: str) -> TensorPlan:
    scheme = weight_scheme(config, module)
    packed, scale, shape = parts[PACKED], parts[SCALE], parts.get(SHAPE)
    if scheme.format != PACK_QUANTIZED or not scheme.is_packed_int or shape is None or not scheme.symmetric:
        raise InputError(f"{source}: {module}: --dequantize-assistant takes symmetric pack-quantized int4 / int8 "
                         f"weights with their weight_shape; this is {scheme.describe()}")
    rows, words = packed.shape
    columns = words * (32 // scheme.num_bits)
    return TensorPlan(name=f"{module}.weight", dtype=dtype, shape=(rows, columns), source=packed.source,
                      action=ACTION_DEQUANTIZED, transform=Transform.DEQUANTIZE_PACKED,
                      companions=(scale.source, shape.source))


def _scaled_weight(module: str, parts: Mapping[str, TensorPlan], dtype: str, source: str) -> TensorPlan:
    weight, scale = parts["weight"], parts[SCALE]
    if weight.dtype not in _SCALED_DTYPES or len(weight.shape) != 2:
        raise InputError(f"{source}: {module}.weight is {weight.dtype}{list(weight.shape)}: --dequantize-assistant "
                         "takes 2-D float8 or int8 weights beside their weight_scale")
    return TensorPlan(name=weight.name, dtype=dtype, shape=weight.shape, source=weight.source,
                      action=ACTION_DEQUANTIZED, transform=Transform.DEQUANTIZE_SCALED, companions=(scale.source,))


def _plain_dtype(checkpoint: Checkpoint) -> str:
    """The float dtype most of the checkpoint's unquantized elements are stored in (bf16 for every published pair):
    what its dequantized weights are written in."""
    quantized = (PACKED, SCALE, SHAPE, ZERO_POINT, G_IDX, INPUT_SCALE)
    counts: dict[str, int] = {}
    for ref in checkpoint.tensors.values():
        if ref.dtype in _FLOATS and not ref.name.endswith(quantized):
            counts[ref.dtype] = counts.get(ref.dtype, 0) + math.prod(ref.shape)
    if not counts:
        raise InputError(f"{checkpoint.path}: no unquantized float tensor to take the dequantized weights' dtype from")
    return max(counts, key=counts.get)


def without_quantization(config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json without its quantization_config (top level and text_config): the weights are plain float now."""
    new = copy.deepcopy(dict(config))
    for holder in (new, text_config_of(new)):
        if isinstance(holder, dict):
            holder.pop("quantization_config", None)
    return new

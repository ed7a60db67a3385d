"""Which quantization scheme applies to which module, from a compressed-tensors or NVIDIA Model Optimizer
`quantization_config` (pure).

compressed-tensors matches `ignore` entries and group `targets` against module names: an exact name,
a `re:` regular expression (re.match), or a class name such as "Linear" (every projection here is one).
Anchors: compressed-tensors `quantization/lifecycle/apply.py` (ignore wins over targets) and
`quantization/quant_args.py` (strategy: tensor | channel | group | block | token | tensor_group).

Model Optimizer (`quant_method: modelopt`, e.g. nvidia/Gemma-4-31B-IT-NVFP4) lists excluded modules as
wildcards (`ignore` in config.json, `exclude_modules` in hf_quant_config.json); a module is excluded when a
pattern fnmatches its name or is a substring of it, as vLLM 0.27's `ModelOptQuantConfigBase.is_layer_excluded`
decides (docs/DESIGN.md "Gemma 4 checkpoints in the wild").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Any, Mapping

from .errors import InputError

COMPRESSED_TENSORS = "compressed-tensors"
MODELOPT = "modelopt"
# Strategies whose scales are per output row or per tensor: padding/replicating rows and zero columns stay exact.
ROW_EXACT_STRATEGIES = ("channel", "tensor")
PACK_QUANTIZED = "pack-quantized"
UNPACKED_INT_FORMATS = ("int-quantized", "naive-quantized")  # one int8 code per element, in `weight` itself
PACKED_BITS = (4, 8)  # widths pack_to_int32 fits whole into each int32 word (others straddle words)


@dataclass(frozen=True)
class WeightScheme:
    """How one module's weight is stored."""

    method: str
    format: str | None
    type: str | None
    num_bits: int | None
    strategy: str | None
    group_size: int | None
    block_structure: tuple[int, int] | None = None  # strategy "block": [rows, columns] per scale
    symmetric: bool = True  # False: integer codes carry a zero point (weight_zero_point)

    def describe(self) -> str:
        if self.method == MODELOPT:
            return f"modelopt {self.format}" + (f" group {self.group_size}" if self.group_size else "")
        if self.method != COMPRESSED_TENSORS:
            return f"{self.method} ({self.format or 'unknown format'})"
        size = f" {self.group_size}" if self.group_size else ""
        if self.block_structure:
            size = f" {self.block_structure[0]}x{self.block_structure[1]}"
        return f"{self.type}{self.num_bits} {self.strategy}{size} ({self.format})"

    @property
    def is_fp8(self) -> bool:
        return self.method == COMPRESSED_TENSORS and self.type == "float" and self.num_bits == 8

    @property
    def is_packed_int(self) -> bool:
        """compressed-tensors `pack-quantized` integer codes whose int32 words hold whole codes (4 or 8 bits): a
        code can be moved to another column by integer operations alone."""
        return (self.method == COMPRESSED_TENSORS and self.format == PACK_QUANTIZED and self.type == "int"
                and self.num_bits in PACKED_BITS)

    @property
    def is_unpacked_int8(self) -> bool:
        """compressed-tensors symmetric int8 codes stored one per element (`int-quantized`, llm-compressor's W8A8):
        code 0 dequantizes to 0 under any scale, like fp8's zero."""
        return (self.method == COMPRESSED_TENSORS and self.type == "int" and self.num_bits == 8
                and self.format in UNPACKED_INT_FORMATS and self.symmetric)

    def moves_exactly(self, *, columns: bool) -> bool:
        """Whether padding this weight keeps its dequantized values: rows move with their scale rows (per-channel,
        per-tensor, or groups along the input dim); new zero columns only under per-row or per-tensor scales."""
        allowed = ROW_EXACT_STRATEGIES if columns else (*ROW_EXACT_STRATEGIES, "group")
        return (self.is_fp8 or self.is_unpacked_int8) and self.strategy in allowed


def check_quantization_config(config: Any, *, source: str) -> None:
    """Raises InputError naming the first malformed part of a compressed-tensors config (types only; other
    methods are opaque and only reported)."""
    if not isinstance(config, Mapping) or config.get("quant_method") != COMPRESSED_TENSORS:
        return
    ignore, groups = config.get("ignore") or [], config.get("config_groups") or {}
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        raise InputError(f"{source}: quantization_config.ignore must be a list of strings")
    if not isinstance(groups, Mapping):
        raise InputError(f"{source}: quantization_config.config_groups must be an object")
    for name, group in groups.items():
        targets = group.get("targets") if isinstance(group, Mapping) else None
        weights = group.get("weights") if isinstance(group, Mapping) else None
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise InputError(f"{source}: quantization_config.config_groups.{name}.targets must be a list of strings")
        if weights is not None and not isinstance(weights, Mapping):
            raise InputError(f"{source}: quantization_config.config_groups.{name}.weights must be an object")
        block = (weights or {}).get("block_structure")
        if (weights or {}).get("strategy") == "block" and not (
                isinstance(block, list) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise InputError(f"{source}: quantization_config.config_groups.{name}.weights.block_structure must be "
                             f"[rows, columns] of positive integers for strategy 'block', got {block!r}")


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name or pattern == "Linear" or name.endswith("." + pattern)


def weight_scheme(config: Mapping[str, Any] | None, module: str) -> WeightScheme | None:
    """The scheme of `module` (e.g. 'model.language_model.layers.0.self_attn.o_proj'); None when it stays unquantized.

    A non-compressed-tensors config is reported as one opaque scheme for every module.
    """
    if not config:
        return None
    method = str(config.get("quant_method", "unknown"))
    if method == MODELOPT:
        return _modelopt_scheme(config, module)
    if method != COMPRESSED_TENSORS:
        return WeightScheme(method=method, format=config.get("quant_type") or config.get("fmt"), type=None,
                            num_bits=config.get("bits"), strategy=None, group_size=config.get("group_size"))
    if any(_matches(pattern, module) for pattern in config.get("ignore") or []):
        return None
    for group in (config.get("config_groups") or {}).values():
        weights = group.get("weights") if isinstance(group, Mapping) else None
        if weights and any(_matches(target, module) for target in group.get("targets") or []):
            block = weights.get("block_structure")
            return WeightScheme(method=method, format=config.get("format"), type=weights.get("type"),
                                num_bits=weights.get("num_bits"), strategy=weights.get("strategy"),
                                group_size=weights.get("group_size"),
                                block_structure=tuple(block) if block else None,
                                symmetric=bool(weights.get("symmetric", True)))
    return None


def _modelopt_scheme(config: Mapping[str, Any], module: str) -> WeightScheme | None:
    patterns = config.get("ignore") or config.get("exclude_modules") or []
    if any(fnmatch(module, p) or p in module for p in patterns if isinstance(p, str)):
        return None
    algo = str(config.get("quant_algo") or "unknown").upper()
    bits = 4 if "FP4" in algo else 8 if "FP8" in algo else None
    return WeightScheme(method=MODELOPT, format=algo, type="float", num_bits=bits, strategy=None,
                        group_size=config.get("group_size"))


def modelopt_from_hf_quant_config(document: Any) -> dict[str, Any] | None:
    """hf_quant_config.json ({"producer": ..., "quantization": {...}}) as a config.json-style modelopt
    quantization_config; vLLM 0.27 reads that file when config.json has no quantization_config."""
    if not isinstance(document, Mapping) or not isinstance(document.get("quantization"), Mapping):
        return None
    return {"quant_method": MODELOPT, **dict(document["quantization"])}


def weights_per_element(config: Mapping[str, Any] | None, tensor: str, dtype: str) -> int:
    """How many model weights one stored element of `tensor` holds: 32 // bits in a compressed-tensors
    pack-quantized `weight_packed` (int32 words of 4- or 8-bit codes), 2 in a Model Optimizer FP4 `weight` (two
    codes a byte), else 1 (bf16, fp8, an int8 code, a scale). Parameter counts use it, never an element size."""
    module, _, param = tensor.rpartition(".")
    scheme = weight_scheme(config, module)
    if scheme is None or not scheme.num_bits:
        return 1
    if param == "weight_packed" and scheme.is_packed_int:
        return 32 // scheme.num_bits
    if param == "weight" and scheme.method == MODELOPT and scheme.num_bits == 4 and dtype == "U8":
        return 2
    return 1

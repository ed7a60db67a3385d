"""`pad-global`: every layer gets head_dim = global_head_dim and num_key_value_heads KV heads, exactly.

Sliding layers grow d -> D with the interleaved-per-half duplicate placement; full k_eq_v layers replicate their global
KV heads (docs/DESIGN.md "The pad-global transform: placement math"). The config becomes homogeneous, so no transformers
version has a per-layer attribute to reject, and vLLM 0.27 builds every layer alike.

Quantized weights stored one code per element (compressed-tensors fp8, and symmetric int8 `int-quantized`, W8A8)
move with their per-row scales, so dequantized values are exactly the originals; o_proj's zero columns (code 0) are
exact under any per-row scale; per-tensor scales stay.
fp8 `block` scales move too where every output block's rows (columns) come from one source block: padding
repeats source row j at rows j*r .. j*r + r - 1, so each scale row is repeated r times whenever the blocks tile
the projection's rows (head_dim 128 or 256 with 128-row blocks alike), each o_proj scale column r times (zeros
are exact under any scale). Other block shapes are refused by name.

Packed integer codes (compressed-tensors `pack-quantized`, symmetric int4 / int8: Google's QAT W4A16, int8
channel-wise) move too: q/k/v rows are whole rows of int32 words and of their group or channel scales, so they move
as they are; o_proj's codes are unpacked, spread to every r-th column with the zero code between, and repacked,
and its group scales repeat r times along the input, which is exact when a group never straddles two halves of a
head (group size dividing head_dim / 2; 32 divides 128, the 31B sliding half). `weight_shape` follows. Asymmetric
codes (a zero point) are refused by name.
"""

from __future__ import annotations

from typing import Any

from ..cost import homogeneous
from ..errors import InputError
from ..gemma4 import DIALECT_LEGACY, FORM_HOMOGENEOUS, KV_UNIFORM, AttentionConfig, LayerGeometry, ModelSpec
from ..plan import CachePlacement, TensorPlan, Transform
from ..quantization import WeightScheme, weight_scheme
from ..validate.attention import AttentionTensor
from .base import Layout, explicit_geometry, kept, register_layout, transformed

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


@register_layout("pad-global")
class PadGlobalLayout(Layout):
    description = ("homogeneous geometry (head_dim = global_head_dim, uniform KV heads) by exact padding; "
                   "serves with any transformers version; convert target and assistant together")
    preference = 10
    advice_why = "the zero-cost per-layer layout does not serve there; pad-global (homogeneous geometry) does"
    card_text = (
        "Every layer has the global geometry (`head_dim` = `global_head_dim`, the same KV-head count everywhere), so "
        "the config has no per-layer keys and vLLM 0.27 loads it under any transformers version. The sliding layers' "
        "heads are padded exactly (interleaved per half, rows duplicated, norm weights and `o_proj` columns zero on "
        "the copies: same outputs, nothing rescaled) and the global k_eq_v KV heads are replicated. The price is "
        "KV-cache memory (below) and larger weights. The target and its assistant **must both** be pad-global: "
        "mixing layouts computes garbage.")
    kv_note = "pad-global widens the sliding layers' cache"
    price_note = "costs KV cache and weights; convert target and assistant together"
    # a GPU picks FA4 / TRITON_ATTN only where head sizes differ
    # (docs/DESIGN.md "The pad-global transform: placement math")
    serve_flags = " --attention-backend TRITON_ATTN"
    serve_note = ("`--attention-backend TRITON_ATTN` keeps the kernel path the original heterogeneous geometry gets "
                  "(vLLM picks FA4/TRITON_ATTN only when head sizes differ).")
    pair_must_match = True

    def output_attention(self, attention: AttentionConfig) -> AttentionConfig:
        return homogeneous(attention)

    def ledger_shape(self, kv_heads: str) -> tuple[str, str]:
        return FORM_HOMOGENEOUS, KV_UNIFORM

    def check(self, spec: ModelSpec, *, source: str) -> list[str]:
        a = spec.attention
        if a.global_head_dim % a.head_dim or a.head_dim % 2:
            raise InputError(f"{source}: pad-global needs global_head_dim ({a.global_head_dim}) to be an integer "
                             f"multiple of an even head_dim ({a.head_dim})")
        if a.k_eq_v and a.num_kv_heads % a.num_global_kv_heads:
            raise InputError(f"{source}: pad-global needs num_key_value_heads ({a.num_kv_heads}) to be a multiple "
                             f"of num_global_key_value_heads ({a.num_global_kv_heads})")
        for layer in a.layers:
            for module in _changed_modules(layer, a):
                self._check_quantization(spec, layer, module, source)
        return []

    @staticmethod
    def _check_quantization(spec: ModelSpec, layer: LayerGeometry, module: str, source: str) -> None:
        name = _projection_name(spec, layer.index, module)
        scheme = weight_scheme(spec.quantization, name)
        columns = module == "o_proj"
        if scheme is None or scheme.moves_exactly(columns=columns):
            return
        if scheme.is_packed_int:
            why = _packed_problem(scheme, module, layer)
            if why is None:
                return
        elif scheme.is_fp8 and scheme.strategy == "block" and scheme.block_structure:
            why = _block_problem(scheme.block_structure, module, layer, spec.attention)
            if why is None:
                return
        elif scheme.is_fp8 and scheme.strategy in ("group", "block", "tensor_group"):
            why = "its scale groups would straddle original and padding " + ("columns" if columns else "rows")
        else:
            why = ("pad-global moves fp8 weights with per-channel, per-tensor or tiling block scales, symmetric int8 "
                   "codes with per-channel or per-tensor scales, and symmetric 4- or 8-bit pack-quantized codes, "
                   "exactly")
        raise InputError(f"{source}: {name} is quantized as {scheme.describe()}; {why}. Refusing to requantize: "
                         "convert the bf16 checkpoint, or use --layout per-layer")

    def plan_attention(self, tensor: AttentionTensor, spec: ModelSpec, out_name: str) -> TensorPlan:
        a, layer, shape = spec.attention, tensor.layer, tensor.source.shape
        target = a.global_head_dim
        rows = {"q_proj": a.num_heads * layer.head_dim}.get(tensor.module, layer.num_kv_heads * layer.head_dim)
        per_row = bool(shape) and shape[0] == rows  # weight, bias, per-channel scale; not a per-tensor scale
        block = _scale_block(tensor, spec)
        if block is not None:
            return self._plan_block_scale(tensor, spec, out_name, block)
        packed = _packed_scheme(tensor, spec)
        if packed is not None and (tensor.param in ("weight_packed", "weight_shape")
                                   or (tensor.module == "o_proj" and tensor.param == "weight_scale")):
            return self._plan_packed(tensor, spec, out_name, packed)
        if layer.head_dim != target:
            ratio = target // layer.head_dim
            if tensor.module in ("q_proj", "k_proj", "v_proj") and per_row:
                heads = a.num_heads if tensor.module == "q_proj" else layer.num_kv_heads
                return transformed(tensor, out_name, action="padded", transform=Transform.PAD_HEAD_ROWS,
                                   shape=(shape[0] * ratio, *shape[1:]), num_heads=heads,
                                   head_dim=layer.head_dim, target_head_dim=target)
            if tensor.module in ("q_norm", "k_norm") and tensor.param == "weight":
                return transformed(tensor, out_name, action="padded", transform=Transform.PAD_HEAD_NORM,
                                   shape=(target,), head_dim=layer.head_dim, target_head_dim=target)
            if tensor.module == "o_proj" and tensor.param == "weight":
                return transformed(tensor, out_name, action="padded-columns", transform=Transform.PAD_HEAD_COLUMNS,
                                   shape=(shape[0], shape[1] * ratio), num_heads=a.num_heads,
                                   head_dim=layer.head_dim, target_head_dim=target)
        elif layer.num_kv_heads != a.num_kv_heads and tensor.module == "k_proj" and per_row:
            repeats = a.num_kv_heads // layer.num_kv_heads
            return transformed(tensor, out_name, action="replicated", transform=Transform.REPLICATE_KV_HEADS,
                               shape=(shape[0] * repeats, *shape[1:]), num_heads=layer.num_kv_heads,
                               head_dim=layer.head_dim, repeats=repeats)
        return kept(tensor, out_name)

    @staticmethod
    def _plan_block_scale(tensor: AttentionTensor, spec: ModelSpec, out_name: str,
                          block: tuple[int, int]) -> TensorPlan:
        """A `block` weight_scale [rows / block rows, columns / block columns] moved like the weight's rows
        (or o_proj's columns); check() made sure every output block reads one source block."""
        a, layer, shape = spec.attention, tensor.layer, tensor.source.shape
        target, rows_per_block = a.global_head_dim, block[0]
        if layer.head_dim != target and tensor.module in ("q_proj", "k_proj", "v_proj"):
            ratio = target // layer.head_dim
            return transformed(tensor, out_name, action="padded", transform=Transform.REPEAT_ROWS,
                               shape=(shape[0] * ratio, *shape[1:]), repeats=ratio)
        if layer.head_dim != target and tensor.module == "o_proj":
            ratio = target // layer.head_dim
            return transformed(tensor, out_name, action="padded-columns", transform=Transform.REPEAT_COLUMNS,
                               shape=(shape[0], shape[1] * ratio), repeats=ratio)
        if layer.head_dim == target and layer.num_kv_heads != a.num_kv_heads and tensor.module == "k_proj":
            repeats = a.num_kv_heads // layer.num_kv_heads
            return transformed(tensor, out_name, action="replicated", transform=Transform.REPLICATE_KV_HEADS,
                               shape=(shape[0] * repeats, *shape[1:]), num_heads=layer.num_kv_heads,
                               head_dim=layer.head_dim // rows_per_block, repeats=repeats)
        return kept(tensor, out_name)

    @staticmethod
    def _plan_packed(tensor: AttentionTensor, spec: ModelSpec, out_name: str,
                     scheme: WeightScheme) -> TensorPlan:
        """A pack-quantized projection's weight_packed, weight_shape, or o_proj weight_scale (q/k/v scales are
        whole rows and go the per-row way); check() made sure the codes and groups move exactly."""
        a, layer, shape = spec.attention, tensor.layer, tensor.source.shape
        ratio = a.global_head_dim // layer.head_dim
        repeats = a.num_kv_heads // layer.num_kv_heads if tensor.module == "k_proj" else 1
        if layer.head_dim == a.global_head_dim and repeats == 1:
            return kept(tensor, out_name)
        if tensor.param == "weight_shape":
            rows, columns = (1, ratio) if tensor.module == "o_proj" else (ratio if ratio > 1 else repeats, 1)
            return transformed(tensor, out_name, action="reshaped", transform=Transform.SCALE_WEIGHT_SHAPE, shape=shape,
                               rows=rows, columns=columns)
        if tensor.module != "o_proj":  # weight_packed rows: the per-row transforms move whole int32 words
            if ratio > 1:
                heads = a.num_heads if tensor.module == "q_proj" else layer.num_kv_heads
                return transformed(tensor, out_name, action="padded", transform=Transform.PAD_HEAD_ROWS,
                                   shape=(shape[0] * ratio, *shape[1:]), num_heads=heads, head_dim=layer.head_dim,
                                   target_head_dim=a.global_head_dim)
            return transformed(tensor, out_name, action="replicated", transform=Transform.REPLICATE_KV_HEADS,
                               shape=(shape[0] * repeats, *shape[1:]), num_heads=layer.num_kv_heads,
                               head_dim=layer.head_dim, repeats=repeats)
        if tensor.param == "weight_packed":
            return transformed(tensor, out_name, action="padded-columns", transform=Transform.PAD_PACKED_COLUMNS,
                               shape=(shape[0], shape[1] * ratio), num_bits=int(scheme.num_bits), ratio=ratio)
        if scheme.strategy == "group":  # o_proj's group scales: each new group reads one source group
            return transformed(tensor, out_name, action="padded-columns", transform=Transform.REPEAT_COLUMNS,
                               shape=(shape[0], shape[1] * ratio), repeats=ratio)
        return kept(tensor, out_name)  # channel scales: the zero codes are exact under any scale

    def cache_placement(self, *, num_kv_heads: int, head_dim: int, output_kv_heads: int, output_head_dim: int,
                        key: bool) -> CachePlacement | None:
        # as plan_attention moves k_proj / v_proj rows: each head's rows padded (duplicated into the copy slots),
        # then whole heads replicated; k_norm's zero weights at the copy slots zero the cached key copies
        rows: list[tuple[Transform, dict[str, int]]] = []
        norm = None
        if output_head_dim != head_dim:
            rows.append((Transform.PAD_HEAD_ROWS, dict(num_heads=num_kv_heads, head_dim=head_dim,
                                                       target_head_dim=output_head_dim)))
            if key:
                norm = (Transform.PAD_HEAD_NORM, dict(head_dim=head_dim, target_head_dim=output_head_dim))
        if output_kv_heads != num_kv_heads:
            rows.append((Transform.REPLICATE_KV_HEADS, dict(num_heads=num_kv_heads, head_dim=output_head_dim,
                                                            repeats=output_kv_heads // num_kv_heads)))
        return CachePlacement(rows=tuple(rows), norm=norm)

    def geometry_keys(self, attention: AttentionConfig) -> dict[str, Any]:
        # num_global_key_value_heads stays written: transformers 5.14.1 fails on None
        # (docs/DESIGN.md "The pad-global transform: placement math")
        return explicit_geometry(attention, head_dim=attention.global_head_dim,
                                 num_global_key_value_heads=attention.num_kv_heads)

    def matches(self, spec: ModelSpec) -> bool:
        return spec.attention.is_homogeneous and spec.dialect == DIALECT_LEGACY


def _changed_modules(layer: LayerGeometry, attention: AttentionConfig) -> tuple[str, ...]:
    """The projections whose tensors pad-global rewrites in this layer."""
    if layer.head_dim != attention.global_head_dim:
        return tuple(m for m in PROJECTIONS if m != "v_proj" or not layer.k_eq_v)
    if layer.num_kv_heads != attention.num_kv_heads:
        return ("k_proj",)
    return ()


def _projection_name(spec: ModelSpec, layer: int, module: str) -> str:
    """The module name a quantization_config's targets and ignore list match (e.g. ...layers.0.self_attn.q_proj)."""
    return f"{spec.weight_prefix}layers.{layer}.self_attn.{module}"


def _projection_scheme(tensor: AttentionTensor, spec: ModelSpec) -> WeightScheme | None:
    """The quantization scheme of the projection this tensor belongs to; None for norms and unquantized ones."""
    if tensor.module not in PROJECTIONS:
        return None
    return weight_scheme(spec.quantization, _projection_name(spec, tensor.layer.index, tensor.module))


def _scale_block(tensor: AttentionTensor, spec: ModelSpec) -> tuple[int, int] | None:
    """The [rows, columns] block of a `block`-quantized projection's weight_scale; None for anything else."""
    scheme = _projection_scheme(tensor, spec) if tensor.param == "weight_scale" else None
    return scheme.block_structure if scheme and scheme.strategy == "block" else None


def _packed_scheme(tensor: AttentionTensor, spec: ModelSpec) -> WeightScheme | None:
    """The pack-quantized integer scheme of this projection tensor; None for anything else."""
    scheme = _projection_scheme(tensor, spec)
    return scheme if scheme is not None and scheme.is_packed_int else None


def _packed_problem(scheme: WeightScheme, module: str, layer: LayerGeometry) -> str | None:
    """Why packed integer codes of `module` cannot move exactly; None when they can."""
    if not scheme.symmetric:
        return "its codes carry a zero point (asymmetric), which pad-global does not move"
    if scheme.strategy not in ("group", "channel", "tensor"):
        return f"its {scheme.strategy} scales are not a grid pad-global moves"
    group, width = int(scheme.group_size or 1), layer.head_dim
    if module == "o_proj" and scheme.strategy == "group" and (width // 2) % group:
        if group > width:  # one group holds several whole heads, and pad-global pads each head apart
            heads = f"{group // width}" if group % width == 0 else f"{group / width:.2f}"
            return (f"its groups of {group} input columns span {heads} heads of {width} columns each, and pad-global "
                    f"pads every head, so a padded group would mix heads with padding")
        return (f"its groups of {group} input columns straddle two halves of a {width}-wide head, so a padded group "
                f"would mix two source groups")
    return None


def _block_problem(block: tuple[int, int], module: str, layer: LayerGeometry, a: AttentionConfig) -> str | None:
    """Why `block` scales cannot move exactly with this module's padded rows/columns; None when they can."""
    rows, columns = block
    d, target = layer.head_dim, a.global_head_dim
    if a.hidden_size % (columns if module != "o_proj" else rows):
        return f"its {rows}x{columns} scale blocks do not tile the hidden size {a.hidden_size}"
    if d == target:  # a k_eq_v full layer: whole KV heads are replicated
        if target % rows:
            return f"its {rows}-row scale blocks do not tile a {target}-row head, so replicated heads would split one"
        return None
    ratio = target // d
    if module == "o_proj":
        if columns % ratio or (a.num_heads * d) % columns:
            return (f"its {columns}-column scale blocks cannot follow columns spread x{ratio} (they must be a multiple "
                    f"of {ratio} and tile the {a.num_heads * d} input columns)")
        return None
    # pad_head_rows repeats row j at j*r .. j*r + r - 1, so an output block of `rows` rows reads source block b // r
    # alone whenever blocks tile the projection's rows (head_dim 128 or 256 with 128-row blocks included)
    heads = a.num_heads if module == "q_proj" else layer.num_kv_heads
    if (heads * d) % rows:
        return f"its {rows}-row scale blocks do not tile the {heads * d} rows of {module} ({heads} heads x {d})"
    return None

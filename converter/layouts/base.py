"""The shared half of every layout: find and check attention tensors, rewrite config keys, plan shards."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator, Mapping

from ..errors import InputError, UnsupportedLayoutError, UsageError
from ..gemma4 import (GEOMETRY_KEYS, AttentionConfig, LayerGeometry, ModelSpec, attention_tensor_name,
                      parse_attention_name, parse_moe_name, without_dual_keys)
from ..plan import ACTION_KEPT, ACTION_SPLIT, CheckpointPlan, SourceSlice, TensorPlan, mark_unchanged, plan_shards
from ..quantization import MODELOPT, WeightScheme, weight_scheme
from ..read.checkpoint import Checkpoint
from ..read.quantized import quantized_weight_problems
from ..read.safetensors_header import TensorRef

_REGISTRY: dict[str, type["Layout"]] = {}


def register_layout(name: str) -> Callable[[type["Layout"]], type["Layout"]]:
    """Class decorator adding a layout under `name`; a second class with the same name is a bug, so it raises."""
    def decorate(cls: type["Layout"]) -> type["Layout"]:
        if name in _REGISTRY:
            raise ValueError(f"layout {name!r} is already registered by {_REGISTRY[name].__name__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return decorate


def layout_names() -> list[str]:
    return sorted(_REGISTRY)


def get_layout(name: str, options: Mapping[str, Any] | None = None) -> "Layout":
    """The registered layout instance with `options` over its defaults; UnsupportedLayoutError lists the known names.

    Raises:
        UnsupportedLayoutError: no layout of that name.
        UsageError: an option the layout does not have, or a value it does not accept.
    """
    if name not in _REGISTRY:
        raise UnsupportedLayoutError(f"unknown layout {name!r}; known layouts: {', '.join(layout_names())}")
    return _REGISTRY[name](**dict(options or {}))


def layout_from_manifest(manifest: Mapping[str, Any]) -> "Layout":
    """The layout a conversion.json records, with the options it was run with.

    A manifest written before its layout had options holds none: it gets the layout's `recorded_before_options`.
    """
    name = str(manifest.get("layout", ""))
    options = manifest.get("layout_options")
    if options is None and name in _REGISTRY:
        options = _REGISTRY[name].recorded_before_options
    return get_layout(name, options if isinstance(options, Mapping) else None)


@dataclass(frozen=True)
class AttentionTensor:
    """One q/k/v/o/norm tensor of a text decoder layer, with the geometry it must have."""

    layer: LayerGeometry
    module: str
    param: str
    source: SourceSlice
    from_fused: bool


class Layout:
    """Base class: subclasses set `description` and override the two hooks below."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    # option name -> (default, accepted values); recorded in conversion.json as `layout_options`
    option_choices: ClassVar[Mapping[str, tuple[Any, tuple[Any, ...]]]] = {}
    # the options of outputs written before the layout had any (their conversion.json records none)
    recorded_before_options: ClassVar[Mapping[str, Any]] = {}

    def __init__(self, **options: Any) -> None:
        for key, value in options.items():
            if key not in self.option_choices:
                raise UsageError(f"layout {self.name!r} has no option {key!r}")
            if value not in self.option_choices[key][1]:
                raise UsageError(f"layout {self.name!r} option {key!r} must be one of "
                                 f"{list(self.option_choices[key][1])}, got {value!r}")
        self.options: dict[str, Any] = {key: options.get(key, default)
                                        for key, (default, _) in self.option_choices.items()}

    # -- hooks -------------------------------------------------------------------------------------
    def check(self, spec: ModelSpec, *, source: str) -> list[str]:
        """Raises InputError when the checkpoint cannot take this layout; returns warnings."""
        return []

    def plan_attention(self, tensor: AttentionTensor, spec: ModelSpec, out_name: str) -> TensorPlan:
        raise NotImplementedError

    def geometry_keys(self, attention: AttentionConfig) -> dict[str, Any]:
        raise NotImplementedError

    def matches(self, spec: ModelSpec) -> bool:
        """True when a checkpoint's config already has this layout's geometry."""
        raise NotImplementedError

    # -- shared ------------------------------------------------------------------------------------
    def plan(self, checkpoint: Checkpoint, *, max_shard_bytes: int | None = None) -> CheckpointPlan:
        """The complete plan for one checkpoint: every tensor, the shards, the new config."""
        spec = checkpoint.spec
        check_quantized_attention(spec, source=str(checkpoint.path))
        warnings = self.check(spec, source=str(checkpoint.path))  # a scheme this layout refuses, by name, first
        raise_first(quantized_weight_problems(checkpoint))  # per-layer copies the bytes: check what they claim
        tensors = list(self._plan_tensors(checkpoint))
        shards, indexed = plan_shards(tensors, source_files=[s.file.name for s in checkpoint.shards],
                                      indexed=checkpoint.indexed, max_shard_bytes=max_shard_bytes)
        shards = mark_unchanged(shards, checkpoint.shards)
        metadata = dict(checkpoint.shards[0].metadata) if checkpoint.shards else {}
        metadata.setdefault("format", "pt")
        return CheckpointPlan(role=spec.role, layout=self.name, layout_options=dict(self.options),
                              config=self.rewrite_config(checkpoint.config, spec),
                              shards=shards, indexed=indexed, side_files=checkpoint.side_files,
                              metadata=metadata, warnings=tuple(warnings))

    def rewrite_config(self, config: Any, spec: ModelSpec) -> dict[str, Any]:
        """config.json with the geometry keys replaced, `per_layer_config` and any dual keys gone; the rest kept."""
        new = copy.deepcopy(dict(config))
        text = without_dual_keys(new[spec.text_config_key] if spec.text_config_key else new)
        text.pop("per_layer_config", None)
        text = self.rewrite_text_config(text, spec.attention)
        write_vision_rope_portably(new)
        if spec.text_config_key:
            new[spec.text_config_key] = text
            return new
        return text

    def rewrite_text_config(self, text: dict[str, Any], attention: AttentionConfig) -> dict[str, Any]:
        """The text config (already without per_layer_config and dual keys) with this layout's geometry keys."""
        text.update(self.geometry_keys(attention))
        return text

    def _plan_tensors(self, checkpoint: Checkpoint) -> Iterator[TensorPlan]:
        spec = checkpoint.spec
        attention = list(find_attention_tensors(checkpoint))
        check_attention_tensors(attention, spec, source=str(checkpoint.path))
        check_attention_scales(attention, spec, source=str(checkpoint.path))
        check_moe_tensors(checkpoint)
        claimed = {t.source.ref.name for t in attention}
        for ref in checkpoint.tensors.values():
            if ref.name not in claimed:
                yield TensorPlan(name=ref.name, dtype=ref.dtype, shape=ref.shape, source=SourceSlice.whole(ref),
                                 action=ACTION_KEPT)
        for tensor in attention:
            out_name = attention_tensor_name(spec.weight_prefix, tensor.layer.index, tensor.module, tensor.param)
            yield self.plan_attention(tensor, spec, out_name)


def write_vision_rope_portably(config: dict[str, Any]) -> None:
    """Vision rope "axial" -> "default", in place: transformers >= 5.15 writes "axial" on save_pretrained, which
    5.14.1 cannot build (KeyError: 'axial'); >= 5.15 maps "default" back to "axial" on load
    (modeling_rope_utils.py standardize_rope_params, Gemma4VisionConfig.default_rope_type), so both read it."""
    vision = config.get("vision_config")
    rope = vision.get("rope_parameters") if isinstance(vision, dict) else None
    if isinstance(rope, dict) and rope.get("rope_type") == "axial":
        rope["rope_type"] = "default"


def kept(tensor: AttentionTensor, out_name: str) -> TensorPlan:
    """The tensor unchanged (a fused source's row range is still a plain byte copy)."""
    return TensorPlan(name=out_name, dtype=tensor.source.ref.dtype, shape=tensor.source.shape, source=tensor.source,
                      action=ACTION_SPLIT if tensor.from_fused else ACTION_KEPT)


def transformed(tensor: AttentionTensor, out_name: str, *, action: str, transform: str, shape: tuple[int, ...],
                **params: int) -> TensorPlan:
    """The tensor through a named function of transforms.py."""
    return TensorPlan(name=out_name, dtype=tensor.source.ref.dtype, shape=shape, source=tensor.source,
                      action=f"split+{action}" if tensor.from_fused else action, transform=transform, params=params)


def _fused_slices(ref: TensorRef, layer: LayerGeometry, num_heads: int, source: str,
                  block: WeightScheme | None) -> Iterator[tuple[str, SourceSlice]]:
    """q/k/v row ranges of a fused qkv_proj tensor; `block`: the fp8 block scheme when `ref` is its
    `weight_scale`, whose rows are one per block of weight rows (split exactly when no block straddles two
    projections; refused by name when one does)."""
    rows = {"q_proj": num_heads * layer.head_dim, "k_proj": layer.num_kv_heads * layer.head_dim,
            "v_proj": 0 if layer.k_eq_v else layer.num_kv_heads * layer.head_dim}
    unit = ""
    if block is not None:
        block_rows = block.block_structure[0]
        straddling = next((m for m, n in rows.items() if n % block_rows), None)
        if straddling is not None:
            raise InputError(f"{source}: {ref.name} holds {block.describe()} scales of a fused q/k/v weight, but "
                             f"{straddling} has {rows[straddling]} rows, not a multiple of the {block_rows}-row "
                             "block: a scale spans two projections and cannot be split exactly")
        rows = {m: n // block_rows for m, n in rows.items()}
        unit = f" (one per {block_rows} weight rows)"
    total = sum(rows.values())
    if not ref.shape or ref.shape[0] != total:
        raise InputError(f"{source}: {ref.name} has shape {list(ref.shape)} but layer {layer.index} "
                         f"({layer.layer_type}, head_dim {layer.head_dim}, {layer.num_kv_heads} KV heads"
                         f"{', k_eq_v' if layer.k_eq_v else ''}) needs {total} fused rows{unit}")
    start = 0
    for module, count in rows.items():
        if count:
            yield module, SourceSlice(ref=ref, row_start=start, row_stop=start + count)
        start += count


def _block_scheme(spec: ModelSpec, layer: int) -> WeightScheme | None:
    scheme = weight_scheme(spec.quantization, f"{spec.weight_prefix}layers.{layer}.self_attn.qkv_proj")
    return scheme if scheme is not None and scheme.is_fp8 and scheme.block_structure else None


def find_attention_tensors(checkpoint: Checkpoint) -> Iterator[AttentionTensor]:
    """Every text-decoder attention tensor, a fused qkv_proj already split into q/k/v row ranges."""
    spec = checkpoint.spec
    layers = spec.attention.layers
    for ref in checkpoint.tensors.values():
        parsed = parse_attention_name(ref.name, spec.weight_prefix)
        if parsed is None:
            continue
        if parsed.layer >= len(layers):
            raise InputError(f"{checkpoint.path}: {ref.name} names layer {parsed.layer} but the config has "
                             f"{len(layers)} layers")
        layer = layers[parsed.layer]
        if parsed.module == "qkv_proj":
            block = _block_scheme(spec, parsed.layer) if parsed.param == "weight_scale" else None
            for module, piece in _fused_slices(ref, layer, spec.attention.num_heads, str(checkpoint.path), block):
                yield AttentionTensor(layer=layer, module=module, param=parsed.param, source=piece, from_fused=True)
        else:
            yield AttentionTensor(layer=layer, module=parsed.module, param=parsed.param,
                                  source=SourceSlice.whole(ref), from_fused=False)


def expected_shape(tensor: AttentionTensor, attention: AttentionConfig) -> tuple[int, ...] | None:
    """The shape vLLM 0.27 will build for a weight or bias; None for params it does not size this way."""
    layer, hidden = tensor.layer, attention.hidden_size
    rows = {"q_proj": attention.num_heads * layer.head_dim, "k_proj": layer.num_kv_heads * layer.head_dim,
            "v_proj": layer.num_kv_heads * layer.head_dim}
    if tensor.module in ("q_norm", "k_norm"):
        return (layer.head_dim,) if tensor.param == "weight" else None
    if tensor.module == "o_proj":
        return {"weight": (hidden, attention.num_heads * layer.head_dim), "bias": (hidden,)}.get(tensor.param)
    return {"weight": (rows[tensor.module], hidden), "bias": (rows[tensor.module],)}.get(tensor.param)


def check_attention_tensors(tensors: list[AttentionTensor], spec: ModelSpec, *, source: str) -> None:
    """Raises InputError (the first of attention_problems) when a tensor contradicts the config's geometry."""
    problems = attention_problems(tensors, spec, source=source)
    if problems:
        raise InputError(problems[0].message)


@dataclass(frozen=True)
class AttentionProblem:
    """One contradiction between config and tensors: `tensor` set for a wrong shape or an unexpected tensor,
    `missing` (module names of `layer`) for absent ones."""

    message: str
    layer: LayerGeometry
    tensor: AttentionTensor | None = None
    want: tuple[int, ...] | None = None
    missing: tuple[str, ...] = ()


def attention_problems(tensors: list[AttentionTensor], spec: ModelSpec, *, source: str) -> list[AttentionProblem]:
    """Every tensor whose shape or presence contradicts the config's geometry (shapes first, then per layer)."""
    problems: list[AttentionProblem] = []
    present: dict[int, set[str]] = {}
    for tensor in tensors:
        present.setdefault(tensor.layer.index, set()).add(tensor.module)
        want = expected_shape(tensor, spec.attention)
        if want is not None and tensor.source.shape != want:
            layer = tensor.layer
            problems.append(AttentionProblem(
                f"{source}: {tensor.source.ref.name}{' (' + tensor.module + ' rows)' if tensor.from_fused else ''} "
                f"has shape {list(tensor.source.shape)} but layer {layer.index} ({layer.layer_type}: head_dim "
                f"{layer.head_dim}, {layer.num_kv_heads} KV heads) implies {list(want)}; config and weights disagree",
                layer=layer, tensor=tensor, want=want))
    for layer in spec.attention.layers:
        modules = present.get(layer.index, set())
        required = {"q_proj", "o_proj", "q_norm"} | ({"k_proj", "k_norm"} if layer.has_k else set())
        required |= {"v_proj"} if layer.has_v else set()
        missing = sorted(required - modules)
        if missing:
            problems.append(AttentionProblem(
                f"{source}: layer {layer.index} ({layer.layer_type}) has no {', '.join(missing)} tensor",
                layer=layer, missing=tuple(missing)))
        if "v_proj" in modules and layer.k_eq_v:
            extra = next(t for t in tensors if t.layer.index == layer.index and t.module == "v_proj")
            problems.append(AttentionProblem(
                f"{source}: layer {layer.index} has a v_proj tensor but the config says attention_k_eq_v (V is the "
                "K projection)", layer=layer, tensor=extra))
    return problems


def raise_first(problems: list[str]) -> None:
    """convert's refusal from a list-returning check (inspect lists them all): the first problem as InputError."""
    if problems:
        raise InputError(problems[0])


def attention_scale_problems(tensors: list[AttentionTensor], spec: ModelSpec, *, source: str) -> list[str]:
    """Every compressed-tensors fp8 attention weight with no `weight_scale`, and every block scale whose shape is
    not one value per [rows, columns] block (layouts move scales together with their weights)."""
    scales = {(t.layer.index, t.module): t for t in tensors if t.param == "weight_scale"}
    problems = []
    for tensor in tensors:
        name = f"{spec.weight_prefix}layers.{tensor.layer.index}.self_attn.{tensor.module}"
        scheme = weight_scheme(spec.quantization, name) if tensor.param == "weight" else None
        if scheme is None or not scheme.is_fp8 or not tensor.source.ref.dtype.startswith("F8"):
            continue
        scale = scales.get((tensor.layer.index, tensor.module))
        if scale is None:
            problems.append(f"{source}: {tensor.source.ref.name} is {scheme.describe()} but {name}.weight_scale is "
                            "missing; the checkpoint cannot be dequantized")
        elif scheme.block_structure:
            rows, columns = tensor.source.shape
            want = (-(-rows // scheme.block_structure[0]), -(-columns // scheme.block_structure[1]))
            if tuple(scale.source.shape) != want:
                problems.append(f"{source}: {_piece_name(scale)} has shape {list(scale.source.shape)} but "
                                f"{scheme.describe()} scales of a {[rows, columns]} weight are {list(want)}")
    return problems


def _piece_name(tensor: AttentionTensor) -> str:
    return tensor.source.ref.name + (f" ({tensor.module} rows)" if tensor.from_fused else "")


def check_attention_scales(tensors: list[AttentionTensor], spec: ModelSpec, *, source: str) -> None:
    """Raises InputError: the first of attention_scale_problems."""
    raise_first(attention_scale_problems(tensors, spec, source=source))


def quantized_attention_problems(spec: ModelSpec, *, source: str) -> list[str]:
    """Model Optimizer checkpoints convert only with every attention projection excluded from quantization (as
    nvidia/Gemma-4-31B-IT-NVFP4 ships them): packed fp4 attention weights can be neither checked against the
    config's geometry nor moved exactly. One problem per quantized projection."""
    if not spec.quantization or spec.quantization.get("quant_method") != MODELOPT:
        return []
    problems = []
    for layer in spec.attention.layers:
        present = ("q_proj", *(("k_proj",) if layer.has_k else ()), *(("v_proj",) if layer.has_v else ()), "o_proj")
        for module in present:
            name = f"{spec.weight_prefix}layers.{layer.index}.self_attn.{module}"
            scheme = weight_scheme(spec.quantization, name)
            if scheme is not None:
                problems.append(f"{source}: {name} is quantized as {scheme.describe()}; Model Optimizer checkpoints "
                                "convert only when every self_attn module is excluded from quantization (like "
                                "nvidia/Gemma-4-31B-IT-NVFP4): packed fp4 attention weights cannot be checked or "
                                "padded exactly")
    return problems


def check_quantized_attention(spec: ModelSpec, *, source: str) -> None:
    """Raises InputError: the first of quantized_attention_problems."""
    raise_first(quantized_attention_problems(spec, source=source))


def moe_problems(checkpoint: Checkpoint) -> list[str]:
    """Every fused router/experts tensor that contradicts the config's MoE sizes, and the MoE layers with no experts
    at all (one problem listing them). Per-expert tensors (`experts.<id>.*`, how quantized checkpoints store them)
    are copied as they are; vLLM 0.27 maps both forms (models/gemma4.py load_weights)."""
    spec, source = checkpoint.spec, str(checkpoint.path)
    if spec.moe is None:
        return []
    want = spec.moe.fused_shapes()
    with_experts: set[int] = set()
    problems = []
    for ref in checkpoint.tensors.values():
        parsed = parse_moe_name(ref.name, spec.weight_prefix)
        if parsed is None:
            continue
        layer, suffix = parsed
        if suffix.startswith("experts."):
            with_experts.add(layer)
        if suffix in want and tuple(ref.shape) != want[suffix]:
            m = spec.moe
            problems.append(f"{source}: {ref.name} has shape {list(ref.shape)} but the config's MoE block "
                            f"({m.num_experts} experts, moe_intermediate_size {m.intermediate_size}, hidden "
                            f"{m.hidden_size}) implies {list(want[suffix])}; config and weights disagree")
    missing = [i for i in range(len(spec.attention.layer_types)) if i not in with_experts]
    if missing:
        more = f" (and {len(missing) - 1} more: {missing[1:]})" if len(missing) > 1 else ""
        problems.append(f"{source}: enable_moe_block is true but layer {missing[0]} has no experts tensors "
                        f"({spec.weight_prefix}layers.{missing[0]}.experts.gate_up_proj / .down_proj){more}")
    return problems


def check_moe_tensors(checkpoint: Checkpoint) -> None:
    """Raises InputError: the first of moe_problems."""
    raise_first(moe_problems(checkpoint))


def scheme_problems(checkpoint: Checkpoint, tensors: list[AttentionTensor]) -> list[str]:
    """Every problem of the three checks above, in convert's order (inspect lists them; convert stops at the first)."""
    source = str(checkpoint.path)
    found = (quantized_attention_problems(checkpoint.spec, source=source) + quantized_weight_problems(checkpoint)
             + attention_scale_problems(tensors, checkpoint.spec, source=source) + moe_problems(checkpoint))
    return list(dict.fromkeys(found))


def explicit_geometry(attention: AttentionConfig, **overrides: Any) -> dict[str, Any]:
    """The six flat keys vLLM 0.27 reads, from the resolved geometry, with overrides applied."""
    values = {"head_dim": attention.head_dim, "global_head_dim": attention.global_head_dim,
              "num_key_value_heads": attention.num_kv_heads,
              "num_global_key_value_heads": attention.num_global_kv_heads,
              "attention_k_eq_v": attention.k_eq_v, "layer_types": list(attention.layer_types)}
    values.update(overrides)
    return {key: values[key] for key in GEOMETRY_KEYS}

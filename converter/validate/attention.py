"""Attention tensors against the config's per-layer geometry: what each q/k/v/o/norm tensor must be, and every
tensor whose shape or presence contradicts it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from ..errors import InputError
from ..gemma4 import AttentionConfig, LayerGeometry, ModelSpec, parse_attention_name
from ..quantization import WeightScheme, weight_scheme
from ..read.checkpoint import Checkpoint
from ..read.safetensors_header import TensorRef
from ..read.slices import SourceSlice


@dataclass(frozen=True)
class AttentionTensor:
    """One q/k/v/o/norm tensor of a text decoder layer, with the geometry it must have."""

    layer: LayerGeometry
    module: str
    param: str
    source: SourceSlice
    from_fused: bool


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


def has_fused_qkv(checkpoint: Checkpoint) -> bool:
    """Whether it stores fused self_attn.qkv_proj tensors, from the names alone (nothing split or checked)."""
    return any((parsed := parse_attention_name(name, checkpoint.spec.weight_prefix)) is not None
               and parsed.module == "qkv_proj" for name in checkpoint.tensors)


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

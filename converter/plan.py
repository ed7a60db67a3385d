"""What every output tensor and file will be, decided from config + headers alone (no I/O, no tensor math).

A TensorPlan either COPIES a contiguous byte range of the source (a whole tensor, or a row range of a
fused qkv_proj) or TRANSFORMS it with a named pure function from transforms.py (which may also read companion
tensors: a quantized weight's scale, for --dequantize-assistant). Output shards are
laid out in source byte order so the writer reads every source file once, front to back.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any, Iterable, Mapping

from .read.checkpoint import INDEX_NAME, SINGLE_NAME
from .read.safetensors_header import DTYPES, ShardHeader
from .read.slices import SourceSlice

ACTION_KEPT = "kept"
ACTION_SPLIT = "split"


class Transform(str, Enum):
    """Every pure tensor function a plan may name (transforms.TRANSFORMS holds one per member): the name is what
    conversion.json records. What the plan and the advice must know of each is asked of the member, so a new
    transform is one member here and one function in transforms.py."""

    PAD_HEAD_ROWS = "pad_head_rows"
    PAD_HEAD_NORM = "pad_head_norm"
    PAD_HEAD_COLUMNS = "pad_head_columns"
    REPLICATE_KV_HEADS = "replicate_kv_heads"
    REPEAT_COLUMNS = "repeat_columns"
    REPEAT_ROWS = "repeat_rows"
    PAD_PACKED_COLUMNS = "pad_packed_columns"
    SCALE_WEIGHT_SHAPE = "scale_weight_shape"
    DEQUANTIZE_PACKED = "dequantize_packed"
    DEQUANTIZE_SCALED = "dequantize_scaled"

    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def named(cls, name: str | None) -> Transform | None:
        """The member a TensorPlan's `transform` names; None for none (a kept or split tensor)."""
        try:
            return cls(name)
        except ValueError:
            return None

    @property
    def spreads_input_columns(self) -> bool:
        """Whether it spreads a weight's input columns with zeros between: a block of 32 output columns then holds
        half of a source block and zeros, so a weight on ggml's Q4_0 grid (QAT) leaves it (advice/pitfalls.py)."""
        return self in (Transform.PAD_HEAD_COLUMNS, Transform.PAD_PACKED_COLUMNS)

    def row_units(self, params: Mapping[str, int]) -> tuple[int, int, str | None] | None:
        """(source rows, output rows, the param that counts the units) of one unit, where the output rows come from
        whole units of the source rows alone (a head's rows, or each row); None for the others."""
        if self is Transform.PAD_HEAD_ROWS:
            return params["head_dim"], params["target_head_dim"], "num_heads"
        if self is Transform.REPLICATE_KV_HEADS:
            return params["head_dim"], params["head_dim"] * params["repeats"], "num_heads"
        if self is Transform.REPEAT_ROWS:
            return 1, params["repeats"], None
        if self in (Transform.PAD_HEAD_COLUMNS, Transform.REPEAT_COLUMNS, Transform.PAD_PACKED_COLUMNS):
            return 1, 1, None
        return None


@dataclass(frozen=True)
class CachePlacement:
    """How the K or V cache of a target a layout wrote holds the original's states: transforms over the cache's head
    rows ([heads * head_dim, ...], laid out as the projection's rows), in order; then, for keys, the per-head-dim
    weight k_norm became (the transform of a weight of ones), which scales every head's rows. verify places
    synthetic K/V by it for an assistant checked without its target (proof/numerics.py)."""

    rows: tuple[tuple[Transform, Mapping[str, int]], ...] = ()
    norm: tuple[Transform, Mapping[str, int]] | None = None


@dataclass(frozen=True)
class TensorPlan:
    """One output tensor: its name, dtype, shape and how it is produced from one source slice (and, for a transform
    that needs them, the whole companion tensors it reads beside it, in the order the transform takes them)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    source: SourceSlice
    action: str
    transform: str | None = None
    params: Mapping[str, int] = field(default_factory=dict)
    companions: tuple[SourceSlice, ...] = ()

    @property
    def nbytes(self) -> int:
        return DTYPES[self.dtype][1] * math.prod(self.shape)

    @property
    def read_nbytes(self) -> int:
        """The source bytes it is made of: its slice and its companions."""
        return self.source.nbytes + sum(companion.nbytes for companion in self.companions)

    @property
    def is_copy(self) -> bool:
        return self.transform is None

    @property
    def kind(self) -> Transform | None:
        """The transform it names, as the typed spec (None: kept or split)."""
        return Transform.named(self.transform)

    @property
    def spreads_input_columns(self) -> bool:
        return bool(self.kind and self.kind.spreads_input_columns)


def row_pieces(tensor: TensorPlan, max_bytes: int) -> tuple[TensorPlan, ...]:
    """A TRANSFORM tensor as consecutive pieces of whole row units, each at most max_bytes of output (or one unit).

    The transform of source rows [a, b) of a unit-wise transform is output rows [a*k, b*k), so the pieces' bytes,
    in order, are the tensor's: the writer renders a 168 MB q_proj in 5.5 MB pieces, in buffers that stay in the
    cores' caches and are reused, not in fresh pages the kernel must fault in and zero (docs/BENCHMARKS.md). A tensor
    of at most max_bytes, or one whose transform mixes rows, is one piece.
    """
    units = tensor.kind.row_units(tensor.params) if tensor.kind else None
    if tensor.nbytes <= max_bytes or units is None or len(tensor.source.shape) < 2:
        return (tensor,)
    rows_in, rows_out, count_param = units
    total_rows = tensor.source.shape[0]
    count = total_rows // rows_in
    if total_rows % rows_in or tensor.shape[0] != count * rows_out:
        return (tensor,)
    per_piece = max(1, max_bytes // (tensor.nbytes // count))
    pieces = []
    for first in range(0, count, per_piece):
        units_here = min(per_piece, count - first)
        start = tensor.source.row_start + first * rows_in
        params = dict(tensor.params) | ({count_param: units_here} if count_param else {})
        pieces.append(replace(tensor, source=replace(tensor.source, row_start=start,
                                                     row_stop=start + units_here * rows_in),
                              shape=(units_here * rows_out, *tensor.shape[1:]), params=params))
    return tuple(pieces)


@dataclass(frozen=True)
class ShardPlan:
    file_name: str
    tensors: tuple[TensorPlan, ...]
    # the source file this shard reproduces byte for byte (every tensor of that file kept whole under its own name,
    # nothing else): the file is copied or linked as it is, its header included, instead of being re-serialized
    same_as: Path | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class CheckpointPlan:
    """Everything one converted checkpoint directory will hold."""

    role: str
    layout: str
    config: Mapping[str, Any]
    shards: tuple[ShardPlan, ...]
    indexed: bool
    side_files: tuple[str, ...]
    metadata: Mapping[str, str]
    warnings: tuple[str, ...] = ()
    layout_options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    dequantized: bool = False  # --dequantize-assistant: quantized weights written as plain float (dequantize.py)

    @property
    def tensors(self) -> tuple[TensorPlan, ...]:
        return tuple(t for shard in self.shards for t in shard.tensors)

    @property
    def total_size(self) -> int:
        return sum(shard.nbytes for shard in self.shards)

    @property
    def source_bytes(self) -> int:
        refs = {piece.ref.name: piece.ref.nbytes for t in self.tensors for piece in (t.source, *t.companions)}
        return sum(refs.values())


def plan_shards(tensors: Iterable[TensorPlan], *, source_files: list[str], indexed: bool,
                max_shard_bytes: int | None) -> tuple[tuple[ShardPlan, ...], bool]:
    """Groups output tensors into files, in source byte order.

    Without a byte budget each source shard becomes the output shard of the same name; with one,
    tensors are packed greedily (a tensor larger than the budget gets a shard of its own).

    Returns:
        (shards, indexed): indexed is False only for a single model.safetensors.
    """
    ordered = sorted(tensors, key=lambda t: (source_files.index(t.source.ref.file.name), t.source.offset))
    if max_shard_bytes is None:
        groups = [[t for t in ordered if t.source.ref.file.name == name] for name in source_files]
        names = list(source_files)
        return tuple(ShardPlan(n, tuple(g)) for n, g in zip(names, groups)), indexed
    groups: list[list[TensorPlan]] = [[]]
    filled = 0
    for tensor in ordered:
        if groups[-1] and filled + tensor.nbytes > max_shard_bytes:
            groups.append([])
            filled = 0
        groups[-1].append(tensor)
        filled += tensor.nbytes
    if len(groups) == 1:
        return (ShardPlan(SINGLE_NAME, tuple(groups[0])),), False
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    return tuple(ShardPlan(n, tuple(g)) for n, g in zip(names, groups)), True


def mark_unchanged(shards: Iterable[ShardPlan], source_shards: Iterable[ShardHeader]) -> tuple[ShardPlan, ...]:
    """Sets `same_as` on every shard that is one whole source file unchanged (see ShardPlan)."""
    names_by_file = {s.file: {ref.name for ref in s.tensors} for s in source_shards}
    marked = []
    for shard in shards:
        files = {t.source.ref.file for t in shard.tensors}
        file = next(iter(files)) if len(files) == 1 else None
        unchanged = file is not None and all(
            t.is_copy and t.source.is_whole and t.name == t.source.ref.name for t in shard.tensors) \
            and {t.name for t in shard.tensors} == names_by_file.get(file)
        marked.append(replace(shard, same_as=file) if unchanged else shard)
    return tuple(marked)


def index_document(plan: CheckpointPlan) -> dict[str, Any]:
    """model.safetensors.index.json contents for a sharded plan."""
    weight_map = {t.name: shard.file_name for shard in plan.shards for t in shard.tensors}
    return {"metadata": {"total_size": plan.total_size}, "weight_map": dict(sorted(weight_map.items()))}


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?B)\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000 (decimal units, like huggingface_hub's max_shard_size); ValueError otherwise."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size such as 500MB or 5GB")
    return int(float(match[1]) * _UNITS[match[2].upper()])


__all__ = ["ACTION_KEPT", "ACTION_SPLIT", "CheckpointPlan", "INDEX_NAME", "ShardPlan", "SourceSlice", "TensorPlan",
           "index_document", "mark_unchanged", "parse_size", "plan_shards"]

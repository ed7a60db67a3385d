"""safetensors headers parsed by hand: tensors become TensorRefs (file, offset, size), data is never read.

Format: 8-byte little-endian header length N, N bytes of JSON, then the data region; each entry's
`data_offsets` are relative to the start of the data region.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..errors import InputError
from .json_text import parse_json

# safetensors dtype name -> (torch dtype attribute, bytes per element); names, not torch objects, so that reading
# headers (inspect, check-pair, planning) never imports torch (transforms.torch_dtype resolves them)
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
    "U8": ("uint8", 1), "BOOL": ("bool", 1), "U16": ("uint16", 2), "U32": ("uint32", 4),
    "U64": ("uint64", 8), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
}
MAX_HEADER_BYTES = 100_000_000  # the limit safetensors itself enforces


@dataclass(frozen=True)
class TensorRef:
    """Where one stored tensor's bytes are: enough to copy or load it later, nothing loaded now."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]


@dataclass(frozen=True)
class ShardHeader:
    """One safetensors file's header: its tensors in data order and the free-form metadata."""

    file: Path
    data_start: int
    size: int
    metadata: Mapping[str, str]
    tensors: tuple[TensorRef, ...]


def read_header(path: Path) -> ShardHeader:
    """Reads and checks a safetensors header without touching tensor data.

    Args:
        path: the .safetensors file.

    Returns:
        ShardHeader with tensors sorted by offset.

    Raises:
        InputError: unreadable file, truncated or non-JSON header, unknown dtype, a size that does not
            match the shape, or offsets out of bounds or overlapping.
    """
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, 2)
            handle.seek(0)
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise InputError(f"{path}: not a safetensors file (only {len(prefix)} bytes)")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES:
                raise InputError(f"{path}: header length {length} bytes is over the {MAX_HEADER_BYTES} bytes "
                                 f"safetensors itself reads (corrupt, or not written by safetensors)")
            if 8 + length > size:
                raise InputError(f"{path}: header length {length} exceeds the file size {size} (truncated or corrupt)")
            raw = handle.read(length)
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    header = parse_json(raw, path, what="safetensors header is not valid JSON")
    if not isinstance(header, dict):
        raise InputError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(value, str) for value in metadata.values()):
        # safetensors itself rejects anything but string -> string, and the writer copies it into the output
        raise InputError(f"{path}: __metadata__ is not an object of strings")
    return shard_from_entries(path, header, data_start=8 + length, size=size, metadata=metadata)


def shard_from_entries(path: Path, entries: Mapping[str, Any], *, data_start: int, size: int,
                       metadata: Mapping[str, str]) -> ShardHeader:
    """Checks header entries ({name: {dtype, shape, data_offsets}}) against the file layout; used for local headers
    and for headers the Hub serves without the file.

    Raises:
        InputError: unknown dtype, bad shape or offsets, a size that does not match the shape, overlaps, truncation.
    """
    tensors = sorted((_tensor_ref(path, name, entry, data_start) for name, entry in entries.items()),
                     key=lambda ref: ref.offset)
    _check_layout(path, tensors, data_start, size)
    return ShardHeader(file=path, data_start=data_start, size=size, metadata=metadata, tensors=tuple(tensors))


def _tensor_ref(path: Path, name: str, entry: Any, data_start: int) -> TensorRef:
    if not isinstance(entry, dict):
        raise InputError(f"{path}: header entry {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise InputError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r} (known: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                               for d in shape):
        raise InputError(f"{path}: tensor {name!r} has an invalid shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise InputError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}")
    nbytes, needed = offsets[1] - offsets[0], math.prod(shape) * DTYPES[dtype][1]
    if nbytes != needed:
        raise InputError(f"{path}: tensor {name!r} occupies {nbytes} bytes but {dtype}{shape} needs {needed}")
    return TensorRef(name=name, dtype=dtype, shape=tuple(shape), file=path, offset=data_start + offsets[0],
                     nbytes=nbytes)


def _check_layout(path: Path, tensors: list[TensorRef], data_start: int, size: int) -> None:
    end = data_start
    for ref in tensors:
        if ref.offset < end:
            raise InputError(f"{path}: tensor {ref.name!r} overlaps the previous tensor's bytes")
        end = ref.offset + ref.nbytes
    if end > size:
        last = tensors[-1].name
        raise InputError(f"{path}: tensor {last!r} ends at byte {end} but the file has {size} (truncated)")


def encode_header(entries: Mapping[str, Any]) -> bytes:
    """The 8-byte length + JSON header for a new file, padded with spaces to 8-byte alignment (as safetensors does)."""
    raw = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw

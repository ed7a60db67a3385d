"""Writing: sequential hashed reads of the sources, shards written from a precomputed header, atomic output dir."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from ..errors import InputError, OutputError
from ..plan import ShardPlan, TensorPlan
from .safetensors_header import encode_header

BLOCK_BYTES = 16 * 1024 * 1024
PARTIAL_SUFFIX = ".gemma4-convert-partial"
RETIRED_SUFFIX = ".gemma4-convert-old"  # an output --force replaces, until the new one is in place


class SequentialReader:
    """Reads one source file front to back exactly once, hashing every byte (gaps and header included).

    The plan orders tensors by source offset, so each request starts at or after the previous one.
    """

    def __init__(self, path: Path):
        self.path = path
        self._handle = open(path, "rb")
        self._position = 0
        self._sha256 = hashlib.sha256()

    def _advance_to(self, offset: int) -> None:
        if offset < self._position:
            raise RuntimeError(f"{self.path}: read at {offset} after {self._position}; plan is not in source order")
        for _ in self.blocks(offset - self._position):
            pass

    def blocks(self, nbytes: int) -> Iterator[bytes]:
        """The next nbytes from the current position, in blocks."""
        remaining = nbytes
        while remaining:
            block = self._handle.read(min(BLOCK_BYTES, remaining))
            if not block:
                raise InputError(f"{self.path}: ended {remaining} bytes early (file changed while converting?)")
            self._sha256.update(block)
            self._position += len(block)
            remaining -= len(block)
            yield block

    def range_blocks(self, offset: int, nbytes: int) -> Iterator[bytes]:
        self._advance_to(offset)
        return self.blocks(nbytes)

    def read(self, offset: int, nbytes: int) -> bytearray:
        return bytearray().join(self.range_blocks(offset, nbytes))

    def finish(self) -> str:
        """Hashes the rest of the file and returns its sha256."""
        size = os.fstat(self._handle.fileno()).st_size
        self._advance_to(size)
        self._handle.close()
        return self._sha256.hexdigest()


def shard_header(shard: ShardPlan, metadata: dict[str, str]) -> bytes:
    entries: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for tensor in shard.tensors:
        entries[tensor.name] = {"dtype": tensor.dtype, "shape": list(tensor.shape),
                                "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    return encode_header(entries)


class _HashingWriter:
    def __init__(self, handle):
        self.handle, self.sha256, self.written = handle, hashlib.sha256(), 0

    def write(self, data) -> None:
        self.handle.write(data)
        self.sha256.update(data)
        self.written += len(data)


def write_shard(path: Path, shard: ShardPlan, *, metadata: dict[str, str], readers: dict[Path, SequentialReader],
                render: Callable[[TensorPlan, bytearray], memoryview], on_bytes: Callable[[int], None]) -> str:
    """Writes one output shard; untouched tensors are streamed as raw bytes, the rest go through `render`.

    Returns:
        sha256 of the written file.
    """
    with _output_errors(path), open(path, "wb") as handle:
        out = _HashingWriter(handle)
        out.write(shard_header(shard, metadata))
        for tensor in shard.tensors:
            reader = readers[tensor.source.ref.file]
            if tensor.is_copy:
                for block in reader.range_blocks(tensor.source.offset, tensor.source.nbytes):
                    out.write(block)
                    on_bytes(len(block))
            else:
                data = render(tensor, reader.read(tensor.source.offset, tensor.source.nbytes))
                if len(data) != tensor.nbytes:
                    raise RuntimeError(f"{tensor.name}: transform produced {len(data)} bytes, planned {tensor.nbytes}")
                out.write(data)
                on_bytes(tensor.source.nbytes)
        handle.flush()
        os.fsync(handle.fileno())
    return out.sha256.hexdigest()


def make_directory(path: Path) -> None:
    """mkdir -p; out of space or inodes is an OutputError like any other write."""
    with _output_errors(path):
        path.mkdir(parents=True, exist_ok=True)


def write_json(path: Path, document: Any) -> str:
    """Writes pretty JSON; returns its sha256."""
    raw = (json.dumps(document, indent=2) + "\n").encode("utf-8")
    with _output_errors(path):
        path.write_bytes(raw)
    return hashlib.sha256(raw).hexdigest()


def copy_file(source: Path, destination: Path) -> str:
    """Byte-identical copy; returns the sha256 of what was copied."""
    sha256 = hashlib.sha256()
    with _output_errors(destination), open(source, "rb") as src, open(destination, "wb") as dst:
        while block := src.read(BLOCK_BYTES):
            sha256.update(block)
            dst.write(block)
    return sha256.hexdigest()


def sha256_file(path: Path) -> str:
    sha256 = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(BLOCK_BYTES):
            sha256.update(block)
    return sha256.hexdigest()


@contextmanager
def _output_errors(path: Path) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise OutputError(f"{path}: no space left on device") from exc
        raise OutputError(f"{path}: cannot write ({exc.strerror or exc})") from exc


def partial_dir(destination: Path) -> Path:
    """Where an output is assembled before the final rename: beside it, so the rename stays on one filesystem."""
    return destination.parent / f".{destination.name}{PARTIAL_SUFFIX}"


@contextmanager
def staged_directory(destination: Path, *, replace: bool) -> Iterator[Path]:
    """Yields an empty staging dir; on success it becomes `destination` in one rename, on failure it is removed.

    A staging dir left by a killed run is removed first, so a re-run starts clean. With `replace`, the old
    destination is renamed aside, the new one renamed in, then the old one deleted; if the second rename fails
    the old one is renamed back.
    """
    staging = partial_dir(destination)
    with _output_errors(staging):
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    retired = destination.parent / f".{destination.name}{RETIRED_SUFFIX}"
    moved_aside = False
    try:
        with _output_errors(destination):
            if destination.exists() and replace:
                shutil.rmtree(retired, ignore_errors=True)
                os.replace(destination, retired)
                moved_aside = True
            os.replace(staging, destination)
    except BaseException:
        if moved_aside:
            os.replace(retired, destination)  # the earlier output goes back; nothing half-swapped stays
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(retired, ignore_errors=True)  # also an earlier output that a run killed mid-swap left there

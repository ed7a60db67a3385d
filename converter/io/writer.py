"""Writing: sequential hashed reads of the sources, shards written from a precomputed header, atomic output dir."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import json
import mmap
import os
import queue
import shutil
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from ..errors import InputError, OutputError
from ..plan import ShardPlan, TensorPlan
from .durable import fsync_directory, fsync_tree, write_bytes_durably
from .safetensors_header import encode_header

BLOCK_BYTES = 4 * 1024 * 1024  # one output write (O_DIRECT) and one read-ahead block; docs/BENCHMARKS.md
PARTIAL_SUFFIX = ".gemma4-convert-partial"
RETIRED_SUFFIX = ".gemma4-convert-old"  # an output --force replaces, until the new one is in place


def page_aligned_buffer(nbytes: int) -> memoryview:
    """A writable buffer starting on a page boundary (anonymous mmap).

    A bytearray starts 16 bytes into a page; the kernel's copy into it from the page cache ran 2-3x slower
    than into a page-aligned buffer on the bench machine (docs/BENCHMARKS.md).
    """
    return memoryview(mmap.mmap(-1, nbytes))


READ_CHUNK_BYTES = 4 * 1024 * 1024  # one O_DIRECT read; a multiple of any logical block size


class SequentialReader:
    """Reads one source file front to back exactly once, hashing every byte (gaps and header included).

    The plan orders tensors by source offset, so each request starts at or after the previous one. The file
    is read in READ_CHUNK_BYTES chunks with O_DIRECT where the filesystem allows it (else buffered, same
    code): a stream read once gains nothing from the page cache, and on the bench machine the kernel's
    page-cache copy cost several times the direct read itself (docs/BENCHMARKS.md). Requested ranges are
    copied out of the chunk into the caller's buffer (`fill`, `read`).
    """

    def __init__(self, path: Path):
        self.path = path
        self._handle, self._direct = _open_unbuffered(path)
        self._position = 0  # bytes handed out or skipped
        self._sha256 = hashlib.sha256()
        self._chunk: memoryview | None = None  # page-aligned, allocated on the first read
        self._pending = memoryview(b"")  # read and hashed, not yet handed out

    def _refill(self) -> None:
        if self._chunk is None:
            self._chunk = page_aligned_buffer(READ_CHUNK_BYTES)
        count = self._read_chunk(self._chunk)
        if not count:
            raise EOFError
        self._pending = self._chunk[:count]
        self._sha256.update(self._pending)  # releases the GIL: the read-ahead thread hashes while the writer writes

    def _read_chunk(self, buffer: memoryview) -> int:
        try:
            return self._handle.readinto(buffer)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not self._direct:
                raise
            # a filesystem that accepted O_DIRECT at open but not for this read: carry on buffered
            flags = fcntl.fcntl(self._handle.fileno(), fcntl.F_GETFL)
            fcntl.fcntl(self._handle.fileno(), fcntl.F_SETFL, flags & ~_O_DIRECT)
            self._direct = False
            return self._handle.readinto(buffer)

    def _take(self, nbytes: int, into: memoryview | None) -> None:
        """Hands out (copies into `into`) or skips the next nbytes."""
        done = 0
        while done < nbytes:
            if not self._pending:
                try:
                    self._refill()
                except EOFError:
                    raise InputError(f"{self.path}: ended {nbytes - done} bytes early "
                                     "(file changed while converting?)") from None
            count = min(len(self._pending), nbytes - done)
            if into is not None:
                into[done:done + count] = self._pending[:count]
            self._pending = self._pending[count:]
            done += count
        self._position += nbytes

    def _advance_to(self, offset: int) -> None:
        if offset < self._position:
            raise RuntimeError(f"{self.path}: read at {offset} after {self._position}; plan is not in source order")
        self._take(offset - self._position, None)

    def fill(self, offset: int, view: memoryview) -> None:
        """Reads len(view) bytes at `offset` (at or after the previous read) into `view`."""
        self._advance_to(offset)
        self._take(len(view), view)

    def range_blocks(self, offset: int, nbytes: int) -> Iterator[memoryview]:
        """nbytes at `offset` in blocks of at most BLOCK_BYTES; each block is valid until the next is taken."""
        self._advance_to(offset)
        buffer = page_aligned_buffer(min(BLOCK_BYTES, nbytes)) if nbytes else memoryview(b"")
        for start in range(0, nbytes, BLOCK_BYTES):
            view = buffer[:min(BLOCK_BYTES, nbytes - start)]
            self._take(len(view), view)
            yield view

    def read(self, offset: int, nbytes: int) -> bytearray:
        data = bytearray(nbytes)
        self.fill(offset, memoryview(data))
        return data

    def finish(self) -> str:
        """Hashes the rest of the file and returns its sha256."""
        self._pending = memoryview(b"")
        try:
            while True:
                self._refill()
        except EOFError:
            pass
        self._handle.close()
        self._chunk = None
        return self._sha256.hexdigest()


_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _open_unbuffered(path: Path) -> tuple[io.FileIO, bool]:
    """(file, direct): opened with O_DIRECT where the OS and filesystem accept it (not tmpfs, not macOS)."""
    if _O_DIRECT:
        try:
            return io.FileIO(os.open(path, os.O_RDONLY | _O_DIRECT | getattr(os, "O_CLOEXEC", 0)), "rb"), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return io.FileIO(path, "rb"), False


def shard_header(shard: ShardPlan, metadata: dict[str, str]) -> bytes:
    entries: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for tensor in shard.tensors:
        entries[tensor.name] = {"dtype": tensor.dtype, "shape": list(tensor.shape),
                                "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    return encode_header(entries)


class _HashingWriter:
    """Writes and hashes one output file; with O_DIRECT through a page-aligned staging buffer of BLOCK_BYTES.

    Whole staged blocks are written directly (no page cache: on the bench machine a buffered write cost
    several times a direct one); the tail is written after O_DIRECT is switched off. A filesystem that
    refuses O_DIRECT gets the same bytes buffered.
    """

    def __init__(self, path: Path):
        self.sha256, self.written = hashlib.sha256(), 0
        self.handle, self._direct = _open_for_writing(path)
        self._stage = page_aligned_buffer(BLOCK_BYTES) if self._direct else None
        self._staged = 0

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), BLOCK_BYTES):
            chunk = view[start:start + BLOCK_BYTES]
            self.sha256.update(chunk)
            if self._stage is None:
                self._write_all(chunk)
                continue
            while chunk:
                count = min(len(chunk), BLOCK_BYTES - self._staged)
                self._stage[self._staged:self._staged + count] = chunk[:count]
                self._staged += count
                chunk = chunk[count:]
                if self._staged == BLOCK_BYTES:
                    self._write_all(self._stage)
                    self._staged = 0
        self.written += len(view)

    def _write_all(self, view: memoryview) -> None:
        while view:
            try:
                count = self.handle.write(view)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self._direct:
                    raise
                self._buffered()  # accepted O_DIRECT at open, not for this write
                continue
            if count < len(view) and self._direct:
                self._buffered()  # the rest would no longer be block-aligned
            view = view[count:]

    def _buffered(self) -> None:
        flags = fcntl.fcntl(self.handle.fileno(), fcntl.F_GETFL)
        fcntl.fcntl(self.handle.fileno(), fcntl.F_SETFL, flags & ~_O_DIRECT)
        self._direct = False

    def finish(self) -> None:
        """Writes what is staged and makes the file durable (fsync)."""
        if self._staged:
            if self._direct:
                self._buffered()
            self._write_all(self._stage[:self._staged])
            self._staged = 0
        os.fsync(self.handle.fileno())


def _open_for_writing(path: Path) -> tuple[io.FileIO, bool]:
    """(file, direct): created/truncated like open(path, "wb"), with O_DIRECT where it is accepted."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    if _O_DIRECT:
        try:
            return io.FileIO(os.open(path, flags | _O_DIRECT, 0o666), "wb"), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return io.FileIO(os.open(path, flags, 0o666), "wb"), False


def write_shard(path: Path, shard: ShardPlan, *, metadata: dict[str, str], readers: dict[Path, SequentialReader],
                render: Callable[[TensorPlan, bytearray], memoryview], on_bytes: Callable[[int], None]) -> str:
    """Writes one output shard; untouched tensors are streamed as raw bytes, the rest go through `render`.

    A thread reads (and hashes) the sources a few blocks ahead while this one writes (and hashes) the output:
    hashlib, readinto and write release the GIL, so the two sha256 passes run on two cores.

    Returns:
        sha256 of the written file.
    """
    with _output_errors(path):
        out = _HashingWriter(path)
        with out.handle, _prefetch(shard, readers) as blocks:
            out.write(shard_header(shard, metadata))
            for tensor in shard.tensors:
                if tensor.is_copy:
                    for block in blocks(tensor.source.nbytes):
                        out.write(block)
                        on_bytes(len(block))
                else:
                    raw = bytearray(tensor.source.nbytes)
                    done = 0
                    for block in blocks(tensor.source.nbytes):
                        raw[done:done + len(block)] = block
                        done += len(block)
                    data = render(tensor, raw)
                    del raw
                    if len(data) != tensor.nbytes:
                        raise RuntimeError(f"{tensor.name}: transform produced {len(data)} bytes, "
                                           f"planned {tensor.nbytes}")
                    out.write(data)
                    on_bytes(tensor.source.nbytes)
            out.finish()
    return out.sha256.hexdigest()


PREFETCH_BLOCKS = 4  # buffers in flight between the reading thread and the writer


@contextmanager
def _prefetch(shard: ShardPlan,
              readers: dict[Path, SequentialReader]) -> Iterator[Callable[[int], Iterator[memoryview]]]:
    """Reads the shard's source ranges, in plan order, in a thread; yields `blocks(nbytes)` for the consumer.

    `blocks(n)` yields the next n source bytes of the plan in blocks, each valid until the next is taken. At
    most PREFETCH_BLOCKS buffers exist; an error in the thread is raised in the consumer; leaving the context
    (normally or on error) stops and joins the thread.
    """
    free: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(PREFETCH_BLOCKS):
        free.put(page_aligned_buffer(BLOCK_BYTES))
    filled: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()

    def produce() -> None:
        try:
            for tensor in shard.tensors:
                reader = readers[tensor.source.ref.file]
                for start in range(0, tensor.source.nbytes, BLOCK_BYTES):
                    buffer = free.get()
                    if stop.is_set():
                        return
                    view = buffer[:min(BLOCK_BYTES, tensor.source.nbytes - start)]
                    reader.fill(tensor.source.offset + start, view)
                    filled.put((view, buffer))
        except BaseException as exc:  # handed to the consumer, which raises it
            filled.put((exc, None))

    def blocks(nbytes: int) -> Iterator[memoryview]:
        for _ in range(0, nbytes, BLOCK_BYTES):
            view, buffer = filled.get()
            if buffer is None:
                raise view
            try:
                yield view
            finally:
                free.put(buffer)

    thread = threading.Thread(target=produce, name=f"read-ahead {shard.file_name}", daemon=True)
    thread.start()
    try:
        yield blocks
    finally:
        stop.set()
        free.put(memoryview(bytearray(0)))  # wakes a producer waiting for a buffer
        thread.join()


def make_directory(path: Path) -> None:
    """mkdir -p; out of space or inodes is an OutputError like any other write."""
    with _output_errors(path):
        path.mkdir(parents=True, exist_ok=True)


def write_json(path: Path, document: Any) -> str:
    """Writes pretty JSON (fsynced); returns its sha256."""
    raw = (json.dumps(document, indent=2) + "\n").encode("utf-8")
    with _output_errors(path):
        write_bytes_durably(path, raw)
    return hashlib.sha256(raw).hexdigest()


def copy_file(source: Path, destination: Path) -> str:
    """Byte-identical copy (fsynced); returns the sha256 of what was copied."""
    sha256 = hashlib.sha256()
    with _output_errors(destination), open(source, "rb") as src, open(destination, "wb") as dst:
        while block := src.read(BLOCK_BYTES):
            sha256.update(block)
            dst.write(block)
        dst.flush()
        os.fsync(dst.fileno())
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
            fsync_tree(staging)  # every entry of the new tree is on disk before its name appears
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
    with _output_errors(destination.parent):
        fsync_directory(destination.parent)  # the rename itself (after the swap: a failure here undoes nothing)
    shutil.rmtree(retired, ignore_errors=True)  # also an earlier output that a run killed mid-swap left there

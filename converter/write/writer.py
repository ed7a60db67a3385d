"""Writing: shards written from a precomputed header out of source byte ranges, copies, atomic output dir."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import io
import json
import mmap
import os
import queue
import shutil
import sys
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from ..errors import InputError, OutputError
from ..plan import ShardPlan, TensorPlan, row_pieces
from ..read.safetensors_header import encode_header
from ..read.sequential import (BLOCK_BYTES, HASH_READ_BYTES, BackgroundSha256, SourceFile, known_sha256,
                               page_aligned_buffer)
from .durable import fsync_directory, fsync_tree, write_bytes_durably

_O_DIRECT = getattr(os, "O_DIRECT", 0)
PARTIAL_SUFFIX = ".gemma4-convert-partial"
RETIRED_SUFFIX = ".gemma4-convert-old"  # an output --force replaces, until the new one is in place


def shard_header(shard: ShardPlan, metadata: dict[str, str]) -> bytes:
    entries: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for tensor in shard.tensors:
        entries[tensor.name] = {"dtype": tensor.dtype, "shape": list(tensor.shape),
                                "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    return encode_header(entries)


WRITERS = 4  # O_DIRECT writes in flight: on the bench machine, with other jobs on the disk, 4 wrote ~1.5x faster than 1
STAGED_BLOCKS = WRITERS + 2  # staging buffers: one being filled, the rest being written


class _BlockWriter:
    """Writes blocks at their own offsets from WRITERS threads, so several writes are in flight while the caller
    fills (and a hash thread hashes) the next ones.

    O_DIRECT where the file was opened with it: whole blocks go from the caller's page-aligned buffer (a staging
    buffer, or the source's own page-cache pages through a read-only mapping) to the disk with no copy and no page
    cache on the output side. A filesystem that accepts O_DIRECT at open but refuses a write gets the same bytes
    buffered. `submit` takes (view, offset, done); `done(view)` runs once the view is written (or dropped after an
    error). `close` stops the threads and raises the first error.
    """

    def __init__(self, fd: int, *, direct: bool, name: str):
        self.fd, self.direct = fd, direct
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # the O_DIRECT -> buffered switch
        self._threads = [threading.Thread(target=self._run, name=f"write {name}", daemon=True) for _ in range(WRITERS)]
        for thread in self._threads:
            thread.start()

    def submit(self, view: memoryview, offset: int, done: Callable[[memoryview], None] | None = None) -> None:
        self.raise_error()
        self._queue.put((view, offset, done))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            view, offset, done = item
            try:
                if self._error is None:
                    self.write_at(view, offset)
            except BaseException as exc:  # raised in the caller's thread by its next submit or close
                self._error = exc
            finally:
                if done is not None:
                    done(view)
                del view, item  # a failed write's traceback keeps this frame: it must not pin a mapped source

    def raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Waits for every submitted write; raises the first error."""
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        self._threads = []
        self.raise_error()

    def write_at(self, view: memoryview, offset: int) -> None:
        while view:
            try:
                count = os.pwrite(self.fd, view, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                self.buffered()  # accepted O_DIRECT at open, not for this write
                continue
            if count < len(view) and self.direct:
                self.buffered()  # the rest would no longer be block-aligned
            view, offset = view[count:], offset + count

    def write_tail(self, view: memoryview, offset: int) -> None:
        """The last, unaligned bytes of the file, buffered (O_DIRECT takes whole blocks only); after close()."""
        if self.direct:
            self.buffered()
        self.write_at(view, offset)

    def buffered(self) -> None:
        with self._lock:
            flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
            fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
            self.direct = False


class _HashingWriter:
    """Writes one output file, and hashes it, through page-aligned staging blocks of BLOCK_BYTES.

    The caller fills blocks (`write` copies bytes in, `fill_from` reads a source range straight into them) a chunk of
    HASH_READ_BYTES at a time and hashes each chunk at once, while it is still in the core's cache; each full block
    goes to the _BlockWriter, so the caller's reads and hashing overlap the disk writes. Hashing whole 4 MiB blocks
    6-24 MiB behind the filling, as a hash thread did, cost 1.2-1.4x the CPU seconds of this (docs/BENCHMARKS.md). The
    tail is written after O_DIRECT is switched off. Use as a context manager (it stops the writers and closes the
    file); `finish` completes the file.
    """

    def __init__(self, path: Path, *, hashed: bool = True):
        self.sha256, self.written = hashlib.sha256() if hashed else None, 0
        self.handle, direct = _open_for_writing(path)
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(STAGED_BLOCKS - 1):
            self._free.put(page_aligned_buffer(BLOCK_BYTES))
        self._stage, self._staged = page_aligned_buffer(BLOCK_BYTES), 0
        self._offset = 0  # file offset of the block being staged
        self._blocks = _BlockWriter(self.handle.fileno(), direct=direct, name=path.name)

    def __enter__(self) -> "_HashingWriter":
        return self

    def __exit__(self, *exc_info) -> None:
        try:
            self._stop(raise_errors=exc_info[0] is None)  # never hide the error that is already leaving
        finally:
            self.handle.close()

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        while view:
            room = self._room()
            count = min(len(view), len(room))
            _copy_bytes(room[:count], view[:count])
            self._staged_more(count)
            view = view[count:]

    def fill_from(self, source: SourceFile, offset: int, nbytes: int,
                  on_bytes: Callable[[int], None] = lambda n: None) -> None:
        """Reads nbytes of `source` at offset straight into the staging blocks (one copy, page cache -> block)."""
        while nbytes:
            room = self._room()
            count = min(nbytes, len(room))
            source.read_at(offset, room[:count])
            self._staged_more(count)
            offset, nbytes = offset + count, nbytes - count
            on_bytes(count)

    def _room(self) -> memoryview:
        """Where the next chunk goes: at most HASH_READ_BYTES, so it is hashed from the cache it was copied into."""
        return self._stage[self._staged:self._staged + HASH_READ_BYTES]

    def _staged_more(self, count: int) -> None:
        if self.sha256 is not None:
            self.sha256.update(self._stage[self._staged:self._staged + count])
        self._staged += count
        self.written += count
        if self._staged == BLOCK_BYTES:
            self._blocks.submit(self._stage, self._offset, done=self._free.put)
            self._offset += BLOCK_BYTES
            self._stage, self._staged = self._free.get(), 0

    def _stop(self, *, raise_errors: bool = True) -> None:
        """Drains the writers; raises the first write error."""
        try:
            self._blocks.close()
        except BaseException:
            if raise_errors:
                raise

    def finish(self) -> None:
        """Writes what is staged (durable once staged_directory fsyncs the tree)."""
        self._stop()
        tail = self._stage[:self._staged]
        if tail:
            self._blocks.write_tail(tail, self._offset)
            self._offset += self._staged
            self._staged = 0


def _copy_bytes(destination: memoryview, source: memoryview) -> None:
    """destination[:] = source, with the GIL released during the copy (ctypes.memmove is a foreign call) where
    both buffers are writable: a slice assignment copies holding it, which stalls the hash and render threads
    (0.45 s of GIL time in a pad-global conversion of the 7.7 GB pair)."""
    try:
        to, frm = ctypes.c_char.from_buffer(destination), ctypes.c_char.from_buffer(source)
    except (TypeError, ValueError):  # read-only or empty: the plain copy
        destination[:] = source
        return
    ctypes.memmove(ctypes.addressof(to), ctypes.addressof(frm), len(source))
    del to, frm


def _open_for_writing(path: Path, *, direct: bool = True) -> tuple[io.FileIO, bool]:
    """(file, direct): created/truncated like open(path, "wb"), with O_DIRECT where it is accepted."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    if _O_DIRECT and direct:
        try:
            return io.FileIO(os.open(path, flags | _O_DIRECT, 0o666), "wb"), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return io.FileIO(os.open(path, flags, 0o666), "wb"), False


def write_shard(path: Path, shard: ShardPlan, *, metadata: dict[str, str], sources: dict[Path, SourceFile],
                render: Callable[[TensorPlan, memoryview, memoryview], memoryview] | None,
                on_bytes: Callable[[int], None], hashed: bool = True, buffers: "RenderBuffers | None" = None
                ) -> str | None:
    """Writes one output shard; untouched tensors are read straight into the output's staging blocks, the rest go
    through `render` (None when the shard has no TRANSFORM tensor) on a pool of threads, ahead of the writing.

    The output is hashed by this thread chunk by chunk as its blocks fill (the sources are hashed by the caller's
    hashing_ahead), and written by the _BlockWriter's threads: reading, rendering, hashing and writing overlap on
    every core. `render`
    reads a tensor's source bytes from its second argument and writes the result into its third where it can, both
    taken from `buffers` (one RenderBuffers for every shard of a conversion, so later shards reuse them too); its
    result must not be a view of the source bytes, whose buffer is reused as soon as it returns.

    Returns:
        sha256 of the written file (None when not `hashed`).
    """
    with _output_errors(path):
        with _HashingWriter(path, hashed=hashed) as out, ExitStack() as stack:
            out.write(shard_header(shard, metadata))
            rendered = _rendered_ahead(shard, sources, render, buffers or RenderBuffers(), stack) \
                if render is not None else None
            for index, tensor in enumerate(shard.tensors):
                if tensor.is_copy:
                    out.fill_from(sources[tensor.source.ref.file], tensor.source.offset, tensor.source.nbytes,
                                  on_bytes)
                    continue
                produced = 0
                for data in rendered.pieces(index):
                    out.write(data)
                    produced += len(data)
                if produced != tensor.nbytes:
                    raise RuntimeError(f"{tensor.name}: transform produced {produced} bytes, planned {tensor.nbytes}")
                on_bytes(tensor.source.nbytes)
            out.finish()
    return out.sha256.hexdigest() if out.sha256 is not None else None


RENDER_AHEAD_BYTES = 64 * 1024 * 1024  # rendered bytes of a shard's TRANSFORM tensors not yet written (peak RSS)
RENDER_PIECE_BYTES = 8 * 1024 * 1024  # what a large TRANSFORM tensor is rendered in (plan.row_pieces)
IDLE_RENDER_BYTES = 2 * RENDER_AHEAD_BYTES  # written-out render buffers kept for reuse (RenderBuffers)


class RenderBuffers:
    """Page-aligned buffers for rendering, handed out by size and taken back after the bytes are written, so the
    pieces of one size (every layer's q_proj pieces, say) reuse the same pages.

    A new buffer's pages are faulted in and zeroed by the kernel before the first byte is written to them: in a
    pad-global conversion of the 7.7 GB pair that zeroing (for the source bytes read in and the results written out)
    cost as much CPU as the reads themselves (docs/BENCHMARKS.md). At most IDLE_RENDER_BYTES of idle buffers are kept.
    """

    def __init__(self):
        self._idle: dict[int, list[memoryview]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> memoryview:
        with self._lock:
            idle = self._idle.get(nbytes)
            if idle:
                self._idle_bytes -= nbytes
                return idle.pop()
        return page_aligned_buffer(nbytes) if nbytes else memoryview(bytearray())

    def put(self, buffer: memoryview) -> None:
        with self._lock:
            if buffer.nbytes and self._idle_bytes + buffer.nbytes <= IDLE_RENDER_BYTES:
                self._idle.setdefault(buffer.nbytes, []).append(buffer)
                self._idle_bytes += buffer.nbytes


def _rendered_ahead(shard: ShardPlan, sources: dict[Path, SourceFile], render, buffers: RenderBuffers,
                    stack: ExitStack) -> "_RenderAhead":
    """A _RenderAhead over shard's TRANSFORM tensors; its pool is shut down when `stack` closes, after what has not
    started is cancelled (an error leaves nothing rendering)."""
    pool = stack.enter_context(ThreadPoolExecutor(max_workers=max(1, len(os.sched_getaffinity(0))),
                                                  thread_name_prefix="render"))
    ahead = _RenderAhead(shard, sources, render, buffers, pool)
    stack.callback(ahead.cancel)
    return ahead


class _RenderAhead:
    """The rendered bytes of each TRANSFORM tensor of a shard, in pieces of at most RENDER_PIECE_BYTES of whole row
    units (plan.row_pieces), submitted in file order to a pool of as many threads as the process may use cores (torch
    and preadv release the GIL), while the pieces rendered and not yet written hold at most RENDER_AHEAD_BYTES (or are
    one piece); `pieces` yields a tensor's pieces in order and submits more as each is written. So decoding,
    transforming and encoding of later pieces overlap the writing of earlier ones. Each piece's source bytes are read
    into, and its result rendered into, buffers from `buffers`, which get them back at once (source) or once written.
    """

    def __init__(self, shard: ShardPlan, sources: dict[Path, SourceFile], render, buffers: RenderBuffers,
                 pool: ThreadPoolExecutor):
        self._pieces = {index: row_pieces(tensor, RENDER_PIECE_BYTES)
                        for index, tensor in enumerate(shard.tensors) if not tensor.is_copy}
        self._todo = deque((index, piece) for index, pieces in self._pieces.items() for piece in range(len(pieces)))
        self._sources, self._render, self._buffers, self._pool = sources, render, buffers, pool
        self._futures: dict[tuple[int, int], Future] = {}  # (tensor index, piece) -> submitted and not yet written
        self._submit()

    def _held_bytes(self) -> int:
        return sum(self._pieces[index][piece].nbytes for index, piece in self._futures)

    def _submit(self) -> None:
        while self._todo and (not self._futures or self._held_bytes() < RENDER_AHEAD_BYTES):
            index, piece = key = self._todo.popleft()
            self._futures[key] = self._pool.submit(self._render_one, self._pieces[index][piece])

    def _render_one(self, tensor: TensorPlan) -> tuple[memoryview, memoryview]:
        # anonymous mappings, not bytearrays: bytearray(n) zero-fills n bytes holding the GIL (0.65 s of the
        # 3.5 s the GIL was held in a pad-global conversion of the 7.7 GB pair), a mapping faults its pages in
        # during the read, which releases it
        raw, into = self._buffers.get(tensor.source.nbytes), self._buffers.get(tensor.nbytes)
        try:
            self._sources[tensor.source.ref.file].read_at(tensor.source.offset, raw)
            return self._render(tensor, raw, into), into
        finally:
            self._buffers.put(raw)  # reusable at once: a render's result is never a view of its source bytes

    def pieces(self, index: int) -> Iterator[memoryview]:
        """The rendered bytes of shard.tensors[index], piece by piece (each waited for; valid until the next is
        asked for, when its buffer goes back for reuse). Raises what rendering raised."""
        for piece in range(len(self._pieces[index])):
            data, into = self._futures[index, piece].result()
            try:
                yield data
            finally:
                del self._futures[index, piece]
                self._buffers.put(into)
                self._submit()

    def cancel(self) -> None:
        for future in self._futures.values():
            future.cancel()


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


def copy_file(source: Path, destination: Path, *, expected_size: int | None = None, hashed: bool = True) -> str | None:
    """Byte-identical copy at disk speed; returns the source's sha256, which is the copy's (each byte hashed once,
    on a thread beside the copy; a sha256 the Hub cache already names is taken as is), None when not `hashed`.

    Tried in turn: the source's page-cache pages written to the copy with O_DIRECT through a read-only mapping (no
    copy in memory at all), copy_file_range (the kernel copies, as `cp` does), a read-and-write loop.

    Raises:
        InputError: the source's size is not `expected_size`, or it changed during the copy.
    """
    with _output_errors(destination):
        src = SourceFile(source)
        try:
            _check_size(source, src.size, expected_size)
            known = known_sha256(source) if hashed else None
            with ExitStack() as stack:
                hasher = stack.enter_context(BackgroundSha256(source, size=src.size)) \
                    if hashed and known is None else None
                any(copy(src, destination) for copy in (_copy_from_mapping, _copy_in_kernel, _copy_through_buffers))
                _check_size(source, os.fstat(src.fileno).st_size, src.size)
                digest = known or (hasher.result() if hasher else None)
        finally:
            src.close()
    return digest


def _copy_from_mapping(src: SourceFile, destination: Path) -> bool:
    """Writes the source's pages, mapped read-only, to an O_DIRECT output: the disk reads them from the page cache
    (DMA), so the copy costs no CPU copying. False, with no copy made, where O_DIRECT or the mapping is refused.

    On the bench machine a 7.7 GB pair copied this way in 3.0-3.4 s against 17-19 s for `cp -r` + `sync`, at
    0.3 CPU s against cp's 16 (docs/BENCHMARKS.md). A source truncated meanwhile makes the write fail with EFAULT
    (the kernel reads the mapping, this process never touches it), not a SIGBUS.
    """
    if not src.size:
        return False
    handle, direct = _open_for_writing(destination)
    if not direct:
        handle.close()
        return False
    try:
        mapping = mmap.mmap(src.fileno, src.size, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        handle.close()
        return False
    try:
        if hasattr(mapping, "madvise"):
            mapping.madvise(mmap.MADV_SEQUENTIAL)
        _write_mapped(mapping, handle.fileno(), destination.name)
    except OSError as exc:
        if exc.errno == errno.EFAULT:
            raise InputError(f"{src.path}: shrank while it was copied (file changed while converting?)") from None
        raise
    finally:
        handle.close()
        try:
            mapping.close()
        except BufferError:  # a view is still held by an error on its way out: unmapped when that is collected
            pass
    return True


_DIRECT_ALIGN = 4096  # O_DIRECT lengths and offsets: the largest logical block size of common disks


def _write_mapped(mapping: mmap.mmap, fd: int, name: str) -> None:
    """Writes the mapped file to fd (opened O_DIRECT) at offset 0: whole blocks by the _BlockWriter, the unaligned
    tail buffered. Each written block is unmapped again (MADV_DONTNEED drops this process's page table entries, not
    the page cache), so the copy's resident set stays at a few blocks however large the file."""
    view = memoryview(mapping)
    aligned = len(view) - len(view) % _DIRECT_ALIGN
    blocks = _BlockWriter(fd, direct=True, name=name)

    def unmap(block: memoryview, offset: int) -> None:
        if hasattr(mapping, "madvise"):
            mapping.madvise(mmap.MADV_DONTNEED, offset, len(block))

    try:
        for offset in range(0, aligned, BLOCK_BYTES):
            blocks.submit(view[offset:min(offset + BLOCK_BYTES, aligned)], offset,
                          done=lambda block, offset=offset: unmap(block, offset))
    finally:
        blocks.close()
    if aligned < len(view):
        blocks.write_tail(view[aligned:], aligned)
    view.release()


COPY_RANGE_BYTES = 64 * 1024 * 1024  # one copy_file_range call
_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP}


def _copy_in_kernel(src: SourceFile, destination: Path) -> bool:
    """copy_file_range, as `cp` does: the kernel moves the bytes. False where the kernel cannot (then nothing was
    written and the caller copies through buffers)."""
    if not hasattr(os, "copy_file_range"):
        return False
    out = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        done = 0
        while done < src.size:
            try:
                count = os.copy_file_range(src.fileno, out, min(COPY_RANGE_BYTES, src.size - done), done, done)
            except OSError as exc:
                if done or exc.errno not in _NO_COPY_RANGE:
                    raise
                return False
            if count == 0:
                raise InputError(f"{src.path}: ended {src.size - done} bytes early (file changed while converting?)")
            _start_writeback(out, done, count)
            done += count
    finally:
        os.close(out)
    return True


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Starts writing a just-copied range to disk without waiting for it.

    Without this the kernel starts writeback only past dirty_background_ratio (~2 GB here), so a shard smaller than
    that sat in the page cache until the final fsync and the disk idled meanwhile. On Linux, POSIX_FADV_DONTNEED
    queues the range's dirty pages for writeback and drops only pages already clean (the effect of
    sync_file_range(SYNC_FILE_RANGE_WRITE), which os does not expose). A 6.8 GB copy with an fsync per file took
    17.4-18.1 s on the bench machine, one fsync at the end 13.6-15.6 s, this 13.1-13.8 s, `cp` 13.8-14.8 s.
    """
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


def _copy_through_buffers(src: SourceFile, destination: Path) -> bool:
    """The copy where neither of the others can: read into staging blocks, written by the writer threads."""
    with _HashingWriter(destination, hashed=False) as out:
        out.fill_from(src, 0, src.size)
        out.finish()
    return True


LINK_MODES = ("auto", "copy", "reflink", "hardlink", "symlink")
LINK_MEANING = {
    "hardlink": "unchanged files are hard links: the output's and the source's are one file on disk, so an in-place "
                "write to either changes both (gemma4-convert never writes to a source; a tool that replaces files "
                "by rename breaks the link instead)",
    "symlink": "unchanged files are symbolic links to the source's absolute paths: an in-place write through either "
               "changes both, and the output breaks when the source is moved or deleted",
}
_FICLONE = 0x40049409  # linux/fs.h _IOW(0x94, 9, int): clone the whole file, copy-on-write
# what FICLONE answers on a filesystem or pair of files that cannot share extents (ext4, tmpfs, two filesystems)
_NO_REFLINK = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EPERM}


def _check_size(path: Path, size: int, expected: int | None) -> None:
    if expected is not None and size != expected:
        raise InputError(f"{path}: is {size} bytes, {expected} when its header was read (file changed while "
                         "converting?)")


def place_file(source: Path, destination: Path, *, link: str, expected_size: int | None = None,
               hashed: bool = True) -> tuple[str, str | None]:
    """Puts an unchanged file at destination by `link` mode; returns (how it was made, sha256 or None).

    auto: reflink where the filesystem can, else copy. A link is made without reading the file, so its sha256 is
    not known (None); a copy is hashed on the way unless not `hashed`.

    Raises:
        InputError: the source's size is not `expected_size`.
        OutputError: the mode is impossible here (reflink unsupported, hardlink across filesystems) or the write fails.
    """
    if link != "copy":  # a copy checks while it reads
        with _output_errors(destination):
            _check_size(source, os.stat(source).st_size, expected_size)
    if link in ("auto", "reflink"):
        if _reflink(source, destination):
            return "reflink", None
        if link == "reflink":
            raise OutputError(f"{destination.parent}: cannot reflink {source} here (the filesystem has no "
                              "copy-on-write clones, or source and output are on different filesystems); use "
                              "--link auto to copy instead")
        return "copy", copy_file(source, destination, expected_size=expected_size, hashed=hashed)
    if link == "copy":
        return "copy", copy_file(source, destination, expected_size=expected_size, hashed=hashed)
    with _output_errors(destination):
        try:
            if link == "hardlink":
                os.link(source, destination)  # follows a symlinked source (a Hugging Face cache snapshot) to its blob
            elif link == "symlink":
                os.symlink(source.resolve(), destination)
            else:
                raise ValueError(f"unknown link mode {link!r}")
        except OSError as exc:
            if link == "hardlink" and exc.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise OutputError(f"{destination}: cannot hard-link {source} ({exc.strerror}; hard links need one "
                                  "filesystem and permission to link); use --link auto, copy or symlink") from exc
            raise
    return link, None


def _reflink(source: Path, destination: Path) -> bool:
    """A copy-on-write clone (FICLONE); False, with nothing left at destination, where the filesystem has none."""
    if not sys.platform.startswith("linux"):
        return False
    with _output_errors(destination):
        src = os.open(source, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            dst = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                fcntl.ioctl(dst, _FICLONE, src)
            except OSError as exc:
                if exc.errno not in _NO_REFLINK:
                    raise
                os.close(dst)
                dst = -1
                os.unlink(destination)
                return False
            finally:
                if dst >= 0:
                    os.close(dst)
        finally:
            os.close(src)
    return True


def reflink_possible(source: Path, directory: Path) -> bool:
    """Whether `source` can be cloned into `directory` (an existing one), tried on an unnamed O_TMPFILE: the clone
    is real but no name ever appears, so planning (and --dry-run) still writes nothing. False where unsure."""
    if not sys.platform.startswith("linux") or not hasattr(os, "O_TMPFILE"):
        return False
    try:
        src = os.open(source, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        dst = os.open(directory, os.O_TMPFILE | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError:  # a filesystem without O_TMPFILE, or no write permission: the write itself will say
        os.close(src)
        return False
    try:
        fcntl.ioctl(dst, _FICLONE, src)
        return True
    except OSError:
        return False
    finally:
        os.close(dst)
        os.close(src)


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

"""Writing: shards written from a precomputed header out of sequential source reads, atomic output dir."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import itertools
import json
import os
import queue
import shutil
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from ..errors import InputError, OutputError
from ..plan import ShardPlan, TensorPlan
from ..read.safetensors_header import encode_header
from ..read.sequential import BLOCK_BYTES, SequentialReader, SourceFile, page_aligned_buffer
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


class _HashingWriter:
    """Writes and hashes one output file; with O_DIRECT through page-aligned staging buffers of BLOCK_BYTES.

    Whole staged blocks are written directly (no page cache: on the bench machine a buffered write cost several
    times a direct one), each at its own offset by one of WRITERS threads, so several writes are in flight and
    the caller's hashing and copying overlap the disk instead of waiting for it. The tail is written after
    O_DIRECT is switched off; a filesystem that refuses O_DIRECT gets the same bytes buffered, from the caller's
    thread. Use as a context manager (it stops the threads and closes the file); `finish` completes the file.
    """

    def __init__(self, path: Path, *, hashed: bool = True):
        self.sha256, self.written = hashlib.sha256() if hashed else None, 0
        self.handle, self._direct = _open_for_writing(path)
        self._stage = page_aligned_buffer(BLOCK_BYTES) if self._direct else None
        self._staged = 0
        self._offset = 0  # file offset of the next block handed to the writers (or written in place)
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._full: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # the O_DIRECT -> buffered switch
        self._threads: list[threading.Thread] = []
        if self._direct:
            for _ in range(WRITERS):
                self._free.put(page_aligned_buffer(BLOCK_BYTES))
            self._threads = [threading.Thread(target=self._write_behind, name=f"write {path.name}", daemon=True)
                             for _ in range(WRITERS)]
            for thread in self._threads:
                thread.start()

    def __enter__(self) -> "_HashingWriter":
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop()
        self.handle.close()

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), BLOCK_BYTES):
            chunk = view[start:start + BLOCK_BYTES]
            if self.sha256 is not None:
                self.sha256.update(chunk)
            if self._stage is None:
                self._write_at(chunk, self._offset)
                self._offset += len(chunk)
                continue
            while chunk:
                count = min(len(chunk), BLOCK_BYTES - self._staged)
                self._stage[self._staged:self._staged + count] = chunk[:count]
                self._staged += count
                chunk = chunk[count:]
                if self._staged == BLOCK_BYTES:
                    self._full.put((self._offset, self._stage))
                    self._offset += BLOCK_BYTES
                    self._stage, self._staged = self._free.get(), 0
                    self._raise_error()
        self.written += len(view)

    def _write_behind(self) -> None:
        while (item := self._full.get()) is not None:
            offset, block = item
            try:
                if self._error is None:
                    self._write_at(block, offset)
            except BaseException as exc:  # raised in the caller's thread by its next write or finish
                self._error = exc
            finally:
                self._free.put(block)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _stop(self) -> None:
        for _ in self._threads:
            self._full.put(None)
        for thread in self._threads:
            thread.join()
        self._threads = []

    def _write_at(self, view: memoryview, offset: int) -> None:
        while view:
            try:
                count = os.pwrite(self.handle.fileno(), view, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self._direct:
                    raise
                self._buffered()  # accepted O_DIRECT at open, not for this write
                continue
            if count < len(view) and self._direct:
                self._buffered()  # the rest would no longer be block-aligned
            view, offset = view[count:], offset + count

    def _buffered(self) -> None:
        with self._lock:
            flags = fcntl.fcntl(self.handle.fileno(), fcntl.F_GETFL)
            fcntl.fcntl(self.handle.fileno(), fcntl.F_SETFL, flags & ~_O_DIRECT)
            self._direct = False

    def finish(self) -> None:
        """Writes what is staged (durable once staged_directory fsyncs the tree)."""
        self._stop()
        self._raise_error()
        if self._staged:
            if self._direct:
                self._buffered()
            self._write_at(self._stage[:self._staged], self._offset)
            self._offset += self._staged
            self._staged = 0


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
                render: Callable[[TensorPlan, bytearray], memoryview] | None, on_bytes: Callable[[int], None],
                hashed: bool = True) -> str | None:
    """Writes one output shard; untouched tensors are streamed as raw bytes, the rest go through `render`
    (None when the shard has no TRANSFORM tensor).

    A thread reads (and hashes) the sources a few blocks ahead while this one writes (and hashes) the output:
    hashlib, readinto and write release the GIL, so the two sha256 passes run on two cores.

    Returns:
        sha256 of the written file (None when not `hashed`).
    """
    with _output_errors(path):
        with _HashingWriter(path, hashed=hashed) as out, _prefetch(shard, readers) as blocks:
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
    return out.sha256.hexdigest() if out.sha256 is not None else None


PREFETCH_BLOCKS = 4  # buffers in flight between the reading thread and the writer


@contextmanager
def _read_ahead(steps: Iterable[Callable[[memoryview], memoryview]], name: str) -> Iterator[Iterator[memoryview]]:
    """Runs `steps` in a thread, each filling a free BLOCK_BYTES buffer and returning the filled view; yields the
    iterator of those views, in order, each valid until the next is taken.

    At most PREFETCH_BLOCKS buffers exist; an error in the thread is raised in the consumer; leaving the context
    (normally or on error) stops and joins the thread.
    """
    free: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(PREFETCH_BLOCKS):
        free.put(page_aligned_buffer(BLOCK_BYTES))
    filled: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()
    end = object()

    def produce() -> None:
        try:
            for step in steps:
                buffer = free.get()
                if stop.is_set():
                    return
                filled.put((step(buffer), buffer))
            filled.put((end, None))
        except BaseException as exc:  # handed to the consumer, which raises it
            filled.put((exc, None))

    def views() -> Iterator[memoryview]:
        while True:
            view, buffer = filled.get()
            if buffer is None:
                if view is end:
                    return
                raise view
            try:
                yield view
            finally:
                free.put(buffer)

    thread = threading.Thread(target=produce, name=f"read-ahead {name}", daemon=True)
    thread.start()
    try:
        yield views()
    finally:
        stop.set()
        free.put(memoryview(bytearray(0)))  # wakes a producer waiting for a buffer
        thread.join()


def _shard_steps(shard: ShardPlan,
                 readers: dict[Path, SequentialReader]) -> Iterator[Callable[[memoryview], memoryview]]:
    """The shard's source ranges, in plan order, in blocks of BLOCK_BYTES."""
    for tensor in shard.tensors:
        reader = readers[tensor.source.ref.file]
        for start in range(0, tensor.source.nbytes, BLOCK_BYTES):
            def step(buffer: memoryview, reader=reader, offset=tensor.source.offset + start,
                     count=min(BLOCK_BYTES, tensor.source.nbytes - start)) -> memoryview:
                reader.fill(offset, buffer[:count])
                return buffer[:count]
            yield step


@contextmanager
def _prefetch(shard: ShardPlan,
              readers: dict[Path, SequentialReader]) -> Iterator[Callable[[int], Iterator[memoryview]]]:
    """Reads the shard's source ranges in a thread; yields `blocks(nbytes)`: the next nbytes of the plan in blocks."""
    with _read_ahead(_shard_steps(shard, readers), shard.file_name) as views:
        yield lambda nbytes: itertools.islice(views, -(-nbytes // BLOCK_BYTES))


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
    """Byte-identical copy at disk speed; returns the sha256 of what was copied (hashed once, while copying: the
    copy's sha256 is the source's), None when not `hashed`.

    Raises:
        InputError: the source's size is not `expected_size` (it changed since its header was read).
    """
    with _output_errors(destination):
        src = SourceFile(source)
        try:
            _check_size(source, src.size, expected_size)
            copied, digest = _copy_in_kernel(src, destination, hashed=hashed)
            if not copied:
                digest = _copy_through_buffers(src, destination, hashed=hashed)
        finally:
            src.close()
    return digest


COPY_RANGE_BYTES = 64 * 1024 * 1024  # one copy_file_range call
_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP}


def _copy_in_kernel(src: SourceFile, destination: Path, *, hashed: bool) -> tuple[bool, str | None]:
    """copy_file_range, as `cp` does: the kernel moves the bytes (no copy through this process), while a thread
    hashes each copied range from the page cache the copy just filled (unless not `hashed`). Returns (copied, sha256);
    copied is False where the kernel cannot (then nothing was written and the caller copies through buffers).

    On the bench machine, loaded by other jobs, this ran at cp's speed where the buffered pipeline took 1.5-2x.
    """
    if not hasattr(os, "copy_file_range"):
        return False, None
    out = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
    progress: queue.SimpleQueue = queue.SimpleQueue()
    sha256, hashed_bytes, failure = hashlib.sha256(), [0], []
    hasher = threading.Thread(target=_hash_behind, args=(src, progress, sha256, hashed_bytes, failure),
                              name=f"hash {destination.name}", daemon=True)
    try:
        done = 0
        while done < src.size:
            try:
                count = os.copy_file_range(src.fileno, out, min(COPY_RANGE_BYTES, src.size - done), done, done)
            except OSError as exc:
                if done or exc.errno not in _NO_COPY_RANGE:
                    raise
                return False, None
            if count == 0:
                break  # the source is shorter than it was at open
            if hashed and not hasher.is_alive() and not done:
                hasher.start()
            _start_writeback(out, done, count)
            done += count
            progress.put(done)
        if hashed and not hasher.is_alive() and not done:
            hasher.start()
        progress.put(None)
        if hashed:
            hasher.join()
        if failure:
            raise failure[0]
        seen = hashed_bytes[0] if hashed else done
        if done != src.size or seen != src.size:
            raise InputError(f"{src.path}: ended {src.size - min(done, seen)} bytes early (file changed while "
                             "converting?)")
    finally:
        if hasher.is_alive():
            progress.put(None)
            hasher.join()
        os.close(out)
    return True, sha256.hexdigest() if hashed else None


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


def _hash_behind(src: SourceFile, progress: queue.SimpleQueue, sha256: Any, hashed: list[int],
                 failure: list[BaseException]) -> None:
    """Hashes the source up to each offset `progress` reports (None: stop)."""
    buffer = page_aligned_buffer(BLOCK_BYTES)
    try:
        while (limit := progress.get()) is not None:
            while hashed[0] < limit:
                count = src.readinto(buffer[:min(BLOCK_BYTES, limit - hashed[0])])
                if not count:
                    return
                sha256.update(buffer[:count])
                hashed[0] += count
    except BaseException as exc:  # raised by copy_file
        failure.append(exc)


def _copy_through_buffers(src: SourceFile, destination: Path, *, hashed: bool) -> str | None:
    """The copy where copy_file_range cannot: read (and hashed) by a thread, written by this one."""
    sha256 = hashlib.sha256() if hashed else None
    with _HashingWriter(destination, hashed=False) as out, \
            _read_ahead(_file_steps(src, sha256), destination.name) as views:
        for view in views:
            out.write(view)
        out.finish()
    if out.written != src.size:
        raise InputError(f"{src.path}: ended {src.size - out.written} bytes early (file changed while converting?)")
    return sha256.hexdigest() if sha256 is not None else None


def _file_steps(src: SourceFile, sha256: Any) -> Iterator[Callable[[memoryview], memoryview]]:
    for _ in range(0, src.size, BLOCK_BYTES):
        def step(buffer: memoryview) -> memoryview:
            view = buffer[:src.readinto(buffer)]
            if sha256 is not None:
                sha256.update(view)
            return view
        yield step


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

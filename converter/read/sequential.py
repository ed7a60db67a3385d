"""Reads of source files through the page cache: byte ranges, front-to-back streams, and whole-file sha256s.

`write` reads ranges (SourceFile.read_at) and hashes sources beside it (hashing_ahead, BackgroundSha256); `verify`
compares and the ledger's digests hash tensor bytes through MappedFile.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

from ..errors import InputError

BLOCK_BYTES = 4 * 1024 * 1024  # one output write (O_DIRECT) and one read-ahead block; docs/BENCHMARKS.md


def page_aligned_buffer(nbytes: int) -> memoryview:
    """A writable buffer starting on a page boundary (a private anonymous mapping).

    A bytearray starts 16 bytes into a page; the kernel's copy into it from the page cache ran 2-3x slower
    than into a page-aligned buffer on the bench machine (docs/BENCHMARKS.md). Private, not mmap's default shared
    mapping: a shared anonymous mapping is shmem, whose pages cost more to fault in.
    """
    return memoryview(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))


class SourceFile:
    """Sequential reads of one source file through the page cache, with the kernel's readahead told the file is
    read front to back once (POSIX_FADV_SEQUENTIAL).

    A cached file (just downloaded or converted) is read at memory speed. An uncached one is read ahead by the
    kernel while this process hashes and writes, which O_DIRECT requests of 4 MiB (one at a time) did not do: reading
    and hashing a 1.68 GB shard cold took 1.7-2.05 s buffered against 2.4-6.0 s with O_DIRECT on the quiet bench
    machine, and pad-global of the 6.76 GB target went from 1.79x to 1.12x `cp` cold (docs/BENCHMARKS.md).
    """

    def __init__(self, path: Path):
        self.path = path
        self._fd = self.fileno = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.size = os.fstat(self._fd).st_size
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        self.position = 0

    def readinto(self, buffer: memoryview) -> int:
        """Fills buffer with the next bytes (fewer only at the end of the file); returns the count."""
        want = min(len(buffer), self.size - self.position)
        done = 0
        while done < want:
            count = os.preadv(self._fd, [buffer[done:want]], self.position + done)
            if count == 0:
                break
            done += count
        self.position += done
        return done

    def read_at(self, offset: int, view: memoryview) -> None:
        """Fills view with the len(view) bytes at offset (any order; `position` is left alone).

        Raises:
            InputError: the file ends before offset + len(view).
        """
        done = 0
        while done < len(view):
            count = os.preadv(self._fd, [view[done:]], offset + done)
            if count == 0:
                raise InputError(f"{self.path}: ended {len(view) - done} bytes early (file changed while "
                                 "converting?)")
            done += count

    def close(self) -> None:
        os.close(self._fd)


_SHA256_NAME = re.compile(r"[0-9a-f]{64}")


def known_sha256(path: Path) -> str | None:
    """The sha256 of a file that is already known without reading it: a Hugging Face cache snapshot links each
    LFS file to `blobs/<its sha256>` (the Hub's LFS oid, which the download was fetched by). None otherwise."""
    resolved = Path(os.path.realpath(path))
    if resolved.parent.name == "blobs" and _SHA256_NAME.fullmatch(resolved.name):
        return resolved.name
    return None


def file_sha256(path: Path) -> str:
    """The sha256 of a whole file: known from a Hugging Face cache blob's name, else read front to back here."""
    return known_sha256(path) or _sha256_of(path, threading.Event())[0]


HASH_READ_BYTES = 256 * 1024  # one hash read: small enough that sha256 reads it back from cache, not from memory
HASH_IN_CHILD_BYTES = 64 * 1024 * 1024  # files at least this large are hashed by a child interpreter
# the hashing children yield the cores to the writing process: its reads, renders and write submissions run the moment
# they are ready, so the disk never waits on a hash, and the hashes take every cycle the writing leaves. Measured on
# the 7.7 GB pair (2 cores): per-layer 4.70-4.90 s at the writer's priority, 3.89-4.13 s at this (docs/BENCHMARKS.md)
HASH_CHILD_NICENESS = 19


def _sha256_of(path: Path, stop: threading.Event) -> tuple[str, int]:
    """(hex sha256, bytes hashed) of the file at path, read front to back through its own buffer (not a shared
    mmap, so a file truncated meanwhile hashes short, an InputError for the caller, never a SIGBUS).

    256 KiB reads: the bytes the kernel copies in are hashed while they are still in the core's cache; with 4 MiB
    reads, hashing a warm 2.8 GB shard took 2.15 CPU s against 1.89 (docs/BENCHMARKS.md).
    """
    sha256, hashed = hashlib.sha256(), 0
    source = SourceFile(path)
    try:
        buffer = page_aligned_buffer(HASH_READ_BYTES)
        while not stop.is_set() and (count := source.readinto(buffer)):
            sha256.update(buffer[:count])
            hashed += count
    finally:
        source.close()
    return sha256.hexdigest(), hashed


_CHILD = ("import os, sys; os.nice(int(sys.argv[2])); from pathlib import Path; from threading import Event; "
          "from converter.read.sequential import _sha256_of; print(*_sha256_of(Path(sys.argv[1]), Event()))")


def _sha256_in_child(path: Path, stop: threading.Event) -> tuple[str, int]:
    """_sha256_of run by a child interpreter: a hashing thread needs this process's GIL back after every read and
    every 256 KiB hashed, and waits up to the 5 ms switch interval for it whenever another thread runs Python code
    (tqdm, copying into staging blocks, importing torch). Measured: the pair's five shards hashed in 2.6 s on two
    threads alone, in 197 s beside one thread counting in a loop (docs/BENCHMARKS.md)."""
    package_root = str(Path(__file__).resolve().parents[2])
    # the child runs in the package's directory (so it imports this converter), not the caller's: a relative path
    # would name another file there
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path.absolute()), str(HASH_CHILD_NICENESS)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=package_root)
    while True:
        try:
            out, err = child.communicate(timeout=0.1)
            break
        except subprocess.TimeoutExpired:
            if stop.is_set():
                child.kill()
                child.wait()
                return "", 0
    if child.returncode != 0:
        message = err.decode(errors="replace").strip().splitlines()
        raise InputError(f"{path}: cannot be hashed ({message[-1] if message else f'exit {child.returncode}'})")
    digest, count = out.decode().split()
    return digest, int(count)


class PendingSha256:
    """The sha256 of one whole file, computed by a thread beside the caller (hashlib releases the GIL): `result`
    waits for it. Made by BackgroundSha256 (a thread of its own) or hashing_ahead (a few threads for many files)."""

    def __init__(self, path: Path, *, size: int):
        self.path, self.size = path, size
        self._done = threading.Event()
        self._digest: str | None = None
        self._hashed = 0
        self._error: BaseException | None = None

    def compute(self, stop: threading.Event) -> None:
        try:
            hash_file = _sha256_in_child if self.size >= HASH_IN_CHILD_BYTES else _sha256_of
            self._digest, self._hashed = hash_file(self.path, stop)
            if stop.is_set() and self._hashed != self.size:  # cut short on purpose, not a changed file
                self._error = RuntimeError(f"{self.path}: hashing was stopped before it finished")
        except BaseException as exc:  # raised by result()
            self._error = exc
        finally:
            self._done.set()

    def cancel(self) -> None:
        """Ends a hash that never started (its result raises)."""
        if not self._done.is_set():
            self._error = RuntimeError(f"{self.path}: hashing was stopped before it started")
            self._done.set()

    def result(self) -> str:
        """Waits for the hash.

        Raises:
            InputError: the file is no longer `size` bytes (it changed while converting).
        """
        self._done.wait()
        if self._error is not None:
            raise self._error
        if self._hashed != self.size:
            raise InputError(f"{self.path}: is {self._hashed} bytes, {self.size} when its header was read (file "
                             "changed while converting?)")
        return self._digest


class BackgroundSha256(PendingSha256):
    """A PendingSha256 on a thread of its own, started at once. Use as a context manager, or call `result` and
    `stop` on every path."""

    def __init__(self, path: Path, *, size: int):
        super().__init__(path, size=size)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.compute, args=(self._stop,), name=f"sha256 {path.name}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> "BackgroundSha256":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def hashing_ahead(files: dict[Path, int], stack, *, threads: int) -> dict[Path, PendingSha256]:
    """A PendingSha256 for each of `files` (path -> size), hashed by `threads` threads (write/budget.py),
    largest file first (so the last to finish is a small one), the threads stopped when `stack` closes.

    Started before the first byte is copied or rewritten: the copies are disk-bound, so the hashes of every file
    of a conversion run beside them on the cores the copies leave idle (docs/BENCHMARKS.md).
    """
    pending = {path: PendingSha256(path, size=size) for path, size in files.items()}
    order: queue.SimpleQueue = queue.SimpleQueue()
    for item in sorted(pending.values(), key=lambda item: -item.size):
        order.put(item)
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            try:
                order.get_nowait().compute(stop)
            except queue.Empty:
                return

    threads = [threading.Thread(target=work, name="sha256 ahead", daemon=True)
               for _ in range(min(len(pending), max(1, threads)))]
    for thread in threads:
        thread.start()

    def finish() -> None:
        stop.set()
        for thread in threads:
            thread.join()
        for item in pending.values():  # never started: result() must not wait forever after a stop
            item.cancel()

    stack.callback(finish)
    return pending


class MappedFile:
    """A read-only mapping of one file whose ranges are handed out as memoryviews, a block at a time, with no copy.

    For comparing and hashing bytes (verify, the ledger digests): pread would copy every byte once more. Each handed-out block is
    unmapped again after use (MADV_DONTNEED drops page table entries, not the page cache), so the resident set stays
    a few blocks. As with every mmap reader (safetensors' safe_open too), a file truncated by another process while
    it is compared ends the process with SIGBUS; sizes are checked against the headers first.
    """

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as handle:
            self.size = os.fstat(handle.fileno()).st_size
            self._mapping = mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ) if self.size else None
        if self._mapping is not None and hasattr(self._mapping, "madvise"):
            self._mapping.madvise(mmap.MADV_SEQUENTIAL)

    def blocks(self, offset: int, nbytes: int) -> Iterator[memoryview]:
        """nbytes at offset in blocks of at most BLOCK_BYTES, each valid until the next is taken.

        Raises:
            InputError: the range runs past the end of the file.
        """
        if offset + nbytes > self.size:
            raise InputError(f"{self.path}: ends at {self.size} bytes, before the tensor at {offset}+{nbytes} "
                             "(truncated?)")
        for start in range(offset, offset + nbytes, BLOCK_BYTES):
            stop = min(start + BLOCK_BYTES, offset + nbytes)
            with memoryview(self._mapping)[start:stop] as view:
                yield view
            self._unmap(start, stop)

    def read(self, offset: int, nbytes: int) -> bytearray:
        data = bytearray(nbytes)
        done = 0
        for view in self.blocks(offset, nbytes):
            data[done:done + len(view)] = view
            done += len(view)
        return data

    def _unmap(self, start: int, stop: int) -> None:
        if hasattr(self._mapping, "madvise"):
            page = start - start % mmap.PAGESIZE
            self._mapping.madvise(mmap.MADV_DONTNEED, page, stop - page)

    def close(self) -> None:
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None

"""Reads of source files through the page cache: byte ranges, front-to-back streams, and whole-file sha256s.

`write` reads ranges (SourceFile.read_at) and hashes sources beside it (BackgroundSha256); `verify` compares and the
ledger's digests hash tensor bytes through MappedFile.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import threading
from pathlib import Path
from typing import Iterator

from ..errors import InputError

BLOCK_BYTES = 4 * 1024 * 1024  # one output write (O_DIRECT) and one read-ahead block; docs/BENCHMARKS.md


def page_aligned_buffer(nbytes: int) -> memoryview:
    """A writable buffer starting on a page boundary (anonymous mmap).

    A bytearray starts 16 bytes into a page; the kernel's copy into it from the page cache ran 2-3x slower
    than into a page-aligned buffer on the bench machine (docs/BENCHMARKS.md).
    """
    return memoryview(mmap.mmap(-1, nbytes))


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


class BackgroundSha256:
    """The sha256 of one whole file, computed by a thread that reads it front to back while the caller moves its
    bytes elsewhere: hashlib releases the GIL, so on a machine with a core to spare the hash costs no wall time.

    Reading through its own buffer (not a shared mmap) keeps a file truncated meanwhile an InputError here,
    never a SIGBUS. Use as a context manager, or call `result` (which joins) and `stop` on every path. `gate`: a
    semaphore shared by hashers started ahead of their files (hashing_ahead), so that at most as many hash at once
    as it admits.
    """

    def __init__(self, path: Path, *, size: int, gate: threading.Semaphore | None = None):
        self.path, self.size, self._gate = path, size, gate
        self._sha256 = hashlib.sha256()
        self._hashed = 0
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"sha256 {path.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._gate is not None:
            while not self._gate.acquire(timeout=0.05):
                if self._stop.is_set():
                    return
        try:
            source = SourceFile(self.path)
            try:
                buffer = page_aligned_buffer(BLOCK_BYTES)
                while not self._stop.is_set() and (count := source.readinto(buffer)):
                    self._sha256.update(buffer[:count])
                    self._hashed += count
            finally:
                source.close()
        except BaseException as exc:  # raised by result()
            self._error = exc
        finally:
            if self._gate is not None:
                self._gate.release()

    def result(self) -> str:
        """Waits for the hash.

        Raises:
            InputError: the file is no longer `size` bytes (it changed while converting).
        """
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._hashed != self.size:
            raise InputError(f"{self.path}: is {self._hashed} bytes, {self.size} when its header was read (file "
                             "changed while converting?)")
        return self._sha256.hexdigest()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> "BackgroundSha256":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def hashing_ahead(files: dict[Path, int], stack) -> dict[Path, BackgroundSha256]:
    """A BackgroundSha256 for each of `files` (path -> size), entered on `stack`, as many hashing at once as the
    process may use cores: the copies they stand beside are disk-bound, so hashing one file while another is
    copied keeps the hashes off the critical path (docs/BENCHMARKS.md)."""
    gate = threading.Semaphore(max(1, len(os.sched_getaffinity(0))))
    return {path: stack.enter_context(BackgroundSha256(path, size=size, gate=gate)) for path, size in files.items()}


class MappedFile:
    """A read-only mapping of one file whose ranges are handed out as memoryviews, a block at a time, with no copy.

    For comparing and hashing bytes (verify, proof/digest): pread would copy every byte once more. Each handed-out block is
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

"""Sequential reads of source files: each read once, front to back, through the page cache, hashed as it goes.

`pipeline` streams source bytes into the writer through it and `verify` compares them through it.
"""

from __future__ import annotations

import hashlib
import mmap
import os
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


READ_CHUNK_BYTES = 4 * 1024 * 1024  # one read request


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

    def close(self) -> None:
        os.close(self._fd)


class SequentialReader:
    """Reads one source file front to back exactly once, hashing every byte (gaps and header included).

    The plan orders tensors by source offset, so each request starts at or after the previous one. The file
    is read in READ_CHUNK_BYTES chunks (SourceFile); requested
    ranges are copied out of the chunk into the caller's buffer (`fill`, `read`). `hashed=False` (verify, which
    compares bytes instead) skips the sha256.
    """

    def __init__(self, path: Path, *, hashed: bool = True):
        self.path = path
        self._file = SourceFile(path)
        self._position = 0  # bytes handed out or skipped
        self._sha256 = hashlib.sha256() if hashed else None
        self._chunk: memoryview | None = None  # page-aligned, allocated on the first read
        self._pending = memoryview(b"")  # read and hashed, not yet handed out

    def _refill(self) -> None:
        if self._chunk is None:
            self._chunk = page_aligned_buffer(READ_CHUNK_BYTES)
        count = self._file.readinto(self._chunk)
        if not count:
            raise EOFError
        self._pending = self._chunk[:count]
        if self._sha256 is not None:
            self._sha256.update(self._pending)  # releases the GIL: the read-ahead thread hashes while the writer writes

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

    def finish(self) -> str | None:
        """Hashes the rest of the file (unless unhashed) and returns its sha256."""
        self._pending = memoryview(b"")
        if self._sha256 is not None:
            try:
                while True:
                    self._refill()
            except EOFError:
                pass
        self._file.close()
        self._chunk = None
        return self._sha256.hexdigest() if self._sha256 is not None else None

"""Output files written through page-aligned staging blocks and hashed chunk by chunk as they fill."""

from __future__ import annotations

import hashlib
import queue
from pathlib import Path
from typing import Callable

from ..read import sequential
from ..read.sequential import HASH_READ_BYTES, SourceFile, page_aligned_buffer
from . import budget
from .blocks import BlockWriter, copy_bytes, open_for_writing


class HashingWriter:
    """Writes one output file, and hashes it, through page-aligned staging blocks of BLOCK_BYTES (read/sequential.py).

    The caller fills blocks (`write` copies bytes in, `fill_from` reads a source range straight into them) a chunk of
    HASH_READ_BYTES at a time and hashes each chunk at once, while it is still in the core's cache; each full block
    goes to the BlockWriter, so the caller's reads and hashing overlap the disk writes. Hashing whole 4 MiB blocks
    6-24 MiB behind the filling, as a hash thread did, cost 1.2-1.4x the CPU seconds of this (docs/BENCHMARKS.md). The
    tail is written after O_DIRECT is switched off. Use as a context manager (it stops the writers and closes the
    file); `finish` completes the file.
    """

    def __init__(self, path: Path, *, hashed: bool = True):
        self.sha256, self.written = hashlib.sha256() if hashed else None, 0
        self.handle, direct = open_for_writing(path)
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(budget.STAGED_BLOCKS - 1):
            self._free.put(page_aligned_buffer(sequential.BLOCK_BYTES))
        self._stage, self._staged = page_aligned_buffer(sequential.BLOCK_BYTES), 0
        self._offset = 0  # file offset of the block being staged
        self._blocks = BlockWriter(self.handle.fileno(), direct=direct, name=path.name)

    def __enter__(self) -> "HashingWriter":
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
            copy_bytes(room[:count], view[:count])
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
        if self._staged == sequential.BLOCK_BYTES:
            self._blocks.submit(self._stage, self._offset, done=self._free.put)
            self._offset += sequential.BLOCK_BYTES
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

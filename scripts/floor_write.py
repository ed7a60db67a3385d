#!/usr/bin/env python3
"""The disk's floor for a conversion: write a given list of files (names and sizes) with O_DIRECT straight from
read-only mappings of a warm source, every file fsynced, and nothing else.

This is what a conversion cannot beat at equal durability: the output's own bytes go from the source's page-cache
pages to the disk with no copy in user space, the same number of requests in flight as convert keeps (4 x 4 MiB),
no hashing, no transform. `scripts/bench.py` runs it as the `floor-<layout>` contender and divides that layout's
rows by it; `cp -r` + `sync` moves with the page cache's writeback (8-23 s for the same 7.7 GB on one machine) and
stays a second column only.

The bytes written are the source's, in order, repeated where the output is larger (pad-global writes ~12 % more
than it reads): only their count and placement matter to the disk.

usage: floor_write.py SRC_DIR OUT_DIR SPEC_JSON
  SPEC_JSON: {"files": [[relative path, size in bytes], ...]}
"""

from __future__ import annotations

import json
import mmap
import os
import queue
import sys
import threading
from pathlib import Path

BLOCK = 4 * 1024 * 1024
IN_FLIGHT = 4  # convert's writer threads (converter/write/budget.py WRITERS)
ALIGN = 4096


def source_mappings(source: Path) -> list[mmap.mmap]:
    """Read-only mappings of every file of at least one block under source, largest first (the shards)."""
    files = sorted((p for p in source.rglob("*") if p.is_file() and p.stat().st_size >= BLOCK),
                   key=lambda p: (-p.stat().st_size, str(p)))
    views = []
    for path in files:
        with open(path, "rb") as handle:
            mapping = mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ)
        mapping.madvise(mmap.MADV_SEQUENTIAL)
        views.append(mapping)
    if not views:
        raise SystemExit(f"floor_write: no file of at least {BLOCK} bytes under {source}")
    return views


def source_blocks(mappings: list[mmap.mmap]):
    """(mapping, offset, view) of whole aligned blocks of the source files, in order, forever (an output larger
    than the source wraps)."""
    while True:
        for mapping in mappings:
            usable = len(mapping) - len(mapping) % ALIGN
            for start in range(0, usable, BLOCK):
                yield mapping, start, memoryview(mapping)[start:min(start + BLOCK, usable)]


def write_file(path: Path, size: int, blocks, pool: "WriterPool") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        aligned = size - size % ALIGN
        offset = 0
        while offset < aligned:
            mapping, start, view = next(blocks)
            view = view[:aligned - offset]
            pool.submit(fd, view, offset, (mapping, start))
            offset += len(view)
        pool.drain()
        if size > aligned:  # the unaligned tail, buffered, as convert writes it
            os.close(fd)
            fd = os.open(path, os.O_WRONLY)
            os.pwrite(fd, next(blocks)[2][:size - aligned], aligned)
        os.fsync(fd)
    finally:
        os.close(fd)


class WriterPool:
    """IN_FLIGHT threads doing pwrite; drain() waits until every submitted block is written. Each written block is
    unmapped again (MADV_DONTNEED drops this process's page table entries, not the page cache), as convert does, so
    peak RSS compares."""

    def __init__(self) -> None:
        self.jobs: queue.Queue = queue.Queue(maxsize=IN_FLIGHT)
        self.error: BaseException | None = None
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(IN_FLIGHT)]
        for thread in self.threads:
            thread.start()

    def run(self) -> None:
        while (job := self.jobs.get()) is not None:
            fd, view, offset, (mapping, start) = job
            try:
                length = len(view)
                while view:
                    count = os.pwrite(fd, view, offset)
                    view, offset = view[count:], offset + count
                view.release()
                mapping.madvise(mmap.MADV_DONTNEED, start, length)
            except BaseException as exc:  # reported by drain
                self.error = exc
            finally:
                self.jobs.task_done()
        self.jobs.task_done()

    def submit(self, fd: int, view: memoryview, offset: int, origin: tuple[mmap.mmap, int]) -> None:
        self.jobs.put((fd, view, offset, origin))

    def drain(self) -> None:
        self.jobs.join()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        for _ in self.threads:
            self.jobs.put(None)
        for thread in self.threads:
            thread.join()


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        raise SystemExit(__doc__.rsplit("usage:", 1)[1].strip())
    source, out, spec = Path(argv[0]), Path(argv[1]), json.loads(Path(argv[2]).read_text())
    blocks = source_blocks(source_mappings(source))
    out.mkdir(parents=True)
    pool = WriterPool()
    try:
        for name, size in spec["files"]:
            write_file(out / name, int(size), blocks, pool)
    finally:
        pool.close()
    for directory in sorted({(out / name).parent for name, _ in spec["files"]} | {out}):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


if __name__ == "__main__":
    main(sys.argv[1:])

"""The write engine's thread and memory budget, in one place, derived from the cores the process may use.

A conversion runs, per output: one thread copying unchanged files whole (the disk's work: O_DIRECT from the page
cache, ~0.1 CPU s per GB); up to `shard_threads` threads each rewriting one shard (the cores' work: each output's
sha256 is one stream, ~1.8 GB/s on one core), each with `render_threads` render threads ahead of it (torch and
preadv release the GIL) and `block_writers` O_DIRECT writes in flight behind it; and up to `hash_threads` threads
hashing the sources it reads whole, at niceness 19 (read/sequential.py), on the cores the rest leaves idle.
Memory: every file being written stages `staged_blocks` blocks of BLOCK_BYTES; every shard being rewritten holds at
most RENDER_AHEAD_BYTES of rendered bytes not yet written, rendered in pieces of RENDER_PIECE_BYTES; at most
IDLE_RENDER_BYTES of written-out render buffers are kept for reuse. On the bench machine (2 cores) a pad-global
conversion of the 7.7 GB pair peaked at 555 MiB RSS (docs/BENCHMARKS.md).

The constants are read at call time (`budget.WRITERS`), so a test can set them smaller.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..read.sequential import BLOCK_BYTES

WRITERS = 4  # O_DIRECT writes in flight: on the bench machine, with other jobs on the disk, 4 wrote ~1.5x faster than 1
STAGED_BLOCKS = WRITERS + 2  # staging buffers of one output file: one being filled, the rest being written
SHARDS_AT_ONCE = 2  # rewritten shards written at once (more cores: more at once, up to this; peak RSS grows with it)
RENDER_AHEAD_BYTES = 64 * 1024 * 1024  # rendered bytes of a shard's TRANSFORM tensors not yet written (peak RSS)
RENDER_PIECE_BYTES = 8 * 1024 * 1024  # what a large TRANSFORM tensor is rendered in (plan.row_pieces)
IDLE_RENDER_BYTES = 2 * RENDER_AHEAD_BYTES  # written-out render buffers kept for reuse (RenderBuffers)
COPY_THREADS = 1  # unchanged files are the disk's work: one at a time, beside the rewrites


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, not the machine's count)."""
    return max(1, len(os.sched_getaffinity(0)))


@dataclass(frozen=True)
class Budget:
    """What one conversion may start, for `cores` cores."""

    cores: int
    copy_threads: int
    shard_threads: int
    render_threads: int  # per shard being rewritten
    block_writers: int  # per file being written
    hash_threads: int  # hashing the sources read whole (at most one per file)
    staged_bytes: int  # per file being written
    render_ahead_bytes: int  # per shard being rewritten
    idle_render_bytes: int

    @property
    def threads(self) -> int:
        """The most threads a conversion runs at once (the main thread and the import thread aside)."""
        writing = self.copy_threads + self.shard_threads
        return writing + self.shard_threads * self.render_threads + writing * self.block_writers + self.hash_threads

    @property
    def buffer_bytes(self) -> int:
        """The most bytes of staging and render buffers held at once (the peak RSS's share the engine sets)."""
        writing = self.copy_threads + self.shard_threads
        return (writing * self.staged_bytes + self.shard_threads * self.render_ahead_bytes
                + self.idle_render_bytes)


def budget(cores: int | None = None) -> Budget:
    """The budget for `cores` (default: usable_cores())."""
    cores = usable_cores() if cores is None else max(1, cores)
    return Budget(cores=cores, copy_threads=COPY_THREADS, shard_threads=min(cores, SHARDS_AT_ONCE),
                  render_threads=cores, block_writers=WRITERS, hash_threads=cores,
                  staged_bytes=STAGED_BLOCKS * BLOCK_BYTES, render_ahead_bytes=RENDER_AHEAD_BYTES,
                  idle_render_bytes=IDLE_RENDER_BYTES)

"""Rendering TRANSFORM tensors ahead of the writing, in pieces, into reused page-aligned buffers."""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Iterator

from ..plan import ShardPlan, TensorPlan, row_pieces
from ..read.sequential import SourceFile, page_aligned_buffer
from . import budget


class RenderBuffers:
    """Page-aligned buffers for rendering, handed out by size and taken back after the bytes are written, so the
    pieces of one size (every layer's q_proj pieces, say) reuse the same pages.

    A new buffer's pages are faulted in and zeroed by the kernel before the first byte is written to them: in a
    pad-global conversion of the 7.7 GB pair that zeroing (for the source bytes read in and the results written out)
    cost as much CPU as the reads themselves (docs/BENCHMARKS.md). At most budget.IDLE_RENDER_BYTES of idle buffers are kept.
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
            if buffer.nbytes and self._idle_bytes + buffer.nbytes <= budget.IDLE_RENDER_BYTES:
                self._idle.setdefault(buffer.nbytes, []).append(buffer)
                self._idle_bytes += buffer.nbytes


def rendered_ahead(shard: ShardPlan, sources: dict[Path, SourceFile], render, buffers: RenderBuffers,
                   stack: ExitStack, *, threads: int) -> "_RenderAhead":
    """A _RenderAhead over shard's TRANSFORM tensors on `threads` render threads; its pool is shut down when `stack`
    closes, after what has not started is cancelled (an error leaves nothing rendering)."""
    pool = stack.enter_context(ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="render"))
    ahead = _RenderAhead(shard, sources, render, buffers, pool)
    stack.callback(ahead.cancel)
    return ahead


class _RenderAhead:
    """The rendered bytes of each TRANSFORM tensor of a shard, in pieces of at most budget.RENDER_PIECE_BYTES of whole row
    units (plan.row_pieces), submitted in file order to a pool of render threads (write/budget.py; torch and preadv
    release the GIL), while the pieces rendered and not yet written hold at most budget.RENDER_AHEAD_BYTES (or are
    one piece); `pieces` yields a tensor's pieces in order and submits more as each is written. So decoding,
    transforming and encoding of later pieces overlap the writing of earlier ones. Each piece's source bytes are read
    into, and its result rendered into, buffers from `buffers`, which get them back at once (source) or once written.
    """

    def __init__(self, shard: ShardPlan, sources: dict[Path, SourceFile], render, buffers: RenderBuffers,
                 pool: ThreadPoolExecutor):
        self._pieces = {index: row_pieces(tensor, budget.RENDER_PIECE_BYTES)
                        for index, tensor in enumerate(shard.tensors) if not tensor.is_copy}
        self._todo = deque((index, piece) for index, pieces in self._pieces.items() for piece in range(len(pieces)))
        self._sources, self._render, self._buffers, self._pool = sources, render, buffers, pool
        self._futures: dict[tuple[int, int], Future] = {}  # (tensor index, piece) -> submitted and not yet written
        self._submit()

    def _held_bytes(self) -> int:
        return sum(self._pieces[index][piece].nbytes for index, piece in self._futures)

    def _submit(self) -> None:
        while self._todo and (not self._futures or self._held_bytes() < budget.RENDER_AHEAD_BYTES):
            index, piece = key = self._todo.popleft()
            self._futures[key] = self._pool.submit(self._render_one, self._pieces[index][piece])

    def _render_one(self, tensor: TensorPlan) -> tuple[memoryview, memoryview]:
        # anonymous mappings, not bytearrays: bytearray(n) zero-fills n bytes holding the GIL (0.65 s of the
        # 3.5 s the GIL was held in a pad-global conversion of the 7.7 GB pair), a mapping faults its pages in
        # during the read, which releases it
        raw, into = self._buffers.get(tensor.source.nbytes), self._buffers.get(tensor.nbytes)
        companions = [self._buffers.get(piece.nbytes) for piece in tensor.companions]
        try:
            for piece, buffer in zip((tensor.source, *tensor.companions), (raw, *companions)):
                self._sources[piece.ref.file].read_at(piece.offset, buffer)
            return self._render(tensor, raw, into, companions), into
        finally:
            for buffer in (raw, *companions):
                self._buffers.put(buffer)  # reusable at once: a render's result is never a view of its source bytes

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

"""The threads a conversion writes from (write/budget.py says how many): unchanged files placed on one, rewritten
shards on others, every shard sharing one set of render buffers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, closing
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from ..plan import ShardPlan, TensorPlan
from ..read.sequential import SourceFile
from .budget import Budget
from .placement import place_file
from .render import RenderBuffers
from .shard import write_shard


@dataclass(frozen=True)
class Writers:
    """Where a conversion's shards are written from: unchanged files are copied on `copy_threads` threads (the disk's
    work), rewritten shards on `shard_threads` (the cores' work: each output's sha256 is one stream), all sharing one
    set of render buffers.

    On the 7.7 GB pair from a Hub cache (2 cores), pad-global took 6.4-7.2 s rewriting one shard at a time after
    the copy, against the floor's 3.8 s (docs/BENCHMARKS.md).
    """

    copies: ThreadPoolExecutor
    rewrites: ThreadPoolExecutor
    buffers: RenderBuffers
    budget: Budget

    @classmethod
    def started(cls, stack: ExitStack, budget: Budget) -> "Writers":
        """Writers whose threads are stopped when `stack` closes: what has not started is dropped, what runs ends."""
        writers = cls(copies=ThreadPoolExecutor(max_workers=budget.copy_threads, thread_name_prefix="copy"),
                      rewrites=ThreadPoolExecutor(max_workers=budget.shard_threads, thread_name_prefix="shard"),
                      buffers=RenderBuffers(), budget=budget)
        for pool in (writers.copies, writers.rewrites):
            stack.callback(pool.shutdown, wait=True, cancel_futures=True)
        return writers


def rewrite_shard(shard: ShardPlan, path: Path, *, metadata: Mapping[str, str], hashed: bool,
                  on_bytes: Callable[[int], None], buffers: RenderBuffers, render_threads: int) -> str | None:
    """write_shard of one rewritten shard, its source files opened for it alone."""
    with ExitStack() as stack:
        sources = {source: stack.enter_context(closing(SourceFile(source)))
                   for source in dict.fromkeys(piece.ref.file for tensor in shard.tensors
                                               for piece in (tensor.source, *tensor.companions))}
        render = None if all(tensor.is_copy for tensor in shard.tensors) else _render_transform
        return write_shard(path, shard, metadata=dict(metadata), sources=sources, render=render, on_bytes=on_bytes,
                           hashed=hashed, buffers=buffers, render_threads=render_threads)


def _render_transform(tensor: TensorPlan, raw: memoryview, out: memoryview, companions: list[memoryview]
                      ) -> memoryview:
    """transforms.render_transform, imported by the render threads at their first tensor: torch takes ~1 s to import
    (the pipeline starts that import in the background), and the untouched tensors before it need not wait for it."""
    from ..transforms import render_transform
    return render_transform(tensor, raw, out, companions)


def place_whole(shard: ShardPlan, directory: Path, *, link: str, expected_size: int, hashed: bool,
                on_bytes: Callable[[int], None]) -> tuple[str, str | None]:
    """place_file of an unchanged source shard, its bytes counted as done."""
    placed = place_file(shard.same_as, directory / shard.file_name, link=link, expected_size=expected_size,
                        hashed=hashed)
    on_bytes(sum(t.source.nbytes for t in shard.tensors))
    return placed

"""One output shard: its header, untouched tensors read straight into staging, rendered tensors in order."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Callable

from ..plan import ShardPlan, TensorPlan
from ..read.sequential import SourceFile
from .hashing import HashingWriter
from .headers import shard_header
from .budget import usable_cores
from .render import RenderBuffers, rendered_ahead
from .staging import output_errors


def write_shard(path: Path, shard: ShardPlan, *, metadata: dict[str, str], sources: dict[Path, SourceFile],
                render: Callable[[TensorPlan, memoryview, memoryview], memoryview] | None,
                on_bytes: Callable[[int], None], hashed: bool = True, buffers: "RenderBuffers | None" = None,
                render_threads: int | None = None) -> str | None:
    """Writes one output shard; untouched tensors are read straight into the output's staging blocks, the rest go
    through `render` (None when the shard has no TRANSFORM tensor) on a pool of threads, ahead of the writing.

    The output is hashed by this thread chunk by chunk as its blocks fill (the sources are hashed by the caller's
    hashing_ahead), and written by the BlockWriter's threads: reading, rendering, hashing and writing overlap on
    every core (render_threads of them render; default: every usable core). `render`
    reads a tensor's source bytes from its second argument and writes the result into its third where it can, both
    taken from `buffers` (one RenderBuffers for every shard of a conversion, so later shards reuse them too); its
    result must not be a view of the source bytes, whose buffer is reused as soon as it returns.

    Returns:
        sha256 of the written file (None when not `hashed`).
    """
    with output_errors(path):
        with HashingWriter(path, hashed=hashed) as out, ExitStack() as stack:
            out.write(shard_header(shard, metadata))
            rendered = rendered_ahead(shard, sources, render, buffers or RenderBuffers(), stack,
                                      threads=render_threads or usable_cores()) \
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
                on_bytes(tensor.read_nbytes)
            out.finish()
    return out.sha256.hexdigest() if out.sha256 is not None else None

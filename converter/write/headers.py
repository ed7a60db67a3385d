"""The safetensors header of an output shard, from its plan alone (offsets follow the planned tensor order)."""

from __future__ import annotations

from typing import Any

from ..plan import ShardPlan
from ..read.safetensors_header import encode_header


def shard_header(shard: ShardPlan, metadata: dict[str, str]) -> bytes:
    entries: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for tensor in shard.tensors:
        entries[tensor.name] = {"dtype": tensor.dtype, "shape": list(tensor.shape),
                                "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    return encode_header(entries)

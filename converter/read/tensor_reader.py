"""Random-access reads of single tensors (for `verify`'s layer-by-layer numerics): one pread per tensor."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import InputError


def read_range(path: Path, offset: int, nbytes: int) -> bytearray:
    """nbytes at offset of path; InputError when the file is shorter than its header promised."""
    buffer = bytearray(nbytes)
    view = memoryview(buffer)
    with open(path, "rb") as handle:
        done = 0
        while done < nbytes:
            chunk = os.preadv(handle.fileno(), [view[done:]], offset + done)
            if chunk == 0:
                raise InputError(f"{path}: ends before byte {offset + nbytes} (truncated)")
            done += chunk
    return buffer

"""Whether a source file stayed the same file while a conversion read it: device, inode, size and mtime.

A source replaced during a convert (a download finishing, `hf download` re-run, a sync tool's atomic rename) would
leave the output holding some bytes of one file and a sha256 of another: the copy reads one open file while its
hash, run ahead, opens the name again. Taken before the first read and compared after the last (before the output
is renamed into place), the identity catches a file renamed over the name (new inode) and one written in place (new
mtime, or size), the way rsync and make tell a changed file without reading it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

from ..errors import InputError


@dataclass(frozen=True)
class FileIdentity:
    device: int
    inode: int
    size: int
    mtime_ns: int


def identity_of(path: Path) -> FileIdentity | None:
    """The identity of the file a name leads to (links followed), None when nothing is there."""
    try:
        status = os.stat(path)
    except FileNotFoundError:
        return None
    return FileIdentity(status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)


def identities(paths: Iterable[Path]) -> dict[Path, FileIdentity | None]:
    return {path: identity_of(path) for path in paths}


def refuse_changed(before: Mapping[Path, FileIdentity | None]) -> None:
    """Raises InputError naming the first file whose identity is not what `before` recorded."""
    for path, was in before.items():
        now = identity_of(path)
        if now == was:
            continue
        what = ("was removed" if now is None else "was replaced (another file now has its name)"
                if (now.device, now.inode) != (was.device, was.inode) else
                f"changed size ({was.size} -> {now.size} bytes)" if now.size != was.size else "was modified")
        raise InputError(f"{path}: {what} while it was being converted; nothing was written: rerun once the source "
                         "stops changing")

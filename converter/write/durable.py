"""fsync helpers: what makes "DST exists, so it is complete" hold after a power loss, not only after a crash.

Anchors: safetensors (`src/tensor.rs`, #764) writes a temp file and renames it, without fsync; SQLite and git fsync
the file, then the directory that holds the new name. A rename is atomic in the namespace, but after a power loss
the new name can survive while data it points to (or entries of the renamed tree) did not reach the disk. So: every
file and every directory of the staging tree is fsynced before the final rename, and the parent of DST after it (the
rename itself is an entry in that directory). Files are fsynced all together at the end, not one by one as they are
written: an fsync per shard left the disk idle while the next shard was copied into the page cache (25 % slower than
`cp` on the bench machine, docs/BENCHMARKS.md).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


def write_bytes_durably(path: Path, data: bytes) -> None:
    """Path.write_bytes followed by fsync, by a new file renamed over `path`: whatever sits at `path` (a symlink
    planted in an existing output, where verify writes verification.json) is replaced, never written through."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        with open(fd, "wb", closefd=True) as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise


def fsync_directory(path: Path) -> None:
    """Makes the entries of a directory (created, renamed, removed names) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):  # a filesystem without directory fsync (some FUSE)
            raise
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsyncs every regular file below root, then every directory, deepest first.

    Symbolic links are not followed: a symlinked output file is the source's, which this tool never wrote.
    """
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            path = Path(directory) / name
            if not path.is_symlink():
                fsync_file(path)
        fsync_directory(Path(directory))

"""One writer per output directory: an flock()ed file beside DST, taken before anything is written.

Anchors: huggingface_hub's cache uses `filelock` (a lock file held for the download) and git refuses a second
writer with `index.lock` (created with O_EXCL, so a crashed git leaves a lock a human must delete). We use
flock(2) on `.DST.gemma4-convert-lock`: the kernel drops the lock when its holder dies, however it dies (SIGKILL,
OOM killer), so a lock file left by a killed run is stale by construction and the next run simply takes it over.
The file holds the holder's pid, host and boot id only to name the holder in the refusal message.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..errors import OutputError

LOCK_SUFFIX = ".gemma4-convert-lock"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def lock_path(destination: Path) -> Path:
    """Beside DST (not inside: DST does not exist yet, and the final rename must not carry the lock along)."""
    return destination.parent / f".{destination.name}{LOCK_SUFFIX}"


def _holder() -> dict[str, object]:
    boot = BOOT_ID.read_text().strip() if BOOT_ID.is_file() else None
    return {"pid": os.getpid(), "host": socket.gethostname(), "boot_id": boot}


def _describe_holder(path: Path) -> str:
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
        return f"pid {holder['pid']} on {holder['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"  # it has opened the file but not yet written its name


def _open_locked(path: Path, destination: Path) -> int:
    """An fd of `path` holding an exclusive flock, retried when the holder unlinked the file meanwhile."""
    while True:
        # O_NOFOLLOW: a symlink planted at this name would have us truncate the file it points to
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or status.st_nlink > 1:  # a FIFO, device or hard link planted there
            os.close(fd)
            raise OSError(errno.EEXIST, "not a regular file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise OutputError(f"{destination}: another gemma4-convert "
                                  f"({_describe_holder(path)}) is writing it; wait for it to finish or stop it "
                                  f"(lock {path})") from None
            raise
        # the holder we waited on may have unlinked the file before we locked it: then our inode is orphaned
        try:
            same = os.fstat(fd).st_ino == os.lstat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _write_holder(fd: int) -> None:
    """Names this process in the lock file, best effort: the flock is the lock, the name only helps the message a
    second writer gets, and a full disk (nothing free for even these bytes) must fail where the output is written,
    as an OutputError naming it, not here."""
    try:
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(_holder()).encode("utf-8"))
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise


@contextmanager
def output_lock(destination: Path) -> Iterator[Path]:
    """Holds the lock of `destination` for the block; a second holder gets OutputError at once, in another process
    or in this one (the lock is not reentrant: pipeline.convert takes it once, around the downloads and the writes).

    A lock file whose holder died is taken over (flock is released by the kernel). The lock file is removed on exit.

    Raises:
        OutputError: another holder has it, or the lock file cannot be created.
    """
    path = lock_path(destination)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = _open_locked(path, destination)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise OutputError(f"{path}: no space left on device") from exc
        if exc.errno in (errno.ELOOP, errno.EEXIST):
            raise OutputError(f"{path}: is a symbolic link or not a regular file, where this tool keeps its lock; "
                              "it writes nothing through it: remove it and rerun") from exc
        raise OutputError(f"{path}: cannot create the lock file ({exc.strerror or exc})") from exc
    try:
        _write_holder(fd)
        yield path
    finally:
        try:
            os.unlink(path)  # while still locked: a waiter that opened the old inode retries on the new one
        except FileNotFoundError:
            pass
        os.close(fd)

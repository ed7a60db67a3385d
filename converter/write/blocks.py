"""Block I/O: files opened with O_DIRECT where accepted, and the threads that keep budget.WRITERS writes in flight."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import io
import os
import queue
import threading
from pathlib import Path
from typing import Callable

from . import budget


O_DIRECT = getattr(os, "O_DIRECT", 0)


DIRECT_ALIGN = 4096  # O_DIRECT lengths and offsets: the largest logical block size of common disks


class BlockWriter:
    """Writes blocks at their own offsets from budget.WRITERS threads, so several writes are in flight while the caller
    fills (and a hash thread hashes) the next ones.

    O_DIRECT where the file was opened with it: whole blocks go from the caller's page-aligned buffer (a staging
    buffer, or the source's own page-cache pages through a read-only mapping) to the disk with no copy and no page
    cache on the output side. A filesystem that accepts O_DIRECT at open but refuses a write gets the same bytes
    buffered. `submit` takes (view, offset, done); `done(view)` runs once the view is written (or dropped after an
    error). `close` stops the threads and raises the first error.
    """

    def __init__(self, fd: int, *, direct: bool, name: str):
        self.fd, self.direct = fd, direct
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # the O_DIRECT -> buffered switch
        self._threads = [threading.Thread(target=self._run, name=f"write {name}", daemon=True) for _ in range(budget.WRITERS)]
        for thread in self._threads:
            thread.start()

    def submit(self, view: memoryview, offset: int, done: Callable[[memoryview], None] | None = None) -> None:
        self.raise_error()
        self._queue.put((view, offset, done))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            view, offset, done = item
            try:
                if self._error is None:
                    self.write_at(view, offset)
            except BaseException as exc:  # raised in the caller's thread by its next submit or close
                self._error = exc
            finally:
                if done is not None:
                    done(view)
                del view, item  # a failed write's traceback keeps this frame: it must not pin a mapped source

    def raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Waits for every submitted write; raises the first error."""
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        self._threads = []
        self.raise_error()

    def write_at(self, view: memoryview, offset: int) -> None:
        while view:
            try:
                count = os.pwrite(self.fd, view, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                self.buffered()  # accepted O_DIRECT at open, not for this write
                continue
            if count < len(view) and self.direct:
                self.buffered()  # the rest would no longer be block-aligned
            view, offset = view[count:], offset + count

    def write_tail(self, view: memoryview, offset: int) -> None:
        """The last, unaligned bytes of the file, buffered (O_DIRECT takes whole blocks only); after close()."""
        if self.direct:
            self.buffered()
        self.write_at(view, offset)

    def buffered(self) -> None:
        with self._lock:
            flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
            fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~O_DIRECT)
            self.direct = False


def open_for_writing(path: Path, *, direct: bool = True) -> tuple[io.FileIO, bool]:
    """(file, direct): created/truncated like open(path, "wb"), with O_DIRECT where it is accepted."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    if O_DIRECT and direct:
        try:
            return io.FileIO(os.open(path, flags | O_DIRECT, 0o666), "wb"), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return io.FileIO(os.open(path, flags, 0o666), "wb"), False


def copy_bytes(destination: memoryview, source: memoryview) -> None:
    """destination[:] = source, with the GIL released during the copy (ctypes.memmove is a foreign call) where
    both buffers are writable: a slice assignment copies holding it, which stalls the hash and render threads
    (0.45 s of GIL time in a pad-global conversion of the 7.7 GB pair)."""
    try:
        to, frm = ctypes.c_char.from_buffer(destination), ctypes.c_char.from_buffer(source)
    except (TypeError, ValueError):  # read-only or empty: the plain copy
        destination[:] = source
        return
    ctypes.memmove(ctypes.addressof(to), ctypes.addressof(frm), len(source))
    del to, frm

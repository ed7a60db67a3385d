"""Unchanged files into the output: copied at disk speed, reflinked, hardlinked or symlinked (--link)."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import sys
from contextlib import ExitStack
from pathlib import Path

from ..errors import InputError, OutputError
from ..read import sequential
from ..read.sequential import BackgroundSha256, SourceFile, known_sha256
from .blocks import DIRECT_ALIGN, BlockWriter, open_for_writing
from .hashing import HashingWriter
from .staging import output_errors


def copy_file(source: Path, destination: Path, *, expected_size: int | None = None, hashed: bool = True) -> str | None:
    """Byte-identical copy at disk speed; returns the source's sha256, which is the copy's (each byte hashed once,
    on a thread beside the copy; a sha256 the Hub cache already names is taken as is), None when not `hashed`.

    Tried in turn: the source's page-cache pages written to the copy with O_DIRECT through a read-only mapping (no
    copy in memory at all), copy_file_range (the kernel copies, as `cp` does), a read-and-write loop.

    Raises:
        InputError: the source's size is not `expected_size`, or it changed during the copy.
    """
    with output_errors(destination):
        src = SourceFile(source)
        try:
            _check_size(source, src.size, expected_size)
            known = known_sha256(source) if hashed else None
            with ExitStack() as stack:
                hasher = stack.enter_context(BackgroundSha256(source, size=src.size)) \
                    if hashed and known is None else None
                any(copy(src, destination) for copy in (_copy_from_mapping, _copy_in_kernel, _copy_through_buffers))
                _check_size(source, os.fstat(src.fileno).st_size, src.size)
                digest = known or (hasher.result() if hasher else None)
        finally:
            src.close()
    return digest


def _copy_from_mapping(src: SourceFile, destination: Path) -> bool:
    """Writes the source's pages, mapped read-only, to an O_DIRECT output: the disk reads them from the page cache
    (DMA), so the copy costs no CPU copying. False, with no copy made, where O_DIRECT or the mapping is refused.

    On the bench machine a 7.7 GB pair copied this way in 3.0-3.4 s against 17-19 s for `cp -r` + `sync`, at
    0.3 CPU s against cp's 16 (docs/BENCHMARKS.md). A source truncated meanwhile makes the write fail with EFAULT
    (the kernel reads the mapping, this process never touches it), not a SIGBUS.
    """
    if not src.size:
        return False
    handle, direct = open_for_writing(destination)
    if not direct:
        handle.close()
        return False
    try:
        mapping = mmap.mmap(src.fileno, src.size, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        handle.close()
        return False
    try:
        if hasattr(mapping, "madvise"):
            mapping.madvise(mmap.MADV_SEQUENTIAL)
        _write_mapped(mapping, handle.fileno(), destination.name)
    except OSError as exc:
        if exc.errno == errno.EFAULT:
            raise InputError(f"{src.path}: shrank while it was copied (file changed while converting?)") from None
        raise
    finally:
        handle.close()
        try:
            mapping.close()
        except BufferError:  # a view is still held by an error on its way out: unmapped when that is collected
            pass
    return True


def _write_mapped(mapping: mmap.mmap, fd: int, name: str) -> None:
    """Writes the mapped file to fd (opened O_DIRECT) at offset 0: whole blocks by the BlockWriter, the unaligned
    tail buffered. Each written block is unmapped again (MADV_DONTNEED drops this process's page table entries, not
    the page cache), so the copy's resident set stays at a few blocks however large the file."""
    view = memoryview(mapping)
    aligned = len(view) - len(view) % DIRECT_ALIGN
    blocks = BlockWriter(fd, direct=True, name=name)

    def unmap(block: memoryview, offset: int) -> None:
        if hasattr(mapping, "madvise"):
            mapping.madvise(mmap.MADV_DONTNEED, offset, len(block))

    try:
        for offset in range(0, aligned, sequential.BLOCK_BYTES):
            blocks.submit(view[offset:min(offset + sequential.BLOCK_BYTES, aligned)], offset,
                          done=lambda block, offset=offset: unmap(block, offset))
    finally:
        blocks.close()
    if aligned < len(view):
        blocks.write_tail(view[aligned:], aligned)
    view.release()


COPY_RANGE_BYTES = 64 * 1024 * 1024  # one copy_file_range call


_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP}


def _copy_in_kernel(src: SourceFile, destination: Path) -> bool:
    """copy_file_range, as `cp` does: the kernel moves the bytes. False where the kernel cannot (then nothing was
    written and the caller copies through buffers)."""
    if not hasattr(os, "copy_file_range"):
        return False
    out = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        done = 0
        while done < src.size:
            try:
                count = os.copy_file_range(src.fileno, out, min(COPY_RANGE_BYTES, src.size - done), done, done)
            except OSError as exc:
                if done or exc.errno not in _NO_COPY_RANGE:
                    raise
                return False
            if count == 0:
                raise InputError(f"{src.path}: ended {src.size - done} bytes early (file changed while converting?)")
            _start_writeback(out, done, count)
            done += count
    finally:
        os.close(out)
    return True


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Starts writing a just-copied range to disk without waiting for it.

    Without this the kernel starts writeback only past dirty_background_ratio (~2 GB here), so a shard smaller than
    that sat in the page cache until the final fsync and the disk idled meanwhile. On Linux, POSIX_FADV_DONTNEED
    queues the range's dirty pages for writeback and drops only pages already clean (the effect of
    sync_file_range(SYNC_FILE_RANGE_WRITE), which os does not expose). A 6.8 GB copy with an fsync per file took
    17.4-18.1 s on the bench machine, one fsync at the end 13.6-15.6 s, this 13.1-13.8 s, `cp` 13.8-14.8 s.
    """
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


def _copy_through_buffers(src: SourceFile, destination: Path) -> bool:
    """The copy where neither of the others can: read into staging blocks, written by the writer threads."""
    with HashingWriter(destination, hashed=False) as out:
        out.fill_from(src, 0, src.size)
        out.finish()
    return True


LINK_MODES = ("auto", "copy", "reflink", "hardlink", "symlink")


LINK_MEANING = {
    "hardlink": "unchanged files are hard links: the output's and the source's are one file on disk, so an in-place "
                "write to either changes both (gemma4-convert never writes to a source; a tool that replaces files "
                "by rename breaks the link instead)",
    "symlink": "unchanged files are symbolic links to the source's absolute paths: an in-place write through either "
               "changes both, and the output breaks when the source is moved or deleted",
}


_FICLONE = 0x40049409  # linux/fs.h _IOW(0x94, 9, int): clone the whole file, copy-on-write


# what FICLONE answers on a filesystem or pair of files that cannot share extents (ext4, tmpfs, two filesystems)
_NO_REFLINK = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EPERM}


def _check_size(path: Path, size: int, expected: int | None) -> None:
    if expected is not None and size != expected:
        raise InputError(f"{path}: is {size} bytes, {expected} when its header was read (file changed while "
                         "converting?)")


def place_file(source: Path, destination: Path, *, link: str, expected_size: int | None = None,
               hashed: bool = True) -> tuple[str, str | None]:
    """Puts an unchanged file at destination by `link` mode; returns (how it was made, sha256 or None).

    auto: reflink where the filesystem can, else copy. A link is made without reading the file, so its sha256 is
    not known (None); a copy is hashed on the way unless not `hashed`.

    Raises:
        InputError: the source's size is not `expected_size`.
        OutputError: the mode is impossible here (reflink unsupported, hardlink across filesystems) or the write fails.
    """
    if link != "copy":  # a copy checks while it reads
        with output_errors(destination):
            _check_size(source, os.stat(source).st_size, expected_size)
    if link in ("auto", "reflink"):
        if _reflink(source, destination):
            return "reflink", None
        if link == "reflink":
            raise OutputError(f"{destination.parent}: cannot reflink {source} here (the filesystem has no "
                              "copy-on-write clones, or source and output are on different filesystems); use "
                              "--link auto to copy instead")
        return "copy", copy_file(source, destination, expected_size=expected_size, hashed=hashed)
    if link == "copy":
        return "copy", copy_file(source, destination, expected_size=expected_size, hashed=hashed)
    with output_errors(destination):
        try:
            if link == "hardlink":
                os.link(source, destination)  # follows a symlinked source (a Hugging Face cache snapshot) to its blob
            elif link == "symlink":
                os.symlink(source.resolve(), destination)
            else:
                raise ValueError(f"unknown link mode {link!r}")
        except OSError as exc:
            if link == "hardlink" and exc.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise OutputError(f"{destination}: cannot hard-link {source} ({exc.strerror}; hard links need one "
                                  "filesystem and permission to link); use --link auto, copy or symlink") from exc
            raise
    return link, None


def _reflink(source: Path, destination: Path) -> bool:
    """A copy-on-write clone (FICLONE); False, with nothing left at destination, where the filesystem has none."""
    if not sys.platform.startswith("linux"):
        return False
    with output_errors(destination):
        src = os.open(source, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            dst = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                fcntl.ioctl(dst, _FICLONE, src)
            except OSError as exc:
                if exc.errno not in _NO_REFLINK:
                    raise
                os.close(dst)
                dst = -1
                os.unlink(destination)
                return False
            finally:
                if dst >= 0:
                    os.close(dst)
        finally:
            os.close(src)
    return True


def reflink_possible(source: Path, directory: Path) -> bool:
    """Whether `source` can be cloned into `directory` (an existing one), tried on an unnamed O_TMPFILE: the clone
    is real but no name ever appears, so planning (and --dry-run) still writes nothing. False where unsure."""
    if not sys.platform.startswith("linux") or not hasattr(os, "O_TMPFILE"):
        return False
    try:
        src = os.open(source, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        dst = os.open(directory, os.O_TMPFILE | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError:  # a filesystem without O_TMPFILE, or no write permission: the write itself will say
        os.close(src)
        return False
    try:
        fcntl.ioctl(dst, _FICLONE, src)
        return True
    except OSError:
        return False
    finally:
        os.close(dst)
        os.close(src)

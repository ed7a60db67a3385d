"""The output directory: built under a staging name beside DST, fsynced, renamed into place; JSON files."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ..errors import OutputError
from .durable import fsync_directory, fsync_tree, write_bytes_durably


PARTIAL_SUFFIX = ".gemma4-convert-partial"


RETIRED_SUFFIX = ".gemma4-convert-old"  # an output --force replaces, until the new one is in place


def make_directory(path: Path) -> None:
    """mkdir -p; out of space or inodes is an OutputError like any other write."""
    with output_errors(path):
        path.mkdir(parents=True, exist_ok=True)


def write_json(path: Path, document: Any) -> str:
    """Writes pretty JSON (fsynced); returns its sha256."""
    return write_text(path, json.dumps(document, indent=2) + "\n")


def write_text(path: Path, text: str) -> str:
    """Writes UTF-8 text (fsynced); returns its sha256."""
    raw = text.encode("utf-8")
    with output_errors(path):
        write_bytes_durably(path, raw)
    return hashlib.sha256(raw).hexdigest()


@contextmanager
def output_errors(path: Path) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise OutputError(f"{path}: no space left on device") from exc
        raise OutputError(f"{path}: cannot write ({exc.strerror or exc})") from exc


def partial_dir(destination: Path) -> Path:
    """Where an output is assembled before the final rename: beside it, so the rename stays on one filesystem."""
    return destination.parent / f".{destination.name}{PARTIAL_SUFFIX}"


def retired_dir(destination: Path) -> Path:
    return destination.parent / f".{destination.name}{RETIRED_SUFFIX}"


def refuse_planted_links(*paths: Path) -> None:
    """The names this tool removes and renames beside DST must be its own directories, not links: removing through
    a link, or renaming onto one, would touch what lies outside DST. Checked under the output lock.

    Raises:
        OutputError: one of them is a symbolic link, or not a directory.
    """
    for path in paths:
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(mode):
            kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a directory"
            raise OutputError(f"{path}: is {kind}, where this tool keeps its own work beside the output; it touches "
                              "nothing through it: remove it and rerun")


@contextmanager
def staged_directory(destination: Path, *, replace: bool) -> Iterator[Path]:
    """Yields an empty staging dir; on success it becomes `destination` in one rename, on failure it is removed.

    A staging dir left by a killed run is removed first, so a re-run starts clean. With `replace`, the old
    destination is renamed aside, the new one renamed in, then the old one deleted; if the second rename fails
    the old one is renamed back.
    """
    staging = partial_dir(destination)
    retired = retired_dir(destination)
    refuse_planted_links(staging, retired)
    with output_errors(staging):
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    moved_aside = False
    try:
        with output_errors(destination):
            fsync_tree(staging)  # every entry of the new tree is on disk before its name appears
            if destination.exists() and replace:
                shutil.rmtree(retired, ignore_errors=True)
                os.replace(destination, retired)
                moved_aside = True
            os.replace(staging, destination)
    except BaseException:
        if moved_aside:
            os.replace(retired, destination)  # the earlier output goes back; nothing half-swapped stays
        shutil.rmtree(staging, ignore_errors=True)
        raise
    with output_errors(destination.parent):
        fsync_directory(destination.parent)  # the rename itself (after the swap: a failure here undoes nothing)
    shutil.rmtree(retired, ignore_errors=True)  # also an earlier output that a run killed mid-swap left there

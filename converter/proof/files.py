"""An output's files against what its conversion.json records: names, sizes, sha256s. verify and upload both ask.

A proof must describe the bytes that ship: verify's tensor checks say nothing of a tokenizer changed after convert,
and a verification.json says nothing of files added or edited after verify. So both read the directory back
against the manifest: a file missing, one the manifest does not list, one of another size, one whose sha256 is not
the recorded one. The manifest cannot list itself, and verification.json is written after it.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any, Callable, Mapping

from ..read.checkpoint import CARD_NAME, MANIFEST_NAME, VERIFICATION_NAME
from ..read.sequential import file_sha256

UNLISTED = frozenset({MANIFEST_NAME, VERIFICATION_NAME})
# The card convert wrote is the one file upload replaces (it renders the card anew from the manifest), so a user
# may edit it freely: it is listed, never compared.
REGENERATED = frozenset({CARD_NAME})


def manifest_sha256(directory: Path) -> str:
    """The sha256 of a checkpoint's conversion.json bytes: what verification.json names as the manifest it proved."""
    return hashlib.sha256((directory / MANIFEST_NAME).read_bytes()).hexdigest()


def file_problems(directory: Path, manifest: Mapping[str, Any], *, hashed: bool,
                  hash_if: Callable[[str], bool] = lambda name: True,
                  on_bytes: Callable[[int], None] = lambda n: None) -> list[str]:
    """One line per file of `directory` that is not as `manifest` records it: missing, not listed, not a regular
    file, another size, another sha256 (with `hashed`, for the names `hash_if` accepts and whose sha256 the
    manifest holds; a linked file's is null). Hidden names (staging temporaries) are not the output's."""
    output = manifest.get("output") or {}
    recorded: Mapping[str, str | None] = output.get("files") or {}
    sizes: Mapping[str, int] = output.get("sizes") or {}
    present = {entry.name for entry in directory.iterdir() if not entry.name.startswith(".")}
    problems = [f"{name}: listed in {MANIFEST_NAME} but missing" for name in sorted(recorded.keys() - present)]
    problems += [f"{name}: in the output but not in {MANIFEST_NAME} (added after convert? remove it)"
                 for name in sorted(present - recorded.keys() - UNLISTED)]
    for name in sorted(recorded.keys() & present - REGENERATED):
        problem = _file_problem(directory / name, recorded[name], sizes.get(name),
                                hashed=hashed and hash_if(name), on_bytes=on_bytes)
        if problem:
            problems.append(f"{name}: {problem}")
    return problems


def _file_problem(path: Path, sha256: str | None, size: int | None, *, hashed: bool,
                  on_bytes: Callable[[int], None]) -> str | None:
    try:
        status = os.stat(path)  # a linked output file is its source's: follow it
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if not stat.S_ISREG(status.st_mode):
        return "not a regular file"
    if size is not None and status.st_size != size:
        return f"{status.st_size} bytes, {MANIFEST_NAME} records {size} (changed since convert)"
    if hashed and sha256:
        actual = file_sha256(path)
        on_bytes(status.st_size)
        if actual != sha256:
            return f"sha256 {actual[:12]}..., {MANIFEST_NAME} records {sha256[:12]}... (changed since convert)"
    return None

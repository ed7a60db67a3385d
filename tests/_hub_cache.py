"""A Hugging Face Hub cache laid out by hand for offline tests (the real huggingface_hub code reads it)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_repo(cache: Path, repo_id: str, sha: str, directory: Path, *, refs: tuple[str, ...] = ("main",),
               skip: tuple[str, ...] = ()) -> Path:
    """Lays `directory`'s files out the way huggingface_hub caches them: blobs, snapshots/<sha> symlinks, refs."""
    root = cache / ("models--" + repo_id.replace("/", "--"))
    for file in sorted(directory.iterdir()):
        if not file.is_file() or file.name in skip:
            continue
        data = file.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = root / "snapshots" / sha / file.name
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    for ref in refs:
        (root / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(sha)
    return root / "snapshots" / sha

"""The checkout's own state: what `git status` reports (the litter check, the clean-checkout test)."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def checkout_changes(root: Path = REPO_ROOT) -> set[str] | None:
    """`git status --porcelain` lines of the checkout (untracked files one by one); None outside a git checkout."""
    try:
        proc = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=all"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return set(proc.stdout.splitlines()) if proc.returncode == 0 else None

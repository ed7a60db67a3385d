"""The project's wheel and what it requires at run time (tests/test_install.py; the ledger's install rows,
scripts/matrix/install_check.py)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def build_wheel(dist: Path, src: Path) -> Path:
    """The wheel, built without build isolation from a copy (in `src`) of the checkout's own files, into `dist`."""
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "converter", src / "converter", ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(dist), str(src)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"pip wheel failed: {proc.stderr.strip()[-2000:]}")
    (built,) = dist.glob("gemma4_convert-*.whl")
    return built


def runtime_requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist lines without an extra marker: what every install of the tool brings."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(name).decode("utf-8"))
    return sorted(r for r in metadata.get_all("Requires-Dist") or [] if "extra ==" not in r)


def requirements_digest(wheel: Path) -> str:
    """What an install row proved: the runtime requirements it installed (tests/test_ledger.py recomputes it)."""
    return hashlib.sha256("\n".join(runtime_requirements(wheel)).encode()).hexdigest()

"""The venv of a consumer that is not vLLM (mlx-lm, ...), built once from scripts/consumers/<name>/requirements.txt.

It lives under ~/.cache/gemma4-convert/consumer-envs/<name>-<first 12 hex of the requirements' sha256> (or
GEMMA4_CONSUMER_ENVS) and is reused while its requirements are unchanged; a half-built one (no stamp) is rebuilt.
A consumer whose folder holds setup_env.py (what pip cannot install: llama.cpp's GGUF converter, SGLang without its
CUDA pins) has it run under the env's python with the env's path and the release once the requirements are in; it
is part of the digest.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STAMP = ".gemma4-consumer-env-complete"


def consumer_python(name: str, release: str = "") -> Path:
    """The python of consumer `name`'s env, built if needed; `release`: the env of requirements-RELEASE.txt (a
    consumer measured in several releases) instead of requirements.txt.

    Raises:
        RuntimeError: the env could not be built (pip's last lines in the message).
    """
    folder = REPO / "scripts" / "consumers" / name
    requirements = folder / (f"requirements-{release}.txt" if release else "requirements.txt")
    setup = folder / "setup_env.py"
    digest = hashlib.sha256(requirements.read_bytes() + (setup.read_bytes() if setup.is_file() else b"")).hexdigest()[:12]
    root = Path(os.environ.get("GEMMA4_CONSUMER_ENVS") or Path.home() / ".cache" / "gemma4-convert" / "consumer-envs")
    env = root / f"{name}-{release + '-' if release else ''}{digest}"
    python = env / "bin" / "python"
    if (env / STAMP).is_file():
        return python
    shutil.rmtree(env, ignore_errors=True)
    env.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=300)
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(requirements)], capture_output=True,
                          text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"building the {name} env {env} failed: {proc.stderr.strip()[-1500:]}")
    if setup.is_file():
        proc = subprocess.run([str(python), str(setup), str(env), release], capture_output=True, text=True,
                              timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"{setup} for the {name} env {env} failed: {proc.stderr.strip()[-1500:]}")
    (env / STAMP).write_text(digest + "\n")
    return python

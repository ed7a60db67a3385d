"""What every consumer check (scripts/consumers/<consumer>/check.py, draft.py, and the vLLM harnesses) shares: its
command line, the prompt the consumers are compared on, the one-line form of a consumer's failure with where in the
consumer it was raised, a free loopback port for a consumer's server, and a config's text config.

Standard library only: each check runs under its consumer's own interpreter and imports this by path.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

PROMPT = [2, 17, 5, 33, 9, 41, 3, 12, 28, 7, 19, 36]  # ids below every test vocabulary; one prompt for every consumer
NEW_TOKENS = 8


def free_port() -> int:
    """A loopback TCP port free now (a consumer's server binds it next)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def text_config_of(config: dict) -> dict:
    """The dict holding a Gemma 4 config's attention keys: `text_config` when nested, else the config itself (as
    converter/gemma4.py text_config_of; this module imports nothing outside the standard library)."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def parse_pairs(description: str, argv: list[str] | None = None) -> tuple[dict[str, Path], Path]:
    """`--reference PAIR [--pair NAME=PAIR ...] --json OUT` -> ({"reference": PAIR, NAME: PAIR, ...}, OUT)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--reference", type=Path, required=True)
    parser.add_argument("--pair", action="append", default=[], metavar="NAME=PAIR")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    return {"reference": args.reference, **{p.split("=", 1)[0]: Path(p.split("=", 1)[1]) for p in args.pair}}, args.json


def in_own_process(script: str, pair: Path, timeout: float, env: dict[str, str] | None = None
                   ) -> tuple[dict | None, subprocess.CompletedProcess]:
    """`script --one PAIR --json OUT` under this interpreter, a process of the pair's own (a consumer's process-wide
    state, its engine's workers, stay its own): (the JSON document it wrote, None if it failed; the process)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "one.json"
        proc = subprocess.run([sys.executable, script, "--one", str(pair), "--json", str(out)], capture_output=True,
                              text=True, timeout=timeout, env={**os.environ, **(env or {})})
        return (json.loads(out.read_text()) if proc.returncode == 0 and out.exists() else None), proc


def one_line(exc: BaseException) -> str:
    """"TypeError: first line of the message", at most 300 characters: what a row's detail quotes."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def _placed(message: str, package: str, frames: list[tuple[str, str]]) -> str:
    """message + " (package/file.py, function)" of the innermost of `frames` (filename, function) in `package`."""
    inside = [(f, name) for f, name in frames if f"/{package}/" in f]
    if not inside:
        return message
    filename, function = inside[-1]
    return f"{message} ({package}/{filename.split(f'/{package}/')[-1]}, {function})"


def failure(exc: BaseException, package: str) -> str:
    """one_line(exc) and where `package` raised it:
    "TypeError: ... (mlx_vlm/speculative/utils.py, run_speculative_rounds)"."""
    return _placed(one_line(exc), package, [(f.filename, f.name) for f in traceback.extract_tb(exc.__traceback__)])


TRACEBACK_FRAME = re.compile(r'^\s*File "([^"]+)", line \d+, in (\S+)')
EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit)): ?(.*)$")


def logged_failure(log: str, package: str) -> str | None:
    """The exception the first traceback in `log` (processes' stderr) ends with, in failure()'s form; None if the log
    holds none. The first: in a multi-process engine the one a worker died of, before the parent's report of it."""
    frames: list[tuple[str, str]] | None = None
    for line in log.splitlines():
        if "Traceback (most recent call last)" in line:
            frames = []
        elif frames is None:
            continue
        elif match := TRACEBACK_FRAME.match(line):
            frames.append(match.groups())
        elif (match := EXCEPTION_LINE.match(line.strip())) and frames:
            return _placed(f"{match[1].rsplit('.', 1)[-1]}: {match[2]}"[:300], package, frames)
    return None

"""What every consumer check (scripts/consumers/<consumer>/check.py) shares: its command line, the prompt the
consumers are compared on, and the one-line form of a consumer's failure.

Standard library only: each check runs under its consumer's own interpreter and imports this by path.
"""

from __future__ import annotations

import argparse
from pathlib import Path

PROMPT = [2, 17, 5, 33, 9, 41, 3, 12, 28, 7, 19, 36]  # ids below every test vocabulary; one prompt for every consumer
NEW_TOKENS = 8


def parse_pairs(description: str, argv: list[str] | None = None) -> tuple[dict[str, Path], Path]:
    """`--reference PAIR [--pair NAME=PAIR ...] --json OUT` -> ({"reference": PAIR, NAME: PAIR, ...}, OUT)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--reference", type=Path, required=True)
    parser.add_argument("--pair", action="append", default=[], metavar="NAME=PAIR")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    return {"reference": args.reference, **{p.split("=", 1)[0]: Path(p.split("=", 1)[1]) for p in args.pair}}, args.json


def one_line(exc: BaseException) -> str:
    """"TypeError: first line of the message", at most 300 characters: what a row's detail quotes."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]

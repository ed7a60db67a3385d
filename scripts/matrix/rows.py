"""What measuring a family of ledger rows yields (scripts/run_ledger.py runs each family's `measure`), and rows carried
over: a row whose key, output digest and torch equal a row of the committed ledger (or of an earlier failed run's
resume file) is not measured again (`make compat` is incremental; `--all` re-measures)."""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from converter.advice.ledger import LedgerRow, load_ledger, row_from_dict

# carried_over(key, digest, torch) -> the ledger's row for this very output and env, or None (measure it)
CarriedOver = Callable[[tuple, str, str], "LedgerRow | None"]


def never_carried(key: tuple, digest: str, torch: str) -> None:
    return None


class RowMismatch(Exception):
    """A consumer's result is not what the row must show (the message says what differs, with the consumer's log)."""


def expect(condition: object, message: object = "") -> None:
    if not condition:
        raise RowMismatch(str(message))


@dataclass(frozen=True)
class Measured:
    """One unit of a family (a row, or the rows one consumer run judges together) at its end: its ledger rows,
    whether they were carried over unchanged, or the mismatch it showed (then no rows)."""

    name: str
    rows: tuple[LedgerRow, ...] = ()
    carried: bool = False
    mismatch: str = ""
    note: str = ""  # what holds short of the whole row (an expected failure of the synthetic input)


@dataclass(frozen=True)
class Family:
    """A family of ledger rows the runner measures itself: its name, its check, the pytest tests that run its units
    by the same functions (deselected from the runner's pytest pass), its units for a --case/--vllm selection, and
    how they are measured."""

    name: str
    check: str
    tests: tuple[str, ...]
    select: Callable[[tuple[str, ...], str], list]
    measure: Callable[[list, Path, CarriedOver], Iterator[Measured]]


def today() -> str:
    return datetime.date.today().isoformat()


def read_rows(path: Path) -> tuple[LedgerRow, ...]:
    """The rows of a JSON-lines file (a run's rows, or its resume file)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return tuple(row_from_dict(json.loads(line), where=str(path)) for line in lines if line.strip())


def carried_rows(resume: Path | None = None) -> tuple[LedgerRow, ...]:
    """The rows a run may carry over: the committed ledger's, and those an earlier failed run kept in `resume`."""
    rows = load_ledger()
    if resume is not None and resume.is_file():
        rows += read_rows(resume)
    return rows


def carried_over_from(rows: tuple[LedgerRow, ...]) -> CarriedOver:
    """carried_over(key, digest, torch): the first of `rows` measured on this very output (digest) and env (key,
    torch), or None; `rows` indexed once, not scanned for every unit."""
    index: dict[tuple, LedgerRow] = {}
    for row in rows:
        index.setdefault((row.key, row.digest, row.torch), row)
    return lambda key, digest, torch: index.get((key, digest, torch))


def carried_group(rows: list[LedgerRow], carried_over: CarriedOver) -> tuple[LedgerRow, ...] | None:
    """The ledger's rows for every one of `rows` (same key, digest and torch), or None where any is missing."""
    kept = [carried_over(row.key, row.digest, row.torch) for row in rows]
    return tuple(kept) if kept and all(kept) else None

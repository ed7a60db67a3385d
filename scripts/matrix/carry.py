"""Rows carried over: a row whose key, output digest and torch equal a row of the committed ledger (or of an earlier
failed run's resume file) is not measured again (`make compat` is incremental; `--all` re-measures)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from converter.advice.ledger import LedgerRow, load_ledger, row_from_dict


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


def unchanged_row(rows: tuple[LedgerRow, ...], key: tuple, digest: str, torch: str) -> LedgerRow | None:
    """The row of `rows` measured on this very output (digest) and env (key, torch), or None."""
    return next((row for row in rows if row.key == key and row.digest == digest and row.torch == torch), None)

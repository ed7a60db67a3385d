"""Recording ledger rows from the engine, install and consumer tests, for `make compat` (scripts/run_ledger.py; the
loader rows it measures itself, scripts/matrix/loader_check.py).

GEMMA4_LEDGER_ROWS=FILE: every checked row whose test passed is appended to FILE (JSON lines of LedgerRow).
GEMMA4_LEDGER_REUSE=1: a row whose key, output digest and environment (vLLM, transformers, torch) equal a row of
the committed ledger is not run again: the test skips, naming the date it was measured, and the row is carried into
FILE as it was (scripts/matrix/rows.py). FILE then holds the whole new ledger.
Neither is set by `make test` (CI's live subset proves the environment works; the ledger proves the rest).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest

from converter.advice.ledger import LedgerRow
from matrix.rows import carried_rows, today, unchanged_row

__all__ = ["record", "recording", "reusing", "skip_if_all_unchanged", "skip_if_unchanged", "today", "unchanged"]

ROWS_VAR = "GEMMA4_LEDGER_ROWS"
REUSE_VAR = "GEMMA4_LEDGER_REUSE"
RESUME_VAR = "GEMMA4_LEDGER_RESUME"  # rows of a failed `make compat` (JSON lines), reused like the ledger


def recording() -> bool:
    return bool(os.environ.get(ROWS_VAR))


def reusing() -> bool:
    return os.environ.get(REUSE_VAR) == "1"


def record(row: LedgerRow) -> None:
    """Appends the row to GEMMA4_LEDGER_ROWS (no-op when unset)."""
    target = os.environ.get(ROWS_VAR)
    if target:
        with Path(target).open("a", encoding="utf-8") as out:
            out.write(json.dumps(asdict(row)) + "\n")


@functools.lru_cache(maxsize=1)
def _reusable() -> tuple[LedgerRow, ...]:
    resume = os.environ.get(RESUME_VAR)
    return carried_rows(Path(resume) if resume else None)


def unchanged(key: tuple, digest: str, torch: str) -> LedgerRow | None:
    """The row for this very output and env in the committed ledger (or the resumed rows of an earlier run whose
    tests passed), when GEMMA4_LEDGER_REUSE=1; else None."""
    return unchanged_row(_reusable(), key, digest, torch) if reusing() else None


def skip_if_unchanged(key: tuple, digest: str, torch: str) -> None:
    """Skips the test when GEMMA4_LEDGER_REUSE=1 and the committed ledger has this row for this very output; the
    row is carried into this run's rows as it was measured."""
    row = unchanged(key, digest, torch)
    if row is not None:
        record(row)
        pytest.skip(f"unchanged since the ledger row measured {row.measured} (same output digest and env)")


def skip_if_all_unchanged(rows: list[LedgerRow]) -> None:
    """Skips the test when GEMMA4_LEDGER_REUSE=1 and the committed ledger (or the resumed rows) hold every one of
    `rows` for the very same output digest and torch; they are carried into this run's rows as they were measured.
    An empty `rows` (nothing recorded) never skips."""
    kept = [unchanged(row.key, row.digest, row.torch) for row in rows]
    if kept and all(kept):
        for row in kept:
            record(row)
        pytest.skip(f"unchanged since the ledger rows measured {min(row.measured for row in kept)}")

"""Recording ledger rows from the loader and engine tests, for `make compat` (scripts/compat.py).

GEMMA4_LEDGER_ROWS=FILE: every checked row is appended to FILE (JSON lines of LedgerRow) whatever its outcome.
GEMMA4_LEDGER_REUSE=1: a row whose key, output digest and environment (vLLM, transformers, torch) equal a row of
the committed ledger is not run again: the test skips, naming the date it was measured, and the row is carried into
FILE as it was. FILE then holds the whole new ledger.
Neither is set by `make test` (CI's live subset proves the environment works; the ledger proves the rest).
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest

from converter.advice.compat import LedgerRow, load_ledger

ROWS_VAR = "GEMMA4_LEDGER_ROWS"
REUSE_VAR = "GEMMA4_LEDGER_REUSE"


def recording() -> bool:
    return bool(os.environ.get(ROWS_VAR))


def today() -> str:
    return datetime.date.today().isoformat()


def record(row: LedgerRow) -> None:
    """Appends the row to GEMMA4_LEDGER_ROWS (no-op when unset)."""
    target = os.environ.get(ROWS_VAR)
    if target:
        with Path(target).open("a", encoding="utf-8") as out:
            out.write(json.dumps(asdict(row)) + "\n")


def unchanged(key: tuple, digest: str, torch: str) -> LedgerRow | None:
    """The committed ledger's row for this very output and env, when GEMMA4_LEDGER_REUSE=1; else None."""
    if os.environ.get(REUSE_VAR) != "1":
        return None
    return next((row for row in load_ledger() if row.key == key and row.digest == digest and row.torch == torch),
                None)


def skip_if_unchanged(key: tuple, digest: str, torch: str) -> None:
    """Skips the test when GEMMA4_LEDGER_REUSE=1 and the committed ledger has this row for this very output; the
    row is carried into this run's rows as it was measured."""
    row = unchanged(key, digest, torch)
    if row is not None:
        record(row)
        pytest.skip(f"unchanged since the ledger row measured {row.measured} (same output digest and env)")

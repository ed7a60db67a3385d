"""Running one unit of a ledger family (scripts/matrix/*_check.py) live in a test: what `make compat` measures into the
ledger, measured the same way by hand or in CI, where its mismatch fails the test in the unit's own words."""

from __future__ import annotations

import pytest

from matrix.rows import Measured, RowMismatch


def measured_live(measure, *args) -> Measured:
    try:
        unit = measure(*args)
    except RowMismatch as mismatch:
        pytest.fail(str(mismatch), pytrace=False)
    assert unit.rows and not unit.carried, unit
    return unit

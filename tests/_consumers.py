"""What the consumer tests (tests/test_consumer_*.py) share: scripts/matrix/consumer_rows.py's pieces, and recording
a consumer run's rows once every one is as expected (tests/_ledger.py)."""

from __future__ import annotations

from converter.advice.ledger import LedgerRow
from matrix.consumer_rows import (AS_RESAVED, CONSUMERS, SAME_TENSORS, draft_distance, engine_case_row,
                                  engine_draft_row, expect_varied, judge_fails_as_original, max_diff, run_check,
                                  surprises, variants, variants_and_digests)

from _ledger import record

__all__ = ["AS_RESAVED", "CONSUMERS", "SAME_TENSORS", "assert_varied", "draft_distance", "engine_case_row",
           "engine_draft_row", "judge_fails_as_original", "max_diff", "record_as_expected", "run_check", "variants",
           "variants_and_digests"]

assert_varied = expect_varied


def record_as_expected(rows: list[LedgerRow]) -> None:
    """Fails the test on a row whose verdict is not its expected one; else records every row (once all held)."""
    unexpected = surprises(rows)
    assert not unexpected, unexpected
    for row in rows:
        record(row)

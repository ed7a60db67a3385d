"""The write engine's thread and memory budget is stated in one place (write/budget.py) and derived from the cores
the process may use; a conversion stays within it."""

from __future__ import annotations

import threading

import pytest

from converter.gemma4 import Role

from converter.pipeline import ConvertRequest, execute, plan_conversion
from converter.read.sequential import BLOCK_BYTES
from converter.write import budget


@pytest.mark.parametrize("cores, shard_threads", [(1, 1), (2, 2), (16, 2)])
def test_the_budget_follows_the_cores(cores, shard_threads):
    b = budget.budget(cores)
    assert (b.cores, b.shard_threads, b.render_threads, b.hash_threads) == (cores, shard_threads, cores, cores)
    assert b.copy_threads == 1 and b.block_writers == budget.WRITERS
    assert b.staged_bytes == budget.STAGED_BLOCKS * BLOCK_BYTES
    assert b.threads == (1 + shard_threads) * (1 + budget.WRITERS) + shard_threads * cores + cores
    assert b.buffer_bytes == ((1 + shard_threads) * b.staged_bytes + shard_threads * budget.RENDER_AHEAD_BYTES
                              + budget.IDLE_RENDER_BYTES)


def test_a_conversion_runs_within_its_thread_budget(pair, tmp_path):
    """Sampled at every progress report, from the writers' own threads: never more threads than the budget's, beside
    the main thread and the one importing torch in the background."""
    seen: list[int] = []
    plan = plan_conversion(ConvertRequest(out=tmp_path / "out", layout="pad-global",
                                          sources={Role.TARGET: pair / "target", Role.ASSISTANT: pair / "assistant"}))
    before = threading.active_count()
    execute(plan, on_bytes=lambda n: seen.append(threading.active_count() - before))
    assert seen and max(seen) <= budget.budget().threads + 1, (max(seen), budget.budget())

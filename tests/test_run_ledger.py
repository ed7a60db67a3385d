"""The ledger runner's pieces (scripts/run_ledger.py, scripts/matrix/loader_check.py), without vLLM: what a run of a
selection keeps, which rows it selects, and that a row the ledger holds for the same output is carried over without
starting a checker."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from converter.advice.ledger import CHECK_ENGINE, CHECK_LOADER, load_ledger
from matrix.cases import LOADER_ROWS
from matrix.envs import VllmEnv
from matrix.loader_check import CasePairs, measure_rows, row_key, select

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_ledger():
    spec = importlib.util.spec_from_file_location("run_ledger", REPO / "scripts" / "run_ledger.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_a_selection_replaces_only_the_groups_it_recorded(run_ledger):
    base = next(row for row in load_ledger() if row.check == CHECK_LOADER and row.tp == 1)
    loader = [replace(base, case="a", vllm="0.27.0"), replace(base, case="a", vllm="0.28.0"),
              replace(base, case="b", vllm="0.27.0")]
    tp = replace(base, case="a", vllm="0.27.0", tp=2)  # a row the run's selection did not record (the TP test)
    engine = replace(base, case="a", vllm="0.27.0", check=CHECK_ENGINE)
    remeasured = replace(loader[0], measured="2099-01-01", transformers="5.99.0")
    rows = run_ledger.merged((*loader, tp, engine), [remeasured],
                             lambda row: row.check == CHECK_LOADER and row.vllm == "0.27.0")
    assert rows == [loader[1], loader[2], tp, engine, remeasured]
    # a row of the selection's group the run did not produce is dropped (its key is gone from the matrix)
    assert loader[0] not in rows


def test_the_loader_rows_of_a_case_and_release():
    rows = select(("31b-mm-2shards",), "0.27.0")
    assert rows and {(row.source, row.vllm) for row in rows} == {("31b-mm-2shards", "0.27.0")}
    assert len(select((), "")) == len(LOADER_ROWS)


def test_a_row_the_ledger_holds_is_carried_over_without_a_checker(loader_case, tmp_path):
    row = next(r for r in LOADER_ROWS if r.ci and r.variant == "per-layer")
    env = VllmEnv(Path("/no/such/python"), "5.14.1", row.vllm, row.package, "2.13.0")
    pairs = CasePairs(tmp_path / "pairs", loader_case)
    held = next(r for r in load_ledger() if r.check == CHECK_LOADER)
    asked = []

    def carried_over(key, digest, torch):
        asked.append((key, digest, torch))
        return held

    [outcome] = measure_rows([row], lambda _row: env, pairs, tmp_path / "work", carried_over=carried_over)
    assert outcome.carried and outcome.rows == (held,) and not outcome.mismatch
    key, digest, torch = asked[0]
    assert key == row_key(row, env, digest) and len(digest) == 64 and torch == "2.13.0"
    assert not (tmp_path / "work").exists()  # no checker batch was written


def test_a_family_that_crashes_fails_the_run_and_keeps_the_rows_measured_before(run_ledger, monkeypatch, tmp_path):
    from matrix import envs
    from matrix.rows import Family, Measured

    monkeypatch.setenv(envs.PYTHONS_VAR, "")  # measure_families sets it; restored after the test
    held = next(r for r in load_ledger() if r.check == CHECK_LOADER)

    def measure(units, work, carried_over):
        yield Measured("first", (held,))
        raise TimeoutError("the consumer ran past its timeout")

    crashing = Family("crashing", CHECK_LOADER, (), lambda cases, vllm: ["first", "second"], measure)
    steady = Family("steady", CHECK_ENGINE, (), lambda cases, vllm: ["only"],
                    lambda units, work, carried_over: iter([Measured("only", (held,))]))
    rows, failed, seconds = run_ledger.measure_families([crashing, steady], [], tmp_path, cases=(), vllm="",
                                                        reuse=False, resume=None)
    assert rows == [held, held] and failed == 1 and set(seconds) == {"crashing", "steady"}


def test_the_docs_a_run_writes_are_those_docs_only_renders(run_ledger, tmp_path):
    """A run's rows come in the order measured; the docs it writes must be the ones `--docs-only` renders from the
    ledger file it wrote (the file's sorted order), or CI's stale-docs check fails on a fresh run."""
    rows = list(load_ledger())
    measured_order = rows[::-1]  # ties in the ledger's sort key (same case, variant, versions) come reversed too
    ledger, doc, readme = tmp_path / "ledger.json", tmp_path / "COMPATIBILITY.md", tmp_path / "README.md"
    readme.write_text((REPO / "README.md").read_text(encoding="utf-8"), encoding="utf-8")
    run_ledger.write_ledger(measured_order, {}, ledger=ledger, doc=doc, readme=readme)
    written = doc.read_text(encoding="utf-8")
    run_ledger.write_docs(list(load_ledger(ledger)), doc=doc, readme=readme)
    assert doc.read_text(encoding="utf-8") == written
    assert written == run_ledger.render_markdown(rows)  # the committed ledger's own rows render the same page

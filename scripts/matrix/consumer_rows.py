"""What the consumer rows share (ledger checks `consumer` and `draft`): the pairs a consumer compares, running its
check program (scripts/consumers/<consumer>/check.py) under the consumer's own interpreter, and the arithmetic of
comparing logits and drafts.

A consumer row is one variant of one engine case in one consumer release: the original (flat keys, what the
consumer reads as published) and both layouts, against the original's results in the same run.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

from converter.advice.ledger import CHECK_CONSUMER, CHECK_DRAFT, FAIL, NOT_RUN, PASS, LedgerRow
from matrix.digest import pair_digest
from matrix.cases import DRAFT_CONTROLS, ENGINE_SOURCES, ORIGINAL, BuiltOnce, EnginePair
from matrix.envs import MissingEnv
from matrix.rows import CarriedOver, Family, Measured, RowMismatch, carried_group, expect, today

CONSUMERS = Path(__file__).resolve().parents[1] / "consumers"
CHECK_TIMEOUT_S = 1800


def variants(pair: EnginePair) -> dict[str, Path]:
    """original (the reference: flat keys, what the consumer reads as published) and both layouts."""
    return {ORIGINAL: pair.reference, **{layout: pair.converted[layout][0] for layout in ("per-layer", "pad-global")}}


AS_RESAVED = "as-resaved"  # the converter's input as transformers >= 5.15 writes it: checked, not a ledger row


def variants_and_digests(pair: EnginePair) -> tuple[dict[str, Path], dict[str, str]]:
    """variants(pair), plus AS_RESAVED where the case's input is the per_layer_config twin of its reference; and the
    pair digest of every variant that is a row."""
    pairs = variants(pair)
    if pair.original != pair.reference:
        pairs[AS_RESAVED] = pair.original
    return pairs, {v: pair_digest(p / "target", p / "assistant") for v, p in pairs.items() if v != AS_RESAVED}


def engine_case_row(consumer: str, version: str, transformers: str, name: str, variant: str, digest: str,
                    verdict: str = PASS, detail: str = "", figures: dict | None = None) -> LedgerRow:
    """A consumer row on an engine case, the consumer's env being no vLLM env (its transformers named by hand)."""
    return LedgerRow(case=name, form=ENGINE_SOURCES[name].form, layout=variant, vllm="", transformers=transformers,
                     torch="", torch_pin=True, check=CHECK_CONSUMER, verdict=verdict, expected=PASS, digest=digest,
                     measured=today(), vllm_package="", detail=detail, figures=figures or {}, consumer=consumer,
                     consumer_version=version)


def engine_draft_row(consumer: str, version: str, transformers: str, name: str, variant: str, digest: str,
                     verdict: str, detail: str, figures: dict, expected: str | None = None) -> LedgerRow:
    """A drafting row (ledger check `draft`) on an engine case: expected to pass, a negative control to fail."""
    row = engine_case_row(consumer, version, transformers, name, variant, digest, verdict, detail, figures)
    return replace(row, check=CHECK_DRAFT, expected=expected or (FAIL if variant in DRAFT_CONTROLS else PASS))


def draft_distance(mine: list, theirs: list) -> tuple[int, float]:
    """Two runs' draft candidates, each [round or step, index, token, probability]: (candidates whose first three
    differ, or that one side lacks; the largest probability difference of the candidates alike)."""
    differ = sum(a[:3] != b[:3] for a, b in zip(mine, theirs)) + abs(len(mine) - len(theirs))
    prob = max((abs(a[3] - b[3]) for a, b in zip(mine, theirs) if a[:3] == b[:3]), default=0.0)
    return differ, prob


SAME_TENSORS = (ORIGINAL, "per-layer")  # every tensor the original's: its drafts must be the original's exactly


def judge_fails_as_original(errors: dict[str, str | None], original: dict[str, str], why: str
                            ) -> tuple[str, str, dict]:
    """A pair the consumer cannot run, the original alike: each attempt's error ({attempt: error}) must be the
    original's; one that fails otherwise, or not at all, fails the row. Else `not run`, with the original's errors."""
    differ = [a for a in original if errors.get(a) != original[a]]
    if differ:
        return FAIL, "; ".join(f"{a}: the original fails with {original[a]}, this pair "
                               f"{errors.get(a) or 'does not'}" for a in differ), {}
    return NOT_RUN, f"{why}, the original alike: " + "; ".join(f"{a}: {e}" for a, e in original.items()), {}


def surprises(rows: list[LedgerRow]) -> str:
    """The rows whose verdict is not their expected one, one line each ("" when every row is as expected)."""
    return "\n".join(f"{r.layout}: {r.verdict} (expected {r.expected}) {r.detail}" for r in rows
                     if r.verdict != r.expected)


def as_expected(unit: str, rows: list[LedgerRow]) -> Measured:
    """The unit's rows, or RowMismatch naming every row whose verdict is not its expected one (the unit's rows are
    judged together: one surprise and none is recorded)."""
    unexpected = surprises(rows)
    expect(not unexpected, unexpected)
    return Measured(unit, tuple(rows))


def carried_or_report(unit: str, rows: list[LedgerRow], carried_over: CarriedOver, python: Callable[[], Path],
                      consumer: str, reference: Path, pairs: dict[str, Path], work: Path, program: str = "check.py"
                      ) -> tuple[Measured | None, dict]:
    """(the unit carried over, {}) where the ledger holds every one of `rows` for these very outputs; else (None, the
    report of the consumer's `program` run under python(), its env built only now)."""
    kept = carried_group(rows, carried_over)
    if kept is not None:
        return Measured(unit, kept, carried=True), {}
    work.mkdir(parents=True, exist_ok=True)
    return None, run_check(python(), consumer, reference, pairs, work / "report.json", program)


def run_check(python: Path, consumer: str, reference: Path, pairs: dict[str, Path], out: Path,
              program: str = "check.py") -> dict:
    """The JSON report of scripts/consumers/<consumer>/<program> run under `python` on the reference and `pairs`."""
    proc = subprocess.run([str(python), str(CONSUMERS / consumer / program), "--reference", str(reference),
                           *[f"--pair={name}={path}" for name, path in pairs.items()], "--json", str(out)],
                          capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    expect(proc.returncode == 0 and out.exists(), proc.stderr[-3000:])
    return json.loads(out.read_text())


def max_diff(a: list | None, b: list | None) -> float | None:
    """max |a - b| over two logits matrices (None when either is missing)."""
    if a is None or b is None:
        return None
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


def expect_varied(tokens: list[int]) -> None:
    """The reference's new tokens are not one token repeated: a comparison of degenerate outputs proves little."""
    new = tokens[-8:]
    expect(len(set(new)) > len(new) // 2, f"degenerate reference output {tokens}")


def consumer_family(name: str, check: str, test: str, units: list[tuple], build_case: Callable[[str, Path], Any],
                    measure_unit: Callable[..., Measured]) -> Family:
    """A family of consumer units, each a tuple whose first item is its case: measure_unit(*unit, built case, work,
    carried_over). A --case selection keeps the units of its cases; a --vllm one none (the rows name no vLLM)."""
    def select(cases: tuple[str, ...], vllm: str) -> list[tuple]:
        return [] if vllm else [unit for unit in units if not cases or unit[0] in cases]

    def measure(selected: list[tuple], work: Path, carried_over: CarriedOver) -> Iterator[Measured]:
        built = BuiltOnce(build_case, work / "cases")
        for index, unit in enumerate(selected):
            try:
                yield measure_unit(*unit, built(unit[0]), work / f"unit-{index}", carried_over)
            except (RowMismatch, MissingEnv, RuntimeError) as mismatch:  # RuntimeError: its env failed to build
                yield Measured("-".join(unit), mismatch=str(mismatch))
    return Family(name, check, (test,), select, measure)

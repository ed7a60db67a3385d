"""Writing the ledger (scripts/run_ledger.py) and checking it still describes what the converter writes
(tests/test_ledger.py): the proof's side of converter/advice/ledger.json, which the product only reads
(converter/advice/ledger.py load_ledger)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Iterable, Mapping

from converter.advice.ledger import CHECK_INSTALL, CHECK_LOADER, INSTALL_LAYOUT, LEDGER_VERSION, LedgerRow, version_key


def sorted_rows(rows: Iterable[LedgerRow]) -> list[LedgerRow]:
    """Rows in the ledger's order: check, case, variant, release, transformers, TP, dtype, consumer, form (every
    field of a row's key, so the order does not depend on the order the rows were measured in)."""
    return sorted(rows, key=lambda r: (r.check, r.case, r.variant, version_key(r.vllm), version_key(r.transformers),
                                       r.tp, r.dtype, r.consumer, r.form))


def ledger_document(rows: Iterable[LedgerRow], releases: dict[str, str] | None = None) -> dict[str, Any]:
    """The JSON document of a ledger, rows in sorted_rows order; `releases`: vLLM release -> the transformers
    specifier its own wheel requires (what the matrix measured it under lies inside it)."""
    document: dict[str, Any] = {"version": LEDGER_VERSION, "rows": [asdict(r) for r in sorted_rows(rows)]}
    if releases:
        document["releases"] = {vllm: {"transformers": spec} for vllm, spec in sorted(
            releases.items(), key=lambda item: version_key(item[0]))}
    return document


# consumers whose rows check the loader cases (loading only, no forward: SGLang on CPU); the other consumers' rows
# and the engine rows check the engine cases (varied greedy output)
LOADER_CASE_CONSUMERS = ("sglang",)


def checks_loader_cases(row: LedgerRow) -> bool:
    """Whether `row.case` names a loader case (cases.SOURCES) rather than an engine case (cases.ENGINE_SOURCES)."""
    return row.check in (CHECK_LOADER, CHECK_INSTALL) or row.consumer in LOADER_CASE_CONSUMERS


def stale_rows(rows: Iterable[LedgerRow], digests: Mapping[tuple[str, str], str]) -> list[str]:
    """One message per (case, variant) whose ledger digest differs from the digest of a fresh conversion.

    digests: (case, variant) -> pair digest of the output built now; a ledger case absent from it is stale too.
    """
    problems = []
    seen: set[tuple[str, str, str]] = set()
    for row in rows:
        mark = (row.case, row.variant, row.check, row.consumer)
        if mark in seen:
            continue
        now = digests.get((row.case if checks_loader_cases(row) else f"engine:{row.case}", row.variant))
        if now != row.digest:
            seen.add(mark)
            what = {"original": "source", INSTALL_LAYOUT: "runtime requirements"}.get(row.layout, "output")
            problems.append(f"stale proof: the {row.variant} {what} of {row.check} case {row.case} "
                            f"{'is no longer built' if now is None else 'changed'} since the ledger was written "
                            f"(ledger {row.digest[:12]}, now {now[:12] if now else '-'}); run make compat")
    return problems

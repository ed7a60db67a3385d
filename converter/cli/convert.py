"""`gemma4-convert convert`: plan, show the cost, stream the conversion with a progress bar, print the serve line."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any, Mapping

import click

from ..advice.serving import MEASURED
from ..cost import human_bytes
from ..errors import UsageError
from ..gemma4 import PER_LAYER_TRANSFORMERS, Role
from ..layouts.base import layout_offering
from ..pipeline import (MADE_WRITTEN, ConversionPlan, ConvertRequest, ConvertResult, PreparedConversion, convert,
                        serve_command)
from ..plan import parse_size
from ..write.placement import LINK_MEANING, LINK_MODES
from ._common import PATH, LayoutChoice, hub_api_for, kv_cost_lines, say_offline_once, serving_env, serving_options


FLAT_KEYS_ONLY = ("keys", "flat")  # the layout option --flat-keys-only sets


def _size(ctx, param, value):
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


@click.command("convert")
@click.argument("src", metavar="[SRC]", required=False)
@click.option("--target", metavar="PATH|REPO[@REV]", help="Gemma 4 target checkpoint directory or Hub repo OWNER/NAME[@REV] "
              "(written to OUT/target).")
@click.option("--assistant", metavar="PATH|REPO[@REV]", help="MTP assistant checkpoint directory or Hub repo OWNER/NAME[@REV] "
              "(written to OUT/assistant). A Hub target without it gets OWNER/NAME-assistant.")
@click.option("--target-only", is_flag=True, help="Convert a Hub target alone: do not look for its assistant.")
@click.option("--out", "out", type=PATH, required=True, help="Output directory (must not exist unless --force).")
@click.option("--layout", type=LayoutChoice(), default=None,
              help="per-layer: tensors and KV cache unchanged, config keys only (any transformers 5.x). "
                   "pad-global: homogeneous geometry by exact padding (costs KV cache and weights). "
                   "Default: the compatibility ledger's choice for --serving / --serving-python, else per-layer.")
@serving_options
@click.option("--flat-keys-only", is_flag=True,
              help=f"per-layer only: write the bare flat keys without the dual keys (serves with "
                   f"transformers<{PER_LAYER_TRANSFORMERS} "
                   "only; the default serves with any transformers 5.x).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists (only after the new output is complete).")
@click.option("--link", type=click.Choice(LINK_MODES), default="auto", show_default=True,
              help="How files the layout leaves unchanged get into OUT: auto = reflink (copy-on-write clone) where "
                   "the filesystem can, else copy; hardlink / symlink share the source's files (see the note "
                   "convert prints).")
@click.option("--hash/--no-hash", "hashed", default=True, show_default=True,
              help="sha256 every file read or written, recorded in conversion.json. --no-hash leaves them null and "
                   "saves one CPU pass over the bytes (verify compares the bytes themselves either way).")
@click.option("--dry-run", is_flag=True, help="Print the plan and the cost; write nothing.")
@click.option("--tp", type=click.IntRange(min=1), default=None, metavar="N",
              help="The tensor-parallel size you serve with: a size vLLM refuses for the output's geometry stops "
                   "the conversion (exit 3); the serve line and the cards name --tensor-parallel-size N.")
@click.option("--any-name", is_flag=True,
              help="Write OUT even where vLLM 0.33 and older would take the assistant's path for another speculative "
                   "method's draft (it holds eagle-, eagle3, dflash or dspark): a warning instead of a refusal.")
@click.option("--dequantize-assistant", is_flag=True,
              help="Write a quantized assistant (compressed-tensors) in its unquantized dtype: each weight its codes "
                   "times its scales, as compressed-tensors decompresses it, and no quantization_config. Stock vLLM "
                   "does not load the quantized assistants published beside bf16 targets (docs/QUANTIZED.md).")
@click.option("--max-shard-size", callback=_size, default=None, metavar="SIZE",
              help="Re-shard output by a byte budget, decimal units (e.g. 5GB). Default: mirror the source shards.")
@click.pass_context
def command(ctx: click.Context, src: str | None, target: str | None, assistant: str | None, target_only: bool,
            out: Path, layout: str | None, serving_python: Path | None, serving_spec: str | None,
            flat_keys_only: bool, force: bool, link: str, hashed: bool, dry_run: bool,
            max_shard_size: int | None, tp: int | None, any_name: bool, dequantize_assistant: bool) -> None:
    """Convert a target and its assistant (or one checkpoint SRC) into OUT.

    \b
    SRC, --target and --assistant are directories or Hub repo ids OWNER/NAME[@REVISION]. A Hub target given
    alone brings its assistant OWNER/NAME-assistant. Hub weights are downloaded only once the plan is made and
    OUT is locked; --dry-run reads their headers only. Options, JSON files and exit codes: docs/CLI.md.
    Examples:
      gemma4-convert convert google/gemma-4-31B-it --out DST
      gemma4-convert convert --target T --assistant A --out DST --serving vllm==0.22.1
    """
    flat_layout = layout_offering(*FLAT_KEYS_ONLY)
    if flat_keys_only and layout not in (None, flat_layout):
        raise UsageError(f"--flat-keys-only applies to --layout {flat_layout} only")
    if target_only and assistant:
        raise UsageError("give --assistant or --target-only, not both")
    sources = {role: text for role, text in ((Role.SINGLE, src), (Role.TARGET, target), (Role.ASSISTANT, assistant))
               if text}
    request = ConvertRequest(
        out=out, sources=sources, layout=flat_layout if flat_keys_only and layout is None else layout,
        layout_options=dict([FLAT_KEYS_ONLY]) if flat_keys_only else {},
        serving=serving_env(serving_python, serving_spec), target_only=target_only, force=force,
        max_shard_bytes=max_shard_size, link=link, hashed=hashed, tp=tp,
        dry_run=dry_run, any_name=any_name, dequantize_assistant=dequantize_assistant)
    with ExitStack() as stack:
        progress: list[Any] = []

        def prepared(ready: PreparedConversion) -> None:
            _print_prepared(ready)
            if not dry_run:
                from tqdm import tqdm  # ~0.1 s: imported by the runs that show progress, not by --help

                progress.append(stack.enter_context(tqdm(
                    total=ready.plan.source_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="converting",
                    disable=None, leave=False)))

        ready, result = convert(request, api=hub_api_for(ctx, sources.values()), on_prepared=prepared,
                                on_bytes=lambda n: progress[0].update(n))
    if any(source.hub_unreachable for source in ready.sources):
        say_offline_once()
    if ready.plan is None:
        _print_serves_as_it_is(ready)
        return
    if result is None:
        click.echo("dry run: nothing written")
        return
    click.echo(f"wrote {out} ({human_bytes(ready.plan.output_bytes)} of tensors{_made_summary(result)})")
    refusal = ready.assistant_refusal
    if refusal:  # a line that cannot serve is not printed
        click.echo(f"no serve line: {refusal}; convert with --dequantize-assistant, or serve the bf16 assistant "
                   "beside the target instead")
        return
    if ready.request.serving is not None and ready.decision is not None and ready.decision.layout is None:
        click.echo(f"no serve line: {ready.decision.why}")  # nothing measured or predicted serves there
        return
    click.echo(_serve_heading(ready))
    if flat_keys_only:
        click.echo(f"  (--flat-keys-only needs transformers<{PER_LAYER_TRANSFORMERS} where vLLM runs: pip install "
                   f"'transformers<{PER_LAYER_TRANSFORMERS}')")
    click.echo(f"  {serve_command(ready.plan)}")



def _serve_heading(ready: PreparedConversion) -> str:
    """"serve it with stock vLLM X:" only where the ledger has rows of X; a prediction says so and how to check."""
    decision, serving = ready.decision, ready.request.serving
    if serving is None:
        return "serve it with stock vLLM:"
    if decision is not None and decision.tested and decision.basis == MEASURED:
        return f"serve it with stock {serving.label()}:"
    return (f"serve it with stock {serving.label()} (predicted, no ledger row of that release; check the output "
            f"there first: make vllm-check TARGET=... ASSISTANT=...):")


def _print_serves_as_it_is(ready: PreparedConversion) -> None:
    """No work for nothing: the verdict, and the serve line for the sources themselves."""
    decision, serving = ready.decision, ready.request.serving
    basis = "measured" if decision.basis == MEASURED else "predicted from the rules, not measured"
    click.echo(f"{serving.introduced()}: the source serves as it is ({basis}); nothing to convert, nothing written "
               "(--layout LAYOUT converts anyway)")
    if ready.paired_assistant:
        repo_id, target = ready.paired_assistant
        click.echo(f"assistant: {repo_id} (published beside {target})")
    refusal = ready.assistant_refusal
    if refusal:
        click.echo(f"no serve line: {refusal}; convert with --dequantize-assistant, or serve the bf16 assistant "
                   "beside the target instead")
        return
    if decision.tested and decision.basis == MEASURED:
        click.echo(f"serve it as it is with stock {serving.label()}:")
    else:
        click.echo(f"serve it as it is (predicted for {serving.label()}, no ledger row of that release; check it there "
                   "first: make vllm-check TARGET=... ASSISTANT=...):")
    click.echo(f"  {ready.source_serve_line}")


def _print_prepared(ready: PreparedConversion) -> None:
    """What was settled before writing: the paired assistant, the decision, the plan and its cost, the notes."""
    if ready.paired_assistant:
        repo_id, target = ready.paired_assistant
        click.echo(f"assistant: {repo_id} (published beside {target}; --assistant names another, --target-only "
                   "converts the target alone)")
    decision, request = ready.decision, ready.request
    if decision is not None:
        if request.layout is None:
            found = f" [{request.serving.introduced()}; --serving names another]" if request.serving and \
                request.serving.beside_tool else ""
            click.echo(f"chosen: --layout {decision.writes_why}{found}")
        elif request.serving is not None and decision.writes != request.layout:
            chooses = "the ledger chooses " if decision.tested and decision.basis == MEASURED else ""  # else it says
            click.echo(f"note: for {request.serving.label()} {chooses}{decision.writes_why}")  # "predicted" itself
        if decision.serves_as_is:
            click.echo(f"note: {decision.serves_as_is}; converting anyway")
    _print_plan(ready.plan, dry_run=request.dry_run, names=ready.names)
    for note in ready.notes:
        click.echo(f"note: {note}")
    if request.link in LINK_MEANING:
        click.echo(f"NOTE: --link {request.link}: {LINK_MEANING[request.link]}", err=True)


def _made_summary(result: ConvertResult) -> str:
    """', unchanged files: 3 reflink, 2 copy' from the manifests just written."""
    counts: dict[str, int] = {}
    for how in result.made.values():
        counts[how] = counts.get(how, 0) + 1
    counts.pop(MADE_WRITTEN, None)
    return ("; unchanged files: " + ", ".join(f"{n} {how}" for how, n in sorted(counts.items()))) if counts else ""


def _print_plan(plan: ConversionPlan, *, dry_run: bool, names: Mapping[Role, str]) -> None:
    layout = plan.layout
    click.echo(f"layout {layout.name}: {layout.summary}")
    for item in plan.items:
        destination = plan.output_dir(item)
        actions: dict[str, int] = {}
        for tensor in item.plan.tensors:
            actions[tensor.action] = actions.get(tensor.action, 0) + 1
        summary = ", ".join(f"{n} {a}" for a, n in sorted(actions.items()))
        growth = item.plan.total_size - item.plan.source_bytes
        params = item.parameters_added
        click.echo(f"  {names.get(item.role, item.source.path)} ({item.source.spec.kind}) -> {destination}")
        click.echo(f"    {len(item.plan.shards)} shard(s); tensors: {summary}")
        click.echo(f"    weights {human_bytes(item.plan.source_bytes)} -> {human_bytes(item.plan.total_size)} "
                   f"({growth / max(item.plan.source_bytes, 1):+.1%}, {params / 1e6:+,.1f} M parameters)")
        if dry_run:
            for shard in item.plan.shards:
                click.echo(f"    {shard.file_name}: {len(shard.tensors)} tensors, {human_bytes(shard.nbytes)}")
    if plan.item(Role.TARGET) is not None:
        costs = plan.kv_costs()
        free = all(c.after == c.before for c in costs) and all(
            i.plan.total_size == i.plan.source_bytes for i in plan.items)
        click.echo(f"  cost of {layout.name} for serving:"
                   + (" none - KV cache and weights unchanged (zero cost)" if free else ""))
        for line in kv_cost_lines(costs):
            click.echo("  " + line)
    for warning in plan.warnings:
        click.echo(f"WARNING: {warning}", err=True)


__all__ = ["command", "UsageError"]

"""`gemma4-convert convert`: plan, show the cost, stream the conversion with a progress bar, print the serve line."""

from __future__ import annotations

from pathlib import Path

import click

from ..advice.serving import ServingEnv, decide, serving_notes, shape_of
from ..cost import human_bytes
from ..errors import UsageError
from ..gemma4 import ROLE_TARGET
from ..hub.download import LocalSource, Purpose, open_checkpoint, parse_repo_ref, published_assistant
from ..layouts import get_layout
from ..layouts.base import layout_offering
from ..validate.attention import has_fused_qkv
from ..pipeline import (MADE_WRITTEN, ConversionPlan, ConvertRequest, ConvertResult, execute, plan_conversion,
                        serve_command)
from ..plan import parse_size
from ..write.lock import output_lock
from ..write.writer import LINK_MEANING, LINK_MODES
from ._common import PATH, LayoutChoice, hub_api, kv_cost_lines, resolve_cli_source, serving_env, serving_options


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
              help="per-layer only: write the bare flat keys without the dual keys (serves with transformers<5.15 "
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
@click.option("--max-shard-size", callback=_size, default=None, metavar="SIZE",
              help="Re-shard output by a byte budget, decimal units (e.g. 5GB). Default: mirror the source shards.")
@click.pass_context
def command(ctx: click.Context, src: str | None, target: str | None, assistant: str | None, target_only: bool,
            out: Path, layout: str | None, serving_python: Path | None, serving_spec: str | None,
            flat_keys_only: bool, force: bool, link: str, hashed: bool, dry_run: bool,
            max_shard_size: int | None, tp: int | None) -> None:
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
    env = serving_env(serving_python, serving_spec)
    texts = {role: text for role, text in (("single", src), ("target", target), ("assistant", assistant)) if text}
    sources = _resolve(ctx, texts, purpose="headers")
    if not target_only:
        texts, sources = _with_published_assistant(ctx, texts, sources)
    layout = _decide_layout(sources, layout=flat_layout if flat_keys_only and layout is None else layout, env=env)
    options = dict(out=out, layout=layout, layout_options=dict([FLAT_KEYS_ONLY]) if flat_keys_only else {}, force=force,
                   max_shard_bytes=max_shard_size, link=link, hashed=hashed, tp=tp)
    plan = plan_conversion(_request(sources, **options))
    _print_plan(plan, dry_run=dry_run, env=env)
    if link in LINK_MEANING:
        click.echo(f"NOTE: --link {link}: {LINK_MEANING[link]}", err=True)
    if dry_run:
        click.echo("dry run: nothing written")
        return
    from tqdm import tqdm  # ~0.1 s: imported by the runs that show progress, not by --help

    with output_lock(out):  # before any download: a second run into OUT stops here, not after fetching weights
        if any(source.remote_shards is not None for source in sources.values()):
            sources = _resolve(ctx, texts, purpose="full")  # the weights, at the commit already resolved
            plan = plan_conversion(_request(sources, **options))
        with tqdm(total=plan.source_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="converting",
                  disable=None, leave=False) as bar:
            result = execute(plan, on_bytes=bar.update)
    click.echo(f"wrote {out} ({human_bytes(plan.output_bytes)} of tensors{_made_summary(result)})")
    for warning in plan.warnings:
        click.echo(f"WARNING: {warning}", err=True)
    click.echo(f"serve it with stock {env.label() if env else 'vLLM'}:")
    if flat_keys_only:
        click.echo("  (--flat-keys-only needs transformers<5.15 where vLLM runs: pip install 'transformers<5.15')")
    click.echo(f"  {serve_command(plan)}")


def _with_published_assistant(ctx: click.Context, texts: dict[str, str], sources: dict[str, LocalSource]
                              ) -> tuple[dict[str, str], dict[str, LocalSource]]:
    """A Hub target given without --assistant becomes a pair with OWNER/NAME-assistant (said in one line); local
    directories and an assistant given alone are left as they are."""
    role = "single" if "single" in texts else "target"
    ref = parse_repo_ref(texts.get(role, ""))
    if ref is None or "assistant" in texts or open_checkpoint(sources[role]).spec.role != ROLE_TARGET:
        return texts, sources
    repo_id, found = published_assistant(ref, api=hub_api(ctx))
    click.echo(f"assistant: {repo_id} (published beside {ref.repo_id}; --assistant names another, --target-only "
               "converts the target alone)")
    rest = {k: v for k, v in texts.items() if k != role}
    return ({**rest, "target": texts[role], "assistant": repo_id},
            {**{k: v for k, v in sources.items() if k != role}, "target": sources[role], "assistant": found})


def _decide_layout(sources: dict[str, LocalSource], *, layout: str | None, env: ServingEnv | None) -> str:
    """--layout when given, else advice's decision for the serving environment (one line says which and why);
    with both, a note where the decision would be another layout."""
    if layout is not None and env is None:
        return layout
    role = next(r for r in ("target", "single", "assistant") if r in sources)
    checkpoint = open_checkpoint(sources[role])
    decision = decide(shape_of(checkpoint.spec, fused=has_fused_qkv(checkpoint)), env)
    if layout is None:
        click.echo(f"chosen: --layout {decision.writes_why}")
    elif env is not None and decision.writes != layout:
        click.echo(f"note: for {env.label()} the ledger chooses {decision.writes_why}")
    if decision.serves_as_is:
        click.echo(f"note: {decision.serves_as_is}; converting anyway")
    return layout or decision.writes


def _made_summary(result: ConvertResult) -> str:
    """', unchanged files: 3 reflink, 2 copy' from the manifests just written."""
    counts: dict[str, int] = {}
    for how in result.made.values():
        counts[how] = counts.get(how, 0) + 1
    counts.pop(MADE_WRITTEN, None)
    return ("; unchanged files: " + ", ".join(f"{n} {how}" for how, n in sorted(counts.items()))) if counts else ""


def _resolve(ctx: click.Context, texts: dict[str, str], *, purpose: Purpose) -> dict[str, LocalSource]:
    """Each source text as a LocalSource; a Hub repo pinned to one commit (hub.resolve_source)."""
    return {role: resolve_cli_source(text, purpose=purpose, ctx=ctx) for role, text in texts.items()}


def _request(sources: dict[str, LocalSource], **options) -> ConvertRequest:
    single, target, assistant = (sources.get(role) for role in ("single", "target", "assistant"))
    return ConvertRequest(target=target and target.path, assistant=assistant and assistant.path,
                          single=single and single.path, **options,
                          origins={role: s.origin() for role, s in sources.items() if s.origin()},
                          opened={s.path: open_checkpoint(s) for s in sources.values() if s.remote_shards is not None})


def _print_plan(plan: ConversionPlan, *, dry_run: bool, env: ServingEnv | None) -> None:
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
        costs = plan.kv_costs()
        free = all(c.after == c.before for c in costs) and all(
            i.plan.total_size == i.plan.source_bytes for i in plan.items)
        click.echo(f"  cost of {layout.name} for serving:"
                   + (" none - KV cache and weights unchanged (zero cost)" if free else ""))
        for line in kv_cost_lines(costs):
            click.echo("  " + line)
    for warning in plan.warnings:
        click.echo(f"WARNING: {warning}", err=True)
    if env is None:  # with env, _decide_layout said it for that env
        sources = [(str(i.source.path), shape_of(i.source.spec, fused=any(t.action.startswith("split")
                                                                         for t in i.plan.tensors)))
                   for i in plan.items]
        for note in serving_notes(sources, plan.request.layout):
            click.echo(f"note: {note}")


__all__ = ["command", "UsageError"]

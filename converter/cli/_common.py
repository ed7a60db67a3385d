"""Option types and renderers shared by the verbs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ..cost import KvCost, human_bytes
from ..hub.download import LocalSource, Purpose, make_api, parse_repo_ref, resolve_source

PATH = click.Path(path_type=Path, file_okay=True, dir_okay=True)


def hub_api(ctx: click.Context | None) -> Any:
    """The HfApi of this invocation: `obj={"hf_api": fake}` when tests inject one, else a real client."""
    obj = ctx.find_root().obj if ctx is not None else None
    return obj["hf_api"] if isinstance(obj, dict) and obj.get("hf_api") is not None else make_api()


def resolve_cli_source(text: str, *, purpose: Purpose, ctx: click.Context | None) -> LocalSource:
    """resolve_source with this invocation's HfApi; a local path needs none (and never imports huggingface_hub)."""
    return resolve_source(text, purpose=purpose, api=hub_api(ctx) if parse_repo_ref(text) is not None else None)


class SourceType(click.ParamType):
    """A local checkpoint path or a Hub repo id `owner/name[@revision]`, resolved to a LocalSource (docs/HUB.md)."""

    name = "PATH|REPO[@REV]"

    def __init__(self, purpose: Purpose) -> None:
        self.purpose = purpose

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> LocalSource:
        if isinstance(value, LocalSource):
            return value
        return resolve_cli_source(str(value), purpose=self.purpose, ctx=ctx)


SOURCE = SourceType("full")  # config, weights and side files
SOURCE_HEADERS = SourceType("headers")  # config and shard headers only: inspect, check-pair


def echo_json(document: Any) -> None:
    click.echo(json.dumps(document, indent=2, sort_keys=False))


def kv_cost_lines(costs: tuple[KvCost, ...]) -> list[str]:
    if costs and costs[0].ratio is None:
        return ["  KV cache: none of its own (every layer reads the target's cache)"]
    lines = []
    for cost in costs:
        label = "every layer holds the full context" if cost.context is None else \
            f"sliding layers keep their window, {cost.context // 1024}k context"
        lines.append(f"  KV cache per token ({label}): {human_bytes(cost.before)} -> {human_bytes(cost.after)} "
                     f"(x{cost.ratio:.2f})")
    return lines

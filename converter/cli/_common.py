"""Option types and renderers shared by the verbs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ..cost import KvCost, human_bytes

PATH = click.Path(path_type=Path, file_okay=True, dir_okay=True)


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

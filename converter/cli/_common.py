"""Option types and renderers shared by the verbs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ..advice.serving import ServingEnv, parse_serving, read_serving_env, serving_env_beside_tool
from ..cost import KvCost, human_bytes
from ..errors import UsageError
from ..layouts import layout_names
from ..hub.download import OFFLINE_NOTE, LocalSource, Purpose, make_api, parse_repo_ref, resolve_source

PATH = click.Path(path_type=Path, file_okay=True, dir_okay=True)


class LayoutChoice(click.Choice):
    """The registered layouts' names (plus `extra`), read each time click checks or shows them: the registry is the
    one list, and a layout registered after this module was imported is a choice too."""

    def __init__(self, extra: tuple[str, ...] = ()) -> None:
        self._extra = extra
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:
        return (*self._extra, *layout_names())

    @choices.setter
    def choices(self, _: Any) -> None:  # click.Choice.__init__ assigns its own tuple
        pass


def hub_api(ctx: click.Context | None) -> Any:
    """The HfApi of this invocation: `obj={"hf_api": fake}` when tests inject one, else a real client."""
    obj = ctx.find_root().obj if ctx is not None else None
    return obj["hf_api"] if isinstance(obj, dict) and obj.get("hf_api") is not None else make_api()


def hub_api_for(ctx: click.Context | None, texts: Any) -> Any:
    """hub_api(ctx) where one of the source texts is a Hub repo, else None: converting local directories never
    imports huggingface_hub."""
    return hub_api(ctx) if any(parse_repo_ref(text) is not None for text in texts) else None


def resolve_cli_source(text: str, *, purpose: Purpose, ctx: click.Context | None) -> LocalSource:
    """resolve_source with this invocation's HfApi; a local path needs none (and never imports huggingface_hub).
    A source read from the cache alone because the Hub did not answer says so once."""
    source = resolve_source(text, purpose=purpose, api=hub_api_for(ctx, [text]))
    if source.hub_unreachable:
        say_offline_once()
    return source


_said: set[str] = set()


def say_offline_once() -> None:
    if OFFLINE_NOTE not in _said:
        _said.add(OFFLINE_NOTE)
        click.echo(OFFLINE_NOTE, err=True)


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


def serving_options(command: Any) -> Any:
    """--serving-python / --serving, as inspect and convert both take them (serving_env turns them into one)."""
    command = click.option(
        "--serving", "serving_spec", default=None, metavar="vllm==X[,transformers==Y]",
        help="Declare the serving environment without having it installed (convert on one machine, serve on "
             "another): the answer is what the compatibility ledger measured for that vLLM release (and "
             "transformers; without it, every transformers the release was measured with).")(command)
    return click.option(
        "--serving-python", type=PATH, default=None, metavar="PYTHON",
        help="The python of the environment vLLM serves from: its vLLM and transformers versions are read "
             "(nothing is imported) and the answer is for exactly that environment.")(command)


def serving_env(serving_python: Path | None, serving_spec: str | None) -> ServingEnv | None:
    """The environment --serving-python or --serving names, else the vLLM installed beside this tool, else None.

    Raises:
        UsageError: both given; a spec of another form; a python without vllm or transformers.
    """
    if serving_python is not None and serving_spec is not None:
        raise UsageError("give --serving-python or --serving, not both")
    if serving_python is not None:
        return read_serving_env(serving_python)
    return parse_serving(serving_spec) if serving_spec is not None else serving_env_beside_tool()


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

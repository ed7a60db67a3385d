"""Shared fixtures: seeded tiny synthetic checkpoints with real Gemma 4 ratios, a CLI runner, the litter check.

Fixtures only: helpers the tests call live in tests/_*.py modules (tests never import this file)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from converter.cli import main
from matrix.synthetic import tiny_preset, write_checkpoint, write_pair

from _checkout import checkout_changes

# fixtures shared by a family of test files, kept beside the fakes they serve: offline_hub, sources, converted
pytest_plugins = ("_hub_fakes",)


@dataclass(frozen=True)
class CliResult:
    code: int
    out: str
    err: str


@pytest.fixture
def run_cli(capsys):
    """Runs `gemma4-convert ARGS` in-process through main() (the real exit-code mapping)."""
    def run(*args: str) -> CliResult:
        capsys.readouterr()
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        captured = capsys.readouterr()
        return CliResult(code=code, out=captured.out, err=captured.err)
    return run


@pytest.fixture(scope="session")
def synthetic_cache(tmp_path_factory):
    """Builds each synthetic checkpoint once per session; tests copy what they modify."""
    root = tmp_path_factory.mktemp("synthetic")
    built: dict[tuple, Path] = {}

    def get(preset: str = "31b", role: str = "pair", **options) -> Path:
        key = (preset, role, tuple(sorted(options.items())))
        if key not in built:
            path = root / f"{preset}-{role}-{len(built)}"
            if role == "pair":
                write_pair(path, preset=tiny_preset(preset), **options)
            else:
                write_checkpoint(path, preset=tiny_preset(preset), role=role, **options)
            built[key] = path
        return built[key]
    return get


@pytest.fixture
def pair(synthetic_cache, tmp_path):
    """A private copy of the default tiny 31B pair (multimodal target in 2 shards): tmp/src/{target,assistant}."""
    src = tmp_path / "src"
    shutil.copytree(synthetic_cache("31b", "pair", num_shards=2), src)
    return src


@pytest.fixture
def all_shared_kv_modes(monkeypatch):
    """Lets transformers 5.23 build Gemma4AssistantForCausalLM (docs/DESIGN.md "Config dialects").

    `Gemma4TextConfig.kv_sharing_modes` looks for a producer layer of every type among the NON-shared layers and
    raises when there is none; in an assistant every layer is shared (its K/V come from the target), so the
    shipped code always raises. When all layers are shared we return "reuse" for each (Q-only layers reading
    shared_kv_states), which is what the assistant forward needs; other configs keep the upstream answer.
    """
    from transformers import Gemma4TextConfig
    upstream = Gemma4TextConfig.kv_sharing_modes

    def kv_sharing_modes(self):
        if self.num_kv_shared_layers == self.num_hidden_layers:
            return ["reuse"] * self.num_hidden_layers
        return upstream.fget(self)

    monkeypatch.setattr(Gemma4TextConfig, "kv_sharing_modes", property(kv_sharing_modes))


# ------------------------------------------------------------------------------------------ a run leaves no litter

def pytest_sessionstart(session):
    session.config._checkout_before = checkout_changes()


def pytest_sessionfinish(session, exitstatus):
    """Fails the run when the tests left something in the checkout that was not there before (scratch belongs in
    tmp_path or beside the output the user named; .gitignore'd caches do not count)."""
    before = getattr(session.config, "_checkout_before", None)
    after = checkout_changes()
    if before is None or after is None:
        return
    litter = sorted(after - before)
    if litter:
        session.config.get_terminal_writer().line(
            "FAILED: the test run left files in the checkout: " + ", ".join(litter[:10]), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def wheel(tmp_path_factory):
    """The project's wheel, built in tmp from the checkout's files (tests/_wheel.py)."""
    from matrix.wheel import build_wheel

    return build_wheel(tmp_path_factory.mktemp("dist"), tmp_path_factory.mktemp("wheel-src"))


def _built_once(build, tmp_path_factory, folder: str):
    """get(NAME) -> build(NAME, a new directory under `folder`), built on the first call only."""
    from matrix.cases import BuiltOnce

    return BuiltOnce(build, tmp_path_factory.mktemp(folder))


@pytest.fixture(scope="session")
def engine_case(tmp_path_factory):
    """cases.build_engine_case(NAME), built once per session: the engine and the consumer tests read the same pairs
    (and never modify them)."""
    from matrix.cases import build_engine_case

    return _built_once(build_engine_case, tmp_path_factory, "engine")


@pytest.fixture(scope="session")
def loader_case(tmp_path_factory):
    """cases.build_loader_case(NAME): variant -> directory, built once per session: the vLLM loader and the SGLang
    tests read the same pairs (and never modify them)."""
    from matrix.cases import build_loader_case

    return _built_once(build_loader_case, tmp_path_factory, "loader")

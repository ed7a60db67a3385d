"""Shared fixtures: seeded tiny synthetic checkpoints with real Gemma 4 ratios, and a CLI runner."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from safetensors import safe_open

from converter.cli import main
from converter.synthetic import tiny_preset, write_checkpoint, write_pair


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


def load_tensors(directory: Path) -> dict:
    """Every tensor of a checkpoint directory (test sizes only)."""
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name)
    return tensors


def read_config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


def text_config(config: dict) -> dict:
    return config.get("text_config", config)

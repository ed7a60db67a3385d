"""Shared by the robustness tests (issue 7): a small synthetic pair, the real CLI, hashes, hostile safetensors.

Not a conftest: the four robustness modules import it explicitly.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from converter.cli import main
from converter.read.checkpoint import INDEX_NAME, MANIFEST_NAME
from matrix.synthetic import scaled_preset, write_pair
from converter.write.staging import PARTIAL_SUFFIX

ROOT = Path(__file__).resolve().parents[1]
TARGET_SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def small_preset():
    """31B ratios (32 heads, 16/4 KV heads, d=4 -> D=8, k_eq_v, 5 sliding + 1 full), about 1.7 MB in all."""
    p = scaled_preset("31b", width_divisor=64, num_layers=6, vocab_size=64)
    return replace(p, intermediate_size=2 * p.hidden_size, vision_hidden_size=16,
                   assistant=replace(p.assistant, intermediate_size=2 * p.assistant.hidden_size))


@dataclass(frozen=True)
class Pair:
    """A private copy of the synthetic pair under `root`, and where the output goes."""

    root: Path
    target: Path
    assistant: Path
    out: Path

    def convert_args(self, layout: str = "pad-global", *extra: str) -> list[str]:
        return ["convert", "--target", str(self.target), "--assistant", str(self.assistant), "--out", str(self.out),
                "--layout", layout, *extra]


def pristine_pair(factory: pytest.TempPathFactory) -> Path:
    """Writes the pair once per module; tests copy it (`copy_pair`) and never touch the original."""
    root = factory.mktemp("pristine")
    write_pair(root, preset=small_preset(), num_shards=2)
    return root


def copy_pair(pristine: Path, root: Path) -> Pair:
    shutil.copytree(pristine, root / "src")
    return Pair(root=root, target=root / "src" / "target", assistant=root / "src" / "assistant", out=root / "dst")


def hash_tree(root: Path) -> dict[str, str]:
    """sha256 of every file under root (symlinks recorded by target, not followed), keyed by relative path."""
    hashes = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            hashes[rel] = "symlink->" + os.readlink(path)
        elif path.is_file():
            hashes[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return hashes


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """The console entry point in-process (main() does the error -> exit code mapping); returns (code, out, err)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(argv)
    captured = capsys.readouterr()
    code = exited.value.code
    return (code if isinstance(code, int) else 1), captured.out, captured.err


def run_console_script(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """The installed console script in a subprocess (what a user runs)."""
    script = Path(sys.executable).parent / "gemma4-convert"
    return subprocess.run([str(script), *argv], capture_output=True, text=True, **kwargs)


def error_lines(stderr: str) -> list[str]:
    """stderr without WARNING lines (plan warnings are printed before writing starts)."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("WARNING:")]


def leftovers(out: Path) -> list[str]:
    """Staging or retired directories of `out` beside it (`.NAME.gemma4-convert-*`)."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.gemma4-convert"))


def staging_dir(out: Path) -> Path:
    return out.parent / f".{out.name}{PARTIAL_SUFFIX}"


def assert_verifiable(directory: Path) -> None:
    """Every file conversion.json lists is there with its sha256, and nothing else is (conversion.json aside)."""
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    files = manifest["output"]["files"]
    present = {p.name for p in directory.iterdir()} - {MANIFEST_NAME}
    assert present == set(files), f"{directory}: files {sorted(present)} != manifest {sorted(files)}"
    for name, digest in files.items():
        assert hashlib.sha256((directory / name).read_bytes()).hexdigest() == digest, f"{directory / name}: sha256"
    if INDEX_NAME in files:
        index = json.loads((directory / INDEX_NAME).read_text())
        assert set(index["weight_map"].values()) <= set(files)


def assert_complete_pair_output(out: Path) -> None:
    assert sorted(p.name for p in out.iterdir()) == ["assistant", "target"]
    assert_verifiable(out / "target")
    assert_verifiable(out / "assistant")


# ---------------------------------------------------------------------------------------------- hostile files

def pack_safetensors(header: dict | bytes, data: bytes = b"", *, length: int | None = None) -> bytes:
    """8-byte little-endian length + header + data; `length` overrides the stated header length."""
    raw = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def split_safetensors(path: Path) -> tuple[dict, bytes]:
    """(header dict, data region) of a well-formed file."""
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + length]), blob[8 + length:]


def tensors_by_offset(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])

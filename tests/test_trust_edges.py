"""Issue 52: trust at the edges. Nothing outside OUT is written, whatever is planted beside it; a proof names the
bytes it proved, and upload refuses an output that changed since; no source file is dropped in silence.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from converter.write.lock import lock_path
from converter.write.staging import partial_dir, retired_dir

EXIT_FAILED, EXIT_INPUT, EXIT_OUTPUT = 1, 3, 4
VICTIM_BYTES = b"a file outside OUT that no conversion may touch\n"


def convert(run_cli, pair: Path, out: Path, *extra: str):
    return run_cli("convert", "--target", pair / "target", "--assistant", pair / "assistant", "--out", out,
                   "--layout", "per-layer", *extra)


def verify(run_cli, pair: Path, out: Path):
    return run_cli("verify", "--target", pair / "target", "--assistant", pair / "assistant", "--converted", out,
                   "--device", "cpu")


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "elsewhere" / "precious.txt"
    path.parent.mkdir()
    path.write_bytes(VICTIM_BYTES)
    return path


@pytest.fixture
def victim_dir(tmp_path: Path) -> Path:
    path = tmp_path / "elsewhere-dir"
    path.mkdir()
    (path / "keep.txt").write_bytes(VICTIM_BYTES)
    return path


@pytest.mark.parametrize("where", ["lock", "staging", "retired"])
@pytest.mark.parametrize("force", [False, True])
def test_a_symlink_planted_beside_out_is_refused_and_its_target_unchanged(pair, tmp_path, run_cli, victim,
                                                                        victim_dir, where, force):
    out = tmp_path / "out"
    if force:
        assert convert(run_cli, pair, out).code == 0
    planted = {"lock": lock_path, "staging": partial_dir, "retired": retired_dir}[where](out)
    planted.symlink_to(victim if where == "lock" else victim_dir)
    before = sorted(os.listdir(out)) if force else None
    result = convert(run_cli, pair, out, *(["--force"] if force else []))
    assert result.code == EXIT_OUTPUT, result.err
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and str(planted) in lines[0] and "symbolic link" in lines[0], lines
    assert victim.read_bytes() == VICTIM_BYTES
    assert sorted(os.listdir(victim_dir)) == ["keep.txt"] and (victim_dir / "keep.txt").read_bytes() == VICTIM_BYTES
    assert planted.is_symlink()  # left for the user to look at: the tool removes only what it made
    assert (sorted(os.listdir(out)) == before) if force else not out.exists()


def test_a_hard_link_planted_at_the_lock_is_refused(pair, tmp_path, run_cli, victim):
    out = tmp_path / "out"
    os.link(victim, lock_path(out))
    result = convert(run_cli, pair, out)
    assert result.code == EXIT_OUTPUT and "remove it and rerun" in result.err
    assert victim.read_bytes() == VICTIM_BYTES


def test_verify_replaces_a_planted_verification_link_instead_of_writing_through_it(pair, tmp_path, run_cli, victim):
    out = tmp_path / "out"
    assert convert(run_cli, pair, out).code == 0
    (out / "target" / "verification.json").symlink_to(victim)
    result = verify(run_cli, pair, out)
    assert result.code == 0, result.err
    assert victim.read_bytes() == VICTIM_BYTES
    written = out / "target" / "verification.json"
    assert not written.is_symlink() and json.loads(written.read_text())["passed"] is True

"""Issue 16: two writers into one DST, a lock left by a killed run, and fsync before/after the final rename.

The writers are real `gemma4-convert convert` processes. The first is held still right after it staged its first
checkpoint (a wrapper around pipeline._write_checkpoint that waits on stdin; nothing else changes), so the second
run meets it mid-write on every machine, without timing luck.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers_robustness import (assert_complete_pair_output, copy_pair, error_lines, hash_tree, leftovers,
                                 pristine_pair, run_cli, staging_dir)
from converter.write.lock import lock_path

EXIT_OUTPUT = 4

HOLD_AFTER_STAGING = r"""
import sys
import converter.pipeline as pipeline
from converter.cli import main

real = pipeline._write_checkpoint


def held(*args, **kwargs):
    files = real(*args, **kwargs)
    print("STAGED", flush=True)
    sys.stdin.readline()  # the test says when to go on, or kills us here
    return files


pipeline._write_checkpoint = held
main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pristine_pair(tmp_path_factory)


def start_held_convert(argv: list[str]) -> subprocess.Popen:
    """A real convert that stops after staging its first checkpoint; returns once it is there."""
    process = subprocess.Popen([sys.executable, "-c", HOLD_AFTER_STAGING, *argv], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in process.stdout:
        if line.strip() == "STAGED":
            return process
    process.wait()
    raise AssertionError(f"the first convert never staged anything: {process.stderr.read()}")


def test_a_second_convert_into_the_same_dst_is_refused_and_neither_is_damaged(pristine, tmp_path, capsys):
    pair = copy_pair(pristine, tmp_path)
    first = start_held_convert(pair.convert_args("pad-global"))
    try:
        staged = hash_tree(staging_dir(pair.out))
        assert staged, "the first run has staged files"
        holder = json.loads(lock_path(pair.out).read_text())
        assert holder["pid"] == first.pid
        for extra in ((), ("--force",)):
            code, _, err = run_cli(pair.convert_args("per-layer", *extra), capsys)
            lines = error_lines(err)
            assert code == EXIT_OUTPUT, err
            assert len(lines) == 1 and f"another gemma4-convert (pid {first.pid} on " in lines[0], err
            assert str(pair.out) in lines[0]
            assert hash_tree(staging_dir(pair.out)) == staged, "the second run touched the first one's staging"
            assert not pair.out.exists()
        out, err = first.communicate("\n\n", timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, err
    assert_complete_pair_output(pair.out)
    layout = json.loads((pair.out / "target" / "conversion.json").read_text())["layout"]
    assert layout == "pad-global"  # the first run's output, not the refused second one's
    assert leftovers(pair.out) == []  # staging renamed, lock file removed


def test_a_lock_left_by_a_killed_run_is_taken_over(pristine, tmp_path, capsys):
    pair = copy_pair(pristine, tmp_path)
    first = start_held_convert(pair.convert_args("per-layer"))
    first.send_signal(signal.SIGKILL)
    first.wait()
    first.stdout.close()
    first.stderr.close()
    assert json.loads(lock_path(pair.out).read_text())["pid"] == first.pid  # what a killed run leaves
    assert staging_dir(pair.out).is_dir()
    code, out, err = run_cli(pair.convert_args("per-layer"), capsys)
    assert code == 0, err
    assert_complete_pair_output(pair.out)
    assert leftovers(pair.out) == []


def test_files_and_staging_tree_are_fsynced_before_the_rename_and_the_parent_after(pristine, tmp_path, capsys,
                                                                                 monkeypatch):
    """Records every fsync (by the path its fd names) and rename, around the real functions."""
    pair = copy_pair(pristine, tmp_path)
    events: list[tuple[str, str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), ""))
        real_fsync(fd)

    def replace(src, dst, **kwargs) -> None:
        events.append(("replace", str(src), str(dst)))
        real_replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    code, _, err = run_cli(pair.convert_args("pad-global"), capsys)
    monkeypatch.undo()
    assert code == 0, err
    staging = str(staging_dir(pair.out))
    final = events.index(("replace", staging, str(pair.out)))
    before = {path for kind, path, _ in events[:final] if kind == "fsync"}
    after = {path for kind, path, _ in events[final + 1:] if kind == "fsync"}
    written = [p for p in pair.out.rglob("*")]
    assert written
    for path in written:  # every file (shards, index, config, side files, conversion.json) and every directory
        assert staging + str(path)[len(str(pair.out)):] in before, f"{path} not fsynced before the rename"
    assert staging in before
    assert str(pair.out.parent) in after, "the directory holding the rename was not fsynced after it"


def test_the_output_lock_is_not_reentrant(tmp_path):
    """One holder at a time, this process included: convert takes it once, around the downloads and the writes."""
    from converter.errors import OutputError
    from converter.write.lock import lock_path, output_lock

    dst = tmp_path / "dst"
    with output_lock(dst) as held:
        assert held == lock_path(dst) and held.exists()
        with pytest.raises(OutputError, match="another gemma4-convert .* is writing it"):
            with output_lock(dst):
                pass
    assert not lock_path(dst).exists()
    with output_lock(dst):  # released: taken again
        pass

"""Issue 7: a conversion killed anywhere leaves DST absent or complete, never half-written; the next run succeeds.

How the kill lands deterministically: the console entry point runs in a child process through a small driver
(`_DRIVER` below) that wraps one library call so the child SIGSTOPs itself at a named point. The test waits for
the stop (waitpid WUNTRACED, no sleeps, no polling), looks at the disk, then SIGKILLs (or SIGINT/SIGTERMs and
SIGCONTs) it. Nothing in the library knows about the test; the wrappers only add a pause.

Points: mid-shard (bytes of the first target shard written, not all), between-shards (first shard complete),
before-rename (staging complete, DST not yet there), and with --force over an earlier output: mid-swap (old
output moved aside, new one not yet in place) and after-swap (new output in place, old one not yet deleted).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from _helpers_robustness import (TARGET_SHARDS, assert_complete_pair_output, copy_pair, error_lines, hash_tree, leftovers,
                                 pristine_pair, run_cli, staging_dir)
from converter.write.staging import PARTIAL_SUFFIX

SHARD1, SHARD2 = TARGET_SHARDS

_DRIVER = r"""
import os, signal, sys
import converter.write.engine as engine
import converter.write.hashing as hashing
import converter.write.staging as staging
import converter.pipeline as pipeline
from converter.cli import main

point, argv = sys.argv[1], sys.argv[2:]


def stop():
    os.kill(os.getpid(), signal.SIGSTOP)


if point == "mid-shard":
    original_write = hashing.HashingWriter.write

    def write(self, data):
        original_write(self, data)
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 4 and not getattr(hashing, "_stopped", False):  # the header and 3 tensors are written
            hashing._stopped = True
            self.handle.flush()
            stop()
    hashing.HashingWriter.write = write
elif point == "between-shards":
    original_shard = engine.write_shard

    def write_shard(*args, **kwargs):
        digest = original_shard(*args, **kwargs)
        # the target's rewritten shard; the assistant's is written at the same time and may finish first
        if args[0].parent.name == "target" and not getattr(hashing, "_stopped", False):
            hashing._stopped = True
            stop()
        return digest
    engine.write_shard = write_shard
else:
    original_replace = os.replace

    def replace(src, dst):
        staged = str(src).endswith(staging.PARTIAL_SUFFIX)
        if point == "before-rename" and staged:
            stop()
        original_replace(src, dst)
        retiring = str(dst).endswith(staging.RETIRED_SUFFIX)  # not a JSON file's temp renamed over its name
        if (point == "mid-swap" and retiring) or (point == "after-swap" and staged):
            stop()
    os.replace = replace
main(argv)
"""


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pristine_pair(tmp_path_factory)


def _start_and_stop(point: str, argv: list[str]) -> subprocess.Popen:
    """Starts the converter and returns once it has stopped itself at `point` (fails if it exits instead)."""
    # SIGINT at its default: a test run started in the background (nohup, `cmd &` in a script) passes SIGINT on
    # ignored, and Python then installs no KeyboardInterrupt handler: the SIGINT case would test the shell, not us
    child = subprocess.Popen([sys.executable, "-c", _DRIVER, point, *argv], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _, status = os.waitpid(child.pid, os.WUNTRACED)
    if not os.WIFSTOPPED(status):
        child.returncode = os.waitstatus_to_exitcode(status)
        pytest.fail(f"the converter exited ({child.returncode}) before reaching {point}: {child.stderr.read()}")
    return child


def _kill(child: subprocess.Popen) -> None:
    child.kill()  # SIGKILL works on a stopped process
    child.wait()
    child.stdout.close()
    child.stderr.close()


CASES = {
    # point: (force over an earlier output, what must be on disk while stopped)
    "mid-shard": (False, "staging"),
    "between-shards": (False, "staging"),
    "before-rename": (False, "staging"),
    "mid-swap": (True, "retired"),
    "after-swap": (True, "dst"),
}


@pytest.mark.parametrize("point", list(CASES))
def test_sigkill_leaves_no_half_written_model(point: str, pristine: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    force, stopped_with = CASES[point]
    pair = copy_pair(pristine, tmp_path)
    source_before = hash_tree(pair.root / "src")
    extra = ["--force"] if force else []
    if force:  # an earlier, different, complete output that --force must replace atomically
        assert run_cli(pair.convert_args("per-layer"), capsys)[0] == 0
    argv = pair.convert_args("pad-global", *extra)

    child = _start_and_stop(point, argv)
    partial_shards = sorted(p.name for p in (staging_dir(pair.out) / "target").glob("*.safetensors"))
    if stopped_with == "staging":
        assert staging_dir(pair.out).is_dir() and not pair.out.exists()
        # pad-global rewrites SHARD1 and copies the unchanged SHARD2 on a thread of its own, at the same time
        assert SHARD1 in partial_shards and set(partial_shards) <= {SHARD1, SHARD2}
        partial_size = (staging_dir(pair.out) / "target" / SHARD1).stat().st_size
    elif stopped_with == "retired":
        assert not pair.out.exists() and (pair.out.parent / f".{pair.out.name}.gemma4-convert-old").is_dir()
    else:
        assert pair.out.is_dir() and not staging_dir(pair.out).exists()
    _kill(child)

    # DST is absent or complete and verifiable; a retired earlier output is complete too
    if pair.out.exists():
        assert_complete_pair_output(pair.out)
    retired = pair.out.parent / f".{pair.out.name}.gemma4-convert-old"
    if retired.exists():
        assert_complete_pair_output(retired)

    code, _, err = run_cli(argv, capsys)  # the re-run cleans up after the killed one and succeeds
    assert code == 0, err
    assert_complete_pair_output(pair.out)
    assert "pad-global" in (pair.out / "target" / "conversion.json").read_text()
    if stopped_with == "staging":  # the kill really came mid-shard / after a whole shard
        assert (partial_size < (pair.out / "target" / SHARD1).stat().st_size) == (point == "mid-shard")
    assert leftovers(pair.out) == []
    assert hash_tree(pair.root / "src") == source_before


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupt_is_one_line_and_cleans_up(signum: int, pristine: Path, tmp_path: Path) -> None:
    pair = copy_pair(pristine, tmp_path)
    source_before = hash_tree(pair.root / "src")
    child = _start_and_stop("mid-shard", pair.convert_args())
    assert staging_dir(pair.out).is_dir()
    os.kill(child.pid, signum)
    os.kill(child.pid, signal.SIGCONT)
    _, err = child.communicate()
    assert child.returncode == 130, err
    lines = error_lines(err)
    assert lines == ["error: interrupted; nothing was left behind"], err
    assert not pair.out.exists() and leftovers(pair.out) == []
    assert hash_tree(pair.root / "src") == source_before


# ---------------------------------------------------------------------------------------------- the rename fails

def _failing_rename(monkeypatch: pytest.MonkeyPatch, before: Callable[[Path], None]) -> None:
    """Runs `before(dst)` just before the staging dir is renamed to DST (in this process)."""
    real = os.replace

    def replace(src, dst):
        if str(src).endswith(PARTIAL_SUFFIX):
            before(Path(dst))
        real(src, dst)
    monkeypatch.setattr(os, "replace", replace)


def test_dst_created_meanwhile_is_left_alone(pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Someone else creates DST while we convert: exit 4, their DST untouched, our staging dir gone."""
    pair = copy_pair(pristine, tmp_path)

    def interlope(dst: Path) -> None:
        dst.mkdir()
        (dst / "theirs.txt").write_text("not ours\n")
    _failing_rename(monkeypatch, interlope)
    code, _, err = run_cli(pair.convert_args(), capsys)
    assert code == 4, err
    lines = error_lines(err)
    assert len(lines) == 1 and str(pair.out) in lines[0] and "Traceback" not in err, err
    assert sorted(p.name for p in pair.out.iterdir()) == ["theirs.txt"]
    assert leftovers(pair.out) == []


def test_force_puts_the_earlier_output_back_when_the_swap_fails(pristine: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    pair = copy_pair(pristine, tmp_path)
    assert run_cli(pair.convert_args("per-layer"), capsys)[0] == 0
    earlier = hash_tree(pair.out)

    def fail(dst: Path) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    _failing_rename(monkeypatch, fail)
    code, _, err = run_cli(pair.convert_args("pad-global", "--force"), capsys)
    assert code == 4 and len(error_lines(err)) == 1 and "Input/output error" in err, err
    assert hash_tree(pair.out) == earlier
    assert_complete_pair_output(pair.out)
    assert leftovers(pair.out) == []

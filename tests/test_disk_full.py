"""Issue 7: a full disk gives exit 4 and one clear "no space" line, leaves nothing behind, and never touches the source.

The output goes to a small tmpfs this test mounts (root only; the tests skip with the reason otherwise). Three
ways to run out: the up-front free-space check refuses a disk that is too small from the start; a disk that is
big enough when planned but filled by another file right after planning hits a real ENOSPC while writing
(early, midway, or at the last small files); and a tmpfs with too few inodes runs out of files, not bytes.
Last, a conversion from a read-only bind mount shows the source is only ever opened for reading.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

import converter.pipeline as pipeline
from _helpers_robustness import Pair, copy_pair, error_lines, hash_tree, leftovers, pristine_pair, run_cli

PAGE = 4096


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pristine_pair(tmp_path_factory)


@pytest.fixture
def mount_tmpfs(tmp_path: Path) -> Iterator:
    """mount_tmpfs(options) -> a fresh tmpfs directory; unmounted at teardown."""
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a size-limited tmpfs needs root")
        point = tmp_path / f"tmpfs{len(mounted)}"
        point.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True,
                                text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip() or result.returncode}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


def _pair_into(pristine: Path, tmp_path: Path, out: Path) -> Pair:
    pair = copy_pair(pristine, tmp_path)
    return Pair(root=pair.root, target=pair.target, assistant=pair.assistant, out=out)


def _free(path: Path) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def _assert_clean_failure(pair: Pair, code: int, err: str, source_before: dict[str, str], expected: str) -> None:
    lines = error_lines(err)
    assert code == 4, err
    assert len(lines) == 1 and expected in lines[0], err
    assert "Traceback" not in err
    assert not pair.out.exists() and leftovers(pair.out) == []
    assert hash_tree(pair.root / "src") == source_before


def test_up_front_check_refuses_a_disk_that_is_too_small(pristine: Path, tmp_path: Path, mount_tmpfs,
                                                         capsys: pytest.CaptureFixture) -> None:
    disk = mount_tmpfs("size=256k")
    pair = _pair_into(pristine, tmp_path, disk / "dst")
    source_before = hash_tree(pair.root / "src")
    code, out, err = run_cli(pair.convert_args(), capsys)
    _assert_clean_failure(pair, code, err, source_before, "not enough space")
    assert str(disk) in err and "KiB free" in err and "MiB" in err
    assert os.listdir(disk) == []  # refused before writing anything


@pytest.mark.parametrize("left_free", ["nothing", "half", "all-but-a-page"])
def test_enospc_while_writing(left_free: str, pristine: Path, tmp_path: Path, mount_tmpfs,
                              capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = mount_tmpfs("size=8m")
    pair = _pair_into(pristine, tmp_path, disk / "dst")
    source_before = hash_tree(pair.root / "src")
    planned = {}
    real_plan = pipeline.plan_conversion

    def plan_then_fill(request):
        """The up-front check passes; then another writer takes the space the conversion was counting on."""
        plan = real_plan(request)
        keep = {"nothing": 0, "half": plan.output_bytes // 2, "all-but-a-page": plan.output_bytes - PAGE}[left_free]
        with open(disk / "filler", "wb") as filler:
            filler.write(bytes(max(_free(disk) - keep, 0)))
        planned["output_bytes"], planned["free"] = plan.output_bytes, _free(disk)
        return plan
    monkeypatch.setattr(pipeline, "plan_conversion", plan_then_fill)

    code, out, err = run_cli(pair.convert_args(), capsys)

    assert planned["free"] < planned["output_bytes"]
    _assert_clean_failure(pair, code, err, source_before, "no space left on device")
    assert sorted(os.listdir(disk)) == ["filler"]


@pytest.mark.parametrize("inodes", [2, 3, 8])
def test_out_of_inodes(inodes: int, pristine: Path, tmp_path: Path, mount_tmpfs,
                       capsys: pytest.CaptureFixture) -> None:
    """Plenty of bytes, too few files: the staging dir, a checkpoint subdir or a shard cannot be created."""
    disk = mount_tmpfs(f"size=64m,nr_inodes={inodes}")
    pair = _pair_into(pristine, tmp_path, disk / "dst")
    source_before = hash_tree(pair.root / "src")
    code, out, err = run_cli(pair.convert_args(), capsys)
    _assert_clean_failure(pair, code, err, source_before, "no space left on device")
    assert os.listdir(disk) == []


def test_source_on_a_read_only_mount(pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The source is only ever opened for reading: a conversion from a read-only bind mount (EROFS even for root)
    succeeds and leaves every source byte as it was."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    pair = copy_pair(pristine, tmp_path)
    view = tmp_path / "read-only-source"
    view.mkdir()
    for command in (["mount", "--bind", str(pair.root / "src"), str(view)],
                    ["mount", "-o", "remount,bind,ro", str(view)]):
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            subprocess.run(["umount", "-l", str(view)], capture_output=True)
            pytest.skip(f"cannot make a read-only bind mount here: {result.stderr.strip() or result.returncode}")
    try:
        with pytest.raises(OSError):
            (view / "target" / "probe").write_text("")
        source_before = hash_tree(view)
        ro = Pair(root=pair.root, target=view / "target", assistant=view / "assistant", out=tmp_path / "dst")
        code, _, err = run_cli(ro.convert_args(), capsys)
        assert code == 0, err
        assert hash_tree(view) == source_before
    finally:
        subprocess.run(["umount", "-l", str(view)], check=False)

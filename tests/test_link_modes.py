"""`convert --link auto|copy|reflink|hardlink|symlink`: what each mode makes of the files a layout leaves unchanged.

For every mode: the source is byte-for-byte untouched, conversion.json records how each file was made, files that
change (config.json, the index, re-serialized shards) are always written, verify / inspect / upload work on the
output, and `--force` over a linked output leaves the source intact. Reflinks need a filesystem with copy-on-write
clones: GEMMA4_REFLINK_DIR names a directory on one, else tmp_path is probed, else (as root, with mkfs.xfs) the
tests mount a loop XFS image with reflink=1 of their own, else they skip with one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from converter.write import placement

WRITTEN = "written"
SOURCE_CARDS = {"README.source.md": "README.md"}  # output name -> source name; the output's README.md is the card


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file's bytes and inode (a source must keep both)."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_ino) for p in sorted(root.rglob("*"))
            if p.is_file()}


def _convert(run_cli, src: Path, out: Path, *, layout: str, link: str, force: bool = False):
    args = ["convert", "--target", src / "target", "--assistant", src / "assistant", "--out", out,
            "--layout", layout, "--link", link] + (["--force"] if force else [])
    return run_cli(*args)


def _manifest(directory: Path) -> dict:
    return json.loads((directory / "conversion.json").read_text())


def _check_made(src: Path, out: Path, link: str) -> dict[str, str]:
    """Checks every file against what conversion.json says made it; returns name -> how for both checkpoints."""
    seen = {}
    for role in ("target", "assistant"):
        manifest = _manifest(out / role)
        made, hashes = manifest["output"]["made"], manifest["output"]["files"]
        assert set(made) == set(hashes) == {p.name for p in (out / role).iterdir()} - {"conversion.json"}
        assert made["config.json"] == WRITTEN and not os.path.samefile(out / role / "config.json",
                                                                         src / role / "config.json")
        for name, how in made.items():
            source_name = SOURCE_CARDS.get(name, name)  # the source's README.md is kept as README.source.md
            produced, original = out / role / name, src / role / source_name
            seen[f"{role}/{name}"] = how
            if how == WRITTEN:
                assert hashes[name] == hashlib.sha256(produced.read_bytes()).hexdigest()
                continue
            assert how == link or (link == "auto" and how in ("copy", "reflink")), (name, how)
            assert produced.read_bytes() == original.read_bytes(), name
            assert os.path.islink(produced) == (how == "symlink"), name
            assert os.path.samefile(produced, original) == (how in ("hardlink", "symlink")), name
            if how == "symlink":
                assert os.readlink(produced) == str(original.resolve())
            if how == "copy":  # read, so hashed (once: the output's sha256 is the source's)
                digest = hashlib.sha256(original.read_bytes()).hexdigest()
                assert hashes[name] == manifest["source"]["files"][source_name] == digest
            else:  # never read: no hash claimed
                assert hashes[name] is None and manifest["source"]["files"][source_name] is None
        assert manifest["output"]["link"] == link
    return seen


@pytest.mark.parametrize("link", ["auto", "copy", "hardlink", "symlink"])
def test_per_layer_links_every_unchanged_file(pair, tmp_path, run_cli, link):
    before = _snapshot(pair)
    out = tmp_path / "out"
    result = _convert(run_cli, pair, out, layout="per-layer", link=link)
    assert result.code == 0, result.err
    made = _check_made(pair, out, link)
    shards = [name for name in made if name.endswith(".safetensors")]
    assert shards and all(made[name] != WRITTEN for name in shards)  # per-layer changes no tensor
    assert _snapshot(pair) == before
    meaning = [line for line in result.err.splitlines() if line.startswith("NOTE: --link")]
    assert len(meaning) == (1 if link in placement.LINK_MEANING else 0)  # said once, and only for the sharing modes


@pytest.mark.parametrize("link", ["hardlink", "symlink"])
def test_linked_outputs_verify_inspect_and_upload(pair, tmp_path, run_cli, link):
    before = _snapshot(pair)
    out = tmp_path / "out"
    assert _convert(run_cli, pair, out, layout="per-layer", link=link).code == 0
    verified = run_cli("verify", "--target", pair / "target", "--assistant", pair / "assistant", "--converted", out,
                       "--device", "cpu", "--seq-len", "8")
    assert verified.code == 0, verified.out + verified.err
    assert "structure: OK" in verified.out
    inspected = run_cli("inspect", out / "target", "--json")
    assert inspected.code == 0 and json.loads(inspected.out)["conversion"]["layout"] == "per-layer"
    upload = run_cli("upload", out, "--target-repo", "me/t", "--assistant-repo", "me/a", "--dry-run")
    assert upload.code == 0, upload.err
    assert "model.safetensors" in upload.out
    assert _snapshot(pair) == before  # verify wrote verification.json into the output, not through a link


def test_verify_catches_a_changed_file_behind_a_symlink(pair, tmp_path, run_cli):
    """A symlinked output is only as good as the file it points to: verify reads what is there now."""
    out = tmp_path / "out"
    copy = tmp_path / "copy"
    shutil.copytree(pair, copy)
    assert _convert(run_cli, copy, out, layout="per-layer", link="symlink").code == 0
    shard = next((copy / "assistant").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))  # the source the link points to changes after the conversion
    result = run_cli("verify", pair / "assistant", out / "assistant", "--device", "cpu", "--seq-len", "8")
    assert result.code == 1 and "bytes differ from the source" in result.out


@pytest.mark.parametrize("link", ["hardlink", "symlink", "copy"])
def test_pad_global_links_only_what_it_does_not_change(synthetic_cache, tmp_path, run_cli, link):
    src = tmp_path / "src"
    shutil.copytree(synthetic_cache("31b", "pair", num_shards=6), src)  # the last shard: no attention
    before = _snapshot(src)
    out = tmp_path / "out"
    assert _convert(run_cli, src, out, layout="pad-global", link=link).code == 0
    made = _check_made(src, out, link)
    target_shards = {name: how for name, how in made.items() if name.startswith("target/model-")}
    assert WRITTEN in target_shards.values() and set(target_shards.values()) - {WRITTEN}  # both kinds present
    assert made["assistant/model.safetensors"] == WRITTEN
    assert _snapshot(src) == before
    verified = run_cli("verify", "--target", src / "target", "--assistant", src / "assistant", "--converted", out,
                       "--device", "cpu", "--seq-len", "8")
    assert verified.code == 0, verified.out


def test_fused_qkv_shards_are_rewritten_not_linked(synthetic_cache, tmp_path, run_cli):
    src = tmp_path / "src"
    shutil.copytree(synthetic_cache("31b", "target", fused_qkv=True), src)
    out = tmp_path / "out"
    assert run_cli("convert", src, "--out", out, "--layout", "per-layer", "--link", "hardlink").code == 0
    made = _manifest(out)["output"]["made"]
    assert made["model.safetensors"] == WRITTEN and not os.path.samefile(out / "model.safetensors",
                                                                          src / "model.safetensors")


@pytest.mark.parametrize("link", ["hardlink", "symlink"])
def test_force_over_a_linked_output_keeps_the_source(pair, tmp_path, run_cli, link):
    before = _snapshot(pair)
    out = tmp_path / "out"
    assert _convert(run_cli, pair, out, layout="per-layer", link=link).code == 0
    assert _convert(run_cli, pair, out, layout="pad-global", link=link, force=True).code == 0
    assert _convert(run_cli, pair, out, layout="per-layer", link="copy", force=True).code == 0
    assert _snapshot(pair) == before
    _check_made(pair, out, "copy")


def test_hardlink_semantics_are_what_convert_says(pair, tmp_path, run_cli):
    """An in-place write to a hard-linked output changes the source too (the printed NOTE); a copy does not."""
    out = tmp_path / "out"
    assert _convert(run_cli, pair, out, layout="per-layer", link="hardlink").code == 0
    readme = out / "target" / "README.source.md"  # the source's README.md, hard-linked under the name it travels by
    with open(readme, "r+b") as handle:
        handle.write(b"#")
    assert (pair / "target" / "README.md").read_bytes().startswith(b"#")


def test_reflink_on_a_filesystem_without_it_is_one_line_and_leaves_nothing(pair, tmp_path, run_cli):
    if _reflink_dir(tmp_path) == tmp_path:
        pytest.skip(f"{tmp_path} supports reflinks; the refusal needs a filesystem without them")
    out = tmp_path / "out"
    result = _convert(run_cli, pair, out, layout="per-layer", link="reflink")
    assert result.code == 4 and len(_errors(result.err)) == 1 and "--link auto" in result.err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["src"]


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def _supports_reflink(directory: Path) -> bool:
    probe = directory / f".reflink-probe-{uuid.uuid4().hex}"
    try:
        probe.write_bytes(b"x" * 4096)
        return placement._reflink(probe, probe.with_name(probe.name + ".clone"))
    except OSError:
        return False
    finally:
        for path in (probe, probe.with_name(probe.name + ".clone")):
            path.unlink(missing_ok=True)


def _reflink_dir(tmp_path: Path) -> Path | None:
    named = os.environ.get("GEMMA4_REFLINK_DIR")
    for candidate in ([Path(named)] if named else []) + [tmp_path]:
        if candidate.is_dir() and _supports_reflink(candidate):
            return candidate
    return None


@pytest.fixture(scope="session")
def loop_xfs(tmp_path_factory) -> Iterator[Path | None]:
    """A loop-mounted 512 MiB XFS image with reflink=1, where root may make one (CI does); None elsewhere."""
    if os.geteuid() != 0 or not shutil.which("mkfs.xfs"):
        yield None
        return
    root = tmp_path_factory.mktemp("xfs")
    image, point = root / "xfs.img", root / "mnt"
    point.mkdir()
    with open(image, "wb") as handle:
        handle.truncate(512 * 1024 * 1024)  # sparse
    made = all(subprocess.run(step, capture_output=True).returncode == 0
               for step in (["mkfs.xfs", "-q", "-m", "reflink=1", str(image)],
                            ["mount", "-o", "loop", str(image), str(point)]))
    try:
        yield point if made and _supports_reflink(point) else None
    finally:
        if made:
            subprocess.run(["umount", str(point)], capture_output=True, check=False)
        image.unlink(missing_ok=True)


@pytest.fixture
def reflink_root(tmp_path, loop_xfs):
    root = _reflink_dir(tmp_path) or loop_xfs
    if root is None:
        pytest.skip("no filesystem with reflinks: set GEMMA4_REFLINK_DIR to a directory on XFS (reflink=1) or btrfs, "
                    "or run as root with mkfs.xfs")
    work = root if root == tmp_path else root / f"gemma4-test-{uuid.uuid4().hex}"
    work.mkdir(exist_ok=True)
    yield work
    if work != tmp_path:
        shutil.rmtree(work, ignore_errors=True)


def test_auto_needs_no_space_for_files_it_can_clone(pair, loop_xfs, run_cli):
    """The up-front space check counts what auto will clone as free, and what copy will copy as needed."""
    if loop_xfs is None:
        pytest.skip("needs a loop XFS of the test's own to fill (root and mkfs.xfs)")
    work = loop_xfs / f"space-{uuid.uuid4().hex}"
    shutil.copytree(pair, work / "src")
    shards = sum(p.stat().st_size for p in (work / "src").rglob("*.safetensors"))
    filler = work / "filler"
    with open(filler, "wb") as handle:  # leaves a quarter of the shards' size free
        os.posix_fallocate(handle.fileno(), 0, shutil.disk_usage(loop_xfs).free - shards // 4)
    try:
        copied = _convert(run_cli, work / "src", work / "copied", layout="per-layer", link="copy")
        assert copied.code == 4 and "not enough space" in copied.err and len(_errors(copied.err)) == 1, copied.err
        cloned = _convert(run_cli, work / "src", work / "cloned", layout="per-layer", link="auto")
        assert cloned.code == 0, cloned.err
        assert set(_check_made(work / "src", work / "cloned", "auto").values()) == {WRITTEN, "reflink"}
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize("link", ["auto", "reflink"])
def test_reflinks_share_nothing_writable_with_the_source(pair, reflink_root, run_cli, link):
    src = reflink_root / "src"
    shutil.copytree(pair, src)
    before = _snapshot(src)
    out = reflink_root / "out"
    assert _convert(run_cli, src, out, layout="per-layer", link=link).code == 0
    made = _check_made(src, out, link)
    assert {how for how in made.values()} == {WRITTEN, "reflink"}
    verified = run_cli("verify", "--target", src / "target", "--assistant", src / "assistant", "--converted", out,
                       "--device", "cpu", "--seq-len", "8")
    assert verified.code == 0, verified.out
    shard = next((out / "target").glob("*.safetensors"))
    with open(shard, "r+b") as handle:  # copy-on-write: an in-place write to the output leaves the source as it was
        handle.seek(100)
        handle.write(b"\xff" * 64)
    assert _snapshot(src) == before
    assert _convert(run_cli, src, out, layout="pad-global", link=link, force=True).code == 0
    assert _snapshot(src) == before


def test_hardlink_across_filesystems_is_one_line(pair, reflink_root, run_cli, tmp_path):
    if reflink_root == tmp_path or os.stat(reflink_root).st_dev == os.stat(pair).st_dev:
        pytest.skip("needs the source and the output on two filesystems (GEMMA4_REFLINK_DIR elsewhere)")
    out = reflink_root / "out"
    result = _convert(run_cli, pair, out, layout="per-layer", link="hardlink")
    assert result.code == 4 and "cannot hard-link" in result.err and len(_errors(result.err)) == 1
    assert "Traceback" not in result.err
    assert not out.exists()


@pytest.mark.parametrize("layout", ["per-layer", "pad-global"])
def test_no_hash_leaves_the_weight_hashes_null_and_still_verifies(pair, tmp_path, run_cli, layout):
    out = tmp_path / "out"
    result = run_cli("convert", "--target", pair / "target", "--assistant", pair / "assistant", "--out", out,
                     "--layout", layout, "--link", "copy", "--no-hash")
    assert result.code == 0, result.err
    for role in ("target", "assistant"):
        manifest = _manifest(out / role)
        assert manifest["output"]["hashed"] is False
        made = manifest["output"]["made"]
        for name, digest in manifest["output"]["files"].items():
            # config, index, the card: from memory, hashed for free
            small = (name.endswith(".json") or name == "README.md") and made[name] == WRITTEN
            assert (digest is not None) == small, (name, digest)
            if small:
                assert digest == hashlib.sha256((out / role / name).read_bytes()).hexdigest()
        assert set(manifest["source"]["files"].values()) == {None}
    verified = run_cli("verify", "--target", pair / "target", "--assistant", pair / "assistant", "--converted", out,
                       "--device", "cpu", "--seq-len", "8")
    assert verified.code == 0, verified.out

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


@pytest.fixture
def verified(pair, tmp_path, run_cli) -> Path:
    """A per-layer pair output that verify passed."""
    out = tmp_path / "out"
    assert convert(run_cli, pair, out).code == 0
    assert verify(run_cli, pair, out).code == 0
    return out


def upload_dry_run(run_cli, out: Path, *extra: str):
    return run_cli("upload", out, "me/gemma-4-31B-it-vllm", "--dry-run", *extra)


def flip_a_tensor_byte(shard: Path) -> None:
    """One byte of the last tensor's data changed in place: same size, other bytes."""
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))


def test_upload_refuses_a_tensor_byte_changed_after_verify(verified, run_cli):
    shard = verified / "target" / "model-00002-of-00002.safetensors"
    flip_a_tensor_byte(shard)
    result = upload_dry_run(run_cli, verified)
    assert result.code == EXIT_FAILED
    assert "model-00002-of-00002.safetensors: sha256" in result.err and "changed since convert" in result.err
    assert upload_dry_run(run_cli, verified, "--no-hash").code == 0  # sizes alone: what --no-hash gives up


def test_upload_refuses_a_config_value_changed_after_verify(verified, run_cli):
    config = verified / "assistant" / "config.json"
    document = json.loads(config.read_text())
    document["rms_norm_eps"] = 1e-5
    config.write_text(json.dumps(document, indent=2) + "\n")
    result = upload_dry_run(run_cli, verified, "--no-hash")
    assert result.code == EXIT_FAILED and "assistant: config.json: " in result.err, result.err


def test_upload_refuses_a_file_added_after_convert(verified, run_cli):
    (verified / "target" / "model-00003-of-00002.safetensors").write_bytes(b"junk")
    result = upload_dry_run(run_cli, verified, "--no-hash")
    assert result.code == EXIT_FAILED
    assert "model-00003-of-00002.safetensors: in the output but not in conversion.json" in result.err


def test_upload_refuses_another_outputs_proof(verified, pair, tmp_path, run_cli):
    other = tmp_path / "pad-global"
    assert run_cli("convert", "--target", pair / "target", "--assistant", pair / "assistant", "--out", other,
                   "--layout", "pad-global").code == 0
    assert verify(run_cli, pair, other).code == 0
    for directory in (verified, verified / "target", verified / "assistant"):
        (directory / "verification.json").write_bytes((other / directory.relative_to(verified)
                                                       / "verification.json").read_bytes())
    result = upload_dry_run(run_cli, verified)
    assert result.code == EXIT_FAILED
    assert "verification.json: proves another conversion.json, not " in result.err
    # unverified on request: and the stale proof stays home, off the card and out of the upload
    unverified = upload_dry_run(run_cli, verified, "--no-verify")
    assert unverified.code == 0, unverified.err
    assert "verification.json" not in unverified.out


def test_verify_fails_a_side_file_changed_after_convert(verified, pair, run_cli):
    with open(verified / "target" / "tokenizer.json", "ab") as handle:
        handle.write(b" ")
    result = verify(run_cli, pair, verified)
    assert result.code == EXIT_FAILED
    assert "tokenizer.json: " in result.out and "changed since convert" in result.out
    assert "tokenizer.json: not the source's tokenizer.json byte for byte" in result.out


def test_a_side_file_that_is_a_device_is_refused_by_name(pair, tmp_path, run_cli):
    tokenizer = pair / "target" / "tokenizer.json"
    tokenizer.unlink()
    tokenizer.symlink_to("/dev/zero")
    result = convert(run_cli, pair, tmp_path / "out")
    assert result.code == EXIT_INPUT
    assert result.err.strip() == (f"error: {tokenizer}: a symbolic link to character device, not a file; a "
                                  "checkpoint's files are regular files: replace it with the file it stands for, "
                                  "or remove it")
    assert not (tmp_path / "out").exists()


def test_a_fifo_among_side_files_is_refused_by_name(pair, tmp_path, run_cli):
    os.mkfifo(pair / "assistant" / "vocab.txt")
    result = convert(run_cli, pair, tmp_path / "out")
    assert result.code == EXIT_INPUT and "vocab.txt: a FIFO, not a file" in result.err


def test_a_subdirectory_is_named_as_left_behind(pair, tmp_path, run_cli):
    (pair / "target" / "original").mkdir()
    result = convert(run_cli, pair, tmp_path / "out")
    assert result.code == 0, result.err
    assert f"{pair / 'target'}: original/ not carried into the output" in result.err + result.out
    assert "original" not in os.listdir(tmp_path / "out" / "target")


def _change_during_convert(monkeypatch, victim: Path, how: str) -> None:
    """The source shard changes right after the first checkpoint's writes start: renamed over (same size, other
    bytes, as a sync tool or a re-run download replaces a file), or written in place."""
    import converter.pipeline as pipeline

    real = pipeline._write_checkpoint
    changed = []

    def writing(*args, **kwargs):
        files = real(*args, **kwargs)
        if not changed:
            changed.append(victim)
            data = bytearray(victim.read_bytes())
            data[-1] ^= 0xFF
            if how == "renamed over":
                replacement = victim.with_name("replacement.tmp")
                replacement.write_bytes(bytes(data))
                os.replace(replacement, victim)
            else:
                with open(victim, "r+b") as handle:
                    handle.seek(len(data) - 1)
                    handle.write(bytes(data[-1:]))
        return files
    monkeypatch.setattr(pipeline, "_write_checkpoint", writing)


@pytest.mark.parametrize("layout", ["per-layer", "pad-global"])
@pytest.mark.parametrize("how", ["renamed over", "written in place"])
def test_a_source_that_changes_during_convert_fails_it_and_leaves_nothing(pair, tmp_path, run_cli, monkeypatch,
                                                                        layout, how):
    shard = pair / "target" / "model-00001-of-00002.safetensors"
    _change_during_convert(monkeypatch, shard, how)
    out = tmp_path / "out"
    result = run_cli("convert", "--target", pair / "target", "--assistant", pair / "assistant", "--out", out,
                     "--layout", layout)
    assert result.code == EXIT_INPUT
    assert result.err.strip().splitlines()[-1].startswith(f"error: {shard}: ")
    assert ("was replaced" if how == "renamed over" else "was modified") in result.err
    assert not out.exists() and not partial_dir(out).exists()


@pytest.mark.parametrize("name, substring", [("gemma-eagle-draft", "eagle-"), ("My-EAGLE3-pair", "eagle3"),
                                             ("dflash-test", "dflash"), ("gemma_dspark", "dspark")])
def test_an_out_name_vllm_reads_as_another_method_is_refused(pair, tmp_path, run_cli, name, substring):
    out = tmp_path / name
    result = convert(run_cli, pair, out, "--dry-run")
    assert result.code == 2
    line = result.err.strip()
    assert line.startswith(f"error: --out {out}: the assistant's path ") and f"holds {substring!r}" in line
    assert "vLLM 0.33 and older" in line and "(or pass --any-name)" in line
    warned = convert(run_cli, pair, out, "--any-name")
    assert warned.code == 0 and f"holds {substring!r}" in warned.err
    assert (out / "assistant" / "config.json").is_file()


def test_a_target_alone_may_hold_any_name(pair, tmp_path, run_cli):
    result = run_cli("convert", pair / "target", "--out", tmp_path / "eagle-target", "--layout", "per-layer",
                     "--dry-run")
    assert result.code == 0, result.err


def test_an_assistant_repo_vllm_reads_as_another_method_is_refused(verified, run_cli):
    result = run_cli("upload", verified, "--target-repo", "me/g4", "--assistant-repo", "me/g4-eagle3", "--dry-run")
    assert result.code == 2 and "the assistant's repo 'me/g4-eagle3' holds 'eagle3'" in result.err
    assert run_cli("upload", verified, "me/eagle3-pair", "--dry-run").code == 2  # the -assistant repo is named so too
    assert run_cli("upload", verified, "--target-repo", "me/g4", "--assistant-repo", "me/g4-eagle3", "--dry-run",
                   "--any-name").code == 0

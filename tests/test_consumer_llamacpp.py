"""llama.cpp converts an uploaded pair to GGUF and generates what the original generates, and llama-server drafts with its
assistant like the original pair (scripts/matrix/llamacpp_check.py: the rows, what each must show, measured into the
ledger by `make compat`): every unit by hand (`pytest -m compat`), and the judges.
"""

from __future__ import annotations

import pytest

from converter.advice.ledger import FAIL, PASS
from matrix.cases import LLAMACPP_SOURCES, MIXED
from matrix.llamacpp_check import judge, judge_drafting, measure_drafts, measure_loads

from _units import measured_live


@pytest.mark.vllm_loader
@pytest.mark.compat
@pytest.mark.parametrize("name", LLAMACPP_SOURCES)
def test_llamacpp_converts_and_generates_like_the_original(engine_case, tmp_path, name):
    measured_live(measure_loads, name, engine_case(name), tmp_path)


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

@pytest.mark.vllm_loader
@pytest.mark.compat
@pytest.mark.parametrize("name", LLAMACPP_SOURCES)
def test_llamacpp_server_drafts_like_the_original_pair(engine_case, tmp_path, name):
    measured_live(measure_drafts, name, engine_case(name), tmp_path)


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

"""mlx-lm loads the text targets of an uploaded pair and generates what the original generates, and mlx-vlm drafts with
its assistant like the original pair (scripts/matrix/mlx_check.py: the rows, what each must show, measured into the
ledger by `make compat`): every unit by hand (`pytest -m compat`), and the judges.
"""

from __future__ import annotations

import pytest

from converter.advice.ledger import FAIL, NOT_RUN, PASS
from matrix.cases import MLX_DRAFT_SOURCES, MLX_SOURCES
from matrix.mlx_check import judge_mlx, judge_mlx_drafting, judge_not_drafting, measure_drafts, measure_loads

from _units import measured_live


@pytest.mark.vllm_loader
@pytest.mark.compat
@pytest.mark.parametrize("name", MLX_SOURCES)
def test_mlx_lm_loads_and_generates_like_the_original(engine_case, tmp_path, name):
    measured_live(measure_loads, name, engine_case(name), tmp_path)


def test_the_mlx_judge_can_fail():
    ref = {"target_error": None, "greedy": [1, 2, 3], "logits": [[1.0, 2.0]]}
    assert judge_mlx("per-layer", {**ref, "logits": [[1.0, 2.5]]}, ref)[0] == FAIL
    assert judge_mlx("pad-global", {**ref, "logits": [[1.0, 2.5]]}, ref)[0] == PASS
    assert judge_mlx("pad-global", {**ref, "greedy": [1, 2, 4]}, ref)[0] == FAIL
    assert judge_mlx("per-layer", {"target_error": "ValueError: x"}, ref)[0] == FAIL


# ------------------------------------------------------------------------------------------------ drafting (mlx-vlm)

@pytest.mark.vllm_loader
@pytest.mark.compat
@pytest.mark.parametrize("name", MLX_DRAFT_SOURCES)
def test_mlx_vlm_drafts_like_the_original_pair(engine_case, tmp_path, name):
    measured_live(measure_drafts, name, engine_case(name), tmp_path)


def test_the_mlx_drafting_judge_can_fail():
    """Other greedy tokens, another candidate, none drafted, a refused draft: each fails; equal runs pass; a rewritten
    pair passes with other probabilities, a pair of the original's tensors does not."""
    run = {"tokens": [1, 2, 3], "accepted": [0.0, 1.0], "drafts": [[0, 0, 7, 0.5], [0, 1, 9, 0.4]]}
    ref = {"plain": {"tokens": [1, 2, 3]}, "drafting": run}
    assert judge_mlx_drafting("per-layer", ref, ref)[0] == PASS
    assert judge_mlx_drafting("per-layer", {**ref, "drafting": {**run, "tokens": [1, 2, 4]}}, ref)[0] == FAIL
    assert judge_mlx_drafting("per-layer", {**ref, "drafting": {**run, "drafts": []}}, ref)[0] == FAIL
    other = {**run, "drafts": [[0, 0, 7, 0.5], [0, 1, 8, 0.4]]}
    assert judge_mlx_drafting("pad-global", {**ref, "drafting": other}, ref)[0] == FAIL
    near = {**run, "drafts": [[0, 0, 7, 0.51], [0, 1, 9, 0.4]]}
    assert judge_mlx_drafting("per-layer", {**ref, "drafting": near}, ref)[0] == FAIL
    assert judge_mlx_drafting("pad-global", {**ref, "drafting": near}, ref)[0] == PASS
    refused = {**ref, "drafting": {"error": "ValueError: [scaled_dot_product_attention] query, keys ..."}}
    assert judge_mlx_drafting("pad-global", refused, ref)[0] == FAIL
    cannot = {**ref, "drafting": {"error": "TypeError: x"}}
    assert judge_not_drafting(cannot, cannot)[0] == NOT_RUN
    assert judge_not_drafting(ref, cannot)[0] == FAIL

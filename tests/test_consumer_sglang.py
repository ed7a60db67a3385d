"""SGLang reads an uploaded pair's configs, builds both models and loads every tensor as the checkpoint holds it, and
its engine's drafting on CPU is measured (scripts/matrix/sglang_check.py: the rows, what each must show, measured into
the ledger by `make compat`): every unit by hand (`pytest -m compat`), and the judges.
"""

from __future__ import annotations

import pytest

from converter.advice.ledger import FAIL, NOT_RUN, PASS
from matrix.cases import SGLANG_DRAFT_SOURCES, SGLANG_RELEASES, SGLANG_SOURCES

from _units import measured_live
from matrix.sglang_check import judge, judge_sglang_drafting, measure_drafts, measure_loads


@pytest.mark.vllm_loader
@pytest.mark.compat
@pytest.mark.parametrize("name", SGLANG_SOURCES)
@pytest.mark.parametrize("release", sorted(SGLANG_RELEASES))
def test_sglang_loads_every_tensor_like_the_checkpoint(loader_case, tmp_path, release, name):
    measured_live(measure_loads, name, release, loader_case(name), tmp_path)


def test_the_sglang_judge_can_fail():
    """Negative controls: a tensor that differs, a checkpoint tensor loaded into nothing, a draft that reads a cache
    of another shape, a step SGLang failed."""
    good = {"target": {"counts": {"equal": 3}, "not_equal": [], "unused_checkpoint_tensors": []},
            "assistant": {"counts": {"equal": 2}, "not_equal": [], "unused_checkpoint_tensors": []},
            "geometry": {"layers": [{"draft_layer": 0, "type": "full_attention", "target_layer": 5,
                                     "draft": {"head_dim": 512}, "target": {"head_dim": 512}, "match": True}]}}
    assert judge(good)[0] == PASS
    bad = {**good, "target": {**good["target"], "not_equal": [["w", "MISMATCH", "x"]]}}
    assert judge(bad)[0] == FAIL
    assert judge({**good, "assistant": {**good["assistant"], "unused_checkpoint_tensors": ["k"]}})[0] == FAIL
    mismatch = [{**good["geometry"]["layers"][0], "target": {"head_dim": 256}, "match": False}]
    assert judge({**good, "geometry": {"layers": mismatch}})[0] == FAIL
    assert judge({"error": "load target: AssertionError: x"})[0] == FAIL


# ------------------------------------------------------------------------------------------------------ drafting

@pytest.mark.vllm_loader
@pytest.mark.compat
@pytest.mark.parametrize("name", SGLANG_DRAFT_SOURCES)
@pytest.mark.parametrize("release", sorted(SGLANG_RELEASES))
def test_sglang_drafting_on_cpu_ismeasured_live(loader_case, tmp_path, release, name):
    measured_live(measure_drafts, name, release, loader_case(name), tmp_path)


def test_the_sglang_drafting_judge_can_fail():
    """A layout that fails otherwise than the original, or not at all, fails its row; the same errors are `not run`."""
    ref = {"device=cpu": {"error": "RuntimeError: 0 active drivers"}, "cpu engine": {"error": "ModuleNotFoundError: x"}}
    assert judge_sglang_drafting(ref, ref)[0] == NOT_RUN
    assert "0 active drivers" in judge_sglang_drafting(ref, ref)[1]
    assert judge_sglang_drafting({**ref, "device=cpu": {"error": "ValueError: shape"}}, ref)[0] == FAIL
    assert judge_sglang_drafting({**ref, "device=cpu": {"tokens": [1, 2]}}, ref)[0] == FAIL

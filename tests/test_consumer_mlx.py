"""mlx-lm (MLX's CPU backend) loads the text targets of an uploaded pair and generates what the original generates
(ledger check `consumer`; docs/COMPATIBILITY.md, "Other consumers").

scripts/consumers/mlx/check.py runs under the MLX env (scripts/consumers/mlx/requirements.txt, built once by
tests/_consumer_envs.py): `mlx_lm.utils.load_model` (strict shapes) of the original and both layouts of the engine
cases of cases.MLX_SOURCES, float32 logits of a fixed prompt (per-layer identical) and greedy tokens (the original's).
The drafting rows (ledger check `draft`) run mlx-vlm, which drafts with a Gemma 4 assistant, under an env of their own
(scripts/consumers/mlxvlm/requirements.txt): scripts/consumers/mlxvlm/draft.py generates with and without the
assistant drafting and records every draft candidate, on the cases of cases.MLX_DRAFT_SOURCES beside two negative
controls. `make compat` runs the rows; CI checks their digests (tests/test_ledger.py).
"""

from __future__ import annotations

import pytest

from converter.advice.ledger import FAIL, NOT_RUN, PASS, LedgerRow
from converter.proof.digest import pair_digest
from matrix.cases import (DRAFT_CONTROLS, MLX_DRAFT_SOURCES, MLX_DRAFTING_SOURCES, MLX_LM, MLX_SOURCES,
                                     MLX_TRANSFORMERS, MLX_VLM, MLX_VLM_TRANSFORMERS, ORIGINAL, draft_control_pairs)

from _consumer_envs import consumer_python
from _consumers import (AS_RESAVED, SAME_TENSORS, assert_varied, draft_distance, engine_case_row, engine_draft_row,
                        judge_fails_as_original, max_diff, record_as_expected, run_check, variants_and_digests)
from _ledger import skip_if_all_unchanged

MLX = "mlx-lm"


def judge_mlx(variant: str, got: dict, ref: dict) -> tuple[str, str, dict]:
    """mlx-lm's greedy tokens equal the original's; per-layer's logits identical (pad-global's difference is a
    figure: the tokens are the check)."""
    if got["target_error"]:
        return FAIL, f"target: {got['target_error']}", {}
    delta = max_diff(got["logits"], ref["logits"])
    figures = {"max_abs_vs_original": delta, "greedy_identical": got["greedy"] == ref["greedy"]}
    problems = [] if figures["greedy_identical"] else \
        [f"greedy tokens {got['greedy']} != the original's {ref['greedy']}"]
    if variant != "pad-global" and delta != 0:
        problems.append(f"logits differ from the original's by up to {delta:.3g}")
    return (FAIL if problems else PASS), "; ".join(problems), figures


def mlx_row(name: str, variant: str, digest: str, verdict: str = PASS, detail: str = "",
            figures: dict | None = None) -> LedgerRow:
    return engine_case_row(MLX, MLX_LM, MLX_TRANSFORMERS, name, variant, digest, verdict, detail, figures)


@pytest.mark.vllm_loader
@pytest.mark.compat
@pytest.mark.parametrize("name", MLX_SOURCES)
def test_mlx_lm_loads_and_generates_like_the_original(engine_case, tmp_path, name):
    pair = engine_case(name)
    pairs, digests = variants_and_digests(pair)
    skip_if_all_unchanged([mlx_row(name, v, d) for v, d in digests.items()])
    report = run_check(consumer_python("mlx"), "mlx", pair.reference, pairs, tmp_path / "report.json")
    assert report["mlx_lm"] == MLX_LM and report["transformers"] == MLX_TRANSFORMERS
    assert report["device"].startswith("Device(cpu")
    ref = report["pairs"]["reference"]
    assert ref["target_error"] is None, ref
    assert_varied(ref["greedy"])
    if AS_RESAVED in pairs:  # what this tool mends for MLX: no flat global keys, full layers mis-sized
        assert report["pairs"][AS_RESAVED]["target_error"].startswith("ValueError: Expected shape"), report
    rows = [mlx_row(name, v, d, *judge_mlx(v, report["pairs"][v], ref)) for v, d in digests.items()]
    record_as_expected(rows)


def test_the_mlx_judge_can_fail():
    ref = {"target_error": None, "greedy": [1, 2, 3], "logits": [[1.0, 2.0]]}
    assert judge_mlx("per-layer", {**ref, "logits": [[1.0, 2.5]]}, ref)[0] == FAIL
    assert judge_mlx("pad-global", {**ref, "logits": [[1.0, 2.5]]}, ref)[0] == PASS
    assert judge_mlx("pad-global", {**ref, "greedy": [1, 2, 4]}, ref)[0] == FAIL
    assert judge_mlx("per-layer", {"target_error": "ValueError: x"}, ref)[0] == FAIL


# ------------------------------------------------------------------------------------------------ drafting (mlx-vlm)

MLX_VLM_CONSUMER = "mlx-vlm"


def judge_mlx_drafting(variant: str, got: dict, ref: dict) -> tuple[str, str, dict]:
    """(verdict, detail, figures) of one pair drafting in mlx-vlm against the original pair in the same run.

    Every pair: both load and both runs succeed; greedy tokens with the draft equal those without it and the
    original's; every draft candidate (round, index, token) equals the original pair's, and a pair of the original's
    very tensors (the original, per-layer) drafts them with the same probabilities. A rewritten pair's (pad-global)
    probability difference is a figure: float32 arithmetic in another order.
    """
    problems = [f"{step.split('_')[0]}: {got[step]}" for step in ("target_error", "assistant_error") if got.get(step)]
    problems += [f"{run}: {got[run]['error']}" for run in ("plain", "drafting") if got.get(run, {}).get("error")]
    if problems:
        return FAIL, "; ".join(problems), {}
    mine = got["drafting"]["drafts"]
    differ, prob = draft_distance(mine, ref["drafting"]["drafts"])
    figures = {"draft_n": len(mine), "draft_n_accepted": int(sum(got["drafting"]["accepted"])),
               "candidates": len(mine), "candidates_differ": differ, "max_prob_diff": round(prob, 6)}
    want = ref["plain"]["tokens"]
    if got["plain"]["tokens"] != want or got["drafting"]["tokens"] != want:
        problems.append("greedy tokens differ from the original's" + (
            "" if got["plain"]["tokens"] == got["drafting"]["tokens"] else " and from its own without the draft"))
    if not mine:
        problems.append("no draft candidate recorded")
    elif differ:
        problems.append(f"{differ} of {len(mine)} draft candidates differ from the original pair's")
    elif variant in SAME_TENSORS and prob:
        problems.append(f"draft probabilities differ from the original pair's by up to {prob:.3g}")
    return (FAIL if problems else PASS), "; ".join(problems), figures


def judge_not_drafting(got: dict, ref: dict) -> tuple[str, str, dict]:
    """A case mlx-vlm cannot draft, the original alike: each variant must fail exactly as the original does."""
    return judge_fails_as_original({"drafting": got.get("drafting", {}).get("error")},
                                   {"drafting": ref["drafting"]["error"]},
                                   "mlx-vlm drafts only beside its multimodal gemma4 model")


def mlx_draft_row(name: str, variant: str, digest: str, verdict: str = PASS, detail: str = "",
                  figures: dict | None = None) -> LedgerRow:
    expected = None if name in MLX_DRAFTING_SOURCES else NOT_RUN
    return engine_draft_row(MLX_VLM_CONSUMER, MLX_VLM, MLX_VLM_TRANSFORMERS, name, variant, digest, verdict, detail,
                            figures or {}, expected=expected)


@pytest.mark.vllm_loader
@pytest.mark.compat
@pytest.mark.parametrize("name", MLX_DRAFT_SOURCES)
def test_mlx_vlm_drafts_like_the_original_pair(engine_case, tmp_path, name):
    """mlx-vlm with the assistant drafting (kind mtp): every variant's greedy tokens equal its own without the draft
    and the original pair's, and its draft candidates the original pair's; the two controls (the pad-global target
    beside the ORIGINAL assistant, an assistant with its query heads swapped) must not pass. A text-only target:
    mlx-vlm cannot draft beside it, the original alike (a `not run` row with the measured error)."""
    pair = engine_case(name)
    runs, digests = variants_and_digests(pair)
    runs.pop(AS_RESAVED, None)
    if name in MLX_DRAFTING_SOURCES:
        runs.update(draft_control_pairs(pair, tmp_path / "controls"))
        digests.update({c: pair_digest(runs[c] / "target", runs[c] / "assistant") for c in DRAFT_CONTROLS})
    skip_if_all_unchanged([mlx_draft_row(name, v, d) for v, d in digests.items()])
    report = run_check(consumer_python("mlxvlm"), "mlxvlm", pair.reference,
                       {v: p for v, p in runs.items() if v != ORIGINAL}, tmp_path / "report.json", program="draft.py")
    assert report["mlx_vlm"] == MLX_VLM and report["device"].startswith("Device(cpu"), report
    ref = report["pairs"]["reference"]
    assert ref["plain"].get("tokens"), ref
    assert_varied(ref["plain"]["tokens"])
    if name in MLX_DRAFTING_SOURCES:
        assert not judge_mlx_drafting(ORIGINAL, ref, ref)[1], ref  # the original pair drafts, and drafts something
        rows = [mlx_draft_row(name, v, d, *judge_mlx_drafting(v, report["pairs"]["reference" if v == ORIGINAL else v],
                                                              ref)) for v, d in digests.items()]
    else:
        assert ref["drafting"].get("error"), ref  # the original itself: the consumer's limit, measured
        rows = [mlx_draft_row(name, v, d, *judge_not_drafting(report["pairs"]["reference" if v == ORIGINAL else v],
                                                              ref)) for v, d in digests.items()]
    record_as_expected(rows)


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

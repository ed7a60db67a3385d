"""mlx-lm (MLX's CPU backend) loads the text targets of an uploaded pair and generates what the original generates
(ledger check `consumer`; docs/COMPATIBILITY.md, "Other consumers").

scripts/consumers/mlx/check.py runs under the MLX env (scripts/consumers/mlx/requirements.txt, built once by
scripts/matrix/consumer_envs.py): `mlx_lm.utils.load_model` (strict shapes) of the original and both layouts of the engine
cases of cases.MLX_SOURCES, float32 logits of a fixed prompt (per-layer identical) and greedy tokens (the original's).
The drafting rows (ledger check `draft`) run mlx-vlm, which drafts with a Gemma 4 assistant, under an env of their own
(scripts/consumers/mlxvlm/requirements.txt): scripts/consumers/mlxvlm/draft.py generates with and without the
assistant drafting and records every draft candidate, on the cases of cases.MLX_DRAFT_SOURCES beside two negative
controls. scripts/run_ledger.py measures every unit (LOADS, DRAFTS); tests/test_consumer_mlx.py runs them by hand and tests the
judges. CI checks the rows' digests (tests/test_ledger.py).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from converter.advice.ledger import CHECK_CONSUMER, CHECK_DRAFT, FAIL, NOT_RUN, PASS, LedgerRow
from matrix.digest import pair_digest
from matrix.cases import (DRAFT_CONTROLS, MLX_DRAFT_SOURCES, MLX_DRAFTING_SOURCES, MLX_LM, MLX_SOURCES,
                          MLX_TRANSFORMERS, MLX_VLM, MLX_VLM_TRANSFORMERS, ORIGINAL, EnginePair, build_engine_case,
                          draft_control_pairs)
from matrix.consumer_envs import consumer_python
from matrix.consumer_rows import (AS_RESAVED, SAME_TENSORS, as_expected, carried_or_report, consumer_family,
                                  draft_distance, engine_case_row, engine_draft_row, expect_varied,
                                  judge_fails_as_original, max_diff, variants_and_digests)
from matrix.rows import CarriedOver, Measured, expect, never_carried

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


# mlx_row(name, variant, digest, verdict=PASS, detail="", figures=None): a consumer row of mlx-lm on an engine case
mlx_row = partial(engine_case_row, MLX, MLX_LM, MLX_TRANSFORMERS)


def measure_loads(name: str, pair: EnginePair, work: Path, carried_over: CarriedOver = never_carried) -> Measured:
    """mlx-lm loads the original and both layouts of engine case `name` and generates the original's tokens."""
    pairs, digests = variants_and_digests(pair)
    kept, report = carried_or_report(f"mlx-lm-{name}", [mlx_row(name, v, d) for v, d in digests.items()], carried_over,
                                     lambda: consumer_python("mlx"), "mlx", pair.reference, pairs, work)
    if kept is not None:
        return kept
    expect(report["mlx_lm"] == MLX_LM and report["transformers"] == MLX_TRANSFORMERS, report)
    expect(report["device"].startswith("Device(cpu"), report["device"])
    ref = report["pairs"]["reference"]
    expect(ref["target_error"] is None, ref)
    expect_varied(ref["greedy"])
    if AS_RESAVED in pairs:  # what this tool mends for MLX: no flat global keys, full layers mis-sized
        expect(report["pairs"][AS_RESAVED]["target_error"].startswith("ValueError: Expected shape"), report)
    return as_expected(f"mlx-lm-{name}", [mlx_row(name, v, d, *judge_mlx(v, report["pairs"][v], ref))
                                          for v, d in digests.items()])


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


def measure_drafts(name: str, pair: EnginePair, work: Path, carried_over: CarriedOver = never_carried) -> Measured:
    """mlx-vlm with the assistant drafting (kind mtp): every variant's greedy tokens equal its own without the draft
    and the original pair's, and its draft candidates the original pair's; the two controls (the pad-global target
    beside the ORIGINAL assistant, an assistant with its query heads swapped) must not pass. A text-only target:
    mlx-vlm cannot draft beside it, the original alike (a `not run` row with the measured error)."""
    unit = f"mlx-vlm-{name}"
    runs, digests = variants_and_digests(pair)
    runs.pop(AS_RESAVED, None)
    if name in MLX_DRAFTING_SOURCES:
        runs.update(draft_control_pairs(pair, work / "controls"))
        digests.update({c: pair_digest(runs[c] / "target", runs[c] / "assistant") for c in DRAFT_CONTROLS})
    kept, report = carried_or_report(unit, [mlx_draft_row(name, v, d) for v, d in digests.items()], carried_over,
                                     lambda: consumer_python("mlxvlm"), "mlxvlm", pair.reference,
                                     {v: p for v, p in runs.items() if v != ORIGINAL}, work, program="draft.py")
    if kept is not None:
        return kept
    expect(report["mlx_vlm"] == MLX_VLM and report["device"].startswith("Device(cpu"), report)
    ref = report["pairs"]["reference"]
    expect(ref["plain"].get("tokens"), ref)
    expect_varied(ref["plain"]["tokens"])
    if name in MLX_DRAFTING_SOURCES:
        expect(not judge_mlx_drafting(ORIGINAL, ref, ref)[1], ref)  # the original pair drafts, and drafts something
        rows = [mlx_draft_row(name, v, d, *judge_mlx_drafting(v, report["pairs"]["reference" if v == ORIGINAL else v],
                                                              ref)) for v, d in digests.items()]
    else:
        expect(ref["drafting"].get("error"), ref)  # the original itself: the consumer's limit, measured
        rows = [mlx_draft_row(name, v, d, *judge_not_drafting(report["pairs"]["reference" if v == ORIGINAL else v],
                                                              ref)) for v, d in digests.items()]
    return as_expected(unit, rows)


LOADS = consumer_family("mlx-lm", CHECK_CONSUMER,
                        "tests/test_consumer_mlx.py::test_mlx_lm_loads_and_generates_like_the_original",
                        [(n,) for n in MLX_SOURCES], build_engine_case, measure_loads)
DRAFTS = consumer_family("mlx-vlm", CHECK_DRAFT,
                         "tests/test_consumer_mlx.py::test_mlx_vlm_drafts_like_the_original_pair",
                         [(n,) for n in MLX_DRAFT_SOURCES], build_engine_case, measure_drafts)

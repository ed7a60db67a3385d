"""mlx-lm (MLX's CPU backend) loads the text targets of an uploaded pair and generates what the original generates
(ledger check `consumer`; docs/COMPATIBILITY.md, "Other consumers").

scripts/consumers/mlx/check.py runs under the MLX env (scripts/consumers/mlx/requirements.txt, built once by
tests/_consumer_envs.py): `mlx_lm.utils.load_model` (strict shapes) of the original and both layouts of the engine
cases of cases.MLX_SOURCES, float32 logits of a fixed prompt (per-layer identical) and greedy tokens (the original's).
`make compat` runs the rows; CI checks their digests (tests/test_ledger.py).
"""

from __future__ import annotations

import pytest

from converter.advice.compat import FAIL, PASS, LedgerRow
from converter.testing.cases import MLX_LM, MLX_SOURCES, MLX_TRANSFORMERS

from _consumer_envs import consumer_python
from _consumers import (AS_RESAVED, assert_varied, engine_case_row, max_diff, record_as_expected, run_check,
                        variants_and_digests)
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

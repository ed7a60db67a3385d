"""transformers loads an uploaded pair and computes what it computes for the original (ledger check `consumer`;
docs/COMPATIBILITY.md, "Other consumers"): the rows, the judge and how a unit is measured are
scripts/matrix/transformers_check.py's; `make compat` measures them into the ledger (scripts/run_ledger.py) and CI
checks their digests (tests/test_ledger.py), see CI_ROW. Here: every unit by hand (`pytest -m compat`), and the judge.
"""

from __future__ import annotations

import pytest

from converter.advice.ledger import FAIL, PASS
from matrix.cases import CONSUMER_ROWS, ORIGINAL
from matrix.transformers_check import CONSUMER, judge, measure_unit

from _units import measured_live
from _vllm_envs import find_transformers_env

# None in CI: twice under heavy load (2026-12-02) transformers 5.24.0 gave the E2B reference's float32 logits 0.04
# off its own float64 ones (per-layer, the same tensors, 4e-4) with the same tokens, and never alone in 20+ runs:
# unexplained, so the consumer rows stay `make compat`'s (run on a quiet machine) and CI checks their digests
CI_ROW = None


def _params() -> list:
    return [pytest.param(name, tf, marks=[pytest.mark.vllm_loader] + ([] if (name, tf) == CI_ROW else [pytest.mark.compat]),
                         id=f"{name}-{tf}") for name, tf in CONSUMER_ROWS]


@pytest.mark.parametrize("name, transformers", _params())
def test_transformers_loads_and_generates_like_the_original(engine_case, tmp_path, name, transformers):
    env = find_transformers_env(transformers)
    measured_live(measure_unit, name, transformers, env, engine_case(name), tmp_path)


def test_the_judge_can_fail():
    """Negative controls: a per-layer logit off by one ulp, pad-global past the floor, other tokens, and a layout
    whose assistant fails where the original's runs."""
    ref = {"logits": [[1.0, 2.0]], "logits_float64": [[1.0, 2.0 + 1e-6]], "greedy": [1, 2, 3], "assisted": [1, 2, 3],
           "assistant_error": None, "target_error": None}
    assert judge("per-layer", {**ref, "logits": [[1.0, 2.0000002]]}, ref)[0] == FAIL
    assert judge("pad-global", {**ref, "logits": [[1.0, 2.0 + 4e-6]]}, ref)[0] == FAIL
    assert judge("pad-global", {**ref, "logits": [[1.0, 2.0 + 1.5e-6]]}, ref)[0] == PASS
    assert judge("per-layer", {**ref, "greedy": [1, 2, 4]}, ref)[0] == FAIL
    assert judge("per-layer", {**ref, "assisted": None, "assistant_error": "ValueError: x"}, ref)[0] == FAIL
    limited = {**ref, "assisted": None, "assistant_error": "TypeError: y"}
    assert judge(ORIGINAL, limited, limited)[0] == FAIL and judge("per-layer", limited, limited)[0] == PASS


@pytest.mark.parametrize("layout", ["per-layer", "pad-global"])
def test_the_card_lists_what_each_consumer_proved_for_its_layout(layout, tmp_path):
    from converter.advice.ledger import load_ledger
    from converter.advice.tables import consumer_table
    from converter.hub.card import render_card

    proven = [c for c in consumer_table(load_ledger()) if c[layout]["rows"]]
    assert {c["consumer"] for c in proven} >= {CONSUMER}, "no consumer rows in the ledger: run make compat"
    manifest = {"layout": layout, "role": "target", "layout_options": {}, "source": {}, "version": "0"}
    card = render_card(manifest=manifest, verification=None, repo_id="me/t", target_repo="me/t",
                       assistant_repo="me/a", base_model=None)
    for c in proven:
        assert f"{c['consumer']} {c['version']} loads it ({c[layout]['passed']}/{c[layout]['rows']})" in card



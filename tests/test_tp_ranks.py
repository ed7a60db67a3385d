"""Tensor parallelism rank by rank (scripts/matrix/rank_check.py: the rows, measured into the ledger by `make compat`):
every case by hand, and two negative controls that must fail it: a padded target beside an unpadded assistant
(geometry), and two KV heads swapped (every shape intact: only the summed outputs give it away).

Marker ``vllm_loader`` and ``compat``: `make compat` runs it; CI checks the rows' digests (tests/test_ledger.py).
"""

from __future__ import annotations

import json
import shutil

import pytest

from matrix.cases import ORIGINAL, RANK_ENV, RANK_SOURCES, build_loader_case
from matrix.edits import swap_kv_heads
from matrix.rank_check import LAYOUTS, measure_ranks, run_tp_check

from _units import measured_live
from _vllm_envs import find_env

pytestmark = [pytest.mark.vllm_loader, pytest.mark.compat]


@pytest.mark.parametrize("source_name", RANK_SOURCES)
def test_every_rank_adds_up_to_the_unsharded_original(tmp_path, source_name):
    measured_live(measure_ranks, source_name, find_env(*RANK_ENV), tmp_path)


def test_swapped_kv_heads_are_caught_by_the_summed_outputs(tmp_path):
    """Two KV heads of the full layer the draft reads, swapped in a per-layer target: shapes and geometry agree, the
    attention of both target and draft does not."""
    env = find_env(*RANK_ENV)
    built = build_loader_case("31b-mm-2shards", tmp_path / "cases", variants=("per-layer",))
    swapped = tmp_path / "kv-heads-swapped"
    shutil.copytree(built["per-layer"], swapped)
    text = json.loads((swapped / "target" / "config.json").read_text())["text_config"]
    full = max(i for i, t in enumerate(text["layer_types"]) if t == "full_attention")
    swap_kv_heads(swapped / "target", layer=full, head_dim=text["global_head_dim"])
    code, report, output = run_tp_check(env, built[ORIGINAL], [swapped], (2,), tmp_path)
    assert code == 1, output[-3000:]
    mine = next(r for r in report["results"] if r["pair"] == swapped.name)
    assert all(g["ok"] for g in mine["geometry"]), mine["geometry"]
    assert any(p.startswith(f"target.{full}:") for p in mine["problems"]), mine["problems"]
    assert any(p.startswith("draft.") for p in mine["problems"]), mine["problems"]


def test_a_padded_target_with_an_unpadded_assistant_is_caught_on_every_rank(tmp_path):
    """pad-global converts BOTH halves: a pad-global target beside a per-layer assistant reads the wrong bytes at any
    TP (vLLM starts it without a word); the check names the draft layer, its rank and both geometries."""
    env = find_env(*RANK_ENV)
    built = build_loader_case("31b-mm-2shards", tmp_path / "cases", variants=LAYOUTS)
    mixed = tmp_path / "padded-target-unpadded-assistant"
    mixed.mkdir()
    shutil.copytree(built["pad-global"] / "target", mixed / "target")
    shutil.copytree(built["per-layer"] / "assistant", mixed / "assistant")
    code, report, output = run_tp_check(env, built[ORIGINAL], [mixed], (2,), tmp_path)
    assert code == 1, output[-3000:]
    mine = next(r for r in report["results"] if r["pair"] == mixed.name)
    assert not mine["passed"]
    assert any(p.startswith("rank 0: draft layer") and "reads target layer" in p for p in mine["problems"]), mine
    assert any(p.startswith("rank 1: draft layer") for p in mine["problems"]), mine

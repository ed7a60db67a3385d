"""Tensor parallelism rank by rank: vLLM's own layers and weight loaders build every rank of TP 2, 4 and 8 from the
original and from each conversion, and what the ranks hold adds up to the unsharded original (scripts/consumers/vllm/
tp_check.py, in the vLLM 0.27.0 env of RANK_ENV). Rows of the ledger (`make compat`) with `tp`; vLLM checks none of
this. Two negative controls must fail it: a padded target beside an unpadded assistant (geometry), and two KV heads
swapped (every shape intact: only the summed outputs give it away).

Marker ``vllm_loader`` and ``compat``: `make compat` runs it; CI checks the rows' digests (tests/test_ledger.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from converter.advice.ledger import CHECK_LOADER, FAIL, PASS, LedgerRow
from converter.proof.digest import pair_digest
from matrix.cases import (ORIGINAL, RANK_ENV, RANK_SOURCES, RANK_TP_SIZES, SOURCES, build_loader_case)

from matrix.edits import swap_kv_heads
from _ledger import record, recording, skip_if_all_unchanged, today
from _vllm_envs import VllmEnv, find_env

pytestmark = [pytest.mark.vllm_loader, pytest.mark.compat]

REPO = Path(__file__).resolve().parents[1]
TP_CHECK = REPO / "scripts" / "consumers" / "vllm" / "tp_check.py"
LAYOUTS = ("per-layer", "pad-global")
TIMEOUT_S = 1800


def run_tp_check(env: VllmEnv, original: Path, pairs: list[Path], sizes: tuple[int, ...], out: Path,
                 *extra: str) -> tuple[int, dict, str]:
    cmd = [str(env.python), str(TP_CHECK), "--original", str(original), "--json", str(out / "tp.json"), *extra]
    for pair in pairs:
        cmd += ["--pair", str(pair)]
    for tp in sizes:
        cmd += ["--tp", str(tp)]
    proc = subprocess.run(["flock", "/tmp/gemma4-vllm.lock", *cmd], capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    output = proc.stdout + proc.stderr
    assert (out / "tp.json").exists(), f"tp_check wrote no report (exit {proc.returncode}):\n{output[-4000:]}"
    return proc.returncode, json.loads((out / "tp.json").read_text()), output


def _row(source: str, layout: str, env: VllmEnv, tp: int, digest: str, result: dict | None = None) -> LedgerRow:
    figures, detail = {}, ""
    if result is not None:
        figures = {"ranks": tp, "layer_pairs_per_rank": len(result["geometry"]) // tp,
                   "max_relative_error": max(result["relative_errors"].values(), default=0.0)}
        detail = "; ".join(result["problems"]) or "per rank: draft and target KV geometry equal; summed attention " \
                                                 "outputs equal the unsharded original's"
    return LedgerRow(case=source, form=SOURCES[source].form, layout=layout, vllm=env.vllm,
                     transformers=env.transformers, torch=env.torch, torch_pin=env.torch_pin, check=CHECK_LOADER,
                     verdict=PASS if result is None or result["passed"] else FAIL, expected=PASS, digest=digest,
                     measured=today(), vllm_package=env.package, detail=detail, figures=figures, tp=tp,
                     scope="ranks")


@pytest.mark.parametrize("source_name", RANK_SOURCES)
def test_every_rank_adds_up_to_the_unsharded_original(tmp_path, source_name):
    env = find_env(*RANK_ENV)
    built = build_loader_case(source_name, tmp_path / "cases", variants=LAYOUTS)
    variants = (ORIGINAL, *LAYOUTS)
    digests = {v: pair_digest(built[v] / "target", built[v] / "assistant") for v in variants} if recording() else {}
    skip_if_all_unchanged([_row(source_name, v, env, tp, d) for v, d in digests.items() for tp in RANK_TP_SIZES])
    code, report, output = run_tp_check(env, built[ORIGINAL], [built[v] for v in LAYOUTS], RANK_TP_SIZES, tmp_path)
    assert "error" not in report, output[-4000:]
    results = {(r["pair"], r["tp"]): r for r in report["results"]}
    assert set(results) == {(built[v].name, tp) for v in variants for tp in RANK_TP_SIZES}, sorted(results)
    for (name, tp), result in results.items():
        assert result["passed"], f"{name} at TP {tp}: {result['problems']}"
        # every rank compared at least one draft layer with the target layer it reads, and both outputs were summed
        assert len(result["geometry"]) >= tp and all(g["ok"] for g in result["geometry"]), result["geometry"]
        assert {k.split(".")[0] for k in result["relative_errors"]} == {"target", "draft"}, result
    assert code == 0
    for variant in variants:
        for tp in RANK_TP_SIZES:
            if digests:
                record(_row(source_name, variant, env, tp, digests[variant], results[(built[variant].name, tp)]))


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

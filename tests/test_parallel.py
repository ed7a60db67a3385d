"""Tensor parallelism: what each rank holds (converter/parallel.py), `inspect --tp`, `check-pair --tp`, `convert --tp`.

The published head counts are written out here (31B: 32 heads, 16 sliding / 4 global KV heads, head_dim 256 / 512,
k_eq_v; 26B-A4B: 16 heads, 8 / 2; E2B: 8 heads, 1 KV head of 256 / 512); the expected per-rank figures are vLLM 0.27.0's
rules (docs/DESIGN.md "Tensor parallelism in vLLM 0.27.0") and the pad-global KV prices measured there with vLLM's own
layers.
"""

from __future__ import annotations

import json

import pytest

from converter.cost import homogeneous
from converter.gemma4 import FULL, SLIDING, AttentionConfig
from converter.parallel import kv_bytes_per_token_per_rank, layer_type_geometry, rank_geometry, tp_problems


def _config(heads: int, kv: int, global_kv: int, *, k_eq_v: bool, layers: int, shared: int = 0) -> AttentionConfig:
    pattern = (SLIDING,) * 5 + (FULL,)
    return AttentionConfig(hidden_size=heads * 128, num_heads=heads, head_dim=256, global_head_dim=512,
                           num_kv_heads=kv, num_global_kv_heads=global_kv, k_eq_v=k_eq_v,
                           layer_types=(pattern * layers)[:layers], num_kv_shared_layers=shared, sliding_window=1024)


PUBLISHED = {
    "31b": _config(32, 16, 4, k_eq_v=True, layers=60),
    "26b-a4b": _config(16, 8, 2, k_eq_v=True, layers=30),
    "e2b": _config(8, 1, 1, k_eq_v=False, layers=35, shared=20),
}


@pytest.mark.parametrize("model, tp, full_kv, full_replicas, sliding_kv, ratio", [
    ("31b", 1, 4, 1, 16, 2.182), ("31b", 2, 2, 1, 8, 2.182), ("31b", 4, 1, 1, 4, 2.182), ("31b", 8, 1, 2, 2, 2.0),
    ("26b-a4b", 1, 2, 1, 8, 2.182), ("26b-a4b", 2, 1, 1, 4, 2.182), ("26b-a4b", 4, 1, 2, 2, 2.0),
    ("26b-a4b", 8, 1, 4, 1, 1.714),
    # E2B: one KV head everywhere, replicated on every rank, so the price never changes with TP (15 cache-owning
    # layers here: 13 sliding x 256, 2 full x 512 -> 15 x 512)
    ("e2b", 1, 1, 1, 1, 1.765), ("e2b", 2, 1, 2, 1, 1.765), ("e2b", 8, 1, 8, 1, 1.765),
])
def test_per_rank_geometry_and_pad_global_price(model, tp, full_kv, full_replicas, sliding_kv, ratio):
    attention = PUBLISHED[model]
    ranks = layer_type_geometry(attention, tp)
    assert (ranks["full"].kv_heads_per_rank, ranks["full"].kv_head_replicas, ranks["full"].head_dim) == \
        (full_kv, full_replicas, 512)
    assert ranks["sliding"].kv_heads_per_rank == sliding_kv and ranks["sliding"].head_dim == 256
    assert ranks["full"].heads_per_rank == attention.num_heads / tp
    padded = layer_type_geometry(homogeneous(attention), tp)
    assert padded["full"] == padded["sliding"]  # homogeneous on every rank too
    price = kv_bytes_per_token_per_rank(homogeneous(attention), tp) / kv_bytes_per_token_per_rank(attention, tp)
    assert round(price, 3) == ratio
    assert tp_problems(attention, tp) == []


def test_replicated_heads_are_counted_once_per_rank():
    g = rank_geometry(num_heads=32, num_kv_heads=4, head_dim=512, tp=8)
    assert (g.kv_heads_per_rank, g.kv_head_replicas) == (1, 2)
    assert rank_geometry(num_heads=32, num_kv_heads=16, head_dim=256, tp=8).kv_heads_per_rank == 2


@pytest.mark.parametrize("tp, fragments", [
    (3, ["does not divide the 32 attention heads", "does not divide the 16 KV heads",
         "does not divide the 4 KV heads"]),
    (6, ["does not divide the 32 attention heads", "does not divide the 16 KV heads",
         "is not a multiple of the 4 KV heads"]),
    (64, ["does not divide the 32 attention heads"]),
])
def test_sizes_vllm_refuses_are_named(tp, fragments):
    problems = tp_problems(PUBLISHED["31b"], tp, what="the target")
    assert len(problems) == len(fragments)
    for problem, fragment in zip(problems, fragments):
        assert fragment in problem and f"--tensor-parallel-size {tp}" in problem and "vLLM refuses" in problem


# ------------------------------------------------------------------------------------ the CLI

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from matrix.cases import build_loader_case

    return build_loader_case("31b-mm-2shards", tmp_path_factory.mktemp("tp"), variants=("per-layer", "pad-global"))


def test_inspect_tp_reports_each_rank_as_is_and_after_pad_global(pair, run_cli):
    result = run_cli("inspect", pair["original"] / "target", "--tp", "8", "--json")
    assert result.code == 0, result.err
    tp = json.loads(result.out)["tensor_parallel"]
    assert tp["tp"] == 8 and tp["problems"] == [] and tp["pad_global_kv_ratio"] == 2.0
    assert (tp["as_is"]["full"]["kv_heads_per_rank"], tp["as_is"]["full"]["kv_head_replicas"]) == (1, 2)
    assert tp["per_layer"] == tp["as_is"]
    assert tp["pad_global"]["full"]["kv_heads_per_rank"] == tp["pad_global"]["sliding"]["kv_heads_per_rank"] == 2
    text = run_cli("inspect", pair["original"] / "target", "--tp", "8")
    assert "tensor parallel 8, per rank:" in text.out and "pad-global KV cache per rank x2.00" in text.out
    assert json.loads(run_cli("inspect", pair["original"] / "target", "--json").out)["tensor_parallel"] is None


def test_the_recommendation_names_pad_globals_price_at_the_tp_served(pair, run_cli):
    """pad-global costs less KV per rank as TP grows (31B: x2.18 at TP 1-4, x2.0 at TP 8): where the recommendation
    names pad-global, as the layout (vLLM 0.22) or the alternative (0.27), --tp N gives that price."""
    target = pair["original"] / "target"
    alternative = json.loads(run_cli("inspect", target, "--tp", "8", "--json").out)["recommendation"]["alternative"]
    assert alternative["layout"] == "pad-global" and alternative["at_tp"] == {"tp": 8, "kv_cache_ratio_per_rank": 2.0}
    old = json.loads(run_cli("inspect", target, "--tp", "2", "--serving", "vllm==0.22.1", "--json").out)
    assert old["recommendation"]["layout"] == "pad-global"
    assert old["recommendation"]["pad_global_at_tp"] == {"tp": 2, "kv_cache_ratio_per_rank": 2.182}
    assert "at TP 2 its KV cache costs x2.182 per rank" in run_cli("inspect", target, "--tp", "2", "--serving",
                                                                   "vllm==0.22.1").out
    assert "at_tp" not in json.loads(run_cli("inspect", target, "--json").out)["recommendation"]["alternative"]


def test_inspect_tp_vllm_refuses_is_a_problem_and_exit_3(pair, run_cli):
    result = run_cli("inspect", pair["original"] / "target", "--tp", "3", "--json")
    assert result.code == 3
    report = json.loads(result.out)
    assert report["tensor_parallel"]["problems"] and report["tensor_parallel"]["problems"][0] in report["problems"]
    assert "does not divide the 32 attention heads of this target" in result.err


def test_check_pair_compares_every_rank_and_names_a_mismatch(pair, run_cli):
    good = json.loads(run_cli("check-pair", pair["pad-global"] / "target", pair["pad-global"] / "assistant",
                              "--json").out)
    assert good["ok"] and {r["tp"] for r in good["per_rank"]} == {1, 2, 4, 8} and all(r["ok"] for r in good["per_rank"])
    mixed = run_cli("check-pair", pair["pad-global"] / "target", pair["per-layer"] / "assistant", "--json")
    assert mixed.code == 1
    report = json.loads(mixed.out)
    full_at_2 = [r for r in report["per_rank"] if r["tp"] == 2 and r["assistant_layer"] == 3]
    assert full_at_2 == [{"tp": 2, "assistant_layer": 3, "target_layer": 5, "assistant": [32, 2],
                          "target": [32, 8], "ok": False}]
    assert any(p.startswith("per tensor-parallel rank too, at TP 2, 4, 8") for p in report["problems"])
    refused = run_cli("check-pair", pair["per-layer"] / "target", pair["per-layer"] / "assistant", "--tp", "3")
    assert refused.code == 1 and "--tensor-parallel-size 3 does not divide the 32 attention heads" in refused.err


def test_convert_tp_names_the_size_and_refuses_one_vllm_refuses(pair, run_cli, tmp_path):
    src = pair["original"]
    refused = run_cli("convert", "--target", src / "target", "--assistant", src / "assistant", "--out",
                      tmp_path / "no", "--layout", "per-layer", "--tp", "3")
    assert refused.code == 3 and not (tmp_path / "no").exists()
    assert len(refused.err.strip().splitlines()) == 1 and "does not divide the 32 attention heads" in refused.err
    done = run_cli("convert", "--target", src / "target", "--assistant", src / "assistant", "--out",
                   tmp_path / "yes", "--layout", "pad-global", "--tp", "8")
    assert done.code == 0, done.err
    assert "--attention-backend TRITON_ATTN --tensor-parallel-size 8" in done.out
    manifest = json.loads((tmp_path / "yes" / "target" / "conversion.json").read_text())
    assert manifest["tensor_parallel_size"] == 8

"""Converted outputs against the REAL stock vLLM loader, on CPU (docs/VLLM_CHECK.md): CI's live subset.

The rows and what each must show are scripts/matrix/loader_check.py's (cases from scripts/matrix/cases.py):
`make test` runs the rows marked ci (the 31B multimodal pair on 0.27.0 under both transformers generations);
`pytest -m compat` runs every row by hand; `make compat` (scripts/run_ledger.py) measures every row into the ledger
with the same functions, without pytest.

Where the venvs are, and what happens without them: tests/_vllm_envs.py.

The unmarked tests at the end check the checker's pure mapping functions and the row judge in the project venv
(no vLLM needed).
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from converter.advice.ledger import FAIL, PASS
from matrix.cases import LOADER_ROWS, ORIGINAL, SOURCES, LoaderRow
from matrix.loader_check import (CHECKER, XFAIL, CasePairs, RowMismatch, cpu_has_amx, judge, kernel_refusal,
                                 loaders_only, run_batch, run_checker)

from _vllm_envs import VllmEnv, find_env

# the package whose envs the load check runs in (docs/VLLM_CHECK.md, "Which vLLM package")
LOADER_PACKAGE = "vllm"


def loader_env(vllm: str, transformers: str, package: str = LOADER_PACKAGE) -> VllmEnv:
    """The env of one row; a missing one skips that row (fails it in CI)."""
    return find_env(package, vllm, transformers)


@pytest.fixture(scope="module")
def pairs(loader_case, tmp_path_factory):
    """The loader cases, built once per session (shared with the SGLang tests, conftest.loader_case)."""
    return CasePairs(tmp_path_factory.mktemp("loader-pairs"), loader_case)


@pytest.fixture(scope="module")
def batched(request, pairs, tmp_path_factory):
    """result(row, env) -> (exit code, result JSON, checker log): on the first row of an env, every selected row
    of that env in the same mode (--loaders-only or not) is checked in ONE checker process (one vLLM import, ~8 s
    saved a row)."""
    root = tmp_path_factory.mktemp("batches")
    results: dict[str, tuple[int, dict, str]] = {}
    batches = itertools.count()  # a folder per batch: a batch that wrote no JSON may be tried again
    selected = [item.callspec.params["row"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_stock_vllm_load" and hasattr(item, "callspec")]

    def result(row: LoaderRow, env: VllmEnv) -> tuple[int, dict, str]:
        if row.id not in results:
            rows = [r for r in selected if r.env_spec == row.env_spec and loaders_only(r) == loaders_only(row)
                    and r.id not in results]
            results.update(run_batch(env, rows if row in rows else [row], pairs,
                                     root / f"{env.python.parent.parent.name}-{next(batches)}"))
        assert row.id in results, f"the batched checker wrote no JSON for {row.id}"
        return results[row.id]
    return result


def _row_params(rows: tuple[LoaderRow, ...]) -> list:
    """CI runs the rows marked ci; the rest carry the `compat` marker (`pytest -m compat` runs them by hand)."""
    return [pytest.param(r, id=r.id, marks=() if r.ci else pytest.mark.compat) for r in rows]


@pytest.mark.vllm_loader
@pytest.mark.parametrize("row", _row_params(LOADER_ROWS))
def test_stock_vllm_load(pairs, batched, row):
    env = loader_env(row.vllm, row.transformers, row.package)
    pair = pairs.pair(row.source, row.variant)
    try:
        judgement = judge(row, env, pair, batched(row, env), digest="")
    except RowMismatch as mismatch:
        pytest.fail(f"{row.id}: {mismatch}", pytrace=False)
    if judgement.outcome == XFAIL:
        pytest.xfail(judgement.reason)


# The stock kernel selection, not stood in for: on this CPU vLLM 0.27.0 refuses these targets while BUILDING them
# (FP8 block: the last statement of CompressedTensorsW8A8Fp8.create_weights; NVFP4: ModelOptNvFp4LinearMethod's
# constructor), which keeps true what docs/VLLM_CHECK.md says the loaders-only rows do not exercise.
@pytest.mark.vllm_loader
@pytest.mark.compat
@pytest.mark.parametrize("source_name", [name for name, src in SOURCES.items() if src.kernel_refused])
def test_stock_kernel_selection_refuses_on_this_cpu(pairs, tmp_path, source_name):
    source, env = SOURCES[source_name], loader_env("0.27.0", "5.14.1")
    code, result, output = run_checker(env, pairs.pair(source_name, ORIGINAL), tmp_path / "result.json",
                                       *source.checker_args)
    assert (code, result["stage_failed"], result["error_type"]) == (2, "load_target", "ValueError"), output[-4000:]
    assert kernel_refusal(source)[1] in result["error"]
    if source.fp8 == "block" and not cpu_has_amx():
        assert "CPUFp8BlockScaledMMKernel requires AMX tile support" in result["error"]
    draft = result["draft"]
    assert draft is not None and (draft["mismatched"], draft["missing"], draft["unexpected"]) == (0, [], [])


# ------------------------------------------------------------------------------------ checker, no vLLM

def _load_checker():
    spec = importlib.util.spec_from_file_location("vllm027_check", CHECKER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def checker():
    return _load_checker()


def test_expected_target_stacks_qkv_and_copies_k_into_v_on_k_eq_v_layers(checker):
    config = {"text_config": {"layer_types": ["sliding_attention", "full_attention"], "attention_k_eq_v": True,
                              "tie_word_embeddings": True}}
    names = {f"model.language_model.layers.{i}.self_attn.{p}_proj.weight" for i in (0, 1) for p in "qko"}
    names |= {"model.language_model.layers.0.self_attn.v_proj.weight",
              "model.language_model.layers.1.self_attn.v_proj.weight",  # present but overwritten by K in vLLM
              "model.language_model.layers.0.mlp.gate_proj.weight", "model.language_model.layers.0.mlp.up_proj.weight",
              "model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight",
              "model.embed_vision.embedding_projection.weight", "model.embed_vision.embedding.weight",
              "lm_head.weight"}
    got = checker.expected_target(names, config, multimodal_model=True, has_audio=False)
    p = "model.language_model.layers"
    assert got.expected["language_model.model.layers.0.self_attn.qkv_proj.weight"] == (
        f"{p}.0.self_attn.q_proj.weight", f"{p}.0.self_attn.k_proj.weight", f"{p}.0.self_attn.v_proj.weight")
    assert got.expected["language_model.model.layers.1.self_attn.qkv_proj.weight"] == (
        f"{p}.1.self_attn.q_proj.weight", f"{p}.1.self_attn.k_proj.weight", f"{p}.1.self_attn.k_proj.weight")
    assert got.expected["language_model.model.layers.0.mlp.gate_up_proj.weight"] == (
        f"{p}.0.mlp.gate_proj.weight", f"{p}.0.mlp.up_proj.weight")
    assert got.expected["vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight"] == (
        "model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight",)
    assert got.expected["embed_vision.embedding_projection.weight"] == ("model.embed_vision.embedding_projection.weight",)
    assert set(got.ignored) == {"lm_head.weight", "model.embed_vision.embedding.weight",
                                f"{p}.1.self_attn.v_proj.weight"}


def test_expected_text_only_target_keeps_model_prefix(checker):
    config = {"layer_types": ["sliding_attention"], "attention_k_eq_v": False}
    names = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.0.self_attn.v_proj.weight", "model.layers.0.layer_scalar", "model.norm.weight"}
    got = checker.expected_target(names, config, multimodal_model=False, has_audio=False)
    assert set(got.expected) == {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.layer_scalar",
                                 "model.norm.weight"}


def test_expected_draft_maps_projection_prefixes_and_stacks_gate_up(checker):
    names = {"pre_projection.weight", "post_projection.weight", "model.embed_tokens.weight",
             "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
             "masked_embedding.token_ordering", "masked_embedding.centroids.weight"}
    got = checker.expected_draft(names)
    assert got.expected == {
        "model.pre_projection.weight": ("pre_projection.weight",),
        "model.post_projection.weight": ("post_projection.weight",),
        "model.embed_tokens.weight": ("model.embed_tokens.weight",),
        "model.layers.0.mlp.gate_up_proj.weight": ("model.layers.0.mlp.gate_proj.weight",
                                                   "model.layers.0.mlp.up_proj.weight"),
        "masked_embedding.token_ordering": ("masked_embedding.token_ordering",),
        "masked_embedding.centroids.weight": ("masked_embedding.centroids.weight",),
    }


@pytest.mark.parametrize(("target_types", "shared", "draft_types", "want"), [
    (["sliding_attention"] * 5 + ["full_attention"], 0, ["sliding_attention"] * 3 + ["full_attention"],
     [(0, 4), (1, 4), (2, 4), (3, 5)]),
    # E2B-like: the last non-KV-shared layer of each type, not the last layer
    (["sliding_attention"] * 4 + ["full_attention"] + ["sliding_attention"] * 4 + ["full_attention"], 5,
     ["sliding_attention", "full_attention"], [(0, 3), (1, 4)]),
    (["sliding_attention"], 0, ["full_attention"], [(0, None)]),
])
def test_kv_sharing_pairs_follow_vllm_proposer(checker, target_types, shared, draft_types, want):
    assert checker.kv_sharing_pairs(target_types, shared, draft_types) == want


def test_checker_rejects_missing_config_with_usage_exit(checker, tmp_path, capsys):
    assert checker.main(["--target", str(tmp_path), "--assistant", str(tmp_path)]) == checker.EXIT_USAGE
    assert "config.json not found" in capsys.readouterr().err


def test_expected_nvfp4_scales_fuse_per_part(checker):
    """Model Optimizer's per-tensor scalars become one entry per fused part (vLLM's PerTensorScaleParameter)."""
    import torch
    names = {f"model.layers.0.mlp.{p}_proj.{s}" for p in ("gate", "up", "down")
             for s in ("weight", "weight_scale", "weight_scale_2", "input_scale")}
    got = checker.expected_target(names, {"layer_types": ["sliding_attention"]}, multimodal_model=False,
                                  has_audio=False)
    assert got.expected["model.layers.0.mlp.gate_up_proj.weight_scale_2"] == (
        "model.layers.0.mlp.gate_proj.weight_scale_2", "model.layers.0.mlp.up_proj.weight_scale_2")
    assert got.expected["model.layers.0.mlp.down_proj.input_scale"] == ("model.layers.0.mlp.down_proj.input_scale",)
    assert torch.equal(checker.expected_tensor([torch.tensor(2.0), torch.tensor(3.0)]), torch.tensor([2.0, 3.0]))
    assert checker.expected_tensor([torch.tensor(2.0)]).shape == (1,)
    rows = checker.expected_tensor([torch.zeros(2, 4), torch.ones(3, 4)])
    assert rows.shape == (5, 4) and rows[2:].eq(1).all()


def test_loader_only_stands_in_only_for_a_refused_selection():
    spec = importlib.util.spec_from_file_location("vllm027_loader_only", CHECKER.parent / "loader_only.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    rec = module.Recorder()

    def refuse(kind: str):
        if kind == "none":
            raise ValueError("Failed to find a kernel that can implement the layer.\nReasons: none here")
        if kind == "bug":
            raise TypeError("not a refusal")
        return "real kernel"

    select = module._selection_with_stand_in(refuse, "init_x_kernel", rec, returns_class=False)
    assert select("ok") == "real kernel" and rec.refusals == {}
    stand_in = select("none")
    select("none")
    assert isinstance(stand_in, module.LoaderOnlyKernel) and stand_in.input_quant_key() is None
    assert rec.summary() == [{"selection": "init_x_kernel", "layers": 2,
                              "reason": "Failed to find a kernel that can implement the layer. Reasons: none here"}]
    with pytest.raises(TypeError):
        select("bug")
    with pytest.raises(RuntimeError, match="loader-only stand-in"):
        stand_in.apply_weights(None, None)
    # a selection that returns the kernel's class (WNA16's choose_mp_linear_kernel): the scheme constructs it
    choose = module._selection_with_stand_in(refuse, "choose_x_kernel", rec, returns_class=True)
    kernel_type = choose("none")
    kernel = kernel_type({"config": 1}, w_q_param_name="weight_packed")
    assert isinstance(kernel, module.LoaderOnlyKernel) and kernel.refused_by == "choose_x_kernel"
    assert kernel.process_weights_after_loading(None) is None


# ------------------------------------------------------------------------------------ the row judge, no vLLM

def _checker_result(pair_source: str, *, vllm: str, transformers: str, mismatched: int = 0) -> tuple[int, dict, str]:
    """What check.py reports for a pair that loads with every tensor equal (mismatched > 0: that many differ)."""
    from matrix.synthetic import tiny_preset

    draft_layers = len(tiny_preset(SOURCES[pair_source].preset).assistant.layer_types)
    summary = {"compared": 7, "mismatched": 0, "missing": [], "unexpected": []}
    result = {"versions": {"vllm": vllm, "transformers": transformers}, "stage_failed": None, "error_type": None,
              "error": None, "checks_failed": [], "target": dict(summary, mismatched=mismatched), "draft": summary,
              "kv_sharing": [{"draft_layer": i, "target_layer": 3, "ok": True, "draft": [8, 2], "target": [8, 2]}
                             for i in range(draft_layers)],
              "kernel_stand_ins": [], "compared_at": "model"}
    return 0, result, "checker log"


def test_judge_records_a_row_that_loads_equal_and_refuses_one_that_does_not(pairs):
    row = LoaderRow("31b-mm-2shards", ORIGINAL, "0.27.0", "5.14.1")
    env = VllmEnv(Path("/no/python"), "5.14.1", "0.27.0", "vllm", "2.13.0")
    pair = pairs.pair(row.source, row.variant)
    judgement = judge(row, env, pair, _checker_result(row.source, vllm="0.27.0", transformers="5.14.1"), "d1")
    assert judgement.outcome == PASS and judgement.row is not None
    assert (judgement.row.verdict, judgement.row.expected, judgement.row.digest) == (PASS, PASS, "d1")
    assert judgement.row.figures == {"target_compared": 7, "draft_compared": 7, "mismatched": 0, "kv_sharing_ok": True}
    with pytest.raises(RowMismatch, match="target: .*.mismatched.: 2"):
        judge(row, env, pair, _checker_result(row.source, vllm="0.27.0", transformers="5.14.1", mismatched=2), "d1")
    with pytest.raises(RowMismatch, match="0.26.0"):  # the env is not the row's release
        judge(row, env, pair, _checker_result(row.source, vllm="0.26.0", transformers="5.14.1"), "d1")
    # under transformers >= 5.15 stock 0.27.0 cannot parse the original's config: a clean load contradicts predict
    newer = replace(env, transformers="5.24.0")
    with pytest.raises(RowMismatch):
        judge(replace(row, transformers="newest"), newer, pair,
              _checker_result(row.source, vllm="0.27.0", transformers="5.24.0"), "d1")
    failed = _checker_result(row.source, vllm="0.27.0", transformers="5.24.0")
    failed[1].update(stage_failed="model_config", error_type="AmbiguousGlobalPerLayerAttributeError",
                     error="head_dim is set globally and per layer")
    recorded = judge(replace(row, transformers="newest"), newer, pair, (2, failed[1], ""), "d2").row
    assert (recorded.verdict, recorded.expected) == (FAIL, FAIL)
    assert recorded.detail.startswith("model_config: AmbiguousGlobalPerLayerAttributeError: head_dim")

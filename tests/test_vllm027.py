"""Converted outputs against the REAL stock vLLM 0.27.0 loader, on CPU (docs/VLLM_CHECK.md).

The matrix tests (marker ``vllm027``) write tiny synthetic pairs, convert them with the
`gemma4-convert` CLI, and run scripts/vllm027/check.py as a subprocess inside each vLLM venv
(scripts/vllm027/envs.sh, package `vllm`): one with transformers 5.14.1, one with the newest 5.x. They assert on
the checker's --json result: which stage failed and with which exception, or that every loaded
tensor matched and the KV-sharing geometry is consistent.

Where the venvs are, and what happens without them: tests/_vllm_envs.py.

The unmarked tests at the end check the checker's pure mapping functions in the project venv
(no vLLM needed).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from converter.advice.serving import ServingEnv, config_form, predict
from converter.read.checkpoint import read_checkpoint
from converter.testing.synthetic import fp8_quantization_config, modelopt_nvfp4_config, tiny_preset, write_pair

from _vllm_envs import VllmEnv, find_env

REPO = Path(__file__).resolve().parents[1]
CHECKER = REPO / "scripts" / "vllm027" / "check.py"
# the package whose envs the load check runs in (docs/VLLM_CHECK.md, "Which vLLM package")
LOADER_PACKAGE = "vllm"
AMBIGUOUS = "AmbiguousGlobalPerLayerAttributeError"
CHECK_TIMEOUT_S = 600


# ------------------------------------------------------------------------------------ environments

def loader_env(vllm: str, transformers: str) -> VllmEnv:
    """The `vllm` env for one row; a missing one skips that row (fails it in CI)."""
    return find_env(LOADER_PACKAGE, vllm, transformers)


# ------------------------------------------------------------------------------------ pairs

@dataclass(frozen=True)
class Source:
    preset: str
    dialect: str
    multimodal: bool
    num_shards: int
    fp8: str | None = None  # compressed-tensors weight strategy
    unified: bool = False  # gemma4_unified + gemma4_unified_assistant
    nvfp4: bool = False  # Model Optimizer NVFP4 MLP, attention excluded

    @property
    def quantization(self) -> dict | None:
        if self.nvfp4:
            return modelopt_nvfp4_config()
        return fp8_quantization_config(self.fp8, block=FP8_BLOCK) if self.fp8 else None

    @property
    def loaders_only(self) -> bool:
        """vLLM 0.27 selects no CPU GEMM kernel for these linear layers: the check stands in for it and compares
        the tensors as the weight loaders left them (scripts/vllm027/loader_only.py)."""
        return self.nvfp4 or self.fp8 == "block"

    @property
    def checker_args(self) -> tuple[str, ...]:
        # vLLM's modelopt_fp4 accepts bf16/fp16 activations only (ModelOptNvFp4Config.get_supported_act_dtypes);
        # the bf16 checkpoint loads bit-exactly in bf16
        return ("--dtype", "bfloat16") if self.nvfp4 else ()


SOURCES = {
    # 31B ratios (d=16/D=32, 16->4 global KV heads, k_eq_v), gemma4 wrapper with vision tower, 2 shards + index
    "31b-mm-2shards": Source("31b", "legacy", multimodal=True, num_shards=2),
    # the transformers >= 5.15 dialect (per_layer_config, no flat global keys) as the input
    "31b-per-layer-config": Source("31b", "per_layer_config", multimodal=False, num_shards=1),
    # E2B ratios: KV-shared target tail, per-layer input embeddings, ordered-embedding assistant
    "e2b": Source("e2b", "legacy", multimodal=False, num_shards=1),
    # compressed-tensors FP8 target (per-channel scales), like RedHatAI/gemma-4-31B-it-FP8-dynamic
    "31b-fp8": Source("31b", "legacy", multimodal=False, num_shards=2, fp8="channel"),
    # compressed-tensors FP8 block scales (8x8 at the tiny head_dim 16), like RedHatAI/gemma-4-31B-it-FP8-block
    "31b-fp8-block": Source("31b", "legacy", multimodal=False, num_shards=2, fp8="block"),
    # Model Optimizer NVFP4 MLP with every self_attn module excluded, like nvidia/Gemma-4-31B-IT-NVFP4
    "31b-nvfp4": Source("31b", "legacy", multimodal=False, num_shards=2, nvfp4=True),
    # 26B-A4B ratios with its MoE block (fused experts, router): vLLM splits gate_up_proj into w1/w3 per expert;
    # the comparison covers every expert parameter (nothing missing or unexpected)
    "26b-a4b-moe": Source("26b-a4b", "legacy", multimodal=True, num_shards=2),
    # multimodal, config re-saved by transformers 5.23 (zero-cost to read: vision rope "axial" written back)
    "31b-mm-resaved": Source("31b", "per_layer_config", multimodal=True, num_shards=2),
    # gemma4_unified (12B family: encoder-free vision embedder) with gemma4_unified_assistant
    "31b-unified": Source("31b", "legacy", multimodal=True, num_shards=2, unified=True),
}
VARIANTS = ("original", "per-layer", "pad-global")
FP8_BLOCK = (8, 8)
FLAT_KEYS_ONLY = "per-layer-flat-keys-only"  # per-layer --flat-keys-only (the bare flat keys)
CONVERSIONS = {"per-layer": ("per-layer",), FLAT_KEYS_ONLY: ("per-layer", "--flat-keys-only"),
               "pad-global": ("pad-global",)}


def cpu_has_amx() -> bool:
    """vLLM 0.27's only CPU kernel for block-scaled fp8 (CPUFp8BlockScaledMMKernel) needs AMX tiles."""
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


# What stock vLLM 0.27.0 says when it selects no CPU kernel: (selection function, words of its refusal).
# FP8 block: CPUFp8BlockScaledMMKernel is the CPU's only candidate; is_supported needs AMX tiles, and even with AMX
# can_implement needs 128-column blocks (the tiny checkpoints use 8x8). NVFP4: _POSSIBLE_NVFP4_KERNELS has no CPU
# entry, so the refusal lists no reason at all.
FP8_BLOCK_REFUSAL = ("init_fp8_linear_kernel", "CPUFp8BlockScaledMMKernel")
NVFP4_REFUSAL = ("init_nvfp4_linear_kernel", "Failed to find a kernel that can implement the NVFP4 linear layer")


def kernel_refusal(source: Source) -> tuple[str, str]:
    return NVFP4_REFUSAL if source.nvfp4 else FP8_BLOCK_REFUSAL


def quantized_linear_layers(target: Path) -> int:
    """vLLM linear layers holding a checkpoint weight_scale: fused q/k/v and gate/up count once."""
    names = checkpoint_names(target)
    return sum(1 for n in names if n.endswith(".weight_scale") and not re.search(r"\.(k_proj|v_proj|up_proj)\.", n))


def assert_kernel_refusals(stand_ins: list[dict], source: Source, target: Path) -> None:
    """One refusal, by the expected selection, for every quantized linear layer of the target (the draft has none)."""
    selection, words = kernel_refusal(source)
    assert [row["selection"] for row in stand_ins] == [selection], stand_ins
    assert words in stand_ins[0]["reason"], stand_ins
    if source.fp8 == "block" and not cpu_has_amx():
        assert "requires AMX tile support" in stand_ins[0]["reason"]
    assert stand_ins[0]["layers"] == quantized_linear_layers(target) > 0


def _convert_cli() -> list[str]:
    script = Path(sys.executable).parent / "gemma4-convert"
    return [str(script)] if script.exists() else [shutil.which("gemma4-convert") or "gemma4-convert"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(source, variant) -> directory holding target/ and assistant/."""
    root = tmp_path_factory.mktemp("vllm027")
    out: dict[tuple[str, str], Path] = {}
    for name, src in SOURCES.items():
        original = root / name / "original"
        write_pair(original, preset=tiny_preset(src.preset), dialect=src.dialect, multimodal=src.multimodal,
                   num_shards=src.num_shards, unified=src.unified, quantization=src.quantization)
        out[(name, "original")] = original
        for variant, (layout, *options) in CONVERSIONS.items():
            if variant == FLAT_KEYS_ONLY and name != "31b-mm-2shards":
                continue  # the bare flat keys are the legacy source's keys: one source shows them
            dst = root / name / variant
            proc = subprocess.run(
                [*_convert_cli(), "convert", "--target", str(original / "target"),
                 "--assistant", str(original / "assistant"), "--out", str(dst), "--layout", layout, *options],
                capture_output=True, text=True, timeout=600,
            )
            assert proc.returncode == 0, f"convert {name} --layout {layout}: {proc.stderr.strip()}"
            out[(name, variant)] = dst
    return out


def run_checker(env: VllmEnv, pair: Path, json_path: Path, *options: str) -> tuple[int, dict, str]:
    proc = subprocess.run(
        [str(env.python), str(CHECKER), "--target", str(pair / "target"), "--assistant", str(pair / "assistant"),
         "--json", str(json_path), *options],
        capture_output=True, text=True, timeout=CHECK_TIMEOUT_S,
    )
    output = proc.stdout + proc.stderr
    assert json_path.exists(), f"checker wrote no JSON (exit {proc.returncode}):\n{output[-4000:]}"
    return proc.returncode, json.loads(json_path.read_text()), output


# ------------------------------------------------------------------------------------ expectations

def expected_failure(pair: Path, env: VllmEnv) -> str | None:
    """The stage expected to fail with AmbiguousGlobalPerLayerAttributeError, or None when the row must pass.

    The expectation is what `inspect` predicts (converter/advice/serving.py) for the target's config form in this
    env, so every row also checks the prediction against the real loader: transformers >= 5.15 turns the flat
    global keys into per_layer_config, and 5.14.1 already raises on a config.json that holds per_layer_config;
    vLLM 0.27.0 reads `head_dim` globally in ModelConfig either way. per-layer output carries the dual keys
    (loads everywhere), --flat-keys-only output only the flat keys; pad-global output is homogeneous.
    """
    form = config_form(read_checkpoint(pair / "target").spec, fused=False)
    verdict = predict(form, ServingEnv(vllm=env.vllm, transformers=env.transformers))
    assert verdict.outcome in ("loads", "fails"), verdict
    return None if verdict.outcome == "loads" else "model_config"


def checkpoint_names(target: Path) -> set[str]:
    return set(read_checkpoint(target).tensors)


def kv_shared_layers_without_k(target: Path) -> list[int]:
    """Target KV-shared layers whose k_proj the checkpoint lacks (q-only, as converter.testing.synthetic
    writes them)."""
    config = json.loads((target / "config.json").read_text())
    text = config.get("text_config") or config
    prefix = "model.language_model." if "text_config" in config else "model."
    names = checkpoint_names(target)
    first_shared = text["num_hidden_layers"] - (text.get("num_kv_shared_layers") or 0)
    return [i for i in range(first_shared, text["num_hidden_layers"])
            if f"{prefix}layers.{i}.self_attn.k_proj.weight" not in names]


def assert_all_loaded_and_equal(result: dict, output: str) -> None:
    for side in ("target", "draft"):
        summary = result[side]
        assert summary is not None, f"{side} not compared:\n{output[-4000:]}"
        assert summary["compared"] > 0
        assert (summary["mismatched"], summary["missing"], summary["unexpected"]) == (0, [], []), \
            f"{side}: {summary}\n{output[-4000:]}"


def assert_kv_sharing_consistent(result: dict, source: Source) -> None:
    preset = tiny_preset(source.preset)
    rows = result["kv_sharing"]
    assert [r["draft_layer"] for r in rows] == list(range(len(preset.assistant.layer_types)))
    for row in rows:
        assert row["ok"] and row["draft"] == row["target"], row
        assert row["target_layer"] is not None


# ------------------------------------------------------------------------------------ the matrix

# Negative control: a pad-global target beside the ORIGINAL assistant loads and every tensor
# matches, but the draft's head sizes differ from the target layers whose KV cache they read.
MIXED = "pad-global target + original assistant"
# Rows are chosen for the CI budget (~20 s each, docs/VLLM_CHECK.md "The test matrix"): the full source x layout
# grid where users are today (vLLM 0.27.0 under transformers 5.14.1 and the newest); the zero-cost per-layer layout
# and its control at the transformers boundary (5.15.0) and in between (5.19.0); every layout once on 0.27.1 (its
# Gemma 4 files are byte-identical to 0.27.0) and on 0.28.0, which reads per-layer configs itself, under both
# transformers generations, plus the per_layer_config source there and the KV-shared E2B pair.
ROWS = ([(s, v, "0.27.0", t) for s in SOURCES for v in VARIANTS for t in ("5.14.1", "newest")]
        + [("31b-mm-2shards", FLAT_KEYS_ONLY, "0.27.0", t) for t in ("5.14.1", "newest")]
        + [("31b-mm-2shards", MIXED, "0.27.0", "5.14.1")]
        + [(s, v, "0.27.0", t) for t in ("5.15.0", "5.19.0")
           for s, v in (("31b-mm-2shards", "original"), ("31b-mm-2shards", "per-layer"),
                        ("31b-per-layer-config", "per-layer"))]
        + [("31b-mm-2shards", v, "0.27.1", "newest") for v in VARIANTS]
        + [(s, v, "0.28.0", t) for t in ("5.14.1", "newest")
           for s, v in [("31b-mm-2shards", v) for v in VARIANTS]
           + [("31b-per-layer-config", "original"), ("e2b", "per-layer")]])


def _pair_dir(pairs: dict, tmp_path: Path, source_name: str, variant: str) -> Path:
    if variant != MIXED:
        return pairs[(source_name, variant)]
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "target").symlink_to(pairs[(source_name, "pad-global")] / "target")
    (mixed / "assistant").symlink_to(pairs[(source_name, "original")] / "assistant")
    return mixed


@pytest.mark.vllm027
@pytest.mark.parametrize(("source_name", "variant", "vllm", "transformers"), ROWS,
                         ids=lambda v: v.replace(" ", ""))
def test_stock_vllm_load(pairs, tmp_path, source_name, variant, vllm, transformers):
    source, env = SOURCES[source_name], loader_env(vllm, transformers)
    pair = _pair_dir(pairs, tmp_path, source_name, variant)
    options = (*source.checker_args, *(("--loaders-only",) if source.loaders_only else ()))
    code, result, output = run_checker(env, pair, tmp_path / "result.json", *options)
    assert result["versions"]["vllm"] == vllm
    assert result["versions"]["transformers"] == env.transformers

    if variant == MIXED:
        assert (code, result["stage_failed"], result["checks_failed"]) == (1, "kv_sharing", ["kv_sharing"]), \
            output[-4000:]
        assert result["target"]["mismatched"] == 0 and result["draft"]["mismatched"] == 0
        bad = [r for r in result["kv_sharing"] if not r["ok"]]
        assert bad and all(r["draft"] != r["target"] for r in bad)
        return

    failing_stage = expected_failure(pair, env)
    if failing_stage is not None:
        # the bug the converter fixes: stock 0.27.0 cannot even parse the config
        assert (code, result["stage_failed"], result["error_type"]) == (2, failing_stage, AMBIGUOUS), output[-4000:]
        assert "head_dim" in result["error"]
        return

    if source.loaders_only:
        assert result["compared_at"] == "weight_loaders"
        assert_kernel_refusals(result["kernel_stand_ins"], source, pair / "target")

    q_only = kv_shared_layers_without_k(pair / "target")
    if q_only:
        # vLLM 0.27.0 builds k_norm/qkv_proj on every target layer and its loader raises when the
        # checkpoint lacks them; published E2B checkpoints carry them (transformers 5.14.1
        # Gemma4TextModel lists them in _keys_to_ignore_on_load_unexpected). The factory writes
        # q-only KV-shared layers, so only the draft can be checked here.
        assert (code, result["stage_failed"], result["error_type"]) == (2, "load_target", "ValueError"), \
            output[-4000:]
        assert "k_norm" in result["error"]
        draft = result["draft"]
        assert draft is not None and (draft["mismatched"], draft["missing"], draft["unexpected"]) == (0, [], [])
        pytest.xfail(f"synthetic {source.preset} target has q-only KV-shared layers {q_only}: "
                     "stock vLLM 0.27.0 requires their k_proj/v_proj/k_norm")

    assert code == 0 and result["stage_failed"] is None, output[-4000:]
    assert result["checks_failed"] == []
    assert_all_loaded_and_equal(result, output)
    assert_kv_sharing_consistent(result, source)


# The stock kernel selection, not stood in for: on this CPU vLLM 0.27.0 refuses these targets while BUILDING them
# (FP8 block: the last statement of CompressedTensorsW8A8Fp8.create_weights; NVFP4: ModelOptNvFp4LinearMethod's
# constructor), which keeps true what docs/VLLM_CHECK.md says the loaders-only rows do not exercise.
@pytest.mark.vllm027
@pytest.mark.parametrize("source_name", [name for name, src in SOURCES.items() if src.loaders_only])
def test_stock_kernel_selection_refuses_on_this_cpu(pairs, tmp_path, source_name):
    source, env = SOURCES[source_name], loader_env("0.27.0", "5.14.1")
    code, result, output = run_checker(env, pairs[(source_name, "original")], tmp_path / "result.json",
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

    select = module._selection_with_stand_in(refuse, "init_x_kernel", rec)
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

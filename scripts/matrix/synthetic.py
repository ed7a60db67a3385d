"""Synthetic Gemma 4 checkpoints with real config files, tensor names and (optionally) real shapes.

No weights can be downloaded where this project is built and tested, so tests, the demo and the
benchmarks all use this factory. Tensor names follow transformers 5.23's Gemma 4 modules
(`tests/test_synthetic.py` checks them against a meta-device model).

Config files: "legacy" is the published Hub file (written by transformers 5.5, before per_layer_config
existed; nothing here can produce it, so it is written out). Every other dialect is what transformers'
own config classes and `save_pretrained` make of that file (scripts/matrix/resave.py), in this process or
under another interpreter's transformers (`saved_by`), never an imitation.

Geometry sources: the 31B target and assistant numbers are from their published config.json
(docs/DESIGN.md "Checkpoints"). The 26B-A4B target's attention and MoE numbers are from docs/DESIGN.md "Checkpoints"
and "Gemma 4 checkpoints in the wild"; its MoE block is written with transformers' own names and shapes (fused
`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I], `router.proj`/`router.scale`/`router.per_expert_scale`
and the three extra layernorms). E2B/E4B and the 26B-A4B assistant's hidden/intermediate sizes are approximations of the
public configs: attention ratios (head_dim 256/512, no k_eq_v, KV-shared tail layers, per-layer
input embeddings, ordered-embedding assistants) are what matters to the converter.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors.torch import save_file

from converter.gemma4 import FULL, SLIDING, text_config_of
from converter.quantization import weight_scheme

S, F = SLIDING, FULL


@dataclass(frozen=True)
class AssistantShape:
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    use_ordered_embeddings: bool
    num_centroids: int = 2048


@dataclass(frozen=True)
class Preset:
    """The numbers that fix a target/assistant pair's tensor shapes."""

    name: str
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    num_global_kv_heads: int
    head_dim: int
    global_head_dim: int
    k_eq_v: bool
    vocab_size: int
    sliding_window: int
    num_kv_shared_layers: int
    per_layer_input_size: int
    moe: bool
    assistant: AssistantShape
    vision_hidden_size: int = 1152
    num_experts: int = 0  # MoE block (moe=True): routed experts, experts per token, expert width
    top_k_experts: int = 0
    moe_intermediate_size: int = 0


PRESETS: dict[str, Preset] = {
    "31b": Preset("31b", 5376, 21504, (S,) * 5 + (F,), 32, 16, 4, 256, 512, True, 262144, 1024, 0, 0, False,
                  AssistantShape(1024, 8192, (S, S, S, F), False)),
    "26b-a4b": Preset("26b-a4b", 2816, 2112, (S,) * 5 + (F,), 16, 8, 2, 256, 512, True, 262144, 1024, 0, 0, True,
                      AssistantShape(1024, 8192, (S, S, S, F), False),
                      num_experts=128, top_k_experts=8, moe_intermediate_size=704),
    # Gemma 4 12B (gemma4_unified): 48 layers, 16 heads, sliding 8 KV x 256, full 1 KV x 512, k_eq_v (read: sglang's
    # gemma4_unified config fixture quoting google/gemma-4-12B-it); hidden / MLP widths not read: Gemma 3 12B's
    "12b": Preset("12b", 3840, 15360, (S,) * 5 + (F,), 16, 8, 1, 256, 512, True, 262144, 1024, 0, 0, False,
                  AssistantShape(1024, 8192, (S, S, S, F), False)),
    "e2b": Preset("e2b", 1536, 6144, (S,) * 4 + (F,), 8, 1, 1, 256, 512, False, 262144, 512, 20, 256, False,
                  AssistantShape(256, 2048, (S, S, S, F), True)),
    "e4b": Preset("e4b", 2560, 10240, (S,) * 5 + (F,), 8, 2, 2, 256, 512, False, 262144, 512, 18, 256, False,
                  AssistantShape(256, 2048, (S, S, S, F), True)),
}
# Real decoder layer counts; a preset's layer_types above hold one period of the pattern.
REAL_LAYERS = {"31b": 60, "26b-a4b": 30, "12b": 48, "e2b": 35, "e4b": 42}


def _pattern(period: tuple[str, ...], count: int) -> tuple[str, ...]:
    types = [period[i % len(period)] for i in range(count)]
    types[-1] = FULL  # transformers forces the last layer to full attention
    return tuple(types)


def scaled_preset(name: str, *, width_divisor: int = 1, num_layers: int | None = None,
                  vocab_size: int | None = None) -> Preset:
    """A preset shrunk for tests: widths divided (head counts and ratios kept), fewer layers, smaller vocab.

    Args:
        name: one of PRESETS.
        width_divisor: divides hidden, intermediate, head dims and the assistant's widths.
        num_layers: target decoder layers (the real pattern, truncated; default: the real count).
        vocab_size: embedding rows (default: the real vocab divided by width_divisor).

    Returns:
        The scaled Preset.
    """
    base = PRESETS[name]
    layers = num_layers or REAL_LAYERS[name]
    shared = 0
    if base.num_kv_shared_layers:
        # keep a producer of each layer type before the KV-shared tail (transformers insists)
        shared = min(base.num_kv_shared_layers, layers - len(base.layer_types))
    div = width_divisor
    assistant = replace(base.assistant, hidden_size=base.assistant.hidden_size // div,
                        intermediate_size=base.assistant.intermediate_size // div,
                        num_centroids=max(base.assistant.num_centroids // div, 4))
    experts = max(base.num_experts // div, 4) if base.moe else 0
    return replace(base, hidden_size=base.hidden_size // div, intermediate_size=base.intermediate_size // div,
                   num_experts=experts, top_k_experts=min(base.top_k_experts, experts // 2),
                   moe_intermediate_size=base.moe_intermediate_size // div,
                   layer_types=_pattern(base.layer_types, layers), head_dim=base.head_dim // div,
                   global_head_dim=base.global_head_dim // div, vocab_size=vocab_size or base.vocab_size // div,
                   sliding_window=max(base.sliding_window // div, 4), num_kv_shared_layers=shared,
                   per_layer_input_size=base.per_layer_input_size // div,
                   vision_hidden_size=max(base.vision_hidden_size // div, 16), assistant=assistant)


def tiny_preset(name: str = "31b", *, width_divisor: int = 16) -> Preset:
    """KB-sized pair with the real ratios (d=16, D=32 for 31B), for unit tests; width_divisor 8 gives widths
    that are multiples of 32 (hidden 672), what vLLM's CPU int4 kernel requires."""
    period = len(PRESETS[name].layer_types)
    layers = 2 * period if PRESETS[name].num_kv_shared_layers else period
    small = scaled_preset(name, width_divisor=width_divisor, num_layers=layers, vocab_size=256)
    return replace(small, intermediate_size=2 * small.hidden_size, vision_hidden_size=16,
                   assistant=replace(small.assistant, intermediate_size=2 * small.assistant.hidden_size))


# ---------------------------------------------------------------------------------------------- configs

def _attention_keys(*, head_dim: int, global_head_dim: int, num_kv: int, num_global_kv: int, k_eq_v: bool,
                    layer_types: tuple[str, ...]) -> dict:
    """The flat geometry keys of the published (legacy) dialect."""
    return {"head_dim": head_dim, "global_head_dim": global_head_dim, "num_key_value_heads": num_kv,
            "num_global_key_value_heads": num_global_kv, "attention_k_eq_v": k_eq_v, "layer_types": list(layer_types)}


def _rope_parameters() -> dict:
    return {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}}


def target_text_config(p: Preset) -> dict:
    """The gemma4_text config of a target, as the published (legacy) file has it."""
    config = {
        "model_type": "gemma4_text", "hidden_size": p.hidden_size, "intermediate_size": p.intermediate_size,
        "num_hidden_layers": len(p.layer_types), "num_attention_heads": p.num_heads,
        **_attention_keys(head_dim=p.head_dim, global_head_dim=p.global_head_dim, num_kv=p.num_kv_heads,
                          num_global_kv=p.num_global_kv_heads, k_eq_v=p.k_eq_v, layer_types=p.layer_types),
        "vocab_size": p.vocab_size, "sliding_window": p.sliding_window, "rope_parameters": _rope_parameters(),
        "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 262144,
        "final_logit_softcapping": 30.0, "tie_word_embeddings": True, "attention_bias": False,
        "num_kv_shared_layers": p.num_kv_shared_layers,
        "hidden_size_per_layer_input": p.per_layer_input_size,
        "vocab_size_per_layer_input": p.vocab_size if p.per_layer_input_size else 0,
        "enable_moe_block": p.moe, "use_double_wide_mlp": False, "dtype": "bfloat16",
    }
    if p.moe:
        config.update(num_experts=p.num_experts, top_k_experts=p.top_k_experts,
                      moe_intermediate_size=p.moe_intermediate_size)
    return config


def _vision_config(p: Preset) -> dict:
    return {"model_type": "gemma4_vision", "hidden_size": p.vision_hidden_size,
            "intermediate_size": 4 * p.vision_hidden_size, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 2, "head_dim": p.vision_hidden_size // 2, "patch_size": 16,
            "position_embedding_size": 10240, "pooling_kernel_size": 3, "rms_norm_eps": 1e-6,
            # what Hub files written before transformers 5.15 say (5.15+ re-saves it as "axial",
            # docs/DESIGN.md "Gemma 4 checkpoints in the wild")
            "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"},
            "hidden_activation": "gelu_pytorch_tanh", "dtype": "bfloat16"}


def target_config(p: Preset, *, dialect: str, multimodal: bool, saved_by: str | None = None) -> dict:
    """A target's config.json in `dialect`, re-saved by `saved_by`'s transformers when given (see in_dialect)."""
    return in_dialect({"config": _hub_target_config(p, multimodal=multimodal)}, dialect, saved_by=saved_by)["config"]


def assistant_config(p: Preset, *, dialect: str, saved_by: str | None = None) -> dict:
    """An assistant's config.json in `dialect`, re-saved by `saved_by`'s transformers when given (see in_dialect)."""
    return in_dialect({"config": _hub_assistant_config(p)}, dialect, saved_by=saved_by)["config"]


def _hub_target_config(p: Preset, *, multimodal: bool) -> dict:
    text = target_text_config(p)
    if not multimodal:
        return {"architectures": ["Gemma4ForCausalLM"], **text, "transformers_version": "5.5.0"}
    return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": text,
            "vision_config": _vision_config(p), "audio_config": None, "boi_token_id": 255999,
            "eoi_token_id": 258882, "image_token_id": 258880, "video_token_id": 258884,
            "tie_word_embeddings": True, "dtype": "bfloat16", "transformers_version": "5.5.0"}


def _hub_assistant_config(p: Preset) -> dict:
    a = p.assistant
    text = {
        "model_type": "gemma4_text", "hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size,
        "num_hidden_layers": len(a.layer_types), "num_attention_heads": p.num_heads,
        **_attention_keys(head_dim=p.head_dim, global_head_dim=p.global_head_dim, num_kv=p.num_kv_heads,
                          num_global_kv=p.num_global_kv_heads, k_eq_v=p.k_eq_v, layer_types=a.layer_types),
        "num_kv_shared_layers": len(a.layer_types), "vocab_size": p.vocab_size,
        "sliding_window": p.sliding_window, "rope_parameters": _rope_parameters(), "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 262144,
        "final_logit_softcapping": 30.0, "tie_word_embeddings": True, "attention_bias": False,
        "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0, "enable_moe_block": False,
        "use_double_wide_mlp": False, "dtype": "bfloat16",
    }
    return {"architectures": ["Gemma4AssistantForCausalLM"], "model_type": "gemma4_assistant",
            "backbone_hidden_size": p.hidden_size, "text_config": text,
            "use_ordered_embeddings": a.use_ordered_embeddings, "num_centroids": a.num_centroids,
            "centroid_intermediate_top_k": 32, "tie_word_embeddings": True, "dtype": "bfloat16",
            "transformers_version": "5.5.0"}


# ---------------------------------------------------------------------------------------------- dialects

DIALECTS = ("legacy", "per_layer_config", "both")
_RESAVE_SCRIPT = Path(__file__).with_name("resave.py")


def resave_documents(documents: dict[str, dict], *, python: str | None = None) -> tuple[str, dict[str, dict]]:
    """(transformers version, documents) after transformers' `save_pretrained`: this process's, or `python`'s.

    Another interpreter runs scripts/matrix/resave.py by path (it needs only transformers there), one process for
    all documents.

    Raises:
        RuntimeError: the other interpreter failed (its last stderr line is in the message).
    """
    if python is None:
        from .resave import resave_config, transformers_version
        return transformers_version(), {name: resave_config(doc) for name, doc in documents.items()}
    proc = subprocess.run([python, str(_RESAVE_SCRIPT)], input=json.dumps(documents), capture_output=True, text=True,
                          timeout=600, check=False)
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{python} {_RESAVE_SCRIPT.name} failed (exit {proc.returncode}): {last}")
    result = json.loads(proc.stdout)
    return result["transformers"], result["configs"]


def in_dialect(documents: dict[str, dict], dialect: str, *, saved_by: str | None = None) -> dict[str, dict]:
    """Published (legacy) config documents turned into `dialect` by the producer that writes it.

    legacy without saved_by: the published files as they are. Otherwise the files go through transformers'
    `save_pretrained` (saved_by: the python whose transformers does it; default: this process): transformers
    >= 5.15 writes per_layer_config (zero-padded keys, flat global keys popped), 5.14.1 the legacy keys.
    "both" then puts the flat keys back beside per_layer_config (the hand edit of docs/DESIGN.md
    "Zero-cost serving with the dual-keys recipe").

    Raises:
        ValueError: unknown dialect, or the producer does not write the requested one (e.g. per_layer_config
            asked of transformers 5.14.1).
    """
    if dialect not in DIALECTS:
        raise ValueError(f"unknown dialect {dialect!r}; known: {', '.join(DIALECTS)}")
    if dialect == "legacy" and saved_by is None:
        return copy.deepcopy(documents)
    version, saved = resave_documents(documents, python=saved_by)
    for name, doc in saved.items():
        text = text_config_of(doc)
        wrote = "per_layer_config" if "per_layer_config" in text else "legacy"
        heterogeneous = _heterogeneous(text_config_of(documents[name]))
        if heterogeneous and wrote != ("legacy" if dialect == "legacy" else "per_layer_config"):
            raise ValueError(f"transformers {version} writes the {wrote} dialect, not {dialect}")
        if dialect == "both":
            original = text_config_of(documents[name])
            text.update({k: original[k] for k in ("global_head_dim", "num_global_key_value_heads")})
        _keep_released_vision_keys(doc, documents[name])
    return saved


def _keep_released_vision_keys(saved: dict, published: dict) -> None:
    """Puts back the vision_config keys save_pretrained drops as derived (model_patch_size): Google's per_layer_config
    12B file spells them out (UNIFIED_VISION)."""
    vision, released = saved.get("vision_config"), published.get("vision_config")
    if isinstance(vision, dict) and isinstance(released, dict):
        vision.update({k: released[k] for k in RELEASED_VISION_KEYS if k in released and k not in vision})


def _heterogeneous(text: dict) -> bool:
    return (text["head_dim"] != text["global_head_dim"]
            or (text["attention_k_eq_v"] and text["num_key_value_heads"] != text["num_global_key_value_heads"]))


# ---------------------------------------------------------------------------------------------- tensors

@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    kind: str  # "linear" (fan-in scaled), "norm" (around 1), "embedding", "ordering"


def _moe_block(base: str, p: Preset) -> Iterator[TensorSpec]:
    """Gemma4TextRouter + Gemma4TextExperts + the block's extra norms (transformers modeling_gemma4.py), fused
    experts as transformers stores them: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    hidden, experts, width = p.hidden_size, p.num_experts, p.moe_intermediate_size
    yield TensorSpec(base + "router.proj.weight", (experts, hidden), "linear")
    yield TensorSpec(base + "router.scale", (hidden,), "norm")
    yield TensorSpec(base + "router.per_expert_scale", (experts,), "norm")
    yield TensorSpec(base + "experts.gate_up_proj", (experts, 2 * width, hidden), "linear")
    yield TensorSpec(base + "experts.down_proj", (experts, hidden, width), "linear")
    for norm in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
        yield TensorSpec(base + norm + ".weight", (hidden,), "norm")


def _decoder_layer(prefix: str, i: int, *, hidden: int, inter: int, p: Preset, layer_type: str,
                   q_only: bool, fused_qkv: bool, ple: int, moe: bool = False) -> Iterator[TensorSpec]:
    full = layer_type == FULL
    hd = p.global_head_dim if full else p.head_dim
    kv = p.num_global_kv_heads if (full and p.k_eq_v) else p.num_kv_heads
    has_v = not (full and p.k_eq_v)
    base = f"{prefix}layers.{i}."
    yield TensorSpec(base + "layer_scalar", (1,), "norm")
    q_rows, k_rows, v_rows = p.num_heads * hd, kv * hd, (kv * hd if has_v else 0)
    if q_only:
        yield TensorSpec(base + "self_attn.q_proj.weight", (q_rows, hidden), "linear")
    elif fused_qkv:
        yield TensorSpec(base + "self_attn.qkv_proj.weight", (q_rows + k_rows + v_rows, hidden), "linear")
    else:
        yield TensorSpec(base + "self_attn.q_proj.weight", (q_rows, hidden), "linear")
        yield TensorSpec(base + "self_attn.k_proj.weight", (k_rows, hidden), "linear")
        if has_v:
            yield TensorSpec(base + "self_attn.v_proj.weight", (v_rows, hidden), "linear")
    yield TensorSpec(base + "self_attn.q_norm.weight", (hd,), "norm")
    if not q_only:
        yield TensorSpec(base + "self_attn.k_norm.weight", (hd,), "norm")
    yield TensorSpec(base + "self_attn.o_proj.weight", (hidden, p.num_heads * hd), "linear")
    yield TensorSpec(base + "mlp.gate_proj.weight", (inter, hidden), "linear")
    yield TensorSpec(base + "mlp.up_proj.weight", (inter, hidden), "linear")
    yield TensorSpec(base + "mlp.down_proj.weight", (hidden, inter), "linear")
    for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"):
        yield TensorSpec(base + norm + ".weight", (hidden,), "norm")
    if ple:
        yield TensorSpec(base + "per_layer_input_gate.weight", (ple, hidden), "linear")
        yield TensorSpec(base + "per_layer_projection.weight", (hidden, ple), "linear")
        yield TensorSpec(base + "post_per_layer_input_norm.weight", (hidden,), "norm")
    if moe:
        yield from _moe_block(base, p)


def _vision_tensors(p: Preset) -> Iterator[TensorSpec]:
    h = p.vision_hidden_size
    yield TensorSpec("model.vision_tower.patch_embedder.position_embedding_table", (2, 10240, h), "embedding")
    yield TensorSpec("model.vision_tower.patch_embedder.input_proj.weight", (h, 3 * 16 * 16), "linear")
    for i in range(2):
        base = f"model.vision_tower.encoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            yield TensorSpec(base + f"self_attn.{proj}.linear.weight", (h, h), "linear")
        yield TensorSpec(base + "self_attn.q_norm.weight", (h // 2,), "norm")
        yield TensorSpec(base + "self_attn.k_norm.weight", (h // 2,), "norm")
        yield TensorSpec(base + "mlp.gate_proj.linear.weight", (4 * h, h), "linear")
        yield TensorSpec(base + "mlp.up_proj.linear.weight", (4 * h, h), "linear")
        yield TensorSpec(base + "mlp.down_proj.linear.weight", (h, 4 * h), "linear")
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            yield TensorSpec(base + norm + ".weight", (h,), "norm")
    yield TensorSpec("model.embed_vision.embedding_projection.weight", (p.hidden_size, h), "linear")


def target_tensors(p: Preset, *, multimodal: bool, fused_qkv: bool = False) -> list[TensorSpec]:
    prefix = "model.language_model." if multimodal else "model."
    specs = [TensorSpec(prefix + "embed_tokens.weight", (p.vocab_size, p.hidden_size), "embedding")]
    # KV-shared tail layers keep their (unused) k_proj/v_proj/k_norm, as published E2B/E4B checkpoints do
    for i, layer_type in enumerate(p.layer_types):
        specs += _decoder_layer(prefix, i, hidden=p.hidden_size, inter=p.intermediate_size, p=p,
                                layer_type=layer_type, q_only=False, fused_qkv=fused_qkv,
                                ple=p.per_layer_input_size, moe=p.moe)
    specs.append(TensorSpec(prefix + "norm.weight", (p.hidden_size,), "norm"))
    if p.per_layer_input_size:
        total = len(p.layer_types) * p.per_layer_input_size
        specs += [TensorSpec(prefix + "embed_tokens_per_layer.weight", (p.vocab_size, total), "embedding"),
                  TensorSpec(prefix + "per_layer_model_projection.weight", (total, p.hidden_size), "linear"),
                  TensorSpec(prefix + "per_layer_projection_norm.weight", (p.per_layer_input_size,), "norm")]
    if multimodal:
        specs += _vision_tensors(p)
    return specs


def assistant_tensors(p: Preset) -> list[TensorSpec]:
    a = p.assistant
    specs = [TensorSpec("model.embed_tokens.weight", (p.vocab_size, a.hidden_size), "embedding")]
    for i, layer_type in enumerate(a.layer_types):
        specs += _decoder_layer("model.", i, hidden=a.hidden_size, inter=a.intermediate_size, p=p,
                                layer_type=layer_type, q_only=True, fused_qkv=False, ple=0)
    specs += [TensorSpec("model.norm.weight", (a.hidden_size,), "norm"),
              TensorSpec("pre_projection.weight", (a.hidden_size, 2 * p.hidden_size), "linear"),
              TensorSpec("post_projection.weight", (p.hidden_size, a.hidden_size), "linear")]
    if a.use_ordered_embeddings:
        specs += [TensorSpec("masked_embedding.centroids.weight", (a.num_centroids, a.hidden_size), "linear"),
                  TensorSpec("masked_embedding.token_ordering", (p.vocab_size,), "ordering")]
    return specs


DEFAULT_IGNORE = ("lm_head", "re:.*vision_tower.*", "re:.*embed_vision.*")
W4A16_GROUP = 32  # google/gemma-4-*-it-qat-w4a16-ct: int4 symmetric, group 32, weight-only


def preset_scheme(preset: str, **weights):
    """compressed-tensors' preset scheme `preset` (llm-compressor's `scheme=` names: FP8_DYNAMIC, FP8_BLOCK, W4A16,
    W8A16, W8A8, ...) for Linear layers, with the weights fields in `weights` replaced; a block scheme's dynamic
    activation groups follow the block's columns."""
    from compressed_tensors.quantization import preset_name_to_scheme
    scheme = preset_name_to_scheme(preset, ["Linear"])
    update = {"weights": scheme.weights.model_copy(update=weights)}
    if "block_structure" in weights and scheme.input_activations is not None:
        update["input_activations"] = scheme.input_activations.model_copy(
            update={"group_size": weights["block_structure"][1]})
    return scheme.model_copy(update=update)


def preset_quantization_config(preset: str, *, ignore: tuple[str, ...] = (), **weights) -> dict:
    """The quantization_config compressed-tensors' ModelCompressor writes for `preset` (preset_scheme), its format
    inferred by compressed-tensors itself as llm-compressor does (pack-quantized weight-only ints, int-quantized
    W8A8, float-quantized fp8); vision, embeddings and lm_head stay bf16 as in the published checkpoints."""
    import compressed_tensors
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationConfig
    scheme = preset_scheme(preset, **weights)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=[*DEFAULT_IGNORE, *ignore],
                                format=infer_module_format(torch.nn.Linear, scheme).value,
                                quantization_status="compressed")
    return {"version": compressed_tensors.__version__, "quant_method": "compressed-tensors", "sparsity_config": {},
            "transform_config": {}, **config.model_dump(exclude=["quant_method"])}


def fp8_quantization_config(strategy: str = "channel", ignore: tuple[str, ...] = (),
                            block: tuple[int, int] = (128, 128)) -> dict:
    """FP8 like RedHatAI's gemma-4-31B-it checkpoints: "channel" (FP8_DYNAMIC, -FP8-dynamic), "tensor" (FP8_DYNAMIC
    with one weight scale), "block" (FP8_BLOCK, -FP8-block)."""
    if strategy == "block":
        return preset_quantization_config("FP8_BLOCK", ignore=ignore, block_structure=list(block))
    return preset_quantization_config("FP8_DYNAMIC", ignore=ignore, strategy=strategy)


def w4a16_quantization_config(*, group: int = W4A16_GROUP, ignore: tuple[str, ...] = ()) -> dict:
    """Google's QAT W4A16 checkpoints (google/gemma-4-*-it-qat-w4a16-ct): pack-quantized int4 symmetric, group 32,
    weight-only."""
    return preset_quantization_config("W4A16", ignore=ignore, group_size=group)


def int8_quantization_config(preset: str, *, ignore: tuple[str, ...] = ()) -> dict:
    """int8 per output channel: "W8A16" weight-only (pack-quantized, llm-compressor's W8A16 preset) or "W8A8" with
    dynamic per-token int8 activations (int-quantized, llm-compressor's W8A8 preset, as community 26B-A4B QAT repacks
    such as xbill9/gemma-4-26B-A4B-it-qat-w8a8-int8 use)."""
    return preset_quantization_config(preset, ignore=ignore, strategy="channel", group_size=None)


def config_scheme(quantization: dict):
    """The compressed-tensors QuantizationScheme of a config's one group (the factory writes one)."""
    from compressed_tensors.quantization import QuantizationScheme
    return QuantizationScheme.model_validate(quantization["config_groups"]["group_0"])


def _absmax(values: torch.Tensor, args) -> torch.Tensor:
    """One absolute maximum per scale of `args`' strategy: per row, per group of columns, per block, or one."""
    rows, columns = values.shape
    if args.strategy == "channel":
        return values.abs().amax(dim=1, keepdim=True)
    if args.strategy == "group":
        if columns % args.group_size:
            raise ValueError(f"synthetic group {args.group_size} must tile the {columns} input columns")
        return values.reshape(rows, columns // args.group_size, args.group_size).abs().amax(-1)
    if args.strategy == "block":
        block_rows, block_columns = args.block_structure
        if rows % block_rows or columns % block_columns:
            raise ValueError(f"synthetic block {args.block_structure} must tile the weight shape {[rows, columns]}")
        blocks = values.reshape(rows // block_rows, block_rows, columns // block_columns, block_columns)
        return blocks.abs().amax(dim=(1, 3))
    if args.strategy == "tensor":
        return values.abs().amax().reshape(1)
    raise ValueError(f"the synthetic factory writes no {args.strategy} weight scales")


def compress_weight(weight: torch.Tensor, quantization: dict) -> dict[str, torch.Tensor]:
    """`weight` as compressed-tensors stores it under `quantization`: scales from its calculate_qparams (one absmax
    per channel, group, block or tensor), codes from the compressor of the config's format (`weight` int8 / fp8, or
    `weight_packed` int32 + `weight_shape`), `weight_scale` in the weight's dtype."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils import calculate_qparams
    scheme = config_scheme(quantization)
    amax = _absmax(weight.float(), scheme.weights)
    scale, _ = calculate_qparams(-amax, amax, scheme.weights)
    compressor = BaseCompressor.get_value_from_registry(quantization["format"])
    return compressor.compress({"weight": weight, "weight_scale": scale.to(weight.dtype)}, scheme)


NVFP4_GROUP = 16
MODELOPT_EXCLUDE = ("lm_head", "*self_attn*", "*vision_tower*", "*embed_vision*")


def modelopt_nvfp4_config(exclude: tuple[str, ...] = MODELOPT_EXCLUDE) -> dict:
    """config.json quantization_config of a Model Optimizer NVFP4 export (W4A4, group 16) in the form vLLM 0.27's
    ModelOptQuantConfigBase.from_config reads (quant_method/quant_algo/group_size/ignore); the default excludes
    every self_attn module, like nvidia/Gemma-4-31B-IT-NVFP4. KV-cache quantization is not modelled (no k/v
    scale tensors are written), so none is declared."""
    return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": NVFP4_GROUP, "kv_cache_scheme": None,
            "ignore": list(exclude), "producer": {"name": "modelopt", "version": "synthetic"}}


def hf_quant_config(config: dict) -> dict:
    """hf_quant_config.json beside config.json, the file Model Optimizer writes (same facts, its own keys)."""
    return {"producer": config["producer"],
            "quantization": {"quant_algo": config["quant_algo"], "kv_cache_quant_algo": None,
                             "group_size": config["group_size"], "exclude_modules": config["ignore"]}}


def quantize_nvfp4(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """NVFP4 as Model Optimizer stores it: packed e2m1 pairs `weight` uint8 [out, in/2], fp8 `weight_scale`
    [out, in/16] per group, fp32 `weight_scale_2` (global, scalar) and `input_scale` (scalar); values packed by
    compressed-tensors' quantize_and_pack_fp4 (the same e2m1 packing vLLM's NVFP4 kernels read)."""
    from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4
    rows, columns = weight.shape
    values = weight.float()
    global_scale = 448.0 * 6.0 / values.abs().amax().clamp(min=1e-12)
    group_amax = values.reshape(rows, columns // NVFP4_GROUP, NVFP4_GROUP).abs().amax(-1)
    scale = (group_amax / 6.0 * global_scale).to(torch.float8_e4m3fn)
    packed = quantize_and_pack_fp4(values, scale.float(), global_scale=global_scale, group_size=NVFP4_GROUP)
    return {"": packed, "_scale": scale, "_scale_2": (1.0 / global_scale).reshape(()).float(),
            "input_scale": torch.tensor(1.0, dtype=torch.float32)}


def _quantized_module(spec: TensorSpec, quantization: dict | None) -> str | None:
    if quantization is None or spec.kind != "linear" or not spec.name.endswith("_proj.weight"):
        return None
    module = spec.name[: -len(".weight")]
    if ".layers." not in module or weight_scheme(quantization, module) is None:
        return None
    return module


def _materialize(spec: TensorSpec, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    if spec.kind == "ordering":
        return torch.randperm(spec.shape[0], generator=generator)
    values = torch.randn(spec.shape, generator=generator, dtype=torch.float32)
    if spec.kind == "linear":
        values /= spec.shape[-1] ** 0.5
    elif spec.kind == "norm":
        values = 1.0 + 0.1 * values
    return values.to(dtype)


# ---------------------------------------------------------------------------------------------- files

SIDE_FILES = {
    "tokenizer.json": '{"version": "1.0", "model": {"type": "synthetic"}}\n',
    "tokenizer_config.json": '{"tokenizer_class": "GemmaTokenizer"}\n',
    "generation_config.json": '{"bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0}\n',
    "chat_template.jinja": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}\n",
    "README.md": "# Synthetic Gemma 4 checkpoint\n\nRandom weights written by gemma4-convert's factory.\n",
}


def _split_into_shards(specs: list[TensorSpec], num_shards: int, itemsize: int) -> list[list[TensorSpec]]:
    total = sum(itemsize * math.prod(s.shape) for s in specs)
    shards: list[list[TensorSpec]] = [[]]
    filled = 0
    for spec in specs:
        if filled >= total * len(shards) / num_shards and len(shards) < num_shards:
            shards.append([])
        shards[-1].append(spec)
        filled += itemsize * math.prod(spec.shape)
    return shards


def _materialize_all(group: list[TensorSpec], dtype: torch.dtype, generator: torch.Generator,
                     quantization: dict | None) -> dict[str, torch.Tensor]:
    tensors = {}
    for spec in group:
        values = _materialize(spec, dtype, generator)
        if _quantized_module(spec, quantization) and quantization.get("quant_method") == "modelopt":
            for suffix, tensor in quantize_nvfp4(values).items():
                # `weight`, `weight_scale`, `weight_scale_2`; the activation scale sits beside the weight
                tensors[spec.name[:-len("weight")] + suffix if suffix == "input_scale" else spec.name + suffix] = tensor
        elif _quantized_module(spec, quantization):
            stem = spec.name[:-len("weight")]
            for name, tensor in compress_weight(values, quantization).items():
                tensors[stem + name] = tensor
        else:
            tensors[spec.name] = values
    return tensors


def write_tensors(out_dir: Path, specs: list[TensorSpec], *, num_shards: int = 1, dtype: torch.dtype = torch.bfloat16,
                  seed: int = 0, quantization: dict | None = None) -> None:
    """Writes seeded random tensors as safetensors shards (+ index when more than one), one shard in memory."""
    generator = torch.Generator().manual_seed(seed)
    groups = _split_into_shards(specs, num_shards, torch.finfo(dtype).bits // 8)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    weight_map, total = {}, 0
    for file_name, group in zip(names, groups):
        tensors = _materialize_all(group, dtype, generator, quantization)
        save_file(tensors, str(out_dir / file_name), metadata={"format": "pt"})
        for name, tensor in tensors.items():
            weight_map[name] = file_name
            total += tensor.numel() * tensor.element_size()
        del tensors
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# patch_size x pooling_kernel_size as released (16 x 3 = 48-pixel model patches, a 6912-wide patch_ln1): transformers
# derives model_patch_size from the two, mlx-vlm 0.7.10 reads it as a field defaulting to 48, so a smaller product
# loads in transformers and not in mlx-vlm (measured: "Expected shape (6912,) but received shape (48,) for parameter
# vision_embedder.patch_ln1.weight"), where Google's 12B loads in both. The released config.json also spells out
# model_patch_size and num_soft_tokens (docs/DESIGN.md "The 12B family's floors"); transformers' save_pretrained drops
# model_patch_size (a derived property), and SGLang 0.5.23, which parses gemma4_unified with transformers' Gemma4Config,
# reads it as a plain key.
RELEASED_VISION_KEYS = ("model_patch_size",)
UNIFIED_VISION = {"model_type": "gemma4_unified_vision", "patch_size": 16, "pooling_kernel_size": 3,
                  "model_patch_size": 48, "num_soft_tokens": 280, "mm_embed_dim": 16, "mm_posemb_size": 8,
                  "output_proj_dims": 16, "rms_norm_eps": 1e-6}


def as_unified(config: dict, role: str) -> dict:
    """A gemma4 target / gemma4_assistant config turned into the gemma4_unified family (12B): same text geometry,
    encoder-free vision embedder (a tiny Gemma4UnifiedVisionConfig), no audio."""
    unified = copy.deepcopy(config)
    unified["text_config"]["model_type"] = "gemma4_unified_text"
    if role == "assistant":
        unified.update(model_type="gemma4_unified_assistant", architectures=["Gemma4UnifiedAssistantForCausalLM"])
        return unified
    unified.update(model_type="gemma4_unified", architectures=["Gemma4UnifiedForConditionalGeneration"],
                   vision_config=dict(UNIFIED_VISION), audio_config=None)
    return unified


def unified_vision_tensors(config: dict) -> list[TensorSpec]:
    """The encoder-free vision embedder's tensors, named and shaped by transformers' own
    Gemma4UnifiedForConditionalGeneration built on the meta device (no hand-written list)."""
    from transformers import AutoConfig
    from transformers.models.gemma4_unified.modeling_gemma4_unified import Gemma4UnifiedForConditionalGeneration
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        hf_config = AutoConfig.from_pretrained(tmp)
    with torch.device("meta"):
        model = Gemma4UnifiedForConditionalGeneration(hf_config)
    return [TensorSpec(_released_unified_name(name), tuple(t.shape), "norm" if t.dim() == 1 else "linear")
            for name, t in model.state_dict().items() if name.startswith("model.embed_vision.")]


def _released_unified_name(name: str) -> str:
    """transformers' module name -> the released checkpoint's name, inverting transformers' own renaming
    (conversion_mapping.py "gemma4_unified": vision_embedder.* -> embed_vision.*, embed_vision.embedding_projection
    -> embed_vision.multimodal_embedder.embedding_projection); vLLM 0.27 loads the released names."""
    projection = "model.embed_vision.multimodal_embedder.embedding_projection."
    if name.startswith(projection):
        return "model.embed_vision.embedding_projection." + name[len(projection):]
    return "model.vision_embedder." + name[len("model.embed_vision."):]


def _hub_parts(p: Preset, role: str, *, multimodal: bool, fused_qkv: bool,
               quantization: dict | None, unified: bool = False) -> tuple[dict, list[TensorSpec]]:
    """(published config.json, tensor specs) of one role."""
    if unified:
        if not multimodal and role == "target":
            raise ValueError("gemma4_unified targets are multimodal (vLLM 0.27 registers no text-only class)")
        config, specs = _hub_parts(p, role, multimodal=True, fused_qkv=fused_qkv, quantization=quantization)
        config = as_unified(config, role)
        if role == "target":
            specs = [s for s in specs if not s.name.startswith(("model.vision_tower.", "model.embed_vision."))]
            specs += unified_vision_tensors(config)
        return config, specs
    if role == "target":
        return _hub_target_config(p, multimodal=multimodal), target_tensors(p, multimodal=multimodal,
                                                                              fused_qkv=fused_qkv)
    if role != "assistant":
        raise ValueError(f"role must be 'target' or 'assistant', got {role!r}")
    return _hub_assistant_config(p), assistant_tensors(p)


def _write_directory(out: Path, config: dict, specs: list[TensorSpec], *, num_shards: int, dtype: torch.dtype,
                     seed: int, quantization: dict | None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    if quantization:
        config = {**config, "quantization_config": quantization}
    if quantization and quantization.get("quant_method") == "modelopt":
        (out / "hf_quant_config.json").write_text(json.dumps(hf_quant_config(quantization), indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name, text in SIDE_FILES.items():
        (out / name).write_text(text)
    write_tensors(out, specs, num_shards=num_shards, dtype=dtype, seed=seed, quantization=quantization)
    return out


def write_checkpoint(out_dir: str | Path, *, preset: Preset | str, role: str, dialect: str = "legacy",
                     fused_qkv: bool = False, num_shards: int = 1, multimodal: bool = True,
                     dtype: torch.dtype = torch.bfloat16, seed: int = 0, quantization: dict | None = None,
                     saved_by: str | None = None) -> Path:
    """Writes one synthetic target or assistant checkpoint directory.

    Args:
        out_dir: directory to create (must not exist or be empty).
        preset: a Preset or the name of a full-size one in PRESETS.
        role: "target" or "assistant".
        dialect: "legacy" (flat keys), "per_layer_config" (transformers >= 5.15) or "both" (see in_dialect).
        fused_qkv: target only: write self_attn.qkv_proj instead of q/k/v.
        num_shards: 1 writes model.safetensors; more writes numbered shards and an index.
        multimodal: target only: gemma4 wrapper (model.language_model.*, vision tower) vs gemma4_text.
        dtype: weight dtype.
        seed: RNG seed (the assistant uses seed + 1 by convention of write_pair).
        quantization: target only: a compressed-tensors fp8 config (fp8_quantization_config); decoder-layer
            projections not in its ignore list are written as float8_e4m3fn + weight_scale.
        saved_by: python interpreter whose transformers re-saves the config (default: this process's, and only
            for the dialects that need a re-save).

    Returns:
        The checkpoint directory.
    """
    p = PRESETS[preset] if isinstance(preset, str) else preset
    config, specs = _hub_parts(p, role, multimodal=multimodal, fused_qkv=fused_qkv, quantization=quantization)
    config = in_dialect({role: config}, dialect, saved_by=saved_by)[role]
    return _write_directory(Path(out_dir), config, specs, num_shards=num_shards, dtype=dtype, seed=seed,
                            quantization=quantization)


def write_pair(out_dir: str | Path, *, preset: Preset | str, dialect: str = "legacy", fused_qkv: bool = False,
               num_shards: int = 1, multimodal: bool = True, dtype: torch.dtype = torch.bfloat16,
               seed: int = 0, quantization: dict | None = None, saved_by: str | None = None,
               unified: bool = False, assistant_quantization: dict | None = None) -> tuple[Path, Path]:
    """Writes out_dir/target and out_dir/assistant sharing one preset (quantization: the target's;
    assistant_quantization: the assistant's decoder projections, as community quantized assistants have it, its
    pre/post projections bf16); returns both.

    Both configs go through one re-save (one process when saved_by names another interpreter). unified: the
    gemma4_unified / gemma4_unified_assistant family instead of gemma4 / gemma4_assistant.
    """
    p = PRESETS[preset] if isinstance(preset, str) else preset
    out = Path(out_dir)
    target_parts = _hub_parts(p, "target", multimodal=multimodal, fused_qkv=fused_qkv, quantization=quantization,
                              unified=unified)
    assistant_parts = _hub_parts(p, "assistant", multimodal=False, fused_qkv=False, quantization=None,
                                 unified=unified)
    configs = in_dialect({"target": target_parts[0], "assistant": assistant_parts[0]}, dialect, saved_by=saved_by)
    target = _write_directory(out / "target", configs["target"], target_parts[1], num_shards=num_shards,
                              dtype=dtype, seed=seed, quantization=quantization)
    assistant = _write_directory(out / "assistant", configs["assistant"], assistant_parts[1], num_shards=1,
                                 dtype=dtype, seed=seed + 1, quantization=assistant_quantization)
    return target, assistant


# ---------------------------------------------------------------------------------------------- engine pairs
# Pairs the real vLLM engine can run on CPU and whose greedy output says something (docs/VLLM_CHECK.md,
# "Engine check"). vLLM's CPU attention supports head sizes 32..256 and 512 only
# (v1/attention/backends/cpu_attn.py), so tiny_preset's 16/32 cannot run: engine_preset keeps the tiny
# widths and layer counts but the REAL head sizes (256/512 for every preset). With N(0, 1) tied embeddings
# the residual stream is dominated by the current token's own embedding and greedy decoding repeats the
# last token forever, which makes every comparison trivially equal; ENGINE_SCALES shrinks the embedding
# (the layers then dominate) and grows the final norm (logits stay O(10)). Neither tensor is touched by
# any layout, so the converter sees the same kinds of tensors as from write_pair.
ENGINE_SCALES = {"embed_tokens.weight": 0.002, "norm.weight": 50.0}  # target, under its text prefix


# vLLM 0.27.0's CPU fused-MoE kernels (model_executor/layers/fused_moe/cpu_fused_moe.py,
# CPUFusedMOE.check_grouped_gemm) take the grouped-gemm path only when the hidden size and the expert width are
# multiples of 32; on an AMX CPU any other width RAISES instead of falling back. On AVX2 (no prepack_moe_weight op
# in _C_AVX2) every width runs the per-expert torch loop. The real 26B-A4B (2816 / 704) is aligned, so the engine
# pair is rounded up to the same alignment and takes the kernel the real checkpoint takes on every x86 CPU.
# Every expert is routed to (top_k = num_experts): a top-k < E choice is a step function of the hidden state, and
# with random routers fp32 reduction-order noise flips it (measured: the original's own batched and one-at-a-time
# runs then differ by 1.09 in logprob, so no layout can be judged against them); with all experts active the
# routing weights (softmax, renormalisation, per_expert_scale) stay continuous and the fp32 verdict stays strict.
MOE_KERNEL_ALIGNMENT = 32


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def engine_preset(name: str = "31b") -> Preset:
    """tiny_preset(name) with the real head_dim / global_head_dim; a MoE preset keeps its experts, with the
    hidden size and expert width rounded up to MOE_KERNEL_ALIGNMENT (the CPU fused-MoE kernels' tile) and every
    expert active per token (see above)."""
    base = PRESETS[name]
    p = replace(tiny_preset(name), head_dim=base.head_dim, global_head_dim=base.global_head_dim)
    if p.moe:
        p = replace(p, hidden_size=_round_up(p.hidden_size, MOE_KERNEL_ALIGNMENT), top_k_experts=p.num_experts,
                    moe_intermediate_size=_round_up(p.moe_intermediate_size, MOE_KERNEL_ALIGNMENT))
    return p


def edit_in_place(checkpoint_dir: str | Path, chosen: Callable[[str], bool],
                  edit: Callable[[str, torch.Tensor], torch.Tensor]) -> list[str]:
    """Rewrites every tensor of the checkpoint's shards whose name is `chosen` with edit(name, tensor), shard by
    shard; returns the names rewritten (the factory's engine adjustments, made after write_pair)."""
    from safetensors.torch import load_file

    touched = []
    for shard in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        tensors = load_file(str(shard))
        hit = [name for name in tensors if chosen(name)]
        for name in hit:
            tensors[name] = edit(name, tensors[name])
        if hit:
            save_file(tensors, str(shard), metadata={"format": "pt"})
            touched += hit
    return touched


def scale_for_engine(target_dir: str | Path) -> list[str]:
    """Rescales the target's embed_tokens and final norm in place (ENGINE_SCALES); returns the names touched."""
    target = Path(target_dir)
    config = json.loads((target / "config.json").read_text())
    prefix = "model.language_model." if "text_config" in config else "model."
    factors = {prefix + name: factor for name, factor in ENGINE_SCALES.items()}
    touched = edit_in_place(target, lambda name: name in factors,
                            lambda name, tensor: (tensor.float() * factors[name]).to(tensor.dtype))
    if sorted(touched) != sorted(factors):
        raise ValueError(f"{target}: expected tensors {sorted(factors)}, rescaled {sorted(touched)}")
    return touched


def dequantize_checkpoint(source: str | Path, destination: str | Path, *, as_stored: bool = False) -> list[str]:
    """A compressed-tensors checkpoint at `source` (pack-quantized int codes or float-quantized fp8 ones) as dense
    float32 weights at `destination`, through compressed-tensors' own decompressor (scales in float32: every int code
    x scale is then exact, where the checkpoint's bfloat16 scales would round it); every other tensor and file as it
    is, config.json without its quantization_config. Returns the modules dequantized.

    The float reference of a quantized pair's engine check: the same function without the int4 kernels.
    as_stored: the scales as stored (bf16) and the weights in that dtype, what the decompressor gives a bf16
    checkpoint: the reference of `convert --dequantize-assistant`.
    """
    from compressed_tensors.compressors import BaseCompressor
    from safetensors.torch import load_file

    source, destination = Path(source), Path(destination)
    config = json.loads((source / "config.json").read_text())
    quantization = text_config_of(config).pop("quantization_config", None) or \
        config.pop("quantization_config")
    scheme, compressor = config_scheme(quantization), BaseCompressor.get_value_from_registry(quantization["format"])
    destination.mkdir(parents=True)
    for item in source.iterdir():
        if item.suffix != ".safetensors" and item.name != "config.json":
            shutil.copy2(item, destination / item.name)
    (destination / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    done = []
    for shard in sorted(source.glob("*.safetensors")):
        tensors = load_file(str(shard))
        for module in sorted(n[: -len(".weight_scale")] for n in tensors if n.endswith(".weight_scale")):
            parts = {k: tensors.pop(f"{module}.{k}") for k in ("weight_packed", "weight", "weight_scale",
                                                                "weight_shape") if f"{module}.{k}" in tensors}
            if not as_stored:
                parts["weight_scale"] = parts["weight_scale"].float()
            weight = compressor.decompress(parts, scheme)["weight"]
            tensors[f"{module}.weight"] = (weight if as_stored else weight.float()).contiguous()
            done.append(module)
        save_file(tensors, str(destination / shard.name), metadata={"format": "pt"})
    return done


# Google's QAT release of the 26B-A4B (`google/gemma-4-26B-A4B-it-qat-q4_0-unquantized`, the checkpoint its model
# card offers vLLM users for that size: no `-w4a16-ct` exists for the MoE) stores bf16 weights that lie on ggml's Q4_0
# grid, experts fused as in the bf16 release. snap_to_q4_0_grid puts a factory target's decoder projections and
# experts on that grid with ggml's own Q4_0 quantizer (gguf-py, the reference of ggml-quants.c quantize_row_q4_0_ref):
# blocks of 32 along each row's input dimension, one fp16 scale per block, codes -8..7.
Q4_0_BLOCK = 32
_Q4_0_SUFFIXES = (".self_attn.q_proj.weight", ".self_attn.k_proj.weight", ".self_attn.v_proj.weight",
                  ".self_attn.o_proj.weight", ".mlp.gate_proj.weight", ".mlp.up_proj.weight", ".mlp.down_proj.weight",
                  ".experts.gate_up_proj", ".experts.down_proj")


def on_q4_0_grid(weight: torch.Tensor) -> torch.Tensor:
    """weight (last dimension: the input, a multiple of 32) dequantized from its ggml Q4_0 quantization, as float32."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    if weight.shape[-1] % Q4_0_BLOCK:
        raise ValueError(f"Q4_0 blocks of {Q4_0_BLOCK} do not tile an input dimension of {weight.shape[-1]}")
    values = weight.float().numpy()
    return torch.from_numpy(dequantize(quantize(values, GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0)
                            .reshape(values.shape).copy())


# What a QAT repo's assistant config carries beside the others' (google/gemma-4-*-it-qat-q4_0-unquantized-assistant,
# read): the token ids at the top level, eos both <eos> and <end_of_turn>
QAT_ASSISTANT_TOKEN_IDS = {"bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0}


def as_qat_assistant(assistant_dir: str | Path) -> None:
    """The assistant's config.json as the QAT repos publish it (QAT_ASSISTANT_TOKEN_IDS at the top level)."""
    path = Path(assistant_dir) / "config.json"
    config = json.loads(path.read_text())
    config.update(QAT_ASSISTANT_TOKEN_IDS)
    path.write_text(json.dumps(config, indent=2) + "\n")


def snap_to_q4_0_grid(target_dir: str | Path) -> list[str]:
    """Rewrites, in place, every decoder attention projection, dense MLP projection and fused expert tensor of the
    target's shards with its Q4_0 grid values in the checkpoint's own dtype (a code times an fp16 scale, rounded to
    bf16 as the published bf16 checkpoint stores them: each block of 32 still holds at most 16 distinct values).
    Returns the names rewritten.

    Raises:
        ValueError: an input dimension that blocks of 32 do not tile, or no such tensor at all.
    """
    touched = edit_in_place(target_dir, lambda name: ".layers." in name and name.endswith(_Q4_0_SUFFIXES)
                            and "vision" not in name, lambda name, tensor: on_q4_0_grid(tensor).to(tensor.dtype))
    if not touched:
        raise ValueError(f"{target_dir}: no decoder projection or expert tensor to put on the Q4_0 grid")
    return touched


# With q_norm / k_norm weights near 1 (the factory's 1 + 0.1 N(0, 1)), a 256-wide head's q.k has a standard
# deviation of ~16 at attention scaling 1.0, so softmax all but picks one key and one bf16 rounding can pick another:
# the factory's W4A16 engine pair in bf16 sat 1.79 in logprob from its fp32 twin, its tokens differing from the first
# step, and no bf16 verdict could tell a correct layout from a broken one. Scaled by CALM_QK_NORM (q.k std ~1, as
# trained checkpoints keep it), transformers measured the fp32-to-bf16 error of the same pair 4.5 -> 0.16 and their
# greedy argmax agreement 0.47 -> 0.95 over 40 positions.
CALM_QK_NORM = 0.25


def calm_attention(checkpoint_dir: str | Path, factor: float = CALM_QK_NORM) -> list[str]:
    """Scales every q_norm and k_norm weight of the checkpoint in place by factor; returns the names touched."""
    touched = edit_in_place(checkpoint_dir, lambda name: name.endswith(("self_attn.q_norm.weight",
                                                                        "self_attn.k_norm.weight")),
                            lambda name, tensor: (tensor.float() * factor).to(tensor.dtype))
    if not touched:
        raise ValueError(f"{checkpoint_dir}: no q_norm / k_norm weight to scale")
    return touched


def write_engine_pair(out_dir: str | Path, *, preset: str | Preset = "31b", **kwargs) -> tuple[Path, Path]:
    """write_pair with engine_preset(preset) (or the Preset given) and scale_for_engine on the target (kwargs go to
    write_pair)."""
    target, assistant = write_pair(out_dir, preset=engine_preset(preset) if isinstance(preset, str) else preset,
                                   **kwargs)
    scale_for_engine(target)
    return target, assistant

"""A small pure-torch reference of Gemma 4 text attention, decoder layers, the target and the MTP assistant.

Anchors: transformers 5.23.0 `models/gemma4/modeling_gemma4.py` (Gemma4RMSNorm, apply_rotary_pos_emb,
eager_attention_forward, Gemma4TextRotaryEmbedding, Gemma4TextAttention, Gemma4TextDecoderLayer, Gemma4TextModel) and
`models/gemma4_assistant/modeling_gemma4_assistant.py` (Gemma4AssistantMaskedEmbedder, Gemma4AssistantForCausalLM). We
mirror their "eager" path operation by operation and dtype by dtype (norms in fp32 then cast back, cos/sin cast to the
activation dtype, softmax in fp32), so a bf16 run rounds where transformers rounds; tests/test_reference.py holds us to
that. The transformers 5.23.0 file:line of each class, function and default named in this module is in
docs/DESIGN.md "Checkpoints".

Facts the code relies on (checked in 5.23.0; docs/DESIGN.md "Checkpoints"): RMSNorm multiplies by `w` (not `1 + w`); q/k
are normed BEFORE RoPE; v_norm is an RMSNorm without weight; attention scaling is 1.0; a k_eq_v layer's V is the raw
k_proj output (then v_norm, no k_norm/RoPE); "proportional" RoPE rotates the first int(p * hd // 2) frequency pairs and
leaves the rest unrotated (inv_freq 0).

No I/O, no module state: weights are plain dicts of tensors named like the transformers `state_dict` of the
block they feed (`q_proj.weight`, `layers.3.mlp.up_proj.weight`, ...); `sub_weights` strips a checkpoint prefix.
Everything runs on whatever device and dtype the tensors have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F

FULL = "full_attention"
SLIDING = "sliding_attention"
_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
}
# Gemma4TextConfig dataclass defaults (docs/DESIGN.md "Checkpoints") for the keys read here.
_TEXT_DEFAULTS: dict[str, Any] = {
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6, "sliding_window": 512, "final_logit_softcapping": None, "attention_k_eq_v": False,
    "hidden_size_per_layer_input": 256, "num_kv_shared_layers": 0, "enable_moe_block": False, "top_k_experts": None,
}
# Gemma4TextConfig.__post_init__'s default rope_parameters (docs/DESIGN.md "Checkpoints")
_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}

Weights = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class AttentionOutput:
    """What one attention block produces.

    out: [batch, length, hidden] after o_proj. key: [batch, kv_heads, kv_length, head_dim] after k_norm and RoPE.
    value: [batch, kv_heads, kv_length, head_dim] after v_norm. key/value are what an assistant layer consumes.
    """

    out: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor


@dataclass(frozen=True)
class ErrorStats:
    """How far a candidate tensor is from a reference tensor (computed in float64).

    max_abs: max |c - r|. max_rel: max_abs / max |r| (relative to the reference's largest magnitude, so values near
    zero do not blow it up). rel_rms: ||c - r|| / ||r||. cosine: cosine similarity of the flattened tensors.
    """

    max_abs: float
    max_rel: float
    rel_rms: float
    cosine: float


@dataclass(frozen=True)
class LayerSpec:
    """Attention geometry and RoPE of one decoder layer, resolved the way transformers 5.23 resolves them."""

    layer_type: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    k_eq_v: bool
    kv_shared: bool
    rope_theta: float
    partial_rotary_factor: float
    rope_factor: float
    sliding_window: int | None
    eps: float

    def attention_kwargs(self) -> dict[str, Any]:
        """The keyword arguments `attention_block` takes for this layer."""
        return {
            "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "k_eq_v": self.k_eq_v, "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.partial_rotary_factor, "rope_factor": self.rope_factor,
            "sliding_window": self.sliding_window, "eps": self.eps,
        }


@dataclass(frozen=True)
class TextSpec:
    """Everything the text forward needs besides weights."""

    hidden_size: int
    layers: tuple[LayerSpec, ...]
    eps: float
    hidden_activation: str
    final_logit_softcapping: float | None
    hidden_size_per_layer_input: int
    enable_moe_block: bool
    top_k_experts: int | None

    @property
    def kv_producers(self) -> dict[str, int]:
        """Index of the last non-KV-shared layer of each layer type: the K/V a consumer (or an assistant) reads."""
        return {layer.layer_type: i for i, layer in enumerate(self.layers) if not layer.kv_shared}


@dataclass(frozen=True)
class AssistantSpec:
    """The MTP assistant's own keys plus its text spec (every layer KV-shared)."""

    text: TextSpec
    backbone_hidden_size: int
    use_ordered_embeddings: bool
    num_centroids: int
    centroid_intermediate_top_k: int


@dataclass(frozen=True)
class AssistantOutput:
    """Assistant forward results: hidden [batch, q, backbone_hidden] (post_projection), logits [batch, q, vocab]."""

    hidden: torch.Tensor
    logits: torch.Tensor


# ----------------------------------------------------------------------------------------------- config -> spec


def text_spec_from_config(config: Mapping[str, Any]) -> TextSpec:
    """Resolves a Gemma 4 text config dict (either dialect) into a TextSpec.

    Mirrors `Gemma4TextConfig.__post_init__` (docs/DESIGN.md "Checkpoints"): with `per_layer_config` present
    the flat `global_head_dim` / `num_global_key_value_heads` are ignored; without it, full layers get
    `global_head_dim` (default 512) and, when `attention_k_eq_v`, `num_global_key_value_heads` KV heads.

    Args:
        config: the `text_config` dict (or a flat gemma4_text config.json).

    Returns:
        The TextSpec.

    Raises:
        ValueError: bidirectional attention, an unknown RoPE type, or layer_types of the wrong length.
    """
    cfg = {**_TEXT_DEFAULTS, **config}
    if cfg.get("use_bidirectional_attention") == "all":
        raise ValueError("use_bidirectional_attention='all' is not modelled by this reference")
    layer_types = tuple(cfg.get("layer_types") or _default_layer_types(int(cfg["num_hidden_layers"])))
    if len(layer_types) != int(cfg.get("num_hidden_layers", len(layer_types))):
        raise ValueError(f"layer_types has {len(layer_types)} entries, num_hidden_layers is {cfg['num_hidden_layers']}")
    rope = cfg.get("rope_parameters") or _DEFAULT_ROPE
    shared_from = len(layer_types) - int(cfg["num_kv_shared_layers"] or 0)
    layers = tuple(
        _layer_spec(cfg, index=i, layer_type=t, rope=rope[t], kv_shared=i >= shared_from)
        for i, t in enumerate(layer_types)
    )
    return TextSpec(
        hidden_size=int(cfg["hidden_size"]), layers=layers, eps=float(cfg["rms_norm_eps"]),
        hidden_activation=cfg["hidden_activation"], final_logit_softcapping=cfg["final_logit_softcapping"],
        hidden_size_per_layer_input=int(cfg["hidden_size_per_layer_input"] or 0),
        enable_moe_block=bool(cfg["enable_moe_block"]), top_k_experts=cfg["top_k_experts"],
    )


def assistant_spec_from_config(config: Mapping[str, Any]) -> AssistantSpec:
    """Resolves a `gemma4_assistant` config.json dict into an AssistantSpec.

    Like `Gemma4AssistantConfig.__post_init__` (configuration_gemma4_assistant.py), a falsy `num_kv_shared_layers`
    becomes `num_hidden_layers`: every assistant layer reads the target's K/V.

    Args:
        config: the parsed assistant config.json.

    Returns:
        The AssistantSpec.
    """
    text = dict(config["text_config"])
    if not text.get("num_kv_shared_layers"):
        text["num_kv_shared_layers"] = text["num_hidden_layers"]
    return AssistantSpec(
        text=text_spec_from_config(text),
        backbone_hidden_size=int(config.get("backbone_hidden_size", 1536)),
        use_ordered_embeddings=bool(config.get("use_ordered_embeddings", False)),
        num_centroids=int(config.get("num_centroids", 2048)),
        centroid_intermediate_top_k=int(config.get("centroid_intermediate_top_k", 32)),
    )


def _default_layer_types(num_layers: int) -> list[str]:
    # Gemma4TextConfig.__post_init__ (docs/DESIGN.md "Checkpoints"): 5 sliding : 1 full, the last layer always full.
    types = [SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)]
    return types[:-1] + [FULL]


def _layer_spec(cfg: Mapping[str, Any], *, index: int, layer_type: str, rope: Mapping[str, Any],
                kv_shared: bool) -> LayerSpec:
    full = layer_type == FULL
    k_eq_v = full and bool(cfg["attention_k_eq_v"])
    head_dim, kv_heads = int(cfg["head_dim"]), int(cfg["num_key_value_heads"])
    per_layer = cfg.get("per_layer_config")
    if per_layer is not None:
        override = {int(k): v for k, v in per_layer.items()}.get(index, {})
        head_dim = int(override.get("head_dim", head_dim))
        kv_heads = int(override.get("num_key_value_heads", kv_heads))
    elif full:
        head_dim = int(cfg.get("global_head_dim") or 512)
        global_kv = cfg.get("num_global_key_value_heads")
        kv_heads = int(global_kv) if (cfg["attention_k_eq_v"] and global_kv is not None) else kv_heads
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "proportional"):
        raise ValueError(f"layer {index}: rope_type {rope_type!r} is not modelled by this reference")
    proportional = rope_type == "proportional"
    return LayerSpec(
        layer_type=layer_type, num_heads=int(cfg["num_attention_heads"]), num_kv_heads=kv_heads,
        head_dim=head_dim, k_eq_v=k_eq_v, kv_shared=kv_shared, rope_theta=float(rope["rope_theta"]),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)) if proportional else 1.0,
        rope_factor=float(rope.get("factor", 1.0)) if proportional else 1.0,
        sliding_window=int(cfg["sliding_window"]) if layer_type == SLIDING else None, eps=float(cfg["rms_norm_eps"]),
    )


# ------------------------------------------------------------------------------------------------ primitives


class _Prefixed(Mapping):
    """A read-through view of the entries under a prefix: nothing is fetched until it is looked up, so weights that
    load on demand (numerics.py, one tensor at a time) stay on disk until the block that uses them runs."""

    def __init__(self, weights: Weights, prefix: str):
        self._weights, self._prefix = weights, prefix

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._weights[self._prefix + name]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._prefix + name in self._weights

    def __iter__(self):
        return (name[len(self._prefix):] for name in self._weights if name.startswith(self._prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def sub_weights(weights: Weights, prefix: str) -> Weights:
    """The entries of `weights` under `prefix`, with the prefix removed (e.g. "model.language_model.layers.3.").

    A dict gives a new dict (callers may add entries); any other Mapping (numerics.OnDemandWeights) a read-through
    view, so nothing is loaded before it is used.
    """
    if isinstance(weights, dict):
        return {name[len(prefix):]: tensor for name, tensor in weights.items() if name.startswith(prefix)}
    return _Prefixed(weights, prefix)


VOCAB_BLOCK_ROWS = 8192  # lm_head rows per matmul in vocab_logits


def vocab_logits(hidden: torch.Tensor, lm_head: Any) -> torch.Tensor:
    """F.linear(hidden, lm_head), a block of vocabulary rows at a time, each block cast to hidden's dtype.

    lm_head is a tensor, or anything with `row_blocks(rows)` yielding consecutive row blocks (numerics.py reads a
    262144-row embedding from disk that way): the full table never exists in the computing dtype, so an fp32 or fp64
    check of a 31B assistant stays within its memory budget. Each logit is the same dot product as in one matmul.
    """
    blocks = lm_head.split(VOCAB_BLOCK_ROWS) if isinstance(lm_head, torch.Tensor) else \
        lm_head.row_blocks(VOCAB_BLOCK_ROWS)
    return torch.cat([F.linear(hidden, block.to(device=hidden.device, dtype=hidden.dtype)) for block in blocks],
                     dim=-1)


def whole(lm_head: Any) -> torch.Tensor:
    """The tensor itself, or a row-block source (see vocab_logits) read whole."""
    return lm_head if isinstance(lm_head, torch.Tensor) else lm_head.whole()


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor | None, *, eps: float) -> torch.Tensor:
    """Gemma 4 RMSNorm: computed in fp32, multiplied by `weight` (no `1 +`), cast back.

    Mirrors Gemma4RMSNorm._norm/forward (docs/DESIGN.md "Checkpoints"), including torch.pow(ms + eps, -0.5).

    Args:
        hidden: [..., dim] activations.
        weight: [dim] scale, or None for the weightless v_norm / router norm.
        eps: added to the mean square.

    Returns:
        Tensor of hidden's shape and dtype.
    """
    x = hidden.float()
    normed = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        normed = normed * weight.float()
    return normed.type_as(hidden)


def rope_inv_freq(*, head_dim: int, rope_theta: float, partial_rotary_factor: float = 1.0,
                  rope_factor: float = 1.0) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim // 2], fp32 on CPU (where transformers computes them at init).

    partial_rotary_factor 1.0 is the "default" RoPE (Gemma4TextRotaryEmbedding); anything else is "proportional"
    (transformers' _compute_proportional_rope_parameters; both in docs/DESIGN.md "Checkpoints"): the first
    int(p * head_dim // 2) pairs rotate with theta^(-2k/head_dim), the rest get frequency 0 (cos 1, sin 0: unrotated).
    Both divide by `rope_factor`.

    Args:
        head_dim: the layer's head size (the exponent's denominator is the FULL head size).
        rope_theta: base.
        partial_rotary_factor: fraction of the head that rotates.
        rope_factor: "factor" of proportional RoPE (1.0 unless the config says otherwise).

    Returns:
        fp32 tensor [head_dim // 2].
    """
    angles = int(partial_rotary_factor * head_dim // 2)
    exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (rope_theta ** exponents)
    if head_dim // 2 > angles:
        inv_freq = torch.cat((inv_freq, torch.zeros(head_dim // 2 - angles, dtype=torch.float32)))
    return inv_freq / rope_factor


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, *, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [batch, length, head_dim] cast to `dtype` (Gemma4TextRotaryEmbedding.forward).

    The default and proportional attention_scaling is 1.0, so the `* attention_scaling` there is an exact no-op.
    """
    freqs = positions[..., None].float() * inv_freq.to(device=positions.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, length, heads, head_dim] rotated by pairs (i, i + head_dim/2) (apply_rotary_pos_emb)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def causal_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, *, sliding_window: int | None
                ) -> torch.Tensor:
    """Boolean mask [batch, 1, q, k], True where a query may attend to a key.

    Causal: key position <= query position; sliding: also key > query - window (transformers' sliding_window_overlay,
    docs/DESIGN.md "Checkpoints", so the window counts the query itself: `window` keys at most).
    """
    q = q_positions[:, None, :, None]
    k = k_positions[:, None, None, :]
    allowed = k <= q
    if sliding_window is not None:
        allowed = allowed & (k > q - sliding_window)
    return allowed


def as_positions(positions: torch.Tensor | None, length: int, device: torch.device) -> torch.Tensor:
    if positions is None:
        positions = torch.arange(length, device=device)
    positions = positions.to(device)
    return positions[None] if positions.dim() == 1 else positions


def named_linear(x: torch.Tensor, weights: Weights, name: str) -> torch.Tensor:
    return F.linear(x, weights[f"{name}.weight"], weights.get(f"{name}.bias"))


def _activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_activation {name!r} is not modelled by this reference")
    return _ACTIVATIONS[name]


# ------------------------------------------------------------------------------------------------ attention


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, mask: torch.Tensor | None
           ) -> torch.Tensor:
    """Grouped-query scaled-dot-product attention, scaling 1.0, softmax in fp32 (eager_attention_forward).

    Args:
        query: [batch, heads, q, head_dim].
        key: [batch, kv_heads, k, head_dim]; query head h reads KV head h // (heads / kv_heads).
        value: [batch, kv_heads, k, head_dim].
        mask: boolean, broadcastable to [batch, heads, q, k]; None attends everywhere.

    Returns:
        [batch, q, heads * head_dim] in query's dtype.
    """
    batch, kv_heads, length, head_dim = key.shape
    groups = query.shape[1] // kv_heads
    # repeat_kv: expand + reshape, same as repeat_interleave on the head axis.
    key = key[:, :, None].expand(batch, kv_heads, groups, length, head_dim).reshape(batch, -1, length, head_dim)
    value = value[:, :, None].expand(batch, kv_heads, groups, length, head_dim).reshape(batch, -1, length, head_dim)
    scores = torch.matmul(query, key.transpose(2, 3))  # Gemma4TextAttention.scaling = 1.0
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, value).transpose(1, 2)
    return out.reshape(*out.shape[:2], -1)


def project_kv(hidden: torch.Tensor, weights: Weights, *, head_dim: int, k_eq_v: bool, eps: float,
               cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer as transformers stores them (Gemma4TextAttention.forward).

    K = RoPE(k_norm(k_proj x)); V = v_norm(v_proj x), or v_norm(k_proj x) on a k_eq_v layer (raw projection).

    Returns:
        (key, value), each [batch, kv_heads, length, head_dim].
    """
    shape = (*hidden.shape[:-1], -1, head_dim)
    key = named_linear(hidden, weights, "k_proj").view(shape)
    value = key if k_eq_v else named_linear(hidden, weights, "v_proj").view(shape)
    key = apply_rope(rms_norm(key, weights["k_norm.weight"], eps=eps), cos, sin).transpose(1, 2)
    return key, rms_norm(value, None, eps=eps).transpose(1, 2)


@torch.no_grad()
def attention_block(hidden: torch.Tensor, weights: Weights, *, num_heads: int, num_kv_heads: int, head_dim: int,
                    k_eq_v: bool, rope_theta: float, partial_rotary_factor: float = 1.0, rope_factor: float = 1.0,
                    sliding_window: int | None = None, eps: float = 1e-6, positions: torch.Tensor | None = None,
                    kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                    mask: torch.Tensor | None = None) -> AttentionOutput:
    """One Gemma 4 self-attention block (Gemma4TextAttention.forward, eager path).

    Args:
        hidden: [batch, length, hidden] input (already input_layernorm-ed in a decoder layer).
        weights: q_proj.weight, q_norm.weight, o_proj.weight and, unless `kv` is given, k_proj.weight,
            k_norm.weight and (not k_eq_v) v_proj.weight; optional `*.bias`.
        num_heads / num_kv_heads / head_dim: this layer's geometry.
        k_eq_v: V is the k_proj output (full layers of 31B / 26B-A4B).
        rope_theta / partial_rotary_factor / rope_factor: RoPE (partial 1.0 = "default", else "proportional").
        sliding_window: window for the causal mask, None on full layers.
        eps: RMSNorm epsilon.
        positions: [length] or [batch, length] query positions; default 0..length-1.
        kv: (key, value) [batch, kv_heads, kv_length, head_dim] produced elsewhere (an assistant layer attends to
            the target's K/V); then this block computes Q only, and key positions are 0..kv_length-1.
        mask: boolean [.., q, kv] overriding the causal/sliding mask built from the positions.

    Returns:
        AttentionOutput(out, key, value); key/value are the ones attended to.

    Raises:
        ValueError: K/V head count or head size disagrees with num_kv_heads / head_dim, or heads % kv_heads.
    """
    positions = as_positions(positions, hidden.shape[1], hidden.device)
    inv_freq = rope_inv_freq(head_dim=head_dim, rope_theta=rope_theta,
                             partial_rotary_factor=partial_rotary_factor, rope_factor=rope_factor)
    cos, sin = rope_cos_sin(positions, inv_freq, dtype=hidden.dtype)
    query = named_linear(hidden, weights, "q_proj").view(*hidden.shape[:-1], -1, head_dim)
    query = apply_rope(rms_norm(query, weights["q_norm.weight"], eps=eps), cos, sin).transpose(1, 2)
    if kv is None:
        key, value = project_kv(hidden, weights, head_dim=head_dim, k_eq_v=k_eq_v, eps=eps, cos=cos, sin=sin)
        key_positions = positions
    else:
        key, value = kv
        key_positions = torch.arange(key.shape[2], device=hidden.device)[None]
    _check_heads(query, key, value, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    if mask is None:
        mask = causal_mask(positions, key_positions, sliding_window=sliding_window)
    out = named_linear(attend(query, key, value, mask=mask), weights, "o_proj")
    return AttentionOutput(out=out, key=key, value=value)


def _check_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, num_heads: int,
                 num_kv_heads: int, head_dim: int) -> None:
    expected_q = (num_heads, head_dim)
    expected_kv = (num_kv_heads, head_dim)
    got = {"query": (query.shape[1], query.shape[3]), "key": (key.shape[1], key.shape[3]),
           "value": (value.shape[1], value.shape[3])}
    for name, shape in got.items():
        want = expected_q if name == "query" else expected_kv
        if shape != want:
            raise ValueError(f"{name} has {shape[0]} heads of size {shape[1]}, expected {want[0]} x {want[1]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")


# ------------------------------------------------------------------------------------------ layers and models


def mlp_block(hidden: torch.Tensor, weights: Weights, *, activation: str) -> torch.Tensor:
    """down(act(gate x) * up x) (Gemma4TextMLP.forward)."""
    gated = _activation(activation)(named_linear(hidden, weights, "gate_proj")) * named_linear(hidden, weights, "up_proj")
    return named_linear(gated, weights, "down_proj")


def moe_block(residual: torch.Tensor, weights: Weights, *, hidden_size: int, top_k: int, eps: float,
              activation: str) -> torch.Tensor:
    """The MoE branch of a 26B-A4B decoder layer, on the pre-MLP residual (Gemma4TextDecoderLayer.forward,
    Gemma4TextRouter, Gemma4TextExperts' eager loop). Returns [batch, length, hidden] after
    post_feedforward_layernorm_2."""
    flat = residual.reshape(-1, residual.shape[-1])
    routed = rms_norm(flat, None, eps=eps) * weights["router.scale"] * hidden_size ** -0.5
    probs = torch.softmax(named_linear(routed, weights, "router.proj"), dim=-1, dtype=torch.float32)
    top_weights, top_index = torch.topk(probs, k=top_k, dim=-1)
    top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
    top_weights = top_weights * weights["router.per_expert_scale"][top_index]
    experts_in = rms_norm(flat, weights["pre_feedforward_layernorm_2.weight"], eps=eps)
    out = torch.zeros_like(experts_in)
    act = _activation(activation)
    for expert in torch.unique(top_index).tolist():  # ascending, like the upstream loop over expert_hit
        token, slot = torch.where(top_index == expert)
        gate, up = F.linear(experts_in[token], weights["experts.gate_up_proj"][expert]).chunk(2, dim=-1)
        y = F.linear(act(gate) * up, weights["experts.down_proj"][expert]) * top_weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return rms_norm(out.reshape(residual.shape), weights["post_feedforward_layernorm_2.weight"], eps=eps)


@torch.no_grad()
def decoder_layer(hidden: torch.Tensor, weights: Weights, *, layer: LayerSpec, spec: TextSpec,
                  positions: torch.Tensor | None = None, kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                  mask: torch.Tensor | None = None, per_layer_input: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, AttentionOutput]:
    """One Gemma4TextDecoderLayer (its forward): sandwich norms around attention and MLP (+MoE, +per-layer input),
    then the whole output times `layer_scalar`.

    Args:
        hidden: [batch, length, hidden].
        weights: this layer's tensors named as in the module (self_attn.q_proj.weight, mlp.up_proj.weight, ...).
        layer / spec: geometry and model-wide settings.
        positions / kv / mask: passed to attention_block.
        per_layer_input: [batch, length, hidden_size_per_layer_input] on models with per-layer embeddings.

    Returns:
        (new hidden, the attention block's output).

    Raises:
        ValueError: a KV-shared layer without `kv`.
    """
    if layer.kv_shared and kv is None:
        raise ValueError("a KV-shared layer needs the producer's (key, value)")
    attn = attention_block(rms_norm(hidden, weights["input_layernorm.weight"], eps=spec.eps),
                           sub_weights(weights, "self_attn."), positions=positions, kv=kv, mask=mask,
                           **layer.attention_kwargs())
    hidden = hidden + rms_norm(attn.out, weights["post_attention_layernorm.weight"], eps=spec.eps)
    residual = hidden
    mlp = mlp_block(rms_norm(hidden, weights["pre_feedforward_layernorm.weight"], eps=spec.eps),
                    sub_weights(weights, "mlp."), activation=spec.hidden_activation)
    if spec.enable_moe_block:
        mlp = rms_norm(mlp, weights["post_feedforward_layernorm_1.weight"], eps=spec.eps) + moe_block(
            residual, weights, hidden_size=spec.hidden_size, top_k=int(spec.top_k_experts), eps=spec.eps,
            activation=spec.hidden_activation)
    hidden = residual + rms_norm(mlp, weights["post_feedforward_layernorm.weight"], eps=spec.eps)
    if per_layer_input is not None:
        gate = _activation(spec.hidden_activation)(named_linear(hidden, weights, "per_layer_input_gate"))
        projected = named_linear(gate * per_layer_input, weights, "per_layer_projection")
        hidden = hidden + rms_norm(projected, weights["post_per_layer_input_norm.weight"], eps=spec.eps)
    return hidden * weights["layer_scalar"], attn


# ------------------------------------------------------------------------------------------------- assistant


def assistant_inputs(token_embeddings: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
    """The assistant's inputs_embeds: [target's scaled embedding of the last token, target's final-norm hidden]
    (generation/candidate_generator.py Gemma4AssistantCandidateGenerator.get_candidates)."""
    return torch.cat([token_embeddings, target_hidden], dim=-1)


def assistant_masks(*, query_length: int, shared_kv: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                    sliding_window: int, device: torch.device) -> dict[str, torch.Tensor | None]:
    """The assistant's attention masks, as Gemma4AssistantForCausalLM.create_attention_masks builds them.

    Full layers see every target position. Sliding layers use transformers' bidirectional sliding mask
    (|q - j| <= window, sliding_window_bidirectional_overlay, docs/DESIGN.md "Checkpoints") flipped on the KV axis, so
    query i sees the LAST window + 1 - i target positions (for the single query `generate` uses: the last window + 1,
    one more than the target's own causal window).

    Returns:
        {layer type: boolean [1, 1, q, kv] or None (no masking)}.
    """
    masks: dict[str, torch.Tensor | None] = {FULL: None}
    if SLIDING in shared_kv:
        kv_length = shared_kv[SLIDING][0].shape[2]
        q = torch.arange(query_length, device=device)[:, None]
        flipped = (kv_length - 1 - torch.arange(kv_length, device=device))[None, :]
        masks[SLIDING] = ((q - flipped).abs() <= sliding_window)[None, None]
    return masks


def ordered_logits(hidden: torch.Tensor, weights: Weights, *, lm_head: torch.Tensor, num_centroids: int,
                   top_k: int) -> torch.Tensor:
    """E2B/E4B "ordered embeddings" logits (Gemma4AssistantMaskedEmbedder.forward): only the vocab slices of
    the top-k centroids are scored; every other logit is (min selected logit - 1)."""
    batch, length = hidden.shape[:2]
    vocab = lm_head.shape[0]
    _, top = torch.topk(named_linear(hidden, weights, "masked_embedding.centroids"), k=top_k, dim=-1)
    canonical = weights["masked_embedding.token_ordering"].long().view(num_centroids, vocab // num_centroids)[top]
    selected = lm_head[canonical.reshape(-1)].view(batch, length, -1, hidden.shape[-1])
    logits = (hidden.unsqueeze(-2) @ selected.transpose(-1, -2)).squeeze(-2)
    out = torch.full((batch, length, vocab), logits.min().item() - 1.0, dtype=hidden.dtype, device=hidden.device)
    return out.scatter_(-1, canonical.view(batch, length, -1), logits)


@torch.no_grad()
def assistant_forward(weights: Weights, *, spec: AssistantSpec, inputs_embeds: torch.Tensor,
                      shared_kv: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                      positions: torch.Tensor) -> AssistantOutput:
    """The Gemma 4 MTP assistant end to end (Gemma4AssistantForCausalLM.forward): pre_projection, every layer Q-only
    against the target's K/V, final norm, post_projection, logits.

    Args:
        weights: the assistant checkpoint's tensors (pre_projection.weight, post_projection.weight,
            model.layers.N..., model.norm.weight, model.embed_tokens.weight, optional lm_head.weight and
            masked_embedding.*).
        spec: from assistant_spec_from_config.
        inputs_embeds: [batch, q, 2 * backbone_hidden] (see assistant_inputs).
        shared_kv: {"sliding_attention": (key, value), "full_attention": (key, value)} from the target's last
            sliding and last full layer, each [batch, kv_heads, length, head_dim].
        positions: [q] or [batch, q] query positions (`generate` uses the last seen token's position).

    Returns:
        AssistantOutput(hidden, logits).
    """
    text, model = spec.text, sub_weights(weights, "model.")
    hidden = named_linear(inputs_embeds, weights, "pre_projection")
    sliding = next((layer.sliding_window for layer in text.layers if layer.sliding_window is not None), 0)
    masks = assistant_masks(query_length=hidden.shape[1], shared_kv=shared_kv, sliding_window=sliding,
                            device=hidden.device)
    for i, layer in enumerate(text.layers):
        hidden, _ = decoder_layer(hidden, sub_weights(model, f"layers.{i}."), layer=layer, spec=text,
                                  positions=positions, kv=shared_kv[layer.layer_type], mask=masks[layer.layer_type])
    hidden = rms_norm(hidden, model["norm.weight"], eps=text.eps)
    lm_head = weights["lm_head.weight"] if "lm_head.weight" in weights else model["embed_tokens.weight"]
    if spec.use_ordered_embeddings:
        logits = ordered_logits(hidden, weights, lm_head=whole(lm_head), num_centroids=spec.num_centroids,
                                top_k=spec.centroid_intermediate_top_k)
    else:
        logits = vocab_logits(hidden, lm_head)
    return AssistantOutput(hidden=named_linear(hidden, weights, "post_projection"), logits=logits)


# ------------------------------------------------------------------------------------------------ comparison


def compare_outputs(reference: torch.Tensor, candidate: torch.Tensor) -> ErrorStats:
    """Error statistics of `candidate` against `reference`, in float64 on the reference's device.

    Args:
        reference: the trusted tensor (e.g. the original checkpoint's output in fp32).
        candidate: same shape (e.g. the converted checkpoint's output); any dtype and device.

    Returns:
        ErrorStats. A zero reference gives max_rel / rel_rms of 0 when the candidate is zero too, else inf.

    Raises:
        ValueError: the shapes differ.
    """
    if tuple(reference.shape) != tuple(candidate.shape):
        raise ValueError(f"shape mismatch: reference {tuple(reference.shape)} vs candidate {tuple(candidate.shape)}")
    ref = reference.detach().to(torch.float64).flatten()
    cand = candidate.detach().to(device=ref.device, dtype=torch.float64).flatten()
    diff = cand - ref
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    norms = (float(ref.norm()), float(cand.norm()), float(diff.norm()))
    return ErrorStats(
        max_abs=max_abs,
        max_rel=_ratio(max_abs, float(ref.abs().max()) if ref.numel() else 0.0),
        rel_rms=_ratio(norms[2], norms[0]),
        cosine=_cosine(float(ref @ cand), norms[0], norms[1]),
    )


def _cosine(dot: float, norm_a: float, norm_b: float) -> float:
    if norm_a and norm_b:
        return max(-1.0, min(1.0, dot / (norm_a * norm_b)))  # clamp float64 rounding just past +-1
    return float(norm_a == norm_b)


def _ratio(numerator: float, denominator: float) -> float:
    if denominator:
        return numerator / denominator
    return 0.0 if numerator == 0 else math.inf

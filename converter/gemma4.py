"""What a Gemma 4 config.json means: role, dialect and per-layer attention geometry (pure, no I/O).

Geometry follows stock vLLM 0.27.0 (docs/DESIGN.md "What stock vLLM 0.27.0 does"): a full-attention layer uses
`global_head_dim`, and `num_global_key_value_heads` KV heads when `attention_k_eq_v`; a sliding layer
uses `head_dim` and `num_key_value_heads`. The transformers >= PER_LAYER_TRANSFORMERS dialect carries the full-layer
values in `per_layer_config` instead; when both are present transformers ignores the flat keys
(`Gemma4TextConfig.__post_init__` only builds per_layer_config from them when it is absent).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping

from .errors import InputError
from .quantization import check_quantization_config, modelopt_from_hf_quant_config

# gemma4_unified (12B, encoder-free vision) is served by vLLM 0.27 as Gemma4UnifiedForConditionalGeneration, a subclass
# of the gemma4 wrapper whose language model is the same Gemma4ForCausalLM (models/gemma4_unified.py), so its
# attention reads the same flat keys; transformers keeps the same heterogeneous geometry (global_head_dim popped into
# per_layer_config by configuration_gemma4_unified.py >= PER_LAYER_TRANSFORMERS). Its assistant becomes gemma4_mtp like
# the others (docs/DESIGN.md "What stock vLLM 0.27.0 does").
UNIFIED_FAMILY = "gemma4_unified"  # the 12B's target model_type; its assistant's is gemma4_unified_assistant
TARGET_MODEL_TYPES = {"gemma4": "multimodal", "gemma4_text": "text", UNIFIED_FAMILY: "multimodal"}
ASSISTANT_MODEL_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")
FULL = "full_attention"
SLIDING = "sliding_attention"


class Role(str, Enum):
    """Where a checkpoint sits in a conversion or an upload. A plain string wherever it is written (JSON, paths,
    messages), so conversion.json and every output stay byte-identical to the strings they were."""

    TARGET = "target"
    ASSISTANT = "assistant"
    SINGLE = "single"  # one checkpoint alone (convert SRC, upload DST REPO): straight into OUT, its kind its spec's

    __str__ = str.__str__
    __format__ = str.__format__

    @property
    def subdir(self) -> str:
        """Its folder in a converted pair's OUT ("" for one checkpoint alone: OUT itself)."""
        return "" if self is Role.SINGLE else self.value



DIALECT_LEGACY = "legacy"
DIALECT_PER_LAYER = "per_layer_config"
DIALECT_BOTH = "both"

# What a config looks like to a vLLM release (advice/serving.config_form decides it; each layout names its output's).
FORM_FUSED = "fused-qkv"  # self_attn.qkv_proj tensors: vLLM 0.27 maps split q/k/v only
# The first transformers release that writes `per_layer_config` and rebuilds it from the flat keys on load
# (docs/DESIGN.md "Zero-cost serving with the dual-keys recipe"): every "transformers<X" / ">=X" the tool says is built
# from it
PER_LAYER_TRANSFORMERS = "5.15"
# The first transformers whose configs know `per_layer_config` at all (5.14's heterogeneity integration, which raises
# on a global read of a per-layer attribute); older releases drop the key unread and size every layer from the config
# class's defaults (docs/DESIGN.md "The 12B family's floors")
PER_LAYER_KNOWN_TRANSFORMERS = "5.14"
# the 12B family's floors (docs/DESIGN.md "The 12B family's floors"): the first transformers with gemma4_unified
# (5.10.0, yanked; 5.10.1 the first served) and the first vLLM with models/gemma4_unified.py and the
# gemma4_unified_assistant draft in config/speculative.py
UNIFIED_TRANSFORMERS, UNIFIED_VLLM = "5.10", "0.23"
FORM_PER_LAYER_CONFIG = "per-layer-config"  # config.json holds per_layer_config (transformers >= PER_LAYER_TRANSFORMERS dialect)
FORM_HOMOGENEOUS = "homogeneous"  # one head size and KV-head count everywhere
FORM_DUAL_KEYS = "dual-keys"  # heterogeneous flat keys + the zero-cost dual keys
FORM_FLAT = "flat-keys"  # heterogeneous flat keys only (the Hub checkpoints)
KV_MIXED, KV_UNIFORM = "mixed", "uniform"  # whether the KV-head count differs between layer types

# The keys stock vLLM 0.27 reads for per-layer-type geometry, in the order the per-layer layout writes them.
GEOMETRY_KEYS = ("head_dim", "global_head_dim", "num_key_value_heads", "num_global_key_value_heads",
                 "attention_k_eq_v", "layer_types")
_PER_LAYER_OVERRIDES = {"head_dim", "num_key_value_heads"}

# The config-only zero-cost recipe ("dual keys", docs/DESIGN.md "Zero-cost serving with the dual-keys recipe"; pinned
# per transformers version by tests/test_transformers_pins.py). transformers >= PER_LAYER_TRANSFORMERS's
# Gemma4TextConfig.__post_init__ pops the LITERAL names `global_head_dim` / `num_global_key_value_heads` (it still
# builds its own per_layer_config from them, so its own model keeps the right shapes); an `attribute_map` read from
# config.json becomes an instance attribute that shadows the class one (empty for Gemma 4), and
# PreTrainedConfig.__getattribute__ resolves names through it, so vLLM's `getattr(config, "global_head_dim", ...)` finds
# the aliases; `allow_global_per_layer_attribute_access` lets vLLM read the flat (sliding) `head_dim` /
# `num_key_value_heads` of a heterogeneous config instead of raising.
ALLOW_GLOBAL_ACCESS = "allow_global_per_layer_attribute_access"
GLOBAL_ALIASES = {"global_head_dim": "gemma4_global_head_dim",
                  "num_global_key_value_heads": "gemma4_num_global_key_value_heads"}
DUAL_KEYS = (ALLOW_GLOBAL_ACCESS, "attribute_map", *GLOBAL_ALIASES.values())
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "q_norm", "k_norm")


@dataclass(frozen=True)
class LayerGeometry:
    """Attention geometry of one decoder layer, as vLLM 0.27 builds it."""

    index: int
    layer_type: str
    head_dim: int
    num_kv_heads: int
    k_eq_v: bool
    kv_shared: bool

    @property
    def is_full(self) -> bool:
        return self.layer_type == FULL

    @property
    def has_k(self) -> bool:
        """K tensors are required (a KV-shared layer reads another layer's cache; published E2B/E4B targets still
        carry its unused k_proj/v_proj/k_norm, which transformers ignores on load and vLLM 0.27 loads)."""
        return not self.kv_shared

    @property
    def has_v(self) -> bool:
        """A v_proj tensor is required."""
        return not self.kv_shared and not self.k_eq_v


# The attention geometry of each Gemma 4 size Google publishes (AttentionConfig.kv_geometry), by the name the ledger's
# rows give their source form (its first word, e.g. "12b, per_layer_config config, multimodal, ..."): the sliding
# KV heads, the full layers' KV heads (k_eq_v: num_global_key_value_heads) and the ratio of their head sizes
# (global_head_dim 512 over head_dim 256). docs/DESIGN.md
# "Which rows speak for a checkpoint, and the forms Google ships beyond the first three".
RELEASED_KV_GEOMETRY: dict[str, tuple[int, int, int]] = {
    "31b": (16, 4, 2), "26b-a4b": (8, 2, 2), "12b": (8, 1, 2), "e4b": (2, 2, 2), "e2b": (1, 1, 2)}


def describe_kv_geometry(geometry: tuple[int, int, int]) -> str:
    """"8 sliding / 1 full KV heads, full heads 2x as wide"."""
    sliding, full, ratio = geometry
    return f"{sliding} sliding / {full} full KV heads, full heads {ratio}x as wide"


@dataclass(frozen=True)
class AttentionConfig:
    """The attention keys of a text config, resolved from whichever dialect the file uses."""

    hidden_size: int
    num_heads: int
    head_dim: int
    global_head_dim: int
    num_kv_heads: int
    num_global_kv_heads: int
    k_eq_v: bool
    layer_types: tuple[str, ...]
    num_kv_shared_layers: int
    sliding_window: int | None

    def layer(self, index: int) -> LayerGeometry:
        full = self.layer_types[index] == FULL
        kv_shared = index >= len(self.layer_types) - self.num_kv_shared_layers
        return LayerGeometry(
            index=index,
            layer_type=self.layer_types[index],
            head_dim=self.global_head_dim if full else self.head_dim,
            num_kv_heads=self.num_global_kv_heads if (full and self.k_eq_v) else self.num_kv_heads,
            k_eq_v=full and self.k_eq_v,
            kv_shared=kv_shared,
        )

    @property
    def is_homogeneous(self) -> bool:
        """True when no layer differs from another in head size or KV heads (nothing for transformers to reject)."""
        return len({(g.head_dim, g.num_kv_heads) for g in self.layers}) == 1

    @property
    def layers(self) -> tuple[LayerGeometry, ...]:
        return tuple(self.layer(i) for i in range(len(self.layer_types)))

    @property
    def kv_geometry(self) -> tuple[int, int, int] | None:
        """(sliding KV heads, full KV heads, full head size / sliding head size): what tells Google's checkpoints
        apart for the ledger (RELEASED_KV_GEOMETRY); None where every layer is alike (nothing to tell)."""
        if self.is_homogeneous or FULL not in self.layer_types or self.head_dim <= 0:
            return None
        full = self.layer(self.layer_types.index(FULL))
        sliding = next((g for g in self.layers if not g.is_full), full)
        return sliding.num_kv_heads, full.num_kv_heads, full.head_dim // max(sliding.head_dim, 1)

    @property
    def mixed_kv_heads(self) -> bool:
        """Layer types differ in KV-head count (31B, 26B-A4B: 16 sliding, 4 or 2 global), which vLLM 0.21 and 0.22
        get wrong in the draft (they build every draft layer with the sliding count)."""
        return len({g.num_kv_heads for g in self.layers}) > 1


@dataclass(frozen=True)
class MoeConfig:
    """The 26B-A4B mixture-of-experts block beside each layer's dense MLP (`enable_moe_block`)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    hidden_size: int

    def fused_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-layer tensor suffix -> shape, as transformers' Gemma4TextRouter / Gemma4TextExperts store them
        (experts fused: gate_up_proj [E, 2I, H], down_proj [E, H, I]; vLLM 0.27 splits them on load)."""
        e, i, h = self.num_experts, self.intermediate_size, self.hidden_size
        return {"router.proj.weight": (e, h), "router.scale": (h,), "router.per_expert_scale": (e,),
                "experts.gate_up_proj": (e, 2 * i, h), "experts.down_proj": (e, h, i)}


@dataclass(frozen=True)
class ModelSpec:
    """A checkpoint's identity and geometry, decided from config.json alone."""

    role: str
    model_type: str
    multimodal: bool
    text_config_key: str | None
    weight_prefix: str
    dialect: str
    attention: AttentionConfig
    backbone_hidden_size: int | None
    quantization: Mapping[str, Any] | None
    moe: MoeConfig | None = None
    # the text config carries the complete zero-cost dual keys (DUAL_KEYS), consistent with the flat ones
    dual_keys: bool = False
    max_position_embeddings: int | None = None

    @property
    def kind(self) -> str:
        if self.role == Role.ASSISTANT:
            return f"MTP assistant ({self.model_type})"
        return f"Gemma 4 target ({'multimodal' if self.multimodal else 'text-only'} {self.model_type})"

    @property
    def unified(self) -> bool:
        """The 12B family (gemma4_unified / gemma4_unified_assistant), which older transformers and vLLM lack."""
        return self.model_type.startswith(UNIFIED_FAMILY)

    def last_layer_of_type(self, layer_type: str) -> int | None:
        found = [i for i, t in enumerate(self.attention.layer_types) if t == layer_type]
        return found[-1] if found else None


def text_config_of(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The dict holding the attention keys: `text_config` when nested, else the config itself."""
    nested = config.get("text_config")
    return nested if isinstance(nested, Mapping) else config


def read_spec(config: Mapping[str, Any], *, source: str, hf_quant_config: Any = None) -> ModelSpec:
    """Interprets a Gemma 4 target or assistant config.json.

    Args:
        config: the parsed config.json.
        source: file name used in error messages.
        hf_quant_config: the parsed hf_quant_config.json (Model Optimizer), used when config.json has no
            quantization_config, as vLLM 0.27 does.

    Returns:
        The ModelSpec.

    Raises:
        InputError: not a Gemma 4 target/assistant, or a required key is missing or contradictory.
    """
    model_type = config.get("model_type")
    if model_type in ASSISTANT_MODEL_TYPES:
        role, multimodal = Role.ASSISTANT, False
    elif isinstance(model_type, str) and model_type in TARGET_MODEL_TYPES:
        role, multimodal = Role.TARGET, TARGET_MODEL_TYPES[model_type] == "multimodal"
    else:
        known = ", ".join((*TARGET_MODEL_TYPES, *ASSISTANT_MODEL_TYPES))
        raise InputError(f"{source}: model_type {model_type!r} is not Gemma 4 (expected one of {known})")
    nested = role == Role.ASSISTANT or multimodal
    if nested and not isinstance(config.get("text_config"), Mapping):
        raise InputError(f"{source}: model_type {model_type!r} needs a `text_config` object")
    text = text_config_of(config)
    dialect, attention = _read_attention(text, role=role, source=source)
    quantization = (config.get("quantization_config") or text.get("quantization_config")
                    or modelopt_from_hf_quant_config(hf_quant_config))
    if quantization is not None and not isinstance(quantization, Mapping):
        raise InputError(f"{source}: `quantization_config` must be an object, got {quantization!r}")
    check_quantization_config(quantization, source=source)
    return ModelSpec(
        role=role,
        model_type=model_type,
        multimodal=multimodal,
        text_config_key="text_config" if nested else None,
        weight_prefix="model.language_model." if multimodal else "model.",
        dialect=dialect,
        attention=attention,
        backbone_hidden_size=config.get("backbone_hidden_size"),
        quantization=quantization,
        moe=_read_moe(text, attention.hidden_size, source),
        dual_keys=has_dual_keys(text, source=source),
        max_position_embeddings=_optional_int(text.get("max_position_embeddings")),
    )


def _optional_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _read_moe(text: Mapping[str, Any], hidden_size: int, source: str) -> MoeConfig | None:
    if not text.get("enable_moe_block"):
        return None
    return MoeConfig(num_experts=_require_int(text, "num_experts", source),
                     top_k=_require_int(text, "top_k_experts", source),
                     intermediate_size=_require_int(text, "moe_intermediate_size", source), hidden_size=hidden_size)


def _require_int(text: Mapping[str, Any], key: str, source: str) -> int:
    value = text.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InputError(f"{source}: text config key {key!r} must be a positive integer, got {value!r}")
    return value


def _read_layer_types(text: Mapping[str, Any], source: str) -> tuple[str, ...]:
    layer_types = text.get("layer_types")
    if not isinstance(layer_types, list) or not layer_types:
        raise InputError(f"{source}: text config has no `layer_types` list; cannot tell sliding from full layers")
    unknown = sorted({str(t) for t in layer_types if t not in (FULL, SLIDING)})  # str(): entries may be any JSON
    if unknown:
        raise InputError(f"{source}: unknown layer types {unknown} in `layer_types`")
    layers = _require_int(text, "num_hidden_layers", source) if "num_hidden_layers" in text else len(layer_types)
    if layers != len(layer_types):
        raise InputError(f"{source}: num_hidden_layers is {layers} but layer_types lists {len(layer_types)}")
    return tuple(layer_types)


def _read_attention(text: Mapping[str, Any], *, role: str, source: str) -> tuple[str, AttentionConfig]:
    layer_types = _read_layer_types(text, source)
    head_dim = _require_int(text, "head_dim", source)
    num_kv = _require_int(text, "num_key_value_heads", source)
    k_eq_v = text.get("attention_k_eq_v", False)
    if not isinstance(k_eq_v, bool):
        raise InputError(f"{source}: text config key 'attention_k_eq_v' must be true or false, got {k_eq_v!r}")
    has_flat = "global_head_dim" in text or "num_global_key_value_heads" in text
    per_layer = text.get("per_layer_config")
    if per_layer is not None:
        dialect = DIALECT_BOTH if has_flat else DIALECT_PER_LAYER
        global_head_dim, num_global_kv = _read_per_layer_config(per_layer, layer_types, head_dim, num_kv, source)
    else:
        dialect = DIALECT_LEGACY
        global_head_dim = _require_int(text, "global_head_dim", source) if FULL in layer_types else head_dim
        if k_eq_v and FULL in layer_types:
            num_global_kv = _require_int(text, "num_global_key_value_heads", source)
        else:
            num_global_kv = text.get("num_global_key_value_heads") or num_kv
    shared = text.get("num_kv_shared_layers") or 0
    if not isinstance(shared, int) or not 0 <= shared <= len(layer_types):
        raise InputError(f"{source}: num_kv_shared_layers must be an integer in [0, {len(layer_types)}], "
                         f"got {shared!r}")
    if role == Role.ASSISTANT:
        shared = len(layer_types)  # every assistant layer reads the target's KV (Gemma4AssistantConfig.__post_init__)
    window = text.get("sliding_window")
    return dialect, AttentionConfig(
        hidden_size=_require_int(text, "hidden_size", source),
        num_heads=_require_int(text, "num_attention_heads", source),
        head_dim=head_dim,
        global_head_dim=global_head_dim,
        num_kv_heads=num_kv,
        num_global_kv_heads=num_global_kv,
        k_eq_v=k_eq_v,
        layer_types=layer_types,
        num_kv_shared_layers=int(shared),
        sliding_window=window if isinstance(window, int) else None,
    )


def _read_per_layer_config(per_layer: Any, layer_types: tuple[str, ...], head_dim: int, num_kv: int,
                           source: str) -> tuple[int, int]:
    """Full-layer (head_dim, kv heads) from a transformers >= PER_LAYER_TRANSFORMERS `per_layer_config`; sliding layers keep the base."""
    if not isinstance(per_layer, Mapping):
        raise InputError(f"{source}: `per_layer_config` must be an object keyed by layer index")
    overrides: dict[str, set[tuple[int, int]]] = {FULL: set(), SLIDING: set()}
    seen: set[int] = set()
    for key, values in per_layer.items():
        if not re.fullmatch(r"\d+", str(key)) or int(key) >= len(layer_types) or not isinstance(values, Mapping):
            raise InputError(f"{source}: `per_layer_config` entry {key!r} is not a valid layer index with overrides")
        # transformers' save_pretrained zero-pads the keys to the widest index ("05" ... "59"); compare as integers
        if int(key) in seen:
            raise InputError(f"{source}: `per_layer_config` names layer {int(key)} twice")
        seen.add(int(key))
        unknown = set(values) - _PER_LAYER_OVERRIDES
        if unknown:
            raise InputError(f"{source}: `per_layer_config[{key}]` overrides {sorted(unknown)}, "
                             f"which this tool cannot carry into flat keys (only {sorted(_PER_LAYER_OVERRIDES)})")
        value = (values.get("head_dim", head_dim), values.get("num_key_value_heads", num_kv))
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
            raise InputError(f"{source}: `per_layer_config[{key}]` values must be positive integers, got {values!r}")
        overrides[layer_types[int(key)]].add(value)
    for index, layer_type in enumerate(layer_types):
        if index not in seen:
            overrides[layer_type].add((head_dim, num_kv))
    if overrides[SLIDING] - {(head_dim, num_kv)}:
        raise InputError(f"{source}: `per_layer_config` overrides sliding layers; vLLM 0.27 cannot express that")
    if len(overrides[FULL]) > 1:
        raise InputError(f"{source}: `per_layer_config` gives full layers different geometries "
                         f"{sorted(overrides[FULL])}; vLLM 0.27 has one global_head_dim")
    return next(iter(overrides[FULL]), (head_dim, num_kv))


_ATTENTION_NAME = re.compile(
    r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.self_attn\.(?P<module>" + "|".join(ATTENTION_MODULES)
    + r")\.(?P<param>[a-z_]+)$")


@dataclass(frozen=True)
class AttentionTensorName:
    """A parsed `<prefix>layers.<i>.self_attn.<module>.<param>` name."""

    layer: int
    module: str
    param: str


def parse_attention_name(name: str, prefix: str) -> AttentionTensorName | None:
    """The layer/module/param of a text-decoder attention tensor, or None for anything else (vision tower included)."""
    match = _ATTENTION_NAME.match(name)
    if not match or match["prefix"] != prefix:
        return None
    return AttentionTensorName(layer=int(match["layer"]), module=match["module"], param=match["param"])


def attention_tensor_name(prefix: str, layer: int, module: str, param: str) -> str:
    return f"{prefix}layers.{layer}.self_attn.{module}.{param}"


_MOE_NAME = re.compile(r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.(?P<suffix>(?:router|experts)\..+)$")


def parse_moe_name(name: str, prefix: str) -> tuple[int, str] | None:
    """(layer, suffix such as 'experts.gate_up_proj') of a text-decoder router/experts tensor, else None."""
    match = _MOE_NAME.match(name)
    if not match or match["prefix"] != prefix:
        return None
    return int(match["layer"]), match["suffix"]


def with_dual_keys(text: Mapping[str, Any], flat: Mapping[str, Any]) -> dict[str, Any]:
    """`text` plus the zero-cost dual keys for the flat geometry `flat` (other attribute_map entries kept)."""
    new = dict(text)
    new.update(flat)
    new[ALLOW_GLOBAL_ACCESS] = True
    new["attribute_map"] = {**dict(text.get("attribute_map") or {}), **GLOBAL_ALIASES}
    for name, alias in GLOBAL_ALIASES.items():
        new[alias] = flat[name]
    return new


def without_dual_keys(text: Mapping[str, Any]) -> dict[str, Any]:
    """`text` with every zero-cost key removed (an attribute_map left with nothing else goes too)."""
    new = {key: value for key, value in text.items() if key not in DUAL_KEYS}
    rest = {k: v for k, v in dict(text.get("attribute_map") or {}).items() if k not in GLOBAL_ALIASES}
    if rest:
        new["attribute_map"] = rest
    return new


def has_dual_keys(text: Mapping[str, Any], *, source: str) -> bool:
    """True when `text` carries the complete dual keys; InputError when the aliases contradict the flat keys.

    vLLM reads the aliases (through attribute_map, under every transformers version), transformers >= PER_LAYER_TRANSFORMERS the
    literal keys: a mismatch would give the two different geometries.
    """
    mapping = text.get("attribute_map")
    if not isinstance(mapping, Mapping) or any(mapping.get(k) != v for k, v in GLOBAL_ALIASES.items()):
        return False
    for name, alias in GLOBAL_ALIASES.items():
        if alias in text and name in text and text[alias] != text[name]:
            raise InputError(f"{source}: {alias} is {text[alias]!r} but {name} is {text[name]!r}; vLLM reads the "
                             f"first (attribute_map), transformers >= {PER_LAYER_TRANSFORMERS} the second: make them "
                             f"equal")
    return text.get(ALLOW_GLOBAL_ACCESS) is True and all(alias in text for alias in GLOBAL_ALIASES.values())

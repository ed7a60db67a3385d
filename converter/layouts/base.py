"""What a layout is: the plug-in registry and interface, and the planning every layout shares (config keys, shards).

Whether a checkpoint is what its config says is validate/'s question: `Layout.plan` asks it once, before planning."""

from __future__ import annotations

import copy
from typing import Any, Callable, ClassVar, Iterator, Mapping

from ..dequantize import dequantized, refuse_undequantizable, without_quantization
from ..errors import UnsupportedLayoutError, UsageError
from ..gemma4 import GEOMETRY_KEYS, AttentionConfig, ModelSpec, attention_tensor_name, without_dual_keys
from ..plan import (ACTION_KEPT, ACTION_SPLIT, CachePlacement, CheckpointPlan, SourceSlice, TensorPlan, mark_unchanged,
                    plan_shards)
from ..read.checkpoint import Checkpoint
from ..validate import refuse_invalid, refuse_invalid_config
from ..validate.attention import AttentionTensor, find_attention_tensors

_REGISTRY: dict[str, type["Layout"]] = {}


def register_layout(name: str) -> Callable[[type["Layout"]], type["Layout"]]:
    """Class decorator adding a layout under `name`; a second class with the same name is a bug, so it raises."""
    def decorate(cls: type["Layout"]) -> type["Layout"]:
        if name in _REGISTRY:
            raise ValueError(f"layout {name!r} is already registered by {_REGISTRY[name].__name__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return decorate


def layout_names() -> list[str]:
    return sorted(_REGISTRY)


def layouts_in_preference() -> list["Layout"]:
    """Every registered layout with its default options, cheapest first: the order advice tries them in."""
    return [cls() for cls in sorted(_REGISTRY.values(), key=lambda cls: (cls.preference, cls.name))]


def layout_offering(option: str, value: Any) -> str:
    """The name of the layout that takes `option` = `value` (a CLI flag that sets a layout option, e.g.
    --flat-keys-only, names no layout itself)."""
    (name,) = [name for name, cls in _REGISTRY.items() if value in cls.option_choices.get(option, ((), ()))[1]]
    return name


def default_layout() -> "Layout":
    """What `convert` writes when nothing decides otherwise: the cheapest layout."""
    return layouts_in_preference()[0]


def get_layout(name: str, options: Mapping[str, Any] | None = None) -> "Layout":
    """The registered layout instance with `options` over its defaults; UnsupportedLayoutError lists the known names.

    Raises:
        UnsupportedLayoutError: no layout of that name.
        UsageError: an option the layout does not have, or a value it does not accept.
    """
    if name not in _REGISTRY:
        raise UnsupportedLayoutError(f"unknown layout {name!r}; known layouts: {', '.join(layout_names())}")
    return _REGISTRY[name](**dict(options or {}))


def layout_from_manifest(manifest: Mapping[str, Any]) -> "Layout":
    """The layout a conversion.json records, with the options it was run with.

    A manifest written before its layout had options holds none: it gets the layout's `recorded_before_options`.
    """
    name = str(manifest.get("layout", ""))
    options = manifest.get("layout_options")
    if options is None and name in _REGISTRY:
        options = _REGISTRY[name].recorded_before_options
    return get_layout(name, options if isinstance(options, Mapping) else None)


class Layout:
    """Base class: subclasses set `description` and override the two hooks below."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    # option name -> (default, accepted values); recorded in conversion.json as `layout_options`
    option_choices: ClassVar[Mapping[str, tuple[Any, tuple[Any, ...]]]] = {}
    # the options of outputs written before the layout had any (their conversion.json records none)
    recorded_before_options: ClassVar[Mapping[str, Any]] = {}

    # What the layout says of itself wherever the tool speaks of it (advice, cards, the serve line, pairing, costs):
    # code outside layouts/ asks the layout and never spells its name.
    preference: ClassVar[int] = 100  # advice tries layouts lowest first (cheapest first); the lowest is the default
    cost_note: ClassVar[str] = ""  # what it costs, in a few words (advice's "at zero cost, same tensors ...")
    advice_why: ClassVar[str] = ""  # why advice picks it where it serves
    price_note: ClassVar[str] = ""  # what advice says it costs where it names it as the alternative
    caveat: ClassVar[str] = ""  # what could stop it serving where no row says it fails yet
    card_text: ClassVar[str] = ""  # the card's paragraph on the layout
    kv_note: ClassVar[str] = ""  # under the card's KV-cache table
    serve_note: ClassVar[str] = ""  # under the card's `vllm serve` line
    serve_flags: ClassVar[str] = ""  # appended to `vllm serve`
    pair_must_match: ClassVar[bool] = False  # target and assistant must both carry it: one side alone is garbage

    @property
    def summary(self) -> str:
        """The description's first clause: what convert's one line about the layout says (the rest is --help's)."""
        return self.description.split(";")[0]

    def __init__(self, **options: Any) -> None:
        for key, value in options.items():
            if key not in self.option_choices:
                raise UsageError(f"layout {self.name!r} has no option {key!r}")
            if value not in self.option_choices[key][1]:
                raise UsageError(f"layout {self.name!r} option {key!r} must be one of "
                                 f"{list(self.option_choices[key][1])}, got {value!r}")
        self.options: dict[str, Any] = {key: options.get(key, default)
                                        for key, (default, _) in self.option_choices.items()}

    # -- hooks -------------------------------------------------------------------------------------
    def check(self, spec: ModelSpec, *, source: str) -> list[str]:
        """Raises InputError when the checkpoint cannot take this layout; returns warnings."""
        return []

    def plan_attention(self, tensor: AttentionTensor, spec: ModelSpec, out_name: str) -> TensorPlan:
        raise NotImplementedError

    def geometry_keys(self, attention: AttentionConfig) -> dict[str, Any]:
        raise NotImplementedError

    def matches(self, spec: ModelSpec) -> bool:
        """True when a checkpoint's config already has this layout's geometry."""
        raise NotImplementedError

    def output_attention(self, attention: AttentionConfig) -> AttentionConfig:
        """The geometry of this layout's output: what vLLM builds and caches (KV cost, TP divisions)."""
        return attention

    def cache_placement(self, *, num_kv_heads: int, head_dim: int, output_kv_heads: int, output_head_dim: int,
                        key: bool) -> CachePlacement | None:
        """Where a target this layout wrote caches the K (key) or V states of a layer whose original geometry is
        (num_kv_heads, head_dim) and whose output geometry is (output_kv_heads, output_head_dim); None where this
        layout does not write that geometry. Here: as they are, for a layout that keeps KV geometry."""
        return CachePlacement() if (num_kv_heads, head_dim) == (output_kv_heads, output_head_dim) else None

    def ledger_shape(self, kv_heads: str) -> tuple[str, str]:
        """(config form, KV-head pattern) of this layout's output for a source with KV-head pattern `kv_heads`:
        what the ledger matches its rows by (advice/evidence.py)."""
        raise NotImplementedError

    @property
    def variant(self) -> str:
        """The layout with the options that change what it writes, as the ledger names its rows and the card its
        text (LedgerRow.variant)."""
        return self.name

    # -- shared ------------------------------------------------------------------------------------
    def admit(self, checkpoint: Checkpoint) -> None:
        """Refuses a checkpoint this layout cannot convert, before anything is planned (convert, verify).

        Raises:
            InputError: in this order: what the config declares that cannot be converted, what this layout cannot
                take (its `check`), the first problem of the tensors; all but the layout's are
                validate.checkpoint_problems, the list inspect reports.
        """
        spec, source = checkpoint.spec, str(checkpoint.path)
        refuse_invalid_config(spec, source=source)
        self.check(spec, source=source)
        refuse_invalid(checkpoint)

    def plan(self, checkpoint: Checkpoint, *, max_shard_bytes: int | None = None,
             dequantize: bool = False) -> CheckpointPlan:
        """The complete plan for one checkpoint `admit` let through: every tensor, the shards, the new config.
        `dequantize`: its quantized weights written as plain float, without quantization_config (dequantize.py)."""
        spec = checkpoint.spec
        warnings = self.check(spec, source=str(checkpoint.path))
        tensors = list(self._plan_tensors(checkpoint))
        config = self.rewrite_config(checkpoint.config, spec)
        if dequantize:
            refuse_undequantizable(spec, source=str(checkpoint.path))
            tensors, config = dequantized(tensors, checkpoint, layout=self.name), without_quantization(config)
        shards, indexed = plan_shards(tensors, source_files=[s.file.name for s in checkpoint.shards],
                                      indexed=checkpoint.indexed, max_shard_bytes=max_shard_bytes)
        shards = mark_unchanged(shards, checkpoint.shards)
        metadata = dict(checkpoint.shards[0].metadata) if checkpoint.shards else {}
        metadata.setdefault("format", "pt")
        return CheckpointPlan(role=spec.role, layout=self.name, layout_options=dict(self.options), config=config,
                              shards=shards, indexed=indexed, side_files=checkpoint.side_files,
                              metadata=metadata, warnings=tuple(warnings), dequantized=dequantize)

    def rewrite_config(self, config: Any, spec: ModelSpec) -> dict[str, Any]:
        """config.json with the geometry keys replaced, `per_layer_config` and any dual keys gone; the rest kept."""
        new = copy.deepcopy(dict(config))
        text = without_dual_keys(new[spec.text_config_key] if spec.text_config_key else new)
        text.pop("per_layer_config", None)
        text = self.rewrite_text_config(text, spec.attention)
        write_vision_rope_portably(new)
        if spec.text_config_key:
            new[spec.text_config_key] = text
            return new
        return text

    def rewrite_text_config(self, text: dict[str, Any], attention: AttentionConfig) -> dict[str, Any]:
        """The text config (already without per_layer_config and dual keys) with this layout's geometry keys."""
        text.update(self.geometry_keys(attention))
        return text

    def _plan_tensors(self, checkpoint: Checkpoint) -> Iterator[TensorPlan]:
        spec = checkpoint.spec
        attention = list(find_attention_tensors(checkpoint))
        claimed = {t.source.ref.name for t in attention}
        for ref in checkpoint.tensors.values():
            if ref.name not in claimed:
                yield TensorPlan(name=ref.name, dtype=ref.dtype, shape=ref.shape, source=SourceSlice.whole(ref),
                                 action=ACTION_KEPT)
        for tensor in attention:
            out_name = attention_tensor_name(spec.weight_prefix, tensor.layer.index, tensor.module, tensor.param)
            yield self.plan_attention(tensor, spec, out_name)


def write_vision_rope_portably(config: dict[str, Any]) -> None:
    """Vision rope "axial" -> "default", in place: transformers >= PER_LAYER_TRANSFORMERS writes "axial" on save_pretrained, which
    5.14.1 cannot build (KeyError: 'axial'); >= PER_LAYER_TRANSFORMERS maps "default" back to "axial" on load
    (modeling_rope_utils.py standardize_rope_params, Gemma4VisionConfig.default_rope_type), so both read it."""
    vision = config.get("vision_config")
    rope = vision.get("rope_parameters") if isinstance(vision, dict) else None
    if isinstance(rope, dict) and rope.get("rope_type") == "axial":
        rope["rope_type"] = "default"


def kept(tensor: AttentionTensor, out_name: str) -> TensorPlan:
    """The tensor unchanged (a fused source's row range is still a plain byte copy)."""
    return TensorPlan(name=out_name, dtype=tensor.source.ref.dtype, shape=tensor.source.shape, source=tensor.source,
                      action=ACTION_SPLIT if tensor.from_fused else ACTION_KEPT)


def transformed(tensor: AttentionTensor, out_name: str, *, action: str, transform: str, shape: tuple[int, ...],
                **params: int) -> TensorPlan:
    """The tensor through a named function of transforms.py."""
    return TensorPlan(name=out_name, dtype=tensor.source.ref.dtype, shape=shape, source=tensor.source,
                      action=f"split+{action}" if tensor.from_fused else action, transform=transform, params=params)


def explicit_geometry(attention: AttentionConfig, **overrides: Any) -> dict[str, Any]:
    """The six flat keys vLLM 0.27 reads, from the resolved geometry, with overrides applied."""
    values = {"head_dim": attention.head_dim, "global_head_dim": attention.global_head_dim,
              "num_key_value_heads": attention.num_kv_heads,
              "num_global_key_value_heads": attention.num_global_kv_heads,
              "attention_k_eq_v": attention.k_eq_v, "layer_types": list(attention.layer_types)}
    values.update(overrides)
    return {key: values[key] for key in GEOMETRY_KEYS}

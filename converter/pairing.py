"""Can a target and an assistant serve together? Geometry, hidden sizes and the layout this tool recorded."""

from __future__ import annotations

import shlex

from dataclasses import dataclass
from typing import Any, Mapping

from .errors import UnsupportedLayoutError
from .gemma4 import ModelSpec, Role
from .layouts import Layout, get_layout
from .parallel import DEFAULT_TP_SIZES, rank_geometry, tp_problems

DEFAULT_SPECULATIVE_TOKENS = 4


@dataclass(frozen=True)
class KvShare:
    """One assistant layer and the target layer whose KV cache it reads, with (head_dim, KV heads) of each."""

    assistant_layer: int
    layer_type: str
    target_layer: int | None
    assistant_geometry: tuple[int, int]
    target_geometry: tuple[int, int] | None

    @property
    def ok(self) -> bool:
        return self.target_geometry == self.assistant_geometry


@dataclass(frozen=True)
class RankShare:
    """One assistant layer and its target layer on one tensor-parallel rank: (head_dim, KV heads per rank)."""

    tp: int
    assistant_layer: int
    target_layer: int
    assistant_rank: tuple[int, int]
    target_rank: tuple[int, int]

    @property
    def ok(self) -> bool:
        return self.assistant_rank == self.target_rank


@dataclass(frozen=True)
class PairReport:
    shares: tuple[KvShare, ...]
    problems: tuple[str, ...]
    per_rank: tuple[RankShare, ...] = ()
    notes: tuple[str, ...] = ()  # what the pair does differently from one Google ships; it can still serve

    @property
    def ok(self) -> bool:
        return not self.problems


def recorded_layout(manifest: Mapping[str, Any] | None) -> str | None:
    return manifest.get("layout") if manifest else None


def check_pair(target: ModelSpec, assistant: ModelSpec, *, target_manifest: Mapping[str, Any] | None = None,
               assistant_manifest: Mapping[str, Any] | None = None, tp_sizes: tuple[int, ...] = DEFAULT_TP_SIZES,
               tp_required: bool = False) -> PairReport:
    """Every reason the pair would fail or compute garbage in vLLM 0.27; empty problems means it can serve.

    tp_sizes: the tensor-parallel sizes whose per-rank KV geometry is compared (vLLM computes the draft's from the
    assistant's own config and never checks it against the target layer's cache it reads). tp_required: the user
    serves with these sizes, so one vLLM refuses for the target's geometry is a problem too.
    """
    problems: list[str] = []
    if target.role != Role.TARGET:
        problems.append(f"the target is a {target.kind}, not a target")
    if assistant.role != Role.ASSISTANT:
        problems.append(f"the assistant is a {assistant.kind}, not an MTP assistant")
    if problems:
        return PairReport(shares=(), problems=tuple(problems))
    if assistant.backbone_hidden_size != target.attention.hidden_size:
        problems.append(f"assistant backbone_hidden_size {assistant.backbone_hidden_size} != target hidden_size "
                        f"{target.attention.hidden_size}")
    shares = tuple(_kv_share(target, layer) for layer in assistant.attention.layers)
    for share in shares:
        if share.target_layer is None:
            problems.append(f"assistant layer {share.assistant_layer} ({share.layer_type}) has no target layer of "
                            "that type to read KV from")
        elif not share.ok:
            problems.append(f"assistant layer {share.assistant_layer} ({share.layer_type}) expects (head_dim, KV heads)"
                            f" {share.assistant_geometry} but target layer {share.target_layer} caches "
                            f"{share.target_geometry}")
    per_rank = tuple(_rank_share(target, assistant, share, tp) for tp in tp_sizes for share in shares
                     if share.target_layer is not None)
    bad = [r for r in per_rank if r.tp > 1 and not r.ok]
    if bad:
        sizes = ", ".join(str(tp) for tp in sorted({r.tp for r in bad}))
        problems.append(f"per tensor-parallel rank too, at TP {sizes}: e.g. at TP {bad[0].tp} assistant layer "
                        f"{bad[0].assistant_layer} computes with (head_dim, KV heads per rank) {bad[0].assistant_rank}"
                        f" where target layer {bad[0].target_layer} caches {bad[0].target_rank}; vLLM checks neither")
    if tp_required:
        for tp in tp_sizes:
            problems.extend(tp_problems(target.attention, tp, what="the target"))
    layouts = (recorded_layout(target_manifest), recorded_layout(assistant_manifest))
    both = [name for name in layouts if name and _known_layout(name) and _known_layout(name).pair_must_match]
    if both and layouts[0] != layouts[1]:
        problems.append(f"layouts differ: target {layouts[0] or 'unconverted'}, assistant {layouts[1] or 'unconverted'}"
                        f"; {both[0]} must be applied to both")
    return PairReport(shares=shares, problems=tuple(problems), per_rank=per_rank, notes=pair_notes(target, assistant))




def pair_notes(target: ModelSpec, assistant: ModelSpec) -> tuple[str, ...]:
    """What the consumers do with a pair whose assistant differs from its target in what vLLM shares between them
    (the draft's positions and the cache its sliding layers read) or in family (docs/DESIGN.md, "Pairs that differ
    from their target")."""
    notes = []
    draft_positions, positions = assistant.max_position_embeddings, target.max_position_embeddings
    if draft_positions is not None and positions is not None and draft_positions < positions:
        notes.append(f"assistant max_position_embeddings {draft_positions} < target's {positions}: vLLM 0.27 sizes "
                     f"the draft's rotary table by the assistant's (its raise to the target's length is for EAGLE "
                     f"only), so a longer context reads past it; serve with --max-model-len {draft_positions} or "
                     f"less there (0.34 raises it to the target's max_model_len)")
    elif draft_positions is not None and positions is not None and draft_positions > positions:
        notes.append(f"assistant max_position_embeddings {draft_positions} > target's {positions}: vLLM caps the "
                     f"draft at the target's max_model_len; nothing else changes")
    draft_window, window = assistant.attention.sliding_window, target.attention.sliding_window
    if draft_window is not None and window is not None and draft_window != window:
        effect = ("reaches blocks the target's sliding-window cache has already freed (vLLM: stale KV, lower "
                  "acceptance)" if draft_window > window else "attends to less than the target's cache holds")
        notes.append(f"assistant sliding_window {draft_window} != target's {window}: its sliding layers read the "
                     f"target's cache but attend over their own window (vLLM 0.27's Gemma4MTP), which {effect}")
    if target.unified != assistant.unified:
        notes.append(f"{assistant.model_type} beside a {target.model_type} target: vLLM 0.27 maps "
                     f"both assistant types to one draft (Gemma4MTP) and serves the pair; no such pair is published "
                     f"(the 12B ships gemma4_unified with gemma4_unified_assistant), so check the assistant was "
                     f"trained for this target")
    return tuple(notes)


def _rank_share(target: ModelSpec, assistant: ModelSpec, share: KvShare, tp: int) -> RankShare:
    def on_rank(spec: ModelSpec, head_dim: int, kv_heads: int) -> tuple[int, int]:
        return head_dim, rank_geometry(spec.attention.num_heads, kv_heads, head_dim, tp).kv_heads_per_rank

    return RankShare(tp=tp, assistant_layer=share.assistant_layer, target_layer=share.target_layer,
                     assistant_rank=on_rank(assistant, share.assistant_geometry[0], share.assistant_geometry[1]),
                     target_rank=on_rank(target, share.target_geometry[0], share.target_geometry[1]))


def _kv_share(target: ModelSpec, assistant_layer) -> KvShare:
    source = target.last_layer_of_type(assistant_layer.layer_type)
    geometry = None
    if source is not None:
        layer = target.attention.layer(source)
        geometry = (layer.head_dim, layer.num_kv_heads)
    return KvShare(assistant_layer=assistant_layer.index, layer_type=assistant_layer.layer_type, target_layer=source,
                   assistant_geometry=(assistant_layer.head_dim, assistant_layer.num_kv_heads),
                   target_geometry=geometry)


# vLLM <= 0.33 picks a draft's speculative method from substrings of its model string, lower-cased, ahead of the
# method the --speculative-config names: `elif "eagle-" in self.draft_model_config.model.lower(): self.method =
# "eagle"` in SpeculativeConfig.__post_init__ (vllm/config/speculative.py; read in 0.27.0, which also lists eagle3,
# dflash and dspark). An MTP assistant so named is then built as that method's draft and fails in SpeculativeConfig
# (measured on 0.27.0: AttributeError: 'Gemma4AssistantConfig' object has no attribute 'vocab_size'). vLLM 0.34
# reads Gemma 4 MTP's own speculator config first and is unaffected. docs/DESIGN.md, "Draft names vLLM misreads".
METHOD_BY_DRAFT_NAME = (("eagle-", "EAGLE"), ("eagle3", "EAGLE-3"), ("dflash", "DFlash"), ("dspark", "DSpark"))
MISREADING_RELEASES = "vLLM 0.33 and older"


def misread_draft_name(reference: str) -> str | None:
    """Why vLLM would not serve `reference` (a draft's path or repo id, as the serve line names it) as an MTP
    draft, or None when it would."""
    lowered = reference.lower()
    for substring, method in METHOD_BY_DRAFT_NAME:
        if substring in lowered:
            return (f"{reference!r} holds {substring!r}: {MISREADING_RELEASES} take a draft so named for a {method} "
                    f"draft, whatever --speculative-config says, and fail to start; choose a name without "
                    f"{', '.join(repr(s) for s, _ in METHOD_BY_DRAFT_NAME)}")
    return None


def serve_line(*, target: str | None, assistant: str | None, layout: str | None, tp: int | None = None) -> str:
    """The `vllm serve` command for a pair, by local path (convert) or repo id (cards), with the flags the layout
    (a registered name; any other, or None for a source as it is, gets none) asks for (Layout.serve_flags)."""
    target_ref = target or "<TARGET converted the same way>"
    assistant_ref = assistant or "<ASSISTANT converted the same way>"
    spec = ('{"method": "mtp", "model": "' + assistant_ref + f'", "num_speculative_tokens": '
            f'{DEFAULT_SPECULATIVE_TOKENS}}}')
    # quoted for the shell (a path with a space is one argument); the placeholder stays readable as it is
    command = f"vllm serve {shlex.quote(target) if target else target_ref} --speculative-config {shlex.quote(spec)}"
    known = _known_layout(layout) if layout else None
    command += known.serve_flags if known else ""
    if tp is not None:
        command += f" --tensor-parallel-size {tp}"
    return command


def _known_layout(name: str) -> Layout | None:
    """The registered layout of that name with its default options; None for a name this version does not know."""
    try:
        return get_layout(name)
    except UnsupportedLayoutError:
        return None

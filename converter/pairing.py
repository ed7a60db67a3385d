"""Can a target and an assistant serve together? Geometry, hidden sizes and the layout this tool recorded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .gemma4 import ROLE_ASSISTANT, ROLE_TARGET, ModelSpec

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
class PairReport:
    shares: tuple[KvShare, ...]
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def recorded_layout(manifest: Mapping[str, Any] | None) -> str | None:
    return manifest.get("layout") if manifest else None


def check_pair(target: ModelSpec, assistant: ModelSpec, *, target_manifest: Mapping[str, Any] | None = None,
               assistant_manifest: Mapping[str, Any] | None = None) -> PairReport:
    """Every reason the pair would fail or compute garbage in vLLM 0.27; empty problems means it can serve."""
    problems: list[str] = []
    if target.role != ROLE_TARGET:
        problems.append(f"the target is a {target.kind}, not a target")
    if assistant.role != ROLE_ASSISTANT:
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
    layouts = (recorded_layout(target_manifest), recorded_layout(assistant_manifest))
    if "pad-global" in layouts and layouts[0] != layouts[1]:
        problems.append(f"layouts differ: target {layouts[0] or 'unconverted'}, assistant {layouts[1] or 'unconverted'}"
                        "; pad-global must be applied to both")
    return PairReport(shares=shares, problems=tuple(problems))


def _kv_share(target: ModelSpec, assistant_layer) -> KvShare:
    source = target.last_layer_of_type(assistant_layer.layer_type)
    geometry = None
    if source is not None:
        layer = target.attention.layer(source)
        geometry = (layer.head_dim, layer.num_kv_heads)
    return KvShare(assistant_layer=assistant_layer.index, layer_type=assistant_layer.layer_type, target_layer=source,
                   assistant_geometry=(assistant_layer.head_dim, assistant_layer.num_kv_heads),
                   target_geometry=geometry)


def serve_line(*, target: str | None, assistant: str | None, layout: str) -> str:
    """The `vllm serve` command for a pair, by local path (convert) or repo id (cards); pad-global pins the attention
    backend (FACTS.md section 4)."""
    target_ref = target or "<TARGET converted the same way>"
    assistant_ref = assistant or "<ASSISTANT converted the same way>"
    spec = ('{"method": "mtp", "model": "' + assistant_ref + f'", "num_speculative_tokens": '
            f'{DEFAULT_SPECULATIVE_TOKENS}}}')
    command = f"vllm serve {target_ref} --speculative-config '{spec}'"
    if layout == "pad-global":
        command += " --attention-backend TRITON_ATTN"
    return command

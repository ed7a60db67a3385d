"""`inspect`: what a checkpoint is and what stock vLLM will do with it, from config + headers only.

The document built here is the `--json` output; its keys are documented in docs/CLI.md and stay stable.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from ..cost import kv_costs
from ..parallel import kv_bytes_per_token_per_rank, layer_type_geometry, tp_problems
from ..errors import InputError
from ..gemma4 import (DIALECT_BOTH, DIALECT_LEGACY, DIALECT_PER_LAYER, PER_LAYER_TRANSFORMERS, ModelSpec,
                      parse_moe_name, Role)
from ..layouts import Layout, default_layout, layout_names, layouts_in_preference
from ..layouts.base import layout_from_manifest
from ..quantization import weight_scheme
from ..read.checkpoint import MANIFEST_NAME, Checkpoint
from ..validate import (AttentionTensor, attention_problems, checkpoint_problems, expected_shape,
                        find_attention_tensors)
from .consumers import drafting_proofs
from .pitfalls import q4_0_grid_notes, serving_pitfalls
from .serving import (VLLM_027_OLD, ServingEnv, measured, predict, recommend, releases_where, shape_of,
                      vllm_027_new)
from .vllm_loading import RAISES, TensorLoad, kv_shared_gaps, predict_weight_loading

REPORT_VERSION = 1


def inspect_checkpoint(checkpoint: Checkpoint, *, serving: ServingEnv | None = None,
                       tp: int | None = None) -> dict[str, Any]:
    """The inspect document for one checkpoint (see docs/CLI.md, "inspect SRC").

    Args:
        checkpoint: the checkpoint (config and headers are all that is read).
        serving: the user's serving environment (inspect --serving / --serving-python): the recommendation is for
            it alone.
        tp: the tensor-parallel size the user serves with: the report gains `tensor_parallel`, and a size vLLM
            refuses for this geometry is a problem.
    """
    spec = checkpoint.spec
    attention_tensors = list(find_attention_tensors(checkpoint))
    contradictions = attention_problems(attention_tensors, spec, source=str(checkpoint.path))
    parallel = None if tp is None else tensor_parallel(spec, tp)
    problems = checkpoint_problems(checkpoint, attention_tensors) + (parallel["problems"] if parallel else [])
    recognized = _recognized_layout(checkpoint)
    stock_vllm = predict_vllm(spec, attention_tensors, predict_weight_loading(
        contradictions + kv_shared_gaps(spec, attention_tensors), spec))
    return {
        "report_version": REPORT_VERSION,
        "path": str(checkpoint.path),
        "kind": spec.kind,
        "role": spec.role,
        "model_type": spec.model_type,
        "multimodal": spec.multimodal,
        "weight_prefix": spec.weight_prefix,
        "dialect": _dialect(spec),
        "geometry": _geometry(spec),
        "layers": _layers(spec, attention_tensors),
        "problems": problems,
        "warnings": serving_pitfalls(checkpoint.config, spec) + q4_0_grid_notes(checkpoint),
        "shards": [{"file": s.file.name, "tensors": len(s.tensors), "bytes": s.size} for s in checkpoint.shards],
        "dtypes": dict(Counter(ref.dtype for ref in checkpoint.tensors.values())),
        "tensor_count": len(checkpoint.tensors),
        "total_bytes": checkpoint.total_bytes,
        "quantization": _quantization(spec),
        "moe": _moe(checkpoint),
        "conversion": _conversion(checkpoint, recognized),
        "stock_vllm": stock_vllm,
        LEGACY_STOCK_VLLM_KEY: stock_vllm,
        "recommendation": _at_tensor_parallel(
            recommend(spec, fused=_fused(attention_tensors), env=serving, recognized=recognized), parallel),
        "tensor_parallel": parallel,
        "weight_bytes": _weight_bytes(checkpoint, attention_tensors),
        "kv_cache_bytes_per_token": _kv_cache_bytes(spec),
        "drafting": _drafting(checkpoint),
    }


def _drafting(checkpoint: Checkpoint) -> list[dict[str, Any]]:
    """For an output of this tool: each consumer the ledger proves running its layout's pair with the assistant
    drafting, with the command for this output (the card lists the same); [] for anything else."""
    manifest = checkpoint.manifest or {}
    if manifest.get("tool") != "gemma4-convert" or manifest.get("layout") not in layout_names():
        return []
    layout = layout_from_manifest(manifest)
    role, partner = (Role.TARGET, Role.ASSISTANT) if checkpoint.spec.role == Role.TARGET else \
        (Role.ASSISTANT, Role.TARGET)
    sibling = checkpoint.path.parent / partner
    other = str(sibling) if (sibling / MANIFEST_NAME).is_file() else f"<{partner.upper()} converted the same way>"
    paths = {role: str(checkpoint.path), partner: other}
    return [proof.document(paths[Role.TARGET], paths[Role.ASSISTANT], layout.name)
            for proof in drafting_proofs(layout.variant)]


def layout_key(layout: Layout) -> str:
    """A layout's name as a key of the inspect document: "pad-global" -> "pad_global"."""
    return layout.name.replace("-", "_")


def _kv_cache_bytes(spec: ModelSpec) -> list[dict[str, Any]]:
    """Per context: the source's KV cache per token and each layout's; `ratio`: the costliest layout's."""
    per_layout = {layout_key(layout): kv_costs(spec.attention, layout.output_attention(spec.attention))
                  for layout in layouts_in_preference()}
    rows = []
    for i, source in enumerate(next(iter(per_layout.values()))):
        ratios = [costs[i].ratio for costs in per_layout.values() if costs[i].ratio is not None]
        rows.append({"context": source.context, "current": source.before,
                     **{key: costs[i].after for key, costs in per_layout.items()},
                     "ratio": round(max(ratios), 3) if ratios else None})
    return rows


def _at_tensor_parallel(recommendation: dict[str, Any], parallel: dict[str, Any] | None) -> dict[str, Any]:
    """With --tp N, the price of a geometry-changing layout where the recommendation names it (the layout or its
    alternative) is its KV cache per rank at N: global heads that the source replicates anyway cost nothing extra
    (pad-global on 31B: x2.18 at TP 4, x2.0 at 8)."""
    if parallel is None:
        return recommendation
    for layout in layouts_in_preference():
        ratio = parallel.get(f"{layout_key(layout)}_kv_ratio")
        if ratio is None:
            continue
        at_tp = {"tp": parallel["tp"], "kv_cache_ratio_per_rank": ratio}
        if recommendation["layout"] == layout.name:
            return {**recommendation, f"{layout_key(layout)}_at_tp": at_tp}
        alternative = recommendation.get("alternative")
        if alternative and alternative.get("layout") == layout.name:
            return {**recommendation, "alternative": {**alternative, "at_tp": at_tp}}
    return recommendation


def tensor_parallel(spec: ModelSpec, tp: int) -> dict[str, Any]:
    """What each rank holds per layer type at this TP, as is and after each layout; for a layout that changes the
    geometry, its KV price per rank (global heads the source replicates already cost as much, so pad-global's falls
    as TP grows) and what vLLM refuses of its output that it does not refuse of the source."""
    as_is = {name: g.document() for name, g in layer_type_geometry(spec.attention, tp).items()}
    what = f"this {spec.role}"
    source = tp_problems(spec.attention, tp, what=what)
    before = kv_bytes_per_token_per_rank(spec.attention, tp)
    document: dict[str, Any] = {"tp": tp, "as_is": as_is}
    changed: dict[str, Any] = {}
    for layout in layouts_in_preference():
        output = layout.output_attention(spec.attention)
        key = layout_key(layout)
        if output == spec.attention:
            document[key] = as_is
            continue
        document[key] = {name: g.document() for name, g in layer_type_geometry(output, tp).items()}
        after = kv_bytes_per_token_per_rank(output, tp)
        changed[f"{key}_kv_ratio"] = round(after / before, 3) if before else None
        changed[f"{key}_problems"] = [p for p in tp_problems(output, tp, what=what) if p not in source]
    problems = {"problems": source, **{k: v for k, v in changed.items() if k.endswith("_problems")}}
    return {**document, **{k: v for k, v in changed.items() if k.endswith("_kv_ratio")}, **problems}


def _dialect(spec: ModelSpec) -> dict[str, Any]:
    notes = {
        DIALECT_LEGACY: "flat head_dim/global_head_dim/num_global_key_value_heads keys (what vLLM 0.27 reads)",
        DIALECT_PER_LAYER: f"transformers>={PER_LAYER_TRANSFORMERS} per_layer_config; the flat global keys vLLM 0.27 "
                           "reads are absent",
        DIALECT_BOTH: "flat keys and per_layer_config; transformers ignores the flat global keys "
                      "(per_layer_config wins), vLLM 0.27 reads only the flat ones",
    }
    note = notes[spec.dialect]
    if spec.dual_keys:
        note += ("; plus the zero-cost dual keys (allow_global_per_layer_attribute_access, attribute_map aliases) that "
                 f"keep them readable under transformers>={PER_LAYER_TRANSFORMERS}")
    return {"name": spec.dialect, "wins": DIALECT_LEGACY if spec.dialect == DIALECT_LEGACY else DIALECT_PER_LAYER,
            "note": note}


def _geometry(spec: ModelSpec) -> dict[str, Any]:
    a = spec.attention
    return {"hidden_size": a.hidden_size, "num_attention_heads": a.num_heads, "head_dim": a.head_dim,
            "global_head_dim": a.global_head_dim, "num_key_value_heads": a.num_kv_heads,
            "num_global_key_value_heads": a.num_global_kv_heads, "attention_k_eq_v": a.k_eq_v,
            "num_layers": len(a.layer_types), "num_kv_shared_layers": a.num_kv_shared_layers,
            "sliding_window": a.sliding_window, "homogeneous": a.is_homogeneous,
            "backbone_hidden_size": spec.backbone_hidden_size}


def _attention_form(layer, modules: set[str], fused: bool) -> str:
    if layer.kv_shared:
        return "KV shared (own k/v unused)" if "k_proj" in modules or fused else "Q-only (KV shared)"
    if fused:
        return "fused qkv_proj"
    if layer.k_eq_v and "v_proj" not in modules:
        return "k_eq_v (no v_proj)"
    return "split q/k/v"


def _layers(spec: ModelSpec, tensors: list[AttentionTensor]) -> list[dict[str, Any]]:
    rows = []
    for layer in spec.attention.layers:
        mine = [t for t in tensors if t.layer.index == layer.index]
        shapes = {f"{t.module}.{t.param}": list(t.source.shape) for t in mine}
        mismatched = [f"{t.module}.{t.param}" for t in mine
                      if (want := expected_shape(t, spec.attention)) is not None and t.source.shape != want]
        modules = {t.module for t in mine}
        rows.append({"index": layer.index, "type": layer.layer_type, "head_dim": layer.head_dim,
                     "kv_heads": layer.num_kv_heads,
                     "attention": _attention_form(layer, modules, any(t.from_fused for t in mine)),
                     "tensors": shapes, "shape_mismatches": mismatched,
                     "quantization": _layer_quantization(spec, layer.index, modules)})
    return rows


def _layer_quantization(spec: ModelSpec, index: int, modules: set[str]) -> dict[str, str] | None:
    """Scheme of each attention projection present in the layer; null for an unquantized checkpoint."""
    if not spec.quantization:
        return None
    result = {}
    for module in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if module in modules or (module != "o_proj" and "qkv_proj" in modules):
            scheme = weight_scheme(spec.quantization, f"{spec.weight_prefix}layers.{index}.self_attn.{module}")
            result[module] = scheme.describe() if scheme else "unquantized (ignored)"
    return result


def _quantization(spec: ModelSpec) -> dict[str, Any] | None:
    config = spec.quantization
    if not config:
        return None
    schemes = sorted({weight_scheme(config, f"{spec.weight_prefix}layers.{i}.self_attn.{m}").describe()
                      for i in range(len(spec.attention.layer_types)) for m in ("q_proj", "k_proj", "v_proj", "o_proj")
                      if weight_scheme(config, f"{spec.weight_prefix}layers.{i}.self_attn.{m}")})
    mlp = sorted({scheme.describe() for i in range(len(spec.attention.layer_types))
                  for m in ("gate_proj", "up_proj", "down_proj")
                  if (scheme := weight_scheme(config, f"{spec.weight_prefix}layers.{i}.mlp.{m}"))})
    return {"method": config.get("quant_method"), "format": config.get("format") or config.get("quant_algo"),
            "attention_schemes": schemes, "mlp_schemes": mlp,
            "ignore": list(config.get("ignore") or config.get("exclude_modules") or []), "config": dict(config)}


def _moe(checkpoint: Checkpoint) -> dict[str, Any] | None:
    """The MoE block: sizes from the config, how the experts are stored (every layout copies them raw)."""
    spec = checkpoint.spec
    if spec.moe is None:
        return None
    forms: dict[int, set[str]] = {}
    for name in checkpoint.tensors:
        parsed = parse_moe_name(name, spec.weight_prefix)
        if parsed and parsed[1].startswith("experts."):
            fused = parsed[1] in ("experts.gate_up_proj", "experts.down_proj")
            forms.setdefault(parsed[0], set()).add("fused" if fused else "per-expert")
    storage = sorted(set().union(*forms.values())) if forms else []
    return {"num_experts": spec.moe.num_experts, "top_k_experts": spec.moe.top_k,
            "moe_intermediate_size": spec.moe.intermediate_size, "layers_with_experts": len(forms),
            "storage": "+".join(storage) or "missing"}


def _recognized_layout(checkpoint: Checkpoint) -> str | None:
    manifest = checkpoint.manifest or {}
    if manifest.get("tool") != "gemma4-convert" or manifest.get("layout") not in layout_names():
        return None
    layout = layout_from_manifest(manifest)
    return layout.name if layout.matches(checkpoint.spec) else None


def _conversion(checkpoint: Checkpoint, recognized: str | None) -> dict[str, Any] | None:
    manifest = checkpoint.manifest
    if not manifest or manifest.get("tool") != "gemma4-convert":
        return None
    return {"layout": manifest.get("layout"), "recognized": recognized is not None,
            "tool_version": manifest.get("version"), "source": manifest.get("source", {}).get("path"),
            "converted_with_pair": manifest.get("converted_with_pair"), "warnings": manifest.get("warnings", []),
            "drift": None if recognized is not None else _drift(checkpoint)}


def _drift(checkpoint: Checkpoint) -> dict[str, Any]:
    """What changed in an output's config since this tool wrote it (most often: re-saved by a transformers >=
    PER_LAYER_TRANSFORMERS, which writes per_layer_config and drops the flat keys), which consumers that breaks, and
    the fix."""
    spec = checkpoint.spec
    if spec.dialect != DIALECT_LEGACY:
        what = ("the flat global keys are gone: per_layer_config holds the full layers' geometry (what "
                f"transformers >= {PER_LAYER_TRANSFORMERS} writes on save_pretrained)")
    elif not spec.attention.is_homogeneous and not spec.dual_keys:
        what = (f"the dual keys are gone or disagree with the flat keys (transformers >= {PER_LAYER_TRANSFORMERS} "
                "cannot read them)")
    else:
        what = "config.json differs from what the recorded layout writes"
    serves, fails = releases_where(shape_of(spec, fused=False))
    breaks = (f"stock vLLM {', '.join(fails)} (measured: ledger rows of this config form)" if fails else
              "no vLLM release measured") + "; mlx-lm and SGLang 0.5.13 read the flat keys too (llama.cpp falls back to per_layer_config)"
    return {"what": what, "breaks": breaks, "serves": serves,
            "fix": f"gemma4-convert convert {checkpoint.path} --layout {default_layout().name} --out NEW (config only, "
                   "seconds)"}


def _weight_bytes(checkpoint: Checkpoint, tensors: list[AttentionTensor]) -> dict[str, int | None]:
    """Tensor bytes as is and after each layout (null where the layout refuses the checkpoint), from each layout's
    own plan of every attention tensor."""
    spec, current = checkpoint.spec, checkpoint.total_bytes
    document: dict[str, int | None] = {"current": current}
    for layout in layouts_in_preference():
        try:
            layout.check(spec, source=str(checkpoint.path))
            growth = sum((math.prod(layout.plan_attention(t, spec, t.source.ref.name).shape)
                          - math.prod(t.source.shape)) * t.source.ref.itemsize for t in tensors)
        except InputError:
            document[layout_key(layout)] = None
            continue
        document[layout_key(layout)] = current + growth
    return document


def _fused(tensors: list[AttentionTensor]) -> bool:
    return any(t.from_fused for t in tensors)


# The name `stock_vllm` had in report_version 1's first releases; kept beside it, with the same value, for the
# scripts that parse it (docs/CLI.md). Remove in the next report_version.
LEGACY_STOCK_VLLM_KEY = "vllm_0_27"


def predict_vllm(spec: ModelSpec, tensors: list[AttentionTensor], loads: list[TensorLoad] = ()) -> dict[str, Any]:
    """What stock vLLM did with this config's shape in the ledger, per transformers generation: the release whose
    loader meets both generations (its `vllm` key; 0.27.0, the last before per-layer configs were read).

    `loads`: what its weight loaders do with tensors that contradict the config (vllm_loading.py); where the
    config itself loads, they decide the outcome: "fails" (the error the first one raises) or "loads wrong".
    """
    a = spec.attention
    risk = None
    if spec.dialect == DIALECT_PER_LAYER and not a.is_homogeneous:
        risk = ("global_head_dim/num_global_key_value_heads are absent: if the config is forced through, vLLM builds "
                "full layers with the sliding geometry; a target k_eq_v layer then fails with 'start (0) + length "
                f"({a.num_kv_heads * a.head_dim}) exceeds dimension size ({a.num_global_kv_heads * a.global_head_dim})'"
                " and draft q_proj/o_proj are silently truncated (garbage outputs)")
    shape = shape_of(spec, fused=_fused(tensors))
    envs = (VLLM_027_OLD, vllm_027_new())
    old, new = (measured(shape, env)[0].document() for env in envs)
    # where the config gets through (measured, or expected where no row of this shape ran), the weight loaders
    # decide: the tensors that contradict the config raise or are silently truncated
    config_loads = [v["outcome"] == "loads" or (v["outcome"] == "unknown" and predict(shape, env).outcome == "loads")
                    for v, env in zip((old, new), envs)]
    weights = _weights_verdict(list(loads))
    if weights is not None:
        old = weights if config_loads[0] else old
        new = weights if config_loads[1] else new
    return {"vllm": VLLM_027_OLD.vllm, f"transformers<{PER_LAYER_TRANSFORMERS}": old,
            f"transformers>={PER_LAYER_TRANSFORMERS}": new,
            "silent_truncation_risk": risk, "weights": [load.to_json() for load in loads]}


def _weights_verdict(loads: list[TensorLoad]) -> dict[str, Any] | None:
    if not loads:
        return None
    more = f"; {len(loads) - 1} more contradicting tensor(s), see --json `weights`" if len(loads) > 1 else ""
    raising = [load for load in loads if load.effect == RAISES]
    if raising:
        first = raising[0]
        return {"outcome": "fails", "error": first.error,
                "detail": f"while loading weights, at {first.tensor}: {first.detail} (vLLM 0.27.0 {first.where}; "
                          f"it stops at the first such tensor it reads){more}"}
    first = loads[0]
    return {"outcome": "loads wrong", "error": None,
            "detail": f"no error, but {first.tensor}: {first.detail} (vLLM 0.27.0 {first.where}){more}"}


def summarize_layers(layers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Collapses consecutive layers with identical geometry and attention form for the text table."""
    groups: list[dict[str, Any]] = []
    for row in layers:
        key = (row["type"], row["head_dim"], row["kv_heads"], row["attention"], bool(row["shape_mismatches"]),
               str(row["quantization"]))
        if groups and groups[-1]["key"] == key and groups[-1]["last"] == row["index"] - 1:
            groups[-1]["last"] = row["index"]
        else:
            groups.append({"key": key, "first": row["index"], "last": row["index"], "row": row})
    return groups

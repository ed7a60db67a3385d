"""The MoE block's stored experts and router against the config's MoE sizes."""

from __future__ import annotations

from ..gemma4 import parse_moe_name
from ..read.checkpoint import Checkpoint


def moe_problems(checkpoint: Checkpoint) -> list[str]:
    """Every fused router/experts tensor that contradicts the config's MoE sizes, and the MoE layers with no experts
    at all (one problem listing them). Per-expert tensors (`experts.<id>.*`, how quantized checkpoints store them)
    are copied as they are; vLLM 0.27 maps both forms (models/gemma4.py load_weights)."""
    spec, source = checkpoint.spec, str(checkpoint.path)
    if spec.moe is None:
        return []
    want = spec.moe.fused_shapes()
    with_experts: set[int] = set()
    problems = []
    for ref in checkpoint.tensors.values():
        parsed = parse_moe_name(ref.name, spec.weight_prefix)
        if parsed is None:
            continue
        layer, suffix = parsed
        if suffix.startswith("experts."):
            with_experts.add(layer)
        if suffix in want and tuple(ref.shape) != want[suffix]:
            m = spec.moe
            problems.append(f"{source}: {ref.name} has shape {list(ref.shape)} but the config's MoE block "
                            f"({m.num_experts} experts, moe_intermediate_size {m.intermediate_size}, hidden "
                            f"{m.hidden_size}) implies {list(want[suffix])}; config and weights disagree")
    missing = [i for i in range(len(spec.attention.layer_types)) if i not in with_experts]
    if missing:
        more = f" (and {len(missing) - 1} more: {missing[1:]})" if len(missing) > 1 else ""
        problems.append(f"{source}: enable_moe_block is true but layer {missing[0]} has no experts tensors "
                        f"({spec.weight_prefix}layers.{missing[0]}.experts.gate_up_proj / .down_proj){more}")
    return problems

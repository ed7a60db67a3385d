"""Quantized attention against the schemes the checkpoint declares: Model Optimizer attention that cannot be
checked, and compressed-tensors fp8 scales that do not match their weights. (The quantized weights of every module:
quantized_weights.py.)"""

from __future__ import annotations

from ..gemma4 import ModelSpec
from ..quantization import MODELOPT, weight_scheme
from .attention import AttentionTensor


def quantized_attention_problems(spec: ModelSpec, *, source: str) -> list[str]:
    """Model Optimizer checkpoints convert only with every attention projection excluded from quantization (as
    nvidia/Gemma-4-31B-IT-NVFP4 ships them): packed fp4 attention weights can be neither checked against the
    config's geometry nor moved exactly. One problem per quantized projection."""
    if not spec.quantization or spec.quantization.get("quant_method") != MODELOPT:
        return []
    problems = []
    for layer in spec.attention.layers:
        present = ("q_proj", *(("k_proj",) if layer.has_k else ()), *(("v_proj",) if layer.has_v else ()), "o_proj")
        for module in present:
            name = f"{spec.weight_prefix}layers.{layer.index}.self_attn.{module}"
            scheme = weight_scheme(spec.quantization, name)
            if scheme is not None:
                problems.append(f"{source}: {name} is quantized as {scheme.describe()}; Model Optimizer checkpoints "
                                "convert only when every self_attn module is excluded from quantization (like "
                                "nvidia/Gemma-4-31B-IT-NVFP4): packed fp4 attention weights cannot be checked or "
                                "padded exactly")
    return problems


def attention_scale_problems(tensors: list[AttentionTensor], spec: ModelSpec, *, source: str) -> list[str]:
    """Every compressed-tensors fp8 attention weight with no `weight_scale`, and every block scale whose shape is
    not one value per [rows, columns] block (layouts move scales together with their weights)."""
    scales = {(t.layer.index, t.module): t for t in tensors if t.param == "weight_scale"}
    problems = []
    for tensor in tensors:
        name = f"{spec.weight_prefix}layers.{tensor.layer.index}.self_attn.{tensor.module}"
        scheme = weight_scheme(spec.quantization, name) if tensor.param == "weight" else None
        if scheme is None or not scheme.is_fp8 or not tensor.source.ref.dtype.startswith("F8"):
            continue
        scale = scales.get((tensor.layer.index, tensor.module))
        if scale is None:
            problems.append(f"{source}: {tensor.source.ref.name} is {scheme.describe()} but {name}.weight_scale is "
                            "missing; the checkpoint cannot be dequantized")
        elif scheme.block_structure:
            rows, columns = tensor.source.shape
            want = (-(-rows // scheme.block_structure[0]), -(-columns // scheme.block_structure[1]))
            if tuple(scale.source.shape) != want:
                problems.append(f"{source}: {_piece_name(scale)} has shape {list(scale.source.shape)} but "
                                f"{scheme.describe()} scales of a {[rows, columns]} weight are {list(want)}")
    return problems


def _piece_name(tensor: AttentionTensor) -> str:
    return tensor.source.ref.name + (f" ({tensor.module} rows)" if tensor.from_fused else "")

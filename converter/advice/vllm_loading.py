"""What stock vLLM 0.27.0's weight loaders do with attention tensors that contradict the config (no I/O, no torch).

Read in the vLLM 0.27.0 wheel, tensor parallel size 1 (the file:line of each step, which the `where` of each
TensorLoad below names, is in docs/DESIGN.md "What stock vLLM 0.27.0 does"):
- target q/k/v -> `QKVParallelLinear.weight_loader_v2` -> `load_qkv_weight`: the checkpoint tensor is narrowed to
  the slot's rows (`loaded_weight.narrow(0, 0, rows)`), then `assert param_data.shape == loaded_weight.shape`.
  k_eq_v layers load k_proj into the V slot as well (the model's weight iterator yields it twice).
- draft q_proj -> `ColumnParallelLinear` -> `load_column_parallel_weight`: the same, rows.
- o_proj (both) -> `RowParallelLinear` -> `load_row_parallel_weight`: narrowed to the parameter's input columns,
  then the shape assert.
- q_norm / k_norm are plain RMSNorm parameters -> `default_weight_loader`: a size assert with a message.
So a tensor with too many rows (columns for o_proj) is SILENTLY TRUNCATED, one with too few raises torch's narrow
RuntimeError, any other size difference is a bare AssertionError.
Missing tensors: every linear layer's quant method has `process_weights_after_loading`, so `track_weights_loading`
counts linear parameters as loaded either way: a missing q/k/v/o_proj is never reported and its parameter keeps
`torch.empty` memory. Only a missing norm weight raises (a ValueError), and only for unquantized checkpoints (the check
is off when `quantization_config` is set; the norm then keeps its initial ones).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..gemma4 import ModelSpec, Role
from ..validate.attention import AttentionProblem

RAISES, WRONG = "raises", "loads wrong"

_QKV = ("load_qkv_weight", "model_executor/parameter.py:196", "model_executor/parameter.py:200")
_COLUMN = ("load_column_parallel_weight", "model_executor/parameter.py:150", "model_executor/parameter.py:153")
_ROW = ("load_row_parallel_weight", "model_executor/parameter.py:222", "model_executor/parameter.py:229")
_NORM_ASSERT = "model_executor/model_loader/weight_utils.py:1240"
_NOT_INITIALIZED = "model_executor/model_loader/default_loader.py:467"


@dataclass(frozen=True)
class TensorLoad:
    """What vLLM 0.27.0 does with one contradicting tensor (or a layer's missing tensors)."""

    tensor: str  # the checkpoint tensor name, or "layer N: module, module" for missing ones
    effect: str  # RAISES or WRONG (loads, but the parameter is not the checkpoint tensor)
    error: str | None  # "RuntimeError: start (0) + length (4096) exceeds dimension size (2048)" when RAISES
    where: str  # vLLM 0.27.0 file:line
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"tensor": self.tensor, "effect": self.effect, "error": self.error, "where": self.where,
                "detail": self.detail}


def _narrow_error(length: int, size: int) -> str:
    return f"RuntimeError: start (0) + length ({length}) exceeds dimension size ({size})"


def _linear_load(name: str, have: tuple[int, ...], want: tuple[int, ...], loader: tuple[str, str, str],
                 dim: int) -> TensorLoad:
    """A 2-D linear weight narrowed along `dim` (0: rows, 1: input columns) to the parameter, then shape-asserted."""
    function, narrow_at, assert_at = loader
    what = "rows" if dim == 0 else "columns"
    if len(have) != len(want):
        return TensorLoad(name, RAISES, "AssertionError", assert_at,
                          f"{function}: a {len(have)}-D tensor {list(have)} for the {list(want)} parameter")
    if have[dim] < want[dim]:
        return TensorLoad(name, RAISES, _narrow_error(want[dim], have[dim]), narrow_at,
                          f"{function}: the parameter needs {want[dim]} {what}, the tensor has {have[dim]}")
    other = 1 - dim
    if len(have) > 1 and have[other] != want[other]:
        return TensorLoad(name, RAISES, "AssertionError", assert_at,
                          f"{function}: after narrowing, {list(have[:dim]) + [want[dim]] + list(have[dim + 1:])} "
                          f"is not the parameter's {list(want)} (a bare assert, no message)")
    return TensorLoad(name, WRONG, None, narrow_at,
                      f"{function} silently truncates {list(have)} to its first {want[dim]} {what} "
                      f"({have[dim] - want[dim]} {what} dropped): the layer computes with a different matrix")


def predict_shape_problem(problem: AttentionProblem, spec: ModelSpec) -> TensorLoad | None:
    """The loader's behaviour for a wrong-shaped or unexpected tensor; None for one vLLM does not load this way."""
    tensor = problem.tensor
    if tensor is None or tensor.from_fused:
        return None  # a fused qkv_proj fails earlier (no such parameter name); predict_vllm says so
    name, have = tensor.source.ref.name, tuple(tensor.source.shape)
    if problem.want is None:  # an unexpected tensor: v_proj on a k_eq_v layer
        return TensorLoad(name, WRONG, None, "models/gemma4.py:1702-1711",
                          "the V slot is written twice, from the k_proj copy and from this v_proj: whichever is "
                          "read last wins, so V may not be K as the config says")
    want = tuple(problem.want)
    if tensor.param != "weight":
        return None  # Gemma 4 has no attention biases; do not guess a loader for one
    if tensor.module in ("q_norm", "k_norm"):
        return TensorLoad(name, RAISES, f"AssertionError: Attempted to load weight (torch.Size({list(have)})) "
                          f"into parameter (torch.Size({list(want)}))", _NORM_ASSERT,
                          "default_weight_loader asserts equal sizes for norm weights")
    if tensor.module == "o_proj":
        return _linear_load(name, have, want, _ROW, dim=1)
    loader = _QKV if spec.role == Role.TARGET else _COLUMN
    return _linear_load(name, have, want, loader, dim=0)


def predict_missing(problem: AttentionProblem, spec: ModelSpec) -> TensorLoad:
    """Missing attention tensors: linear ones are never reported (uninitialized memory), norms raise if unquantized."""
    layer = problem.layer
    label = f"layer {layer.index}: {', '.join(problem.missing)}"
    norms = [m for m in problem.missing if m.endswith("_norm")]
    if norms and not spec.quantization:
        return TensorLoad(label, RAISES, f"ValueError: Following weights were not initialized from checkpoint: "
                          f"{{...layers.{layer.index}.self_attn.{norms[0]}.weight...}}", _NOT_INITIALIZED,
                          "the norm weight is never loaded and vLLM's unquantized load check names it")
    linear = [m for m in problem.missing if not m.endswith("_norm")]
    if linear:
        slots = ", ".join(linear) + (" (and V, a k_eq_v copy of K)" if "k_proj" in linear and layer.k_eq_v else "")
        return TensorLoad(label, WRONG, None, "model_executor/model_loader/default_loader.py:455-464",
                          f"{slots} never written: the parameter keeps uninitialized memory and no check reports it "
                          "(linear layers count as loaded)")
    return TensorLoad(label, WRONG, None, "model_executor/model_loader/default_loader.py:436-438",
                      f"{', '.join(norms)} never written: quantized checkpoints skip the load check, the norm "
                      "keeps its initial weight of ones")


def kv_shared_gaps(spec: ModelSpec, tensors: list[Any]) -> list[AttentionProblem]:
    """Target KV-shared layers without k_proj/k_norm (and v_proj): fine for transformers, which ignores them, but vLLM
    0.27.0 builds QKVParallelLinear and k_norm on every target layer (docs/DESIGN.md "What stock vLLM 0.27.0 does"), so
    it meets them as missing tensors. Published E2B/E4B targets carry them; Q-only ones do not load."""
    if spec.role != Role.TARGET:
        return []
    present: dict[int, set[str]] = {}
    for tensor in tensors:
        present.setdefault(tensor.layer.index, set()).add(tensor.module)
    gaps = []
    for layer in spec.attention.layers:
        if not layer.kv_shared:
            continue
        wanted = {"k_proj", "k_norm"} | (set() if layer.k_eq_v else {"v_proj"})
        missing = tuple(sorted(wanted - present.get(layer.index, set())))
        if missing:
            gaps.append(AttentionProblem(f"layer {layer.index}: KV-shared, no {', '.join(missing)}", layer=layer,
                                         missing=missing))
    return gaps


def _read_order(problem: AttentionProblem) -> tuple:
    """vLLM reads files in natural order (`_natural_sort_key`; docs/DESIGN.md "What stock vLLM 0.27.0 does"), each
    file's tensors by name (safe_open.keys() is sorted); missing tensors only matter after everything was read."""
    if problem.tensor is None:
        return (1, [], "", problem.layer.index)
    ref = problem.tensor.source.ref
    natural = [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", ref.file.name)]
    return (0, natural, ref.name, 0)


def predict_weight_loading(problems: list[AttentionProblem], spec: ModelSpec) -> list[TensorLoad]:
    """One TensorLoad per problem vLLM 0.27.0 would meet while loading weights, in the order vLLM meets them."""
    loads = []
    for problem in sorted(problems, key=_read_order):
        load = predict_missing(problem, spec) if problem.missing else predict_shape_problem(problem, spec)
        if load is not None:
            loads.append(load)
    return loads

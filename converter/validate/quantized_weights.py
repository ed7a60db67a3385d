"""Do a compressed-tensors checkpoint's quantized weights have the shapes and types its quantization_config says?

vLLM fails on a contradiction at load time with an AssertionError or, where it ignores `weight_shape`, loads
garbage; per-layer copies bytes without decoding them, so these checks (headers, plus the few bytes of each
`weight_shape`) are what stops such an input before anything is written. Every module the config quantizes is
checked, not only attention:

- pack-quantized (int4/int8 packed into int32, `weight_packed` [rows, ceil(columns * bits / 32)]): the packed
  tensor is int32 and its columns are what `weight_shape` unpacks to;
- int / float quantized (`weight` int8 or float8): the dtype has the config's type and bit width;
- `weight_scale`: one value per row (channel), per group of `group_size` columns (group), per block
  (block), or one (tensor), for the unpacked [rows, columns].
"""

from __future__ import annotations

import struct
from typing import Iterator

from ..quantization import COMPRESSED_TENSORS, WeightScheme, weight_scheme
from ..read.checkpoint import Checkpoint
from ..read.safetensors_header import TensorRef
from ..read.tensor_reader import read_range

PACKED = "pack-quantized"
_INT_FORMATS = {"I64": "<q", "I32": "<i"}
_DTYPE_OF = {("int", 8): ("I8",), ("float", 8): ("F8_E4M3", "F8_E5M2")}


def quantized_weight_problems(checkpoint: Checkpoint) -> list[str]:
    """One line per quantized weight whose tensors contradict the quantization_config (empty: consistent).

    A module counts as quantized where it stores `weight_packed` or `weight_scale` and the config gives it a scheme
    (the config's "Linear" target cannot be told from a norm by name); a config whose format no tensor has at all is
    one problem.
    """
    config = checkpoint.spec.quantization
    if not config or config.get("quant_method") != COMPRESSED_TENSORS:
        return []
    source = str(checkpoint.path)
    modules = dict(_quantized_modules(checkpoint, config))
    problems = [f"{source}: {p}" for module, scheme in modules.items()
                for p in _module_problems(checkpoint, module, scheme)]
    fmt = config.get("format")
    if not modules and fmt in (PACKED, "int-quantized", "float-quantized", "naive-quantized"):
        stores = "weight_packed and weight_shape" if fmt == PACKED else "weight_scale"
        problems.append(f"{source}: the quantization_config says format {fmt}, but no tensor is quantized that way "
                        f"(no *.{stores.split()[0]}): config and weights disagree")
    return problems


def _quantized_modules(checkpoint: Checkpoint, config) -> Iterator[tuple[str, WeightScheme]]:
    seen = set()
    for name in checkpoint.tensors:
        for suffix in (".weight_packed", ".weight_scale"):
            if name.endswith(suffix):
                module = name[: -len(suffix)]
                scheme = weight_scheme(config, module)
                if module not in seen and scheme is not None and scheme.num_bits is not None:
                    seen.add(module)
                    yield module, scheme


def _module_problems(checkpoint: Checkpoint, module: str, scheme: WeightScheme) -> list[str]:
    tensors = checkpoint.tensors
    packed, plain = tensors.get(f"{module}.weight_packed"), tensors.get(f"{module}.weight")
    if packed is None and plain is None:
        return [f"{module}.weight_scale has no weight beside it ({module}.weight or .weight_packed)"]
    if scheme.format == PACKED or packed is not None:
        if packed is None:
            return [f"{module}.weight is {plain.dtype} {list(plain.shape)} but the quantization_config says "
                    f"{scheme.describe()}, which stores {module}.weight_packed (int32) and weight_shape"]
        unpacked, problem = _unpacked_shape(checkpoint, module, packed, scheme)
        if problem:
            return [problem]
    else:
        allowed = _DTYPE_OF.get((str(scheme.type), int(scheme.num_bits)))
        if allowed is not None and plain.dtype not in allowed:
            return [f"{module}.weight is {plain.dtype} but the quantization_config says {scheme.describe()} "
                    f"({' or '.join(allowed)})"]
        unpacked = tuple(plain.shape)
    return _scale_problems(checkpoint, module, scheme, unpacked)


def _unpacked_shape(checkpoint: Checkpoint, module: str, packed: TensorRef,
                    scheme: WeightScheme) -> tuple[tuple[int, ...], str | None]:
    """The [rows, columns] `weight_shape` records, or the contradiction between it and the packed tensor."""
    if packed.dtype != "I32" or len(packed.shape) != 2:
        return (), (f"{module}.weight_packed is {packed.dtype} {list(packed.shape)}; {scheme.describe()} packs into a "
                    "2-D int32 tensor")
    shape_ref = checkpoint.tensors.get(f"{module}.weight_shape")
    if shape_ref is None:
        return (), f"{module}.weight_shape is missing: the packed {module}.weight_packed cannot be unpacked"
    values = _int_values(shape_ref)
    if values is None or len(values) != 2:
        return (), (f"{module}.weight_shape is {shape_ref.dtype} {list(shape_ref.shape)}; want the two integers "
                    "[rows, columns]")
    rows, columns = values
    per_int = 32 // int(scheme.num_bits)
    want = [rows, -(-columns // per_int)]
    if list(packed.shape) != want:
        return (), (f"{module}.weight_packed has shape {list(packed.shape)} but weight_shape {list(values)} packs "
                    f"{per_int} {scheme.num_bits}-bit values per int32 into {want}")
    return (rows, columns), None


def _int_values(ref: TensorRef) -> list[int] | None:
    form = _INT_FORMATS.get(ref.dtype)
    if form is None or len(ref.shape) != 1 or ref.shape[0] > 8:
        return None
    data = read_range(ref.file, ref.offset, ref.nbytes)
    return list(struct.unpack(f"<{ref.shape[0]}{form[1]}", bytes(data)))


def _scale_problems(checkpoint: Checkpoint, module: str, scheme: WeightScheme, unpacked: tuple[int, ...]) -> list[str]:
    scale = checkpoint.tensors.get(f"{module}.weight_scale")
    if len(unpacked) != 2 or scale is None:
        return [] if len(unpacked) != 2 else [f"{module}.weight_scale is missing: {scheme.describe()} cannot be "
                                              "dequantized"]
    rows, columns = unpacked
    want = _scale_shape(scheme, rows, columns)
    got = [d for d in scale.shape]
    if want is None or _same_scale_shape(got, want):
        return []
    return [f"{module}.weight_scale has shape {got} but {scheme.describe()} scales of a [{rows}, {columns}] weight "
            f"are {want}"]


def _scale_shape(scheme: WeightScheme, rows: int, columns: int) -> list[int] | None:
    if scheme.strategy == "channel":
        return [rows, 1]
    if scheme.strategy == "group" and scheme.group_size:
        return [rows, -(-columns // scheme.group_size)]
    if scheme.strategy == "block" and scheme.block_structure:
        return [-(-rows // scheme.block_structure[0]), -(-columns // scheme.block_structure[1])]
    if scheme.strategy == "tensor":
        return [1]
    return None


def _same_scale_shape(got: list[int], want: list[int]) -> bool:
    """Equal, allowing the per-tensor scale written as [] or [1] and a channel scale written as [rows]."""
    if want == [1]:
        return got in ([], [1])
    return got == want or (want[1:] == [1] and got == want[:1])

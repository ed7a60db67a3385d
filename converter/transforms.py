"""Pure tensor functions the layouts are built from: no I/O, no floating-point arithmetic.

Every function moves or zero-fills whole elements, working on a same-width integer view of the
tensor, so bf16, fp32 and fp8 values (and their bit patterns) are carried over exactly; packed integer codes
(compressed-tensors pack-quantized) are unpacked, moved and repacked as integers.

The pad-global placement ("interleaved per half", docs/DESIGN.md "The pad-global transform: placement math"): head
dim i < d/2 goes to slot r*i and d/2+i goes to D/2 + r*i, with r = D/d. Default RoPE over D then pairs (p, p + D/2)
exactly like the original pair (i, i + d/2), with the same frequency, so no rope config changes.
"""

from __future__ import annotations

import ctypes
from typing import Callable, Sequence

import torch

from .plan import TensorPlan, Transform
from .read.safetensors_header import DTYPES

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_int(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(_INT_VIEW[tensor.element_size()])


def _repeat_interleave(values: torch.Tensor, repeats: int, dim: int, out: torch.Tensor | None) -> torch.Tensor:
    """values.repeat_interleave(repeats, dim), written into `out` (a flat byte tensor of the result's size) when given.

    A reused `out` saves the kernel faulting in and zeroing the pages of a new result before they are written: in a
    pad-global conversion of the 7.7 GB pair that zeroing cost as much CPU as reading the sources (docs/BENCHMARKS.md).
    """
    if out is None:
        return values.repeat_interleave(repeats, dim=dim)
    shape = tuple(values.shape)
    spread = (*shape[:dim + 1], repeats, *shape[dim + 1:])
    target = out.view(values.dtype).view(spread)
    target.copy_(values.unsqueeze(dim + 1).expand(spread))
    return target.view(*shape[:dim], shape[dim] * repeats, *shape[dim + 1:])


def _head_ratio(head_dim: int, target_head_dim: int) -> int:
    if head_dim % 2 or target_head_dim % head_dim:
        raise ValueError(f"cannot place head_dim {head_dim} into {target_head_dim}: need an even head_dim "
                         "and a target that is an integer multiple of it")
    return target_head_dim // head_dim


def _check_rows(tensor: torch.Tensor, rows: int, what: str) -> None:
    if tensor.dim() == 0 or tensor.shape[0] != rows:
        raise ValueError(f"{what}: expected {rows} rows, got shape {tuple(tensor.shape)}")


def pad_head_rows(weight: torch.Tensor, *, num_heads: int, head_dim: int, target_head_dim: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Grows each head's rows from head_dim to target_head_dim, duplicating every row into its copy slots.

    Args:
        weight: q/k/v projection weight, bias or per-row scale; rows are [num_heads * head_dim].
        num_heads: heads stacked along the rows.
        head_dim: current rows per head (d).
        target_head_dim: rows per head after padding (D, an integer multiple of d).
        out: where to write the result (a flat byte tensor of its size), as every transform takes it.

    Returns:
        Tensor with num_heads * target_head_dim rows: per head and per half, each row repeated r = D/d times.
    """
    ratio = _head_ratio(head_dim, target_head_dim)
    _check_rows(weight, num_heads * head_dim, "pad_head_rows")
    rest = tuple(weight.shape[1:])
    halves = _as_int(weight).reshape(num_heads, 2, head_dim // 2, *rest)
    padded = _repeat_interleave(halves, ratio, 2, out)
    return padded.reshape(num_heads * target_head_dim, *rest).view(weight.dtype)


def _place_primary(values: torch.Tensor, ratio: int, out: torch.Tensor | None) -> torch.Tensor:
    """[..., n] -> [..., n * ratio] with values at every ratio-th slot and zero bits elsewhere (written into `out`,
    a flat byte tensor of the result's size, when given)."""
    if out is None:
        placed = torch.zeros(*values.shape, ratio, dtype=values.dtype)
    else:
        placed = out.view(values.dtype).view(*values.shape, ratio)
        placed[..., 1:] = 0
    placed[..., 0] = values
    return placed.view(*values.shape[:-1], values.shape[-1] * ratio)


def pad_head_norm(weight: torch.Tensor, *, head_dim: int, target_head_dim: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """q_norm / k_norm weight [d] -> [D]: original values at the primary slots, zeros at the copies.

    The duplicated rows keep the RMS of each head unchanged; the zero weights silence the copies
    so the q.k product only sees the primary slots.
    """
    ratio = _head_ratio(head_dim, target_head_dim)
    if tuple(weight.shape) != (head_dim,):
        raise ValueError(f"pad_head_norm: expected shape ({head_dim},), got {tuple(weight.shape)}")
    return _place_primary(_as_int(weight), ratio, out).view(weight.dtype)


def pad_head_columns(weight: torch.Tensor, *, num_heads: int, head_dim: int, target_head_dim: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """o_proj weight [out, num_heads * d] -> [out, num_heads * D]: W at the primary columns, zeros at the copies.

    Per-output-row scales (fp8 per-channel) need no change: zero is exact under any scale.
    """
    ratio = _head_ratio(head_dim, target_head_dim)
    if weight.dim() != 2 or weight.shape[1] != num_heads * head_dim:
        raise ValueError(f"pad_head_columns: expected [*, {num_heads * head_dim}], got {tuple(weight.shape)}")
    return _place_primary(_as_int(weight), ratio, out).view(weight.dtype)


def replicate_kv_heads(weight: torch.Tensor, *, num_heads: int, head_dim: int, repeats: int,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """Repeats each KV head `repeats` times in place: head j -> heads j*repeats .. j*repeats + repeats - 1.

    Exact for grouped-query attention: query head h reads KV head h // (H / kv) before and after.

    Args:
        weight: k projection weight, bias or per-row scale; rows are [num_heads * head_dim].
        num_heads: KV heads stacked along the rows (G).
        head_dim: rows per head.
        repeats: copies of each head (num_key_value_heads / G).

    Returns:
        Tensor with num_heads * repeats * head_dim rows.
    """
    _check_rows(weight, num_heads * head_dim, "replicate_kv_heads")
    rest = tuple(weight.shape[1:])
    heads = _as_int(weight).reshape(num_heads, head_dim, *rest)
    return _repeat_interleave(heads, repeats, 0, out).reshape(num_heads * repeats * head_dim, *rest).view(weight.dtype)


def repeat_rows(weight: torch.Tensor, *, repeats: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """[n, ...] -> [n * repeats, ...], row k repeated at k*repeats .. k*repeats + repeats - 1.

    An fp8 `block` q/k/v scale: pad_head_rows puts source row j at rows j*r .. j*r + r - 1 (per half and per head
    alike, since D/2 = r * d/2), so output row block b holds source rows of block b // r only, whatever the block
    height, as long as blocks tile the rows.
    """
    if weight.dim() == 0:
        raise ValueError("repeat_rows: expected at least one dimension")
    return _repeat_interleave(_as_int(weight), repeats, 0, out).view(weight.dtype)


def repeat_columns(weight: torch.Tensor, *, repeats: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, n] -> [rows, n * repeats], column c repeated at c*repeats .. c*repeats + repeats - 1.

    An fp8 `block` o_proj scale: after pad_head_columns spreads input column j to j*r, output column block b holds
    source columns of block b // r only (zeros elsewhere, exact under any scale).
    """
    if weight.dim() != 2:
        raise ValueError(f"repeat_columns: expected a 2-D tensor, got shape {tuple(weight.shape)}")
    return _repeat_interleave(_as_int(weight), repeats, 1, out).view(weight.dtype)


def _unpack_codes(words: torch.Tensor, num_bits: int) -> torch.Tensor:
    """int32 words [rows, n] -> their codes [rows, n * 32 / num_bits] (int32, 0 .. 2**num_bits - 1); code k of a
    word sits at bits k*num_bits (compressed-tensors `pack_to_int32`, little end first)."""
    per_word = 32 // num_bits
    shifts = torch.arange(per_word, dtype=torch.int64) * num_bits
    codes = (words.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)
    return codes.reshape(*words.shape[:-1], words.shape[-1] * per_word)


def _pack_codes(codes: torch.Tensor, num_bits: int) -> torch.Tensor:
    """The inverse of _unpack_codes: codes [rows, m] (m a multiple of 32 / num_bits) -> int32 words."""
    per_word = 32 // num_bits
    shifts = torch.arange(per_word, dtype=torch.int64) * num_bits
    words = (codes.to(torch.int64).reshape(*codes.shape[:-1], -1, per_word) << shifts).sum(dim=-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # the same 32 bits, signed


def unpack_signed_codes(words: torch.Tensor, columns: int) -> torch.Tensor:
    """pack-quantized int32 words [rows, n] of a [rows, columns] weight -> its signed codes (int8); the code width
    is what fits the columns into n words (8 int4 or 4 int8 codes per word), the +2**(bits - 1) offset undone."""
    per_word = -(-columns // words.shape[-1]) if words.shape[-1] else 0
    num_bits = 32 // per_word if per_word else 0
    if words.dtype != torch.int32 or num_bits not in (4, 8) or per_word * num_bits != 32:
        raise ValueError(f"unpack_signed_codes: {words.dtype} words {tuple(words.shape)} hold no whole 4- or 8-bit "
                         f"codes of {columns} columns")
    return (_unpack_codes(words, num_bits)[..., :columns] - (1 << (num_bits - 1))).to(torch.int8)


def pad_packed_columns(weight: torch.Tensor, *, num_bits: int, ratio: int, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """A pack-quantized o_proj weight: int32 words of num_bits codes [out, in * num_bits / 32] -> the words of
    [out, in * ratio] codes, code c at column c * ratio (as pad_head_columns places W) and the zero code at the
    copies: compressed-tensors stores a symmetric code as value + 2**(num_bits - 1), so that offset dequantizes to
    exactly 0 under any scale. (`out` is not used: the codes are unpacked into new tensors anyway.)"""
    if weight.dtype != torch.int32 or weight.dim() != 2 or num_bits not in (4, 8) or ratio < 1:
        raise ValueError(f"pad_packed_columns: expected 2-D int32 words of 4- or 8-bit codes, got {weight.dtype} "
                         f"{tuple(weight.shape)} with num_bits {num_bits}, ratio {ratio}")
    codes = _unpack_codes(weight, num_bits)
    padded = torch.full((*codes.shape, ratio), 1 << (num_bits - 1), dtype=torch.int64)
    padded[..., 0] = codes
    return _pack_codes(padded.reshape(codes.shape[0], -1), num_bits)


def scale_weight_shape(weight: torch.Tensor, *, rows: int = 1, columns: int = 1, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """A pack-quantized `weight_shape` [out, in]: the unpacked weight's shape after its rows grew `rows` times and
    its columns `columns` times (vLLM checks the packed tensor against it). (`out` is not used: two integers.)"""
    if tuple(weight.shape) != (2,) or weight.dtype.is_floating_point:
        raise ValueError(f"scale_weight_shape: expected an integer [2] weight_shape, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    return weight * torch.tensor([rows, columns], dtype=weight.dtype)


def expand_scale(scale: torch.Tensor, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """A weight scale broadcast to the weight's shape, in its own dtype: group and block scales [ceil(out/br),
    ceil(in/bc)] repeat over their blocks (the last block may be partial); per-row [out, 1] and per-tensor scales
    broadcast as they are."""
    if scale.dim() != 2 or len(shape) != 2 or scale.shape[1] == 1:
        return scale
    rows, columns = -(-shape[0] // scale.shape[0]), -(-shape[1] // scale.shape[1])
    return scale.repeat_interleave(rows, dim=0)[:shape[0]].repeat_interleave(columns, dim=1)[:, :shape[1]]


def dequantize_packed(words: torch.Tensor, scale: torch.Tensor, weight_shape: torch.Tensor, *,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """A symmetric pack-quantized weight (int32 words of 4- or 8-bit codes, its scale, its `weight_shape`) -> the
    weight in the scale's dtype: each code times its scale, rounded once, as compressed-tensors' own decompressor
    computes it (`x_q.to(scale.dtype) * scale`; docs/QUANTIZED.md "Dequantized assistants"). (`out` is not used.)"""
    rows, columns = (int(v) for v in weight_shape.tolist())
    if words.dim() != 2 or words.shape[0] != rows or not scale.dtype.is_floating_point:
        raise ValueError(f"dequantize_packed: words {tuple(words.shape)} and {scale.dtype} scale "
                         f"{tuple(scale.shape)} are not a pack-quantized [{rows}, {columns}] weight")
    codes = unpack_signed_codes(words, columns)
    return codes.to(scale.dtype) * expand_scale(scale, (rows, columns))


def dequantize_scaled(weight: torch.Tensor, scale: torch.Tensor, *, out: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """A float8 or int8 weight and its scale (per tensor, row, group or block) -> the weight in the scale's dtype,
    each value times its scale rounded once, as compressed-tensors' own decompressor computes it. (`out` unused.)"""
    if weight.dim() != 2 or not scale.dtype.is_floating_point:
        raise ValueError(f"dequantize_scaled: expected a 2-D weight and a float scale, got {weight.dtype} "
                         f"{tuple(weight.shape)} and {scale.dtype} {tuple(scale.shape)}")
    return weight.to(scale.dtype) * expand_scale(scale, tuple(weight.shape))


TRANSFORMS: dict[Transform, Callable[..., torch.Tensor]] = {  # one function per plan.Transform
    Transform.PAD_HEAD_ROWS: pad_head_rows,
    Transform.PAD_HEAD_NORM: pad_head_norm,
    Transform.PAD_HEAD_COLUMNS: pad_head_columns,
    Transform.REPLICATE_KV_HEADS: replicate_kv_heads,
    Transform.REPEAT_COLUMNS: repeat_columns,
    Transform.REPEAT_ROWS: repeat_rows,
    Transform.PAD_PACKED_COLUMNS: pad_packed_columns,
    Transform.SCALE_WEIGHT_SHAPE: scale_weight_shape,
    Transform.DEQUANTIZE_PACKED: dequantize_packed,
    Transform.DEQUANTIZE_SCALED: dequantize_scaled,
}


def apply_transform(name: str, tensor: torch.Tensor, params: dict[str, int], out: torch.Tensor | None = None,
                    companions: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """Runs the named transform; the name and params are what conversion.json records for the tensor. The result is
    written into `out` (a flat byte tensor of its size) where the transform can, else into a new tensor.
    `companions`: the further tensors a transform reads (a quantized weight's scale), in its order."""
    return TRANSFORMS[Transform(name)](tensor, *companions, out=out, **params)


def decode(raw: bytes | bytearray | memoryview, *, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Little-endian safetensors bytes -> tensor (no copy when the buffer is writable)."""
    writable = isinstance(raw, bytearray) or (isinstance(raw, memoryview) and not raw.readonly)
    buffer = raw if writable else bytearray(raw)
    if not buffer:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype).reshape(shape)


def encode(tensor: torch.Tensor) -> memoryview:
    """Tensor -> its raw little-endian bytes, as safetensors stores them (a view, no copy).

    Through ctypes rather than `Tensor.numpy()`: numpy is no requirement of the tool and torch's CPU wheel does not
    bring it, so every verb has to run without it (tests/test_install.py). The array keeps the tensor alive for as
    long as a view of its bytes exists.
    """
    flat = _as_int(tensor).reshape(-1).view(torch.uint8).cpu()
    if not flat.numel():
        return memoryview(b"")
    array = (ctypes.c_ubyte * flat.numel()).from_address(flat.data_ptr())
    array.tensor = flat
    return memoryview(array).cast("B")


def transform_bytes(raw: bytes | bytearray | memoryview, *, dtype: torch.dtype, shape: tuple[int, ...], name: str,
                    params: dict[str, int], out: memoryview | None = None,
                    companions: tuple[torch.Tensor, ...] = (), result_dtype: torch.dtype | None = None) -> memoryview:
    """Decode, apply the named transform, encode: what the writer and `verify` both run for a TRANSFORM tensor.
    `out` (writable, the result's size) is where the result is written where the transform can (see apply_transform);
    the bytes returned may be a view of it. A transform that changes the dtype (a dequantization, whose result is
    in its scale's dtype) is cast to `result_dtype`, the dtype the plan writes."""
    into = torch.frombuffer(out, dtype=torch.uint8) if out is not None and len(out) else None
    result = apply_transform(name, decode(raw, dtype=dtype, shape=shape), params, into, companions)
    if result_dtype is not None and result.dtype != result_dtype:
        result = result.to(result_dtype)
    return encode(result)


def torch_dtype(safetensors_dtype: str) -> torch.dtype:
    """"BF16" -> torch.bfloat16 (io.safetensors_header.DTYPES holds names so header reading needs no torch)."""
    return getattr(torch, DTYPES[safetensors_dtype][0])


def render_transform(tensor: TensorPlan, raw: bytearray | memoryview, out: memoryview | None = None,
                     companions: Sequence[bytes | bytearray | memoryview] = ()) -> memoryview:
    """The bytes of a TRANSFORM tensor, computed from its source bytes (and its companions' bytes, in the order of
    tensor.companions): what the writer writes and `verify` recomputes (one function, so the two can never
    disagree). `out`: as transform_bytes takes it."""
    decoded = tuple(decode(data, dtype=torch_dtype(piece.ref.dtype), shape=piece.shape)
                    for piece, data in zip(tensor.companions, companions, strict=True))
    return transform_bytes(raw, dtype=torch_dtype(tensor.source.ref.dtype), shape=tensor.source.shape,
                           name=tensor.transform, params=dict(tensor.params), out=out, companions=decoded,
                           result_dtype=torch_dtype(tensor.dtype))

"""The pad-global tensor functions: placement, exactness on every dtype, and refusal of impossible ratios."""

import pytest
import torch

from converter.transforms import (decode, encode, pad_head_columns, pad_head_norm, pad_head_rows,
                                  replicate_kv_heads, transform_bytes)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]


def _rows(heads: int, d: int, width: int = 3) -> torch.Tensor:
    return torch.arange(heads * d * width, dtype=torch.float32).reshape(heads * d, width)


def test_pad_head_rows_places_each_half_interleaved_with_duplicates():
    padded = pad_head_rows(_rows(2, 4, 1), num_heads=2, head_dim=4, target_head_dim=8)[:, 0]
    # head 0: dims (0,1 | 2,3) -> slots (0,1,2,3 | 4,5,6,7) = (0,0,1,1 | 2,2,3,3)
    assert padded.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]


@pytest.mark.parametrize("ratio", [2, 4])
def test_rope_pairs_are_preserved(ratio):
    """Default RoPE pairs slot p with p + D/2; the primary slots must pair exactly like i with i + d/2."""
    d = 8
    big = d * ratio
    padded = pad_head_rows(torch.arange(d, dtype=torch.float32)[:, None], num_heads=1, head_dim=d,
                           target_head_dim=big)[:, 0]
    for i in range(d // 2):
        primary = ratio * i
        assert padded[primary] == i and padded[primary + big // 2] == i + d // 2
        # the frequency theta^(-2p/D) of the primary slot equals theta^(-2i/d) of the original dim
        assert 2 * primary / big == 2 * i / d


def test_norm_and_columns_are_zero_at_copies():
    norm = pad_head_norm(torch.tensor([1.0, 2.0, 3.0, 4.0]), head_dim=4, target_head_dim=8)
    assert norm.tolist() == [1, 0, 2, 0, 3, 0, 4, 0]
    columns = pad_head_columns(torch.arange(8.0).reshape(1, 8), num_heads=2, head_dim=4, target_head_dim=8)
    assert columns.tolist() == [[0, 0, 1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0, 7, 0]]


def test_replicate_kv_heads_repeats_each_head_in_place():
    weight = torch.arange(4.0)[:, None]  # 2 heads of dim 2
    assert replicate_kv_heads(weight, num_heads=2, head_dim=2, repeats=3)[:, 0].tolist() == \
        [0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3]


@pytest.mark.parametrize("dtype", DTYPES)
def test_transforms_preserve_bits_for_every_dtype(dtype):
    torch.manual_seed(0)
    weight = torch.randn(2 * 8, 5).to(dtype)
    padded = pad_head_rows(weight, num_heads=2, head_dim=8, target_head_dim=16)
    assert padded.dtype == dtype
    bits = padded.view(torch.uint8 if dtype.itemsize == 1 else torch.int16 if dtype.itemsize == 2 else torch.int32)
    source = weight.view(bits.dtype)
    assert torch.equal(bits.reshape(2, 2, 4, 2, 5)[:, :, :, 0], source.reshape(2, 2, 4, 5))
    assert torch.equal(bits.reshape(2, 2, 4, 2, 5)[:, :, :, 1], source.reshape(2, 2, 4, 5))


def test_per_channel_scale_rows_follow_their_weight_rows():
    scale = torch.arange(8.0)[:, None]  # fp8 per-channel weight_scale [rows, 1]
    assert pad_head_rows(scale, num_heads=2, head_dim=4, target_head_dim=8)[:, 0].tolist() == \
        [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]


@pytest.mark.parametrize("d, big", [(16, 24), (3, 6), (16, 8)])
def test_impossible_ratios_are_refused(d, big):
    with pytest.raises(ValueError, match="cannot place head_dim"):
        pad_head_rows(torch.zeros(d, 2), num_heads=1, head_dim=d, target_head_dim=big)


def test_wrong_row_count_is_refused():
    with pytest.raises(ValueError, match="expected 8 rows"):
        pad_head_rows(torch.zeros(7, 2), num_heads=2, head_dim=4, target_head_dim=8)


def test_bytes_round_trip_through_transform_bytes():
    weight = torch.randn(8, 3).to(torch.bfloat16)
    raw = bytes(encode(weight))
    assert torch.equal(decode(raw, dtype=torch.bfloat16, shape=(8, 3)), weight)
    out = transform_bytes(raw, dtype=torch.bfloat16, shape=(8, 3), name="pad_head_rows",
                          params={"num_heads": 2, "head_dim": 4, "target_head_dim": 8})
    assert bytes(out) == bytes(encode(pad_head_rows(weight, num_heads=2, head_dim=4, target_head_dim=8)))


@pytest.mark.parametrize("num_bits", [4, 8])
@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_pad_packed_columns_moves_codes_as_compressed_tensors_packs_them(num_bits, ratio):
    """Packed with compressed-tensors' own pack_to_int32, padded, unpacked with its unpack_from_int32: every code at
    column c * ratio, the value 0 at the copies (the zero code is the packing offset), in any int32 bit pattern."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    from converter.transforms import pad_packed_columns

    low, high = -(1 << (num_bits - 1)), 1 << (num_bits - 1)
    values = torch.randint(low, high, (6, 64), generator=torch.Generator().manual_seed(num_bits), dtype=torch.int8)
    values[0, :] = high - 1  # top code everywhere: words with the sign bit set
    padded = pad_packed_columns(pack_to_int32(values, num_bits), num_bits=num_bits, ratio=ratio)
    got = unpack_from_int32(padded, num_bits, torch.Size([6, 64 * ratio]))
    want = torch.zeros(6, 64, ratio, dtype=torch.int8)
    want[..., 0] = values
    assert padded.dtype == torch.int32 and got.equal(want.reshape(6, 64 * ratio))


def test_scale_weight_shape_is_integer_only():
    from converter.transforms import scale_weight_shape

    shape = torch.tensor([672, 8192], dtype=torch.int64)
    assert scale_weight_shape(shape, columns=2).tolist() == [672, 16384]
    assert scale_weight_shape(shape, rows=4).tolist() == [2688, 8192]
    with pytest.raises(ValueError, match="integer \\[2\\] weight_shape"):
        scale_weight_shape(torch.tensor([1.0, 2.0]), rows=2)


_INTO_CASES = [
    ("pad_head_rows", (16, 3), {"num_heads": 2, "head_dim": 8, "target_head_dim": 32}),
    ("pad_head_norm", (8,), {"head_dim": 8, "target_head_dim": 16}),
    ("pad_head_columns", (3, 16), {"num_heads": 2, "head_dim": 8, "target_head_dim": 16}),
    ("replicate_kv_heads", (16, 3), {"num_heads": 2, "head_dim": 8, "repeats": 3}),
    ("repeat_rows", (4, 2), {"repeats": 2}),
    ("repeat_columns", (2, 4), {"repeats": 2}),
]


@pytest.mark.parametrize("name,shape,params", _INTO_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_reused_output_buffer_gets_the_same_bytes_as_a_new_tensor(name, shape, params, dtype):
    """The writer renders into buffers it reuses (stale bytes from the previous tensor left in them): the bytes
    written there must be those of a fresh result, zero slots included."""
    from converter.transforms import apply_transform
    source = torch.randn(*shape).to(dtype)
    fresh = encode(apply_transform(name, source, params))
    stale = torch.full((len(fresh),), 0xA5, dtype=torch.uint8)
    into = encode(apply_transform(name, source, params, out=stale))
    assert bytes(into) == bytes(fresh)
    assert bytes(stale.numpy()) == bytes(fresh)  # written in place, not beside it


_PIECE_CASES = [  # (transform, source shape, output shape, params)
    ("pad_head_rows", (4 * 8, 6), (4 * 16, 6), {"num_heads": 4, "head_dim": 8, "target_head_dim": 16}),
    ("replicate_kv_heads", (3 * 8, 6), (3 * 2 * 8, 6), {"num_heads": 3, "head_dim": 8, "repeats": 2}),
    ("pad_head_columns", (10, 16), (10, 32), {"num_heads": 2, "head_dim": 8, "target_head_dim": 16}),
    ("repeat_rows", (10, 4), (20, 4), {"repeats": 2}),
    ("repeat_columns", (10, 4), (10, 8), {"repeats": 2}),
]


@pytest.mark.parametrize("name,source_shape,shape,params", _PIECE_CASES)
@pytest.mark.parametrize("row_start", [0, 8])
def test_a_tensor_rendered_in_row_pieces_is_byte_identical_to_one_render(name, source_shape, shape, params,
                                                                          row_start, tmp_path):
    """The writer renders large TRANSFORM tensors in pieces of whole row units (plan.row_pieces); the pieces' bytes,
    in order, must be the whole render's, for a tensor stored at a row offset too (a fused qkv's slice)."""
    from pathlib import Path

    from converter.plan import TensorPlan, row_pieces
    from converter.read.safetensors_header import TensorRef
    from converter.read.slices import SourceSlice
    from converter.transforms import render_transform
    stored = torch.randn(row_start + source_shape[0], source_shape[1]).to(torch.bfloat16)
    raw = encode(stored)
    ref = TensorRef("w", "BF16", tuple(stored.shape), Path("x"), 0, len(raw))
    tensor = TensorPlan("w", "BF16", shape, SourceSlice(ref, row_start, row_start + source_shape[0]), "padded",
                        transform=name, params=params)
    pieces = row_pieces(tensor, max_bytes=tensor.nbytes // 3)
    assert len(pieces) >= 3 and sum(piece.nbytes for piece in pieces) == tensor.nbytes

    def render(plan: TensorPlan) -> bytes:
        source = bytearray(raw[plan.source.offset:plan.source.offset + plan.source.nbytes])
        return bytes(render_transform(plan, source))

    assert b"".join(render(piece) for piece in pieces) == render(tensor)


def test_a_transform_that_mixes_rows_is_one_piece():
    from pathlib import Path

    from converter.plan import TensorPlan, row_pieces
    from converter.read.safetensors_header import TensorRef
    from converter.read.slices import SourceSlice
    ref = TensorRef("n", "BF16", (4096,), Path("x"), 0, 8192)
    norm = TensorPlan("n", "BF16", (8192,), SourceSlice.whole(ref), "padded", transform="pad_head_norm",
                      params={"head_dim": 4096, "target_head_dim": 8192})
    assert row_pieces(norm, max_bytes=1024) == (norm,)


def test_every_transform_a_plan_may_name_has_its_function():
    """plan.Transform and transforms.TRANSFORMS name the same transforms: a member without a function (or a function
    no plan can name) is a layout that plans what the writer cannot render."""
    from converter.plan import Transform
    from converter.transforms import TRANSFORMS
    assert set(TRANSFORMS) == set(Transform) and all(callable(f) for f in TRANSFORMS.values())

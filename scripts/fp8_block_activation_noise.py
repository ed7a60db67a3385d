"""Measures what pad-global does to an fp8 o_proj at serving time (docs/CLI.md quotes its output).

pad-global moves block-quantized WEIGHTS exactly (their dequantized values are bit-identical; tests/test_fp8.py).
What it cannot keep is the run-time quantization of o_proj's INPUT: with compressed-tensors FP8_BLOCK the input is
quantized dynamically in 1x128 groups along its dims, and after padding each group holds 64 original dims (each
twice, interleaved per half) instead of 128, so group maxima and rounding differ. Per-token dynamic activations
(FP8-dynamic, channel weights) are unaffected: duplicating a value does not change a row's maximum.

This script emulates o_proj at the real 31B sliding-layer sizes (32 heads, head_dim 256 -> 512, hidden 5376) on
CPU in fp32 with random weights and activations: y = dequant(quant_fp8(x)) @ W^T, original vs padded, against the
unquantized product. It prints one JSON line per activation scheme.

usage: python scripts/fp8_block_activation_noise.py [--tokens 64] [--rows 1024] [--seed 0]
"""

from __future__ import annotations

import argparse
import json

import torch

from converter.transforms import pad_head_columns, pad_head_rows

FP8_MAX = 448.0
HEADS, HEAD_DIM, TARGET_HEAD_DIM = 32, 256, 512


def quantize_groups(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """Dynamic symmetric fp8 e4m3 quantize-dequantize per token (group None) or per 1 x `group` slice."""
    shaped = x if group is None else x.reshape(x.shape[0], -1, group)
    amax = shaped.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (shaped / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale
    return q.reshape(x.shape)


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def measure(tokens: int, rows: int, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HEADS * HEAD_DIM, generator=generator)
    weight = torch.randn(rows, HEADS * HEAD_DIM, generator=generator) / (HEADS * HEAD_DIM) ** 0.5
    params = dict(num_heads=HEADS, head_dim=HEAD_DIM, target_head_dim=TARGET_HEAD_DIM)
    # the padded attention output: every dim at its primary slot and its copy (V rows are duplicated)
    x_padded = pad_head_rows(x.t().contiguous(), **params).t().contiguous()
    w_padded = pad_head_columns(weight, **params)
    exact = x @ weight.t()
    results = []
    for scheme, group in (("per-token (FP8-dynamic)", None), ("1x128 groups (FP8_BLOCK)", 128)):
        original = quantize_groups(x, group) @ weight.t()
        padded = quantize_groups(x_padded, group) @ w_padded.t()
        results.append({
            "activations": scheme, "tokens": tokens, "rows": rows,
            "padded_vs_original_rel_rms": rel_rms(padded, original),
            "padded_vs_original_max_abs": float((padded - original).abs().max()),
            "original_quantization_rel_rms": rel_rms(original, exact),
            "padded_quantization_rel_rms": rel_rms(padded, exact),
            "bit_identical": bool(torch.equal(padded, original)),
        })
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rows", type=int, default=1024, help="o_proj output rows emulated (31B has 5376)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for row in measure(args.tokens, args.rows, args.seed):
        print(json.dumps(row))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Write a synthetic Gemma 4 target / assistant / pair with real config files and tensor names.

Examples:
  python scripts/make_synthetic.py --preset 31b --tiny --out /tmp/pair            # KB-MB sized, real ratios
  python scripts/make_synthetic.py --preset 31b --role assistant --out /tmp/a     # full-size 31B assistant (0.94 GB)
  python scripts/make_synthetic.py --preset 31b --num-layers 6 --role target --out /tmp/t --num-shards 2
  python scripts/make_synthetic.py --preset 31b --engine --out /tmp/pair          # runs in the vLLM CPU engine
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from matrix.synthetic import (PRESETS, engine_preset, fp8_quantization_config,  # noqa: E402
                                         modelopt_nvfp4_config, scale_for_engine, scaled_preset, tiny_preset,
                                         write_checkpoint, write_pair)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="31b")
    parser.add_argument("--role", choices=["pair", "target", "assistant"], default="pair")
    parser.add_argument("--out", required=True, type=Path, help="directory to write (pair: OUT/target, OUT/assistant)")
    parser.add_argument("--tiny", action="store_true", help="test size: widths / 16, one or two layer periods")
    parser.add_argument("--engine", action="store_true",
                        help="for the vLLM CPU engine (serve_check): --tiny with the real head sizes 256/512, "
                             "target embed_tokens x0.002 and final norm x50 so greedy output varies; 26b-a4b keeps its "
                             "experts, hidden size and expert width rounded up to 32 (the CPU fused-MoE kernels' tile)")
    parser.add_argument("--width-divisor", type=int, default=1)
    parser.add_argument("--num-layers", type=int, default=None, help="target decoder layers (default: real count)")
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--dialect", choices=["legacy", "per_layer_config", "both"], default="legacy")
    parser.add_argument("--fused-qkv", action="store_true", help="target: write self_attn.qkv_proj")
    parser.add_argument("--num-shards", type=int, default=1)
    parser.add_argument("--text-only", action="store_true", help="target: gemma4_text instead of the gemma4 wrapper")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fp8", choices=["channel", "tensor", "block"], default=None,
                        help="target: compressed-tensors FP8 weights with per-channel, per-tensor or block scales")
    parser.add_argument("--fp8-block", type=int, nargs=2, default=(128, 128), metavar=("ROWS", "COLUMNS"),
                        help="block size for --fp8 block (default 128 128; tiny presets need e.g. 8 8)")
    parser.add_argument("--nvfp4", action="store_true",
                        help="target: Model Optimizer NVFP4 MLPs, self_attn excluded (like nvidia/Gemma-4-31B-IT-NVFP4)")
    parser.add_argument("--unified", action="store_true", help="gemma4_unified + gemma4_unified_assistant")
    parser.add_argument("--saved-by", default=None, metavar="PYTHON",
                        help="re-save the configs with this interpreter's transformers (save_pretrained)")
    args = parser.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} exists and is not empty")
    if args.engine and args.fp8:
        parser.error("--engine writes plain weights; drop --fp8")
    preset = engine_preset(args.preset) if args.engine else tiny_preset(args.preset) if args.tiny else scaled_preset(
        args.preset, width_divisor=args.width_divisor, num_layers=args.num_layers, vocab_size=args.vocab_size)
    common = dict(preset=preset, dialect=args.dialect, dtype=DTYPES[args.dtype], seed=args.seed,
                  saved_by=args.saved_by)
    quantization = fp8_quantization_config(args.fp8, block=tuple(args.fp8_block)) if args.fp8 else None
    quantization = modelopt_nvfp4_config() if args.nvfp4 else quantization
    if args.unified and args.role != "pair":
        parser.error("--unified writes a pair")
    if args.role == "pair":
        paths = write_pair(args.out, fused_qkv=args.fused_qkv, num_shards=args.num_shards,
                           multimodal=not args.text_only, quantization=quantization, unified=args.unified, **common)
    elif args.role == "target":
        paths = (write_checkpoint(args.out, role="target", fused_qkv=args.fused_qkv, num_shards=args.num_shards,
                                  multimodal=not args.text_only, quantization=quantization, **common),)
    else:
        paths = (write_checkpoint(args.out, role="assistant", num_shards=args.num_shards, **common),)
    if args.engine and args.role != "assistant":
        scale_for_engine(paths[0])
    for path in paths:
        print(path)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The naive baseline for scripts/bench.py: load_file every shard, transform in torch, save_file.

What a typical conversion script does (and what `gemma4-convert convert` is measured against): each
source shard is loaded whole with `safetensors.torch.load_file`, every output tensor is taken from
the loaded dict (rows of a fused qkv_proj sliced, pad-global tensors run through the same
`converter.transforms` functions, following the same plan), and each output shard is written with
`save_file`. Same output tensors, names, shards, config and index as `convert`; no hashing, no
conversion.json, no staging rename, no fsync (the benchmark flushes every contender's output
itself). A source shard stays in memory until the last output shard needing it is written.

Example:
  python scripts/naive_convert.py SRC DST --layout pad-global
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from converter.layouts import get_layout, layout_names  # noqa: E402
from converter.plan import CheckpointPlan, TensorPlan, index_document  # noqa: E402
from converter.read.checkpoint import INDEX_NAME, read_checkpoint  # noqa: E402
from converter.transforms import apply_transform  # noqa: E402


def output_tensor(tensor: TensorPlan, loaded: dict[str, torch.Tensor]) -> torch.Tensor:
    """The output tensor computed from the loaded source dict, as the plan describes it."""
    source = loaded[tensor.source.ref.name]
    if not tensor.source.is_whole:
        source = source[tensor.source.row_start:tensor.source.row_stop]
    if tensor.transform is None:
        return source.contiguous()
    return apply_transform(tensor.transform, source, dict(tensor.params)).contiguous()


def convert(source_dir: Path, out_dir: Path, *, layout: str) -> CheckpointPlan:
    """Writes the converted checkpoint to out_dir (which must not exist); returns the plan it followed."""
    checkpoint = read_checkpoint(source_dir)
    plan = get_layout(layout).plan(checkpoint, max_shard_bytes=None)
    out_dir.mkdir(parents=True)
    last_use = {t.source.ref.file: i for i, shard in enumerate(plan.shards) for t in shard.tensors}
    loaded: dict[Path, dict[str, torch.Tensor]] = {}
    for i, shard in enumerate(plan.shards):
        for tensor in shard.tensors:
            if tensor.source.ref.file not in loaded:
                loaded[tensor.source.ref.file] = load_file(str(tensor.source.ref.file))
        tensors = {t.name: output_tensor(t, loaded[t.source.ref.file]) for t in shard.tensors}
        save_file(tensors, str(out_dir / shard.file_name), metadata=dict(plan.metadata))
        del tensors
        for path in [p for p, last in last_use.items() if last == i]:
            loaded.pop(path, None)
    if plan.indexed:
        (out_dir / INDEX_NAME).write_text(json.dumps(index_document(plan), indent=2) + "\n")
    (out_dir / "config.json").write_text(json.dumps(plan.config, indent=2) + "\n")
    for name in plan.side_files:
        shutil.copyfile(source_dir / name, out_dir / name)
    return plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--layout", choices=layout_names(), required=True)
    args = parser.parse_args()
    if args.dst.exists():
        parser.error(f"{args.dst} exists")
    convert(args.src, args.dst, layout=args.layout)


if __name__ == "__main__":
    main()

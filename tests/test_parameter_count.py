"""convert's "M parameters" is the weights the layout adds, right for every dtype: counted in elements (a packed int4
word as its eight codes), never as bytes over one tensor's element size (wrong for fp8, int4 and mixed dtypes).

The oracle reads the written tensors: every output tensor's weights minus the source's, a `weight_packed` counted
by its compressed-tensors `weight_shape` (the logical [rows, columns] the codes stand for).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from converter.gemma4 import Role
from converter.pipeline import ConvertRequest, execute, plan_conversion
from matrix.cases import build_loader_case
from matrix.synthetic import fp8_quantization_config, tiny_preset, write_pair

from _checkpoints import load_tensors


def weights_in(directory: Path) -> int:
    tensors = load_tensors(directory)
    total = 0
    for name, tensor in tensors.items():
        if name.endswith(".weight_packed"):
            total += math.prod(tensors[name[:-len("packed")] + "shape"].tolist())
        else:
            total += tensor.numel()
    return total


def _mixed_dtype(root: Path) -> None:
    """The tiny bf16 pair with the target's first stored tensor re-saved in float32 (checkpoints keep norms in fp32)."""
    write_pair(root, preset=tiny_preset("31b"), num_shards=2)
    shard = sorted((root / "target").glob("*.safetensors"))[0]
    with safe_open(str(shard), "pt") as handle:
        metadata = handle.metadata()
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    first = min(tensors)
    tensors[first] = tensors[first].float()
    save_file(tensors, str(shard), metadata=metadata)
    index = root / "target" / "model.safetensors.index.json"
    document = json.loads(index.read_text())
    document["metadata"]["total_size"] = sum(
        t.numel() * t.element_size() for p in (root / "target").glob("*.safetensors")
        for t in load_tensors_of(p).values())
    index.write_text(json.dumps(document, indent=2))


def load_tensors_of(path: Path) -> dict:
    with safe_open(str(path), "pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


SOURCES = {
    "fp8-channel": lambda root: write_pair(root, preset=tiny_preset("31b"), num_shards=2,
                                           quantization=fp8_quantization_config("channel")),
    # 31B's real head sizes: pad-global moves int4 groups of 32 only where they fit half a head (layouts/pad_global.py)
    "w4a16": lambda root: shutil.copytree(build_loader_case("31b-w4a16-real-heads", root.parent / "cases",
                                                            variants=())["original"], root),
    "mixed-bf16-fp32": _mixed_dtype,
}


@pytest.mark.parametrize("name", SOURCES)
def test_parameters_added_are_counted_in_weights_for_every_dtype(name, tmp_path):
    SOURCES[name](tmp_path / "src")
    plan = plan_conversion(ConvertRequest(out=tmp_path / "out", layout="pad-global",
                                          sources={Role.TARGET: tmp_path / "src" / "target",
                                                   Role.ASSISTANT: tmp_path / "src" / "assistant"}))
    execute(plan)
    for item in plan.items:
        added = weights_in(tmp_path / "out" / item.subdir) - weights_in(tmp_path / "src" / item.subdir)
        assert added > 0 and item.parameters_added == added, (item.subdir, item.parameters_added, added)
    dtypes = {ref.dtype for ref in plan.item("target").source.tensors.values()}
    assert len(dtypes) > 1, dtypes  # each source really mixes element sizes

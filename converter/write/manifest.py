"""conversion.json: the manifest schema of one converted checkpoint (docs/CLI.md lists its keys)."""

from __future__ import annotations

import datetime as _dt
from typing import Any, Mapping

from .. import __version__
from ..plan import CheckpointPlan, TensorPlan
from ..read.checkpoint import Checkpoint

MADE_WRITTEN = "written"  # conversion.json `output.made` of a file this tool generated


def manifest_document(plan: CheckpointPlan, source: Checkpoint, *, source_hashes: Mapping[str, str | None],
                      output_hashes: Mapping[str, str | None], output_sizes: Mapping[str, int], made: Mapping[str, str], link: str, paired: bool,
                      warnings: tuple[str, ...], origin: Mapping[str, str] | None = None,
                      hashed: bool = True, tp: int | None = None,
                      serving: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """conversion.json: enough to audit, verify and cite the conversion (origin: the Hub repo id and commit).

    `output.made` says how each file came to be: "written" (generated), "copy", "reflink", "hardlink" or "symlink"
    (an unchanged source file); a linked file was never read, so its sha256 is null on both sides, as is every
    shard's and weight file's with `hashed` False (--no-hash; the small JSON files are always hashed). `output.sizes`
    holds every file's size: what verify and upload check the output against, hashed or not.
    """
    return {
        "tool": "gemma4-convert",
        "version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "layout": plan.layout,
        "layout_options": dict(plan.layout_options),
        "role": plan.role,
        "model_type": source.spec.model_type,
        "converted_with_pair": paired,
        "tensor_parallel_size": tp,
        "serving": dict(serving) if serving else None,  # the environment the layout was chosen for, if one was
        "warnings": list(warnings),
        "source": {"path": str(source.path.resolve()), **dict(origin or {}), "dialect": source.spec.dialect,
                   "config": dict(source.config), "files": dict(source_hashes)},
        "output": {"files": dict(output_hashes), "sizes": dict(output_sizes), "made": dict(made), "link": link, "hashed": hashed,
                   "total_size": plan.total_size},
        "tensors": [_tensor_record(t) for t in plan.tensors],
        **({"dequantized": True} if plan.dequantized else {}),  # --dequantize-assistant (verify re-plans with it)
    }


def _tensor_record(tensor: TensorPlan) -> dict[str, Any]:
    record: dict[str, Any] = {"name": tensor.name, "action": tensor.action, "source": tensor.source.ref.name,
                              "source_file": tensor.source.ref.file.name}
    if not tensor.source.is_whole:
        record["rows"] = [tensor.source.row_start, tensor.source.row_stop]
    if tensor.transform:
        record["transform"] = tensor.transform
        record["params"] = dict(tensor.params)
    if tensor.companions:
        record["companions"] = [piece.ref.name for piece in tensor.companions]
    return record

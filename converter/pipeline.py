"""The only module that calls every stage: read -> plan -> (transform while) write -> manifest -> rename."""

from __future__ import annotations

import datetime as _dt
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from . import __version__
from .cost import KvCost, human_bytes, kv_costs
from .errors import InputError, OutputError, UsageError
from .gemma4 import ROLE_ASSISTANT, ROLE_TARGET
from .io.checkpoint import INDEX_NAME, MANIFEST_NAME, Checkpoint, read_checkpoint
from .io.safetensors_header import DTYPES
from .io.writer import SequentialReader, copy_file, make_directory, staged_directory, write_json, write_shard
from .layouts import get_layout
from .pairing import PairReport, check_pair
from .plan import CheckpointPlan, TensorPlan, index_document
from .transforms import transform_bytes

DEFAULT_SPECULATIVE_TOKENS = 4


@dataclass(frozen=True)
class ConvertRequest:
    """What `convert` was asked to do; exactly one of (single) or (target and/or assistant) is set."""

    out: Path
    layout: str
    target: Path | None = None
    # options of the layout (Layout.option_choices), e.g. {"keys": "flat"} for per-layer --flat-keys-only
    layout_options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    assistant: Path | None = None
    single: Path | None = None
    force: bool = False
    max_shard_bytes: int | None = None
    # role ("single", "target", "assistant") -> {"repo_id", "revision", ...} for Hub sources (hub.LocalSource.origin)
    origins: Mapping[str, Mapping[str, str]] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class PlannedCheckpoint:
    source: Checkpoint
    plan: CheckpointPlan
    subdir: str  # "" when converting one checkpoint straight into the output dir


@dataclass(frozen=True)
class ConversionPlan:
    request: ConvertRequest
    items: tuple[PlannedCheckpoint, ...]
    pair: PairReport | None
    warnings: tuple[str, ...]

    def item(self, role: str) -> PlannedCheckpoint | None:
        return next((i for i in self.items if i.plan.role == role), None)

    @property
    def source_bytes(self) -> int:
        return sum(i.plan.source_bytes for i in self.items)

    @property
    def output_bytes(self) -> int:
        return sum(i.plan.total_size for i in self.items)

    def kv_costs(self) -> tuple[KvCost, ...]:
        target = self.item(ROLE_TARGET)
        return kv_costs(target.source.spec.attention) if target else ()

    def output_dir(self, item: PlannedCheckpoint) -> Path:
        return self.request.out / item.subdir if item.subdir else self.request.out


@dataclass(frozen=True)
class ConvertResult:
    plan: ConversionPlan
    output_files: dict[str, dict[str, str]]  # subdir -> file name -> sha256


def plan_conversion(request: ConvertRequest) -> ConversionPlan:
    """Reads headers, checks inputs and output, plans every tensor; writes nothing.

    Raises:
        UsageError, InputError, OutputError: with one-line messages naming the file at fault.
    """
    sources = _sources(request)
    layout = get_layout(request.layout, request.layout_options)
    checkpoints = {role: read_checkpoint(path) for role, path in sources.items()}
    _check_output(request, list(sources.values()))
    warnings: list[str] = []
    for role, checkpoint in checkpoints.items():
        _refuse_reconversion(checkpoint)
        if role != "single" and checkpoint.spec.role != role:
            raise UsageError(f"--{role} {checkpoint.path} is a {checkpoint.spec.kind}")
    pair = None
    if ROLE_TARGET in checkpoints and ROLE_ASSISTANT in checkpoints:
        pair = check_pair(checkpoints[ROLE_TARGET].spec, checkpoints[ROLE_ASSISTANT].spec)
        if not pair.ok:
            raise InputError(f"{checkpoints[ROLE_ASSISTANT].path} cannot serve with {checkpoints[ROLE_TARGET].path}: "
                             + "; ".join(pair.problems))
    elif request.layout == "pad-global":
        role = next(iter(checkpoints.values())).spec.role
        other = ROLE_ASSISTANT if role == ROLE_TARGET else ROLE_TARGET
        warnings.append(f"pad-global converted only the {role}: its {other} MUST get the same pad-global "
                        f"conversion, or the pair computes garbage (gemma4-convert check-pair will flag it)")
    items = tuple(PlannedCheckpoint(source=c, plan=layout.plan(c, max_shard_bytes=request.max_shard_bytes),
                                    subdir="" if role == "single" else role) for role, c in checkpoints.items())
    for item in items:
        warnings.extend(item.plan.warnings)
    plan = ConversionPlan(request=request, items=items, pair=pair, warnings=tuple(warnings))
    _check_free_space(request.out, plan.output_bytes)
    return plan


def _sources(request: ConvertRequest) -> dict[str, Path]:
    if request.single is not None:
        if request.target is not None or request.assistant is not None:
            raise UsageError("give either SRC or --target/--assistant, not both")
        return {"single": request.single}
    sources = {role: path for role, path in ((ROLE_TARGET, request.target), (ROLE_ASSISTANT, request.assistant))
               if path is not None}
    if not sources:
        raise UsageError("nothing to convert: give SRC, or --target and/or --assistant")
    return sources


def _check_output(request: ConvertRequest, sources: list[Path]) -> None:
    out = request.out.resolve()
    for source in sources:
        src = source.resolve()
        if out == src or src in out.parents:
            raise UsageError(f"output {request.out} is inside the source {source}; choose a directory outside it")
        if out in src.parents:
            raise UsageError(f"source {source} is inside the output {request.out}; choose another output directory")
    if request.out.exists() and not request.force:
        raise OutputError(f"{request.out} already exists; choose a new directory or pass --force to replace it")
    if request.out.exists() and not request.out.is_dir():
        raise OutputError(f"{request.out} exists and is not a directory")
    if request.out.exists() and not _is_replaceable(request.out):
        raise OutputError(f"refusing to --force-replace {request.out}: it is neither empty nor an output of "
                          "gemma4-convert (no conversion.json); remove it yourself or choose a new directory")


def _is_replaceable(directory: Path) -> bool:
    """--force only ever replaces an empty directory or an earlier output of this tool (never, say, /data)."""
    manifests = [directory / MANIFEST_NAME, directory / ROLE_TARGET / MANIFEST_NAME,
                 directory / ROLE_ASSISTANT / MANIFEST_NAME]
    return not any(directory.iterdir()) or any(path.is_file() for path in manifests)


def _check_free_space(out: Path, needed: int) -> None:
    parent = out.resolve().parent
    while not parent.exists():
        parent = parent.parent
    free = shutil.disk_usage(parent).free
    if free < needed:
        raise OutputError(f"{parent}: not enough space: {human_bytes(free)} free but the output needs "
                          f"{human_bytes(needed)}")


def _refuse_reconversion(checkpoint: Checkpoint) -> None:
    manifest = checkpoint.manifest
    if manifest and manifest.get("tool") == "gemma4-convert":
        original = manifest.get("source", {}).get("path", "the original checkpoint")
        raise InputError(f"{checkpoint.path} is already an output of gemma4-convert (layout "
                         f"{manifest.get('layout')}); convert {original} instead")


def execute(plan: ConversionPlan, *, on_bytes: Callable[[int], None] = lambda n: None) -> ConvertResult:
    """Writes the planned output under a staging name beside it, then renames it into place.

    Raises:
        OutputError: when writing fails (nothing is left behind).
    """
    outputs: dict[str, dict[str, str]] = {}
    paired = plan.pair is not None
    with staged_directory(plan.request.out, replace=plan.request.force) as staging:
        for item in plan.items:
            directory = staging / item.subdir if item.subdir else staging
            make_directory(directory)
            outputs[item.subdir] = _write_checkpoint(item, directory, paired=paired, warnings=plan.warnings,
                                                     on_bytes=on_bytes,
                                                     origin=plan.request.origins.get(item.subdir or "single"))
    return ConvertResult(plan=plan, output_files=outputs)


def render_transform(tensor: TensorPlan, raw: bytearray) -> memoryview:
    """The bytes of a TRANSFORM tensor, computed from its source bytes."""
    return transform_bytes(raw, dtype=DTYPES[tensor.dtype][0], shape=tensor.source.shape, name=tensor.transform,
                           params=dict(tensor.params))


def _write_checkpoint(item: PlannedCheckpoint, directory: Path, *, paired: bool, warnings: tuple[str, ...],
                      on_bytes: Callable[[int], None], origin: Mapping[str, str] | None = None) -> dict[str, str]:
    plan, source = item.plan, item.source
    readers = {shard.file: SequentialReader(shard.file) for shard in source.shards}
    files: dict[str, str] = {}
    for shard in plan.shards:
        files[shard.file_name] = write_shard(directory / shard.file_name, shard, metadata=dict(plan.metadata),
                                             readers=readers, render=render_transform, on_bytes=on_bytes)
    source_hashes = {path.name: reader.finish() for path, reader in readers.items()}
    if plan.indexed:
        files[INDEX_NAME] = write_json(directory / INDEX_NAME, index_document(plan))
    files["config.json"] = write_json(directory / "config.json", plan.config)
    for name in plan.side_files:
        source_hashes[name] = files[name] = copy_file(source.path / name, directory / name)
    write_json(directory / MANIFEST_NAME, manifest_document(item, source_hashes=source_hashes, output_hashes=files,
                                                            paired=paired, warnings=warnings, origin=origin))
    return files


def manifest_document(item: PlannedCheckpoint, *, source_hashes: dict[str, str], output_hashes: dict[str, str],
                      paired: bool, warnings: tuple[str, ...],
                      origin: Mapping[str, str] | None = None) -> dict[str, Any]:
    """conversion.json: enough to audit, verify and cite the conversion (origin: the Hub repo id and commit)."""
    plan, source = item.plan, item.source
    return {
        "tool": "gemma4-convert",
        "version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "layout": plan.layout,
        "layout_options": dict(plan.layout_options),
        "role": plan.role,
        "model_type": source.spec.model_type,
        "converted_with_pair": paired,
        "warnings": list(warnings),
        "source": {"path": str(source.path.resolve()), **dict(origin or {}), "dialect": source.spec.dialect,
                   "config": dict(source.config), "files": source_hashes},
        "output": {"files": output_hashes, "total_size": plan.total_size},
        "tensors": [_tensor_record(t) for t in plan.tensors],
    }


def _tensor_record(tensor: TensorPlan) -> dict[str, Any]:
    record: dict[str, Any] = {"name": tensor.name, "action": tensor.action, "source": tensor.source.ref.name,
                              "source_file": tensor.source.ref.file.name}
    if not tensor.source.is_whole:
        record["rows"] = [tensor.source.row_start, tensor.source.row_stop]
    if tensor.transform:
        record["transform"] = tensor.transform
        record["params"] = dict(tensor.params)
    return record


def serve_command(plan: ConversionPlan) -> str:
    """The `vllm serve` line for what was converted (pad-global pins the attention backend, FACTS.md section 4)."""
    target, assistant = plan.item(ROLE_TARGET), plan.item(ROLE_ASSISTANT)
    if plan.request.single is not None:
        only = plan.items[0]
        target = only if only.plan.role == ROLE_TARGET else None
        assistant = only if only.plan.role == ROLE_ASSISTANT else None
    target_path = str(plan.output_dir(target)) if target else "<TARGET converted the same way>"
    assistant_path = str(plan.output_dir(assistant)) if assistant else "<ASSISTANT converted the same way>"
    spec = ('{"method": "mtp", "model": "' + assistant_path + f'", "num_speculative_tokens": '
            f'{DEFAULT_SPECULATIVE_TOKENS}}}')
    command = f"vllm serve {target_path} --speculative-config '{spec}'"
    if plan.request.layout == "pad-global":
        command += " --attention-backend TRITON_ATTN"
    return command

"""`verify`: structural proof (every byte accounted for) then numerical proof (layer by layer) of a conversion.

Structural: the output is re-planned from the source with the recorded layout, independently of what
conversion.json claims; kept tensors must be byte-identical (sha256 while streaming), transformed ones
bit-identical to the transform recomputed from the source; config, index and manifest must agree.
Numerical: see numerics.py. The report is a frozen dataclass; the CLI maps `passed` to the exit code.
"""

from __future__ import annotations

import os
import platform
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .. import __version__
from ..errors import InputError, UsageError, VerificationFailed
from ..gemma4 import parse_attention_name, Role
from ..layouts.base import layout_from_manifest
from ..pairing import check_pair
from ..parallel import DEFAULT_TP_SIZES
from ..plan import TensorPlan
from ..read.checkpoint import Checkpoint, carried_side_files, check_roles, read_checkpoint
from ..read.sequential import MappedFile, file_sha256
from .checks import LayerCheck
from .files import file_problems, manifest_sha256

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Problem:
    """One structural finding, located as precisely as possible."""

    role: str
    message: str
    tensor: str | None = None
    layer: int | None = None

    def describe(self) -> str:
        where = f"{self.role} layer {self.layer}" if self.layer is not None else self.role
        return f"{where}: {self.message}"


@dataclass(frozen=True)
class StructuralReport:
    problems: tuple[Problem, ...]
    tensors_checked: int
    copied: int
    transformed: int

    @property
    def passed(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class VerifyReport:
    passed: bool
    structural: StructuralReport
    layers: tuple[LayerCheck, ...]
    device: str
    dtype: str
    seed: int
    seq_len: int
    tolerance_factor: float
    wall_seconds: float
    first_failure: str | None
    versions: dict[str, str | None] = field(default_factory=dict)
    manifests: dict[str, str] = field(default_factory=dict)  # role -> sha256 of the conversion.json proved

    def to_json(self) -> dict[str, Any]:
        document = asdict(self)
        document["structural"] = {"passed": self.structural.passed,
                                  "problems": [p.describe() for p in self.structural.problems],
                                  "tensors_checked": self.structural.tensors_checked,
                                  "copied": self.structural.copied, "transformed": self.structural.transformed}
        document.update(tool_version=__version__, torch=self.versions.get("torch"), cuda=self.versions.get("cuda"))
        return document


def _layer_of(checkpoint: Checkpoint, name: str) -> int | None:
    parsed = parse_attention_name(name, checkpoint.spec.weight_prefix)
    if parsed is not None:
        return parsed.layer
    marker = checkpoint.spec.weight_prefix + "layers."
    if name.startswith(marker) and name[len(marker):].split(".")[0].isdigit():
        return int(name[len(marker):].split(".")[0])
    return None


def check_structure(source: Checkpoint, output: Checkpoint, *, role: str,
                    on_bytes: Callable[[int], None] = lambda n: None) -> tuple[list[Problem], int, int]:
    """Every structural problem of one converted checkpoint; returns (problems, copied, transformed)."""
    problems: list[Problem] = []
    manifest = output.manifest
    if not manifest or manifest.get("tool") != "gemma4-convert":
        return [Problem(role, f"{output.path} has no conversion.json from gemma4-convert")], 0, 0
    layout = layout_from_manifest(manifest)
    layout.admit(source)
    expected = layout.plan(source, dequantize=manifest.get("dequantized") is True)
    planned = {t.name: t for t in expected.tensors}
    actual = output.tensors
    for name in sorted(planned.keys() - actual.keys()):
        problems.append(Problem(role, f"{name} is missing from the output", name, _layer_of(source, name)))
    for name in sorted(actual.keys() - planned.keys()):
        problems.append(Problem(role, f"{name} is in the output but not in the plan", name, _layer_of(output, name)))
    problems += _check_manifest(manifest, planned, role)
    if dict(output.config) != dict(expected.config):
        differing = sorted(_differing_keys(expected.config, output.config))
        problems.append(Problem(role, f"config.json differs from what {layout.name} requires at {differing}"))
    copied, transformed, byte_problems = _check_bytes(source, output, planned, role, on_bytes)
    problems += byte_problems
    return problems, copied, transformed


def _differing_keys(expected: Any, actual: Any, prefix: str = "") -> list[str]:
    if isinstance(expected, dict) and isinstance(actual, dict):
        keys = expected.keys() | actual.keys()
        return [d for k in keys for d in _differing_keys(expected.get(k), actual.get(k), f"{prefix}{k}.")]
    return [] if expected == actual else [prefix.rstrip(".")]


def _check_manifest(manifest: dict, planned: dict[str, TensorPlan], role: str) -> list[Problem]:
    records = {r.get("name"): r for r in manifest.get("tensors", [])}
    problems = []
    for name, tensor in planned.items():
        record = records.get(name)
        if record is None:
            problems.append(Problem(role, f"conversion.json does not account for {name}", name))
        elif (record.get("action"), record.get("source"), record.get("transform")) != \
                (tensor.action, tensor.source.ref.name, tensor.transform):
            problems.append(Problem(role, f"conversion.json records {name} as {record.get('action')} of "
                                          f"{record.get('source')}, the layout says {tensor.action} of "
                                          f"{tensor.source.ref.name}", name))
    return problems


def _check_bytes(source: Checkpoint, output: Checkpoint, planned: dict[str, TensorPlan], role: str,
                 on_bytes: Callable[[int], None]) -> tuple[int, int, list[Problem]]:
    """Compares both sides through read-only mappings (MappedFile: no copy of either), in output order.

    Kept tensors are compared a block at a time (memory stays a few blocks, whatever the tensor size); transformed
    ones are recomputed whole (one attention tensor at a time). Where the output file IS the source file (a hard or
    symbolic link) the same byte range of the same file needs no reading.
    """
    from ..transforms import render_transform  # torch

    problems: list[Problem] = []
    copied = transformed = 0
    source_readers: dict[Path, MappedFile] = {}
    for shard in output.shards:
        reader = None
        for ref in shard.tensors:
            tensor = planned.get(ref.name)
            if tensor is None:
                continue
            if (ref.dtype, ref.shape) != (tensor.dtype, tensor.shape):
                problems.append(Problem(role, f"{ref.name} is {ref.dtype}{list(ref.shape)}, expected "
                                              f"{tensor.dtype}{list(tensor.shape)}", ref.name,
                                        _layer_of(output, ref.name)))
                continue
            copied, transformed = copied + tensor.is_copy, transformed + (not tensor.is_copy)
            piece = tensor.source
            if tensor.is_copy and (ref.offset, ref.nbytes) == (piece.offset, piece.nbytes) \
                    and _same_file(shard.file, piece.ref.file):
                on_bytes(piece.nbytes)
                continue
            reader = reader or MappedFile(shard.file)
            source_reader = _reader(source_readers, piece.ref.file)
            if tensor.is_copy:
                equal = all(_equal(got, want) for got, want in zip(reader.blocks(ref.offset, ref.nbytes),
                                                                   source_reader.blocks(piece.offset, piece.nbytes)))
            else:
                companions = [_reader(source_readers, c.ref.file).read(c.offset, c.nbytes) for c in tensor.companions]
                want = render_transform(tensor, source_reader.read(piece.offset, piece.nbytes), companions=companions)
                equal = _equal(reader.read(ref.offset, ref.nbytes), want)
            if not equal:
                what = "bytes differ from the source" if tensor.is_copy else \
                    f"bytes differ from {tensor.transform} of {tensor.source.ref.name}"
                problems.append(Problem(role, f"{ref.name}: {what}", ref.name, _layer_of(output, ref.name)))
            on_bytes(piece.nbytes)
        if reader is not None:
            reader.close()
    for source_reader in source_readers.values():
        source_reader.close()
    return copied, transformed, problems


def _reader(readers: dict[Path, MappedFile], path: Path) -> MappedFile:
    if path not in readers:
        readers[path] = MappedFile(path)
    return readers[path]


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _equal(a: memoryview | bytearray, b: memoryview | bytearray) -> bool:
    """Byte equality at memory speed (memoryview == compares element by element, ~30x slower than this)."""
    import torch

    if len(a) != len(b):
        return False
    if not len(a):
        return True
    with warnings.catch_warnings():  # read-only mapped pages: torch warns that it cannot mark the tensor read-only
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.equal(torch.frombuffer(a, dtype=torch.uint8), torch.frombuffer(b, dtype=torch.uint8))


def structural_report(pairs: dict[str, tuple[Checkpoint, Checkpoint]],
                      on_bytes: Callable[[int], None] = lambda n: None,
                      tp_sizes: tuple[int, ...] = ()) -> StructuralReport:
    """Structure of every converted checkpoint, plus the pair check when both sides were converted: its KV geometry
    per tensor-parallel rank at `tp_sizes` (the sizes the user serves with, each also checked against what vLLM
    refuses), else at DEFAULT_TP_SIZES."""
    problems: list[Problem] = []
    copied = transformed = 0
    for role, (source, output) in pairs.items():
        found, c, t = check_structure(source, output, role=role, on_bytes=on_bytes)
        problems += found + _file_checks(source, output, role)
        copied, transformed = copied + c, transformed + t
    if Role.TARGET in pairs and Role.ASSISTANT in pairs:
        target, assistant = pairs[Role.TARGET][1], pairs[Role.ASSISTANT][1]
        pair = check_pair(target.spec, assistant.spec, target_manifest=target.manifest,
                          assistant_manifest=assistant.manifest, tp_sizes=tp_sizes or DEFAULT_TP_SIZES,
                          tp_required=bool(tp_sizes))
        problems += [Problem("pair", p) for p in pair.problems]
    return StructuralReport(problems=tuple(problems), tensors_checked=copied + transformed, copied=copied,
                            transformed=transformed)


def _file_checks(source: Checkpoint, output: Checkpoint, role: str) -> list[Problem]:
    """The output's files as conversion.json records them (sizes; sha256 of all but the shards, whose tensors
    check_structure compares byte for byte), and each side file the source's own bytes."""
    if not output.manifest:
        return []  # check_structure reported it
    problems = [Problem(role, p) for p in file_problems(output.path, output.manifest, hashed=True,
                                                        hash_if=lambda name: not name.endswith(".safetensors"))]
    recorded = (output.manifest.get("output") or {}).get("files") or {}
    for name, placed in carried_side_files(source.side_files).items():
        path = output.path / placed
        if not path.is_file():
            if placed not in recorded:  # else file_problems named it
                problems.append(Problem(role, f"{placed}: the source's {name} is missing from the output"))
        elif file_sha256(path) != file_sha256(source.path / name):
            problems.append(Problem(role, f"{placed}: not the source's {name} byte for byte"))
    return problems


@dataclass(frozen=True)
class VerifyRequest:
    converted: Path
    target: Path | None = None
    assistant: Path | None = None
    single: Path | None = None
    device: str = "auto"
    dtype: str = "bf16"
    seed: int = 0
    seq_len: int = 64
    tolerance_factor: float = 2.0
    tp_sizes: tuple[int, ...] = ()  # --tp: the tensor-parallel sizes served with (empty: DEFAULT_TP_SIZES, advisory)
    names: dict[str, str] = field(default_factory=dict)  # role -> the source as the user named it (a Hub id)


def resolve_device(name: str) -> torch.device:
    """auto -> cuda when available, else cpu; asking for cuda without one is a usage error."""
    import torch  # the numerical half needs it; `verify --help` and the structural half do not

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was requested but torch sees no CUDA device")
    return torch.device(name)


def load_pairs(request: VerifyRequest) -> dict[str, tuple[Checkpoint, Checkpoint]]:
    """(source, output) checkpoints per role, from the request's paths, each source the one its output was
    converted from.

    Raises:
        UsageError: a source given in the other role (swapped --target/--assistant, or SRC DST of two kinds).
        VerificationFailed: a source other than the one conversion.json records (another pair, another size).
        InputError: a missing or unreadable checkpoint.
    """
    if request.single is not None:
        if request.target or request.assistant:
            raise UsageError("give either SRC DST or --target/--assistant --converted, not both")
        source, output = read_checkpoint(request.single), read_checkpoint(request.converted)
        if source.spec.role != output.spec.role:
            raise UsageError(f"SRC {request.names.get(Role.SINGLE, request.single)} is a {source.spec.kind} and DST "
                             f"{request.converted} a converted {output.spec.kind}: give the {output.spec.kind} "
                             f"it was converted from")
        _check_converted_from(source, output, Role.SINGLE, request.names.get(Role.SINGLE))
        return {source.spec.role: (source, output)}
    given = {Role(role): path for role, path in ((Role.TARGET, request.target), (Role.ASSISTANT, request.assistant))
             if path is not None}
    if not given:
        raise UsageError("nothing to verify: give SRC DST, or --target/--assistant with --converted")
    sources = {role: read_checkpoint(path) for role, path in given.items()}
    check_roles(sources, {role: request.names.get(role, str(path)) for role, path in given.items()})
    pairs = {}
    for role, source in sources.items():
        directory = request.converted / role
        if not directory.is_dir():
            raise InputError(f"{directory}: not found; was {request.converted} converted with --{role}?")
        output = read_checkpoint(directory)
        _check_converted_from(source, output, role, request.names.get(role))
        pairs[str(role)] = (source, output)
    return pairs


def _check_converted_from(source: Checkpoint, output: Checkpoint, role: Role, name: str | None) -> None:
    """The source config conversion.json recorded is this source's: a verdict before any tensor is compared (another
    pair's tensors have other shapes, which the numerical checks cannot even multiply)."""
    recorded = ((output.manifest or {}).get("source") or {}).get("config")
    if recorded is None or recorded == dict(source.config):
        return  # no manifest: check_structure says so
    differing = sorted(_differing_keys(recorded, dict(source.config)))
    shown = ", ".join(differing[:4]) + (f" and {len(differing) - 4} more" if len(differing) > 4 else "")
    flag = "SRC" if role is Role.SINGLE else f"--{role}"
    raise VerificationFailed(f"{output.path} was not converted from {flag} {name or source.path}: its config "
                             f"differs from the one conversion.json records at {shown}")


def versions(device: torch.device) -> dict[str, str | None]:
    import torch

    cuda = torch.version.cuda if device.type == "cuda" else None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    return {"torch": torch.__version__, "cuda": cuda, "device_name": name, "python": platform.python_version()}


def verify(request: VerifyRequest, *, on_bytes: Callable[[int], None] = lambda n: None,
           on_layer: Callable[[str], None] = lambda name: None) -> VerifyReport:
    """Structural then numerical verification; never raises for a failed check (see VerifyReport.passed).

    Raises:
        UsageError / InputError: the inputs cannot be verified at all (missing directories, bad checkpoints).
    """
    from .numerics import numerical_checks  # torch-heavy; imported when used

    started = time.perf_counter()
    device = resolve_device(request.device)
    pairs = load_pairs(request)
    structural = structural_report(pairs, on_bytes=on_bytes, tp_sizes=request.tp_sizes)
    layers = numerical_checks(pairs, device=device, dtype=request.dtype, seed=request.seed,
                              seq_len=request.seq_len, factor=request.tolerance_factor, on_layer=on_layer)
    first = structural.problems[0].describe() if structural.problems else next(
        (f"{c.name}: {c.note}" if c.note else
         f"{c.name}: relative error {c.rel_rms:.3g} is {c.ratio:.1f}x the original's own noise floor "
         f"{c.noise_floor:.3g} (allowed {c.factor}x)" for c in layers if not c.passed), None)
    return VerifyReport(passed=first is None, structural=structural, layers=tuple(layers), device=str(device),
                        dtype=request.dtype, seed=request.seed, seq_len=request.seq_len,
                        tolerance_factor=request.tolerance_factor,
                        wall_seconds=round(time.perf_counter() - started, 3), first_failure=first,
                        versions=versions(device),
                        manifests={role: manifest_sha256(output.path) for role, (_, output) in pairs.items()
                                   if output.manifest})

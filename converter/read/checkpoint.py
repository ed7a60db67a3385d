"""A local checkpoint directory: config.json, the shard headers, the index, the other files. No tensor data."""

from __future__ import annotations

import shlex
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..errors import InputError, UsageError
from ..gemma4 import ModelSpec, Role, read_spec
from .json_text import parse_json
from .safetensors_header import ShardHeader, TensorRef, read_header

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MANIFEST_NAME = "conversion.json"
VERIFICATION_NAME = "verification.json"
# Files a conversion regenerates or must not carry over (weights in other formats would be stale copies).
NOT_COPIED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
HF_QUANT_CONFIG_NAME = "hf_quant_config.json"  # Model Optimizer's quantization description (copied as is)
NOT_COPIED_NAMES = {"config.json", INDEX_NAME, MANIFEST_NAME, VERIFICATION_NAME}
CARD_NAME = "README.md"  # an output's README.md is this tool's card (hub/card.py), never the source's
SOURCE_CARD_NAME = "README.source.md"  # the source's own README.md travels under this name beside the card


@dataclass(frozen=True)
class Checkpoint:
    """Everything the planner needs, read from headers and small JSON files only."""

    path: Path
    config: Mapping[str, Any]
    spec: ModelSpec
    shards: tuple[ShardHeader, ...]
    indexed: bool
    side_files: tuple[str, ...]
    manifest: Mapping[str, Any] | None

    @property
    def tensors(self) -> dict[str, TensorRef]:
        return {ref.name: ref for shard in self.shards for ref in shard.tensors}

    @property
    def total_bytes(self) -> int:
        return sum(ref.nbytes for shard in self.shards for ref in shard.tensors)


def read_json(path: Path) -> Any:
    """Parses a JSON file strictly (parse_json); every failure is a one-line InputError naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise InputError(f"{path}: not found") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read ({getattr(exc, 'strerror', None) or exc})") from exc
    return parse_json(text, path)


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Reads config.json, the index and every shard header of a checkpoint directory.

    Args:
        path: local checkpoint directory.

    Returns:
        The Checkpoint.

    Raises:
        InputError: missing/invalid config or index, missing or unindexed shards, duplicate tensor
            names, corrupt headers, or a config that is not Gemma 4.
    """
    root = Path(path)
    if not root.is_dir():
        raise InputError(_not_a_checkpoint_dir(root))
    config_path = root / "config.json"
    if not _present(config_path):
        gguf = sorted(p.name for p in root.glob("*.gguf"))
        if gguf:
            raise InputError(f"{root}: holds {gguf[0]}, a GGUF file, and no config.json; {WHAT_THIS_TAKES}")
        raise InputError(f"{config_path}: not found (is {root} a Hugging Face checkpoint?)")
    config = read_json(config_path)
    if not isinstance(config, dict):
        raise InputError(f"{config_path}: expected a JSON object")
    hf_quant_path = root / HF_QUANT_CONFIG_NAME
    hf_quant = read_json(hf_quant_path) if _present(hf_quant_path) else None
    spec = read_spec(config, source=str(config_path), hf_quant_config=hf_quant)
    shard_names, indexed = _shard_names(root)
    shards = tuple(read_header(root / name) for name in shard_names)
    _check_index(root, shards, indexed)
    manifest_path = root / MANIFEST_NAME
    manifest = read_json(manifest_path) if _present(manifest_path) else None
    return Checkpoint(path=root, config=config, spec=spec, shards=shards, indexed=indexed,
                      side_files=_side_files(root), manifest=manifest)


WHAT_THIS_TAKES = ("gemma4-convert takes a Hugging Face safetensors checkpoint (a directory with config.json and "
                   "*.safetensors, or a Hub id such as google/gemma-4-31B-it); a GGUF is made from one by llama.cpp's "
                   "convert_hf_to_gguf.py")


def _not_a_checkpoint_dir(root: Path) -> str:
    """Why `root` cannot be read as a checkpoint directory, and what to give instead."""
    if not _present(root):
        return f"{root}: no such file or directory"
    if root.suffix == ".gguf":
        return f"{root}: a GGUF file; {WHAT_THIS_TAKES}"
    if root.suffix == ".safetensors":
        return f"{root}: a single shard; give the directory holding it and its config.json ({root.parent})"
    return f"{root}: not a directory; {WHAT_THIS_TAKES}"


def _present(path: Path) -> bool:
    # exists() is False for a symlink loop or a dangling link: reading it then reports the real OSError
    # ("Too many levels of symbolic links") instead of a misleading "not found".
    return path.exists() or path.is_symlink()


def _shard_names(root: Path) -> tuple[list[str], bool]:
    index_path = root / INDEX_NAME
    present = sorted(p.name for p in root.glob("*.safetensors"))
    if not _present(index_path):
        if present == [SINGLE_NAME]:
            return present, False
        if not present:
            raise InputError(f"{root}: no .safetensors files")
        raise InputError(f"{root}: {len(present)} .safetensors files but no {INDEX_NAME}")
    index = read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise InputError(f"{index_path}: no valid `weight_map`")
    named = sorted(set(weight_map.values()))
    for name in named:
        if Path(name).name != name:
            raise InputError(f"{index_path}: shard name {name!r} is not a plain file name")
        if not (root / name).is_file() and not (root / name).is_symlink():
            raise InputError(f"{index_path}: names shard {name!r}, which is missing from {root}")
    unindexed = sorted(set(present) - set(named))
    if unindexed:
        raise InputError(f"{root}: shard {unindexed[0]!r} is present but not in {INDEX_NAME}")
    return named, True


def _check_index(root: Path, shards: tuple[ShardHeader, ...], indexed: bool) -> None:
    weight_map = read_json(root / INDEX_NAME)["weight_map"] if indexed else None
    check_weight_map(root, shards, weight_map)


def check_weight_map(root: Path, shards: tuple[ShardHeader, ...], weight_map: dict[str, str] | None) -> None:
    """No tensor in two shards, and (when there is an index) index and shard headers name the same tensors."""
    seen: dict[str, Path] = {}
    for shard in shards:
        for ref in shard.tensors:
            if ref.name in seen:
                raise InputError(f"{root}: tensor {ref.name!r} is in both {seen[ref.name].name} and {shard.file.name}")
            seen[ref.name] = shard.file
    if weight_map is None:
        return
    for name, file_name in weight_map.items():
        if name not in seen:
            raise InputError(f"{root / INDEX_NAME}: tensor {name!r} is not in {file_name}")
        if seen[name].name != file_name:
            raise InputError(f"{root / INDEX_NAME}: tensor {name!r} is listed in {file_name} "
                             f"but stored in {seen[name].name}")
    extra = sorted(set(seen) - set(weight_map))
    if extra:
        raise InputError(f"{root / INDEX_NAME}: tensor {extra[0]!r} in {seen[extra[0]].name} is missing from the index")


def carried_side_files(side_files: tuple[str, ...]) -> dict[str, str]:
    """Source name -> output name of each side file an output carries: the source's README.md travels as
    README.source.md (an output's README.md is this tool's card); a source that holds README.source.md already (an
    output of this tool) keeps that one, and its card is rendered anew."""
    carried = {}
    for name in side_files:
        if name == CARD_NAME and SOURCE_CARD_NAME in side_files:
            continue
        carried[name] = SOURCE_CARD_NAME if name == CARD_NAME else name
    return carried


def _side_files(root: Path) -> tuple[str, ...]:
    """Top-level non-weight files to carry over unchanged (tokenizer, generation config, templates, docs).

    Raises:
        InputError: a broken link, or an entry that is not a file or directory (a device, FIFO or socket, directly
            or through a link): its bytes are not a file's to copy, and dropping it would lose it in silence.
    """
    files = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_symlink() and not entry.exists():
            # a dangling link (e.g. an incomplete Hugging Face cache snapshot) must not silently drop a tokenizer
            raise InputError(f"{entry}: broken symbolic link or symbolic link loop")
        if entry.is_dir():
            continue  # subdirectories: sub_directories() names them, and convert says it leaves them
        if not entry.is_file():
            raise InputError(f"{entry}: {_kind(entry)}, not a file; a checkpoint's files are regular files: replace "
                             "it with the file it stands for, or remove it")
        if entry.name in NOT_COPIED_NAMES or entry.name.endswith(NOT_COPIED_SUFFIXES):
            continue
        files.append(entry.name)
    return tuple(files)


def sub_directories(root: Path) -> tuple[str, ...]:
    """Top-level directories of a checkpoint: an output carries top-level files only."""
    return tuple(sorted(e.name for e in root.iterdir() if not e.name.startswith(".") and e.is_dir()))


def _kind(path: Path) -> str:
    mode = path.stat().st_mode
    kind = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else
            "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
    return f"a symbolic link to {kind[2:] if kind.startswith('a ') else kind}" if path.is_symlink() else kind


def check_roles(checkpoints: Mapping[Role, Checkpoint], names: Mapping[Role, str]) -> None:
    """Each --target is a target and each --assistant an assistant; `names` as the user gave them (a Hub id, not
    its snapshot path), so the fix can be typed back."""
    wrong = {role: c for role, c in checkpoints.items() if role is not Role.SINGLE and c.spec.role != role}
    if not wrong:
        return
    said = "; ".join(f"--{role} {shlex.quote(names[role])} is a {c.spec.kind}" for role, c in wrong.items())
    if len(wrong) == 2:
        raise UsageError(f"{said}: swap --target and --assistant")
    role, checkpoint = next(iter(wrong.items()))
    raise UsageError(f"{said}: give it as --{checkpoint.spec.role}")

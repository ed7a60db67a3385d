"""What a converted output IS, as one sha256: the ledger's proof is tied to it (docs/COMPATIBILITY.md).

The digest covers what a consumer reads: config.json, the safetensors index (when there is one) and every tensor's
(name, dtype, shape, sha256 of its bytes), in name order. It leaves out what does not change what vLLM loads:
conversion.json and verification.json (paths, dates), READMEs, shard file names and tensor order within shards.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from converter.read.checkpoint import INDEX_NAME, read_checkpoint, read_json
from converter.read.sequential import MappedFile


def tensor_digests(path: Path) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """name -> (dtype, shape, sha256 of the bytes) for every tensor of the checkpoint at `path`.

    Raises:
        InputError: as read_checkpoint (not a checkpoint, bad headers).
    """
    checkpoint = read_checkpoint(path)
    found: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for shard in checkpoint.shards:
        reader = MappedFile(shard.file)
        try:
            for ref in sorted(shard.tensors, key=lambda t: t.offset):
                sha256 = hashlib.sha256()
                for block in reader.blocks(ref.offset, ref.nbytes):
                    sha256.update(block)
                found[ref.name] = (ref.dtype, tuple(ref.shape), sha256.hexdigest())
        finally:
            reader.close()
    return found


def _canonical_json(path: Path) -> bytes:
    return json.dumps(read_json(path), sort_keys=True, separators=(",", ":")).encode("utf-8")


def checkpoint_digest(path: str | Path) -> str:
    """sha256 over config.json, the index's weight map and every tensor's (name, dtype, shape, sha256 of bytes).

    JSON is hashed in a canonical form (sorted keys), so re-indenting a file does not change the digest.

    Raises:
        InputError: as read_checkpoint.
    """
    root = Path(path)
    sha256 = hashlib.sha256()
    sha256.update(b"config.json\0" + _canonical_json(root / "config.json") + b"\0")
    if (root / INDEX_NAME).is_file():
        weight_map = read_json(root / INDEX_NAME).get("weight_map", {})
        sha256.update(b"index\0" + json.dumps(sorted(weight_map)).encode("utf-8") + b"\0")
    for name, (dtype, shape, digest) in sorted(tensor_digests(root).items()):
        sha256.update(f"{name}\0{dtype}\0{list(shape)}\0{digest}\0".encode("utf-8"))
    return sha256.hexdigest()


def pair_digest(target: str | Path, assistant: str | Path) -> str:
    """One digest for a target and its assistant (each checkpoint_digest, by role)."""
    sha256 = hashlib.sha256()
    for role, path in (("target", target), ("assistant", assistant)):
        sha256.update(f"{role}\0{checkpoint_digest(path)}\0".encode("utf-8"))
    return sha256.hexdigest()

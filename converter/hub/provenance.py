"""What an upload says about where a conversion came from, without any path of this machine (pure, no I/O).

conversion.json keeps the local source path on disk (`convert` names it when refusing a re-conversion, `inspect`
shows it). What goes to the Hub is a public copy: a Hub source as repo id + commit, a local one by its directory
name only, and every string that still holds a path of this machine (the source, DST, the home directory)
rewritten to the last component of that path.

The card's `base_model`: --base-model; else the Hub repo recorded at convert time; else inferred from the local
source: a Hugging Face cache snapshot path (`.../models--ORG--NAME/snapshots/SHA`, huggingface_hub's cache layout,
file_download.py `repo_folder_name`) gives ORG/NAME at commit SHA, and a repo-id-shaped `_name_or_path` in the
source config (what `save_pretrained` of a model loaded from the Hub records) gives that repo.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

_SNAPSHOT = re.compile(r"(?:^|/)models--(?P<owner>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<sha>[0-9a-f]{40})(?:/|$)")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
FROM_SNAPSHOT = "its Hugging Face cache snapshot path"


@dataclass(frozen=True)
class BaseModel:
    repo_id: str
    revision: str | None  # the commit, when known
    how: str  # where it came from, for the upload's summary line


def infer_base_model(manifest: Mapping[str, Any], *, override: str | None = None) -> BaseModel | None:
    """The card's base model (module docstring for the order); None when nothing says which repo it was."""
    source = manifest.get("source") or {}
    if override:
        same = source.get("repo_id") == override
        return BaseModel(override, source.get("revision") if same else None, "--base-model")
    if source.get("repo_id"):
        return BaseModel(str(source["repo_id"]), source.get("revision"), "the Hub source recorded by convert")
    match = _SNAPSHOT.search(str(source.get("path") or ""))
    if match:
        return BaseModel(f"{match['owner']}/{match['name']}", match["sha"], FROM_SNAPSHOT)
    name_or_path = (source.get("config") or {}).get("_name_or_path")
    if isinstance(name_or_path, str) and _REPO_ID.fullmatch(name_or_path):
        return BaseModel(name_or_path, None, "`_name_or_path` in its config")
    return None


def _last_component(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1] or path


def scrub_paths(document: Any, private: Iterable[str]) -> Any:
    """A copy of a JSON document with each private path (longest first) replaced by its last component."""
    roots = sorted({p.rstrip("/") for p in private if p and p.rstrip("/")}, key=len, reverse=True)

    def scrub(value: Any) -> Any:
        if isinstance(value, str):
            for root in roots:
                value = value.replace(root, _last_component(root))
            return value
        if isinstance(value, list):
            return [scrub(v) for v in value]
        if isinstance(value, dict):
            return {scrub(k): scrub(v) for k, v in value.items()}
        return value
    return scrub(document)


def public_manifest(manifest: Mapping[str, Any], *, base: BaseModel | None, private: Iterable[str]) -> dict[str, Any]:
    """conversion.json as uploaded: `source.path` gone, `source.name` (directory name) or repo id + commit."""
    public = copy.deepcopy(dict(manifest))
    source = dict(public.get("source") or {})
    path = str(source.pop("path", "") or "")
    if base is not None and base.how == FROM_SNAPSHOT and not source.get("repo_id"):
        source = {"repo_id": base.repo_id, "revision": base.revision, **source}
    if path and not source.get("repo_id"):
        source = {"name": _last_component(path), **source}
    public["source"] = source
    return scrub_paths(public, [path, *private])

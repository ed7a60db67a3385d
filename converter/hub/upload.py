"""Hugging Face Hub in and out: `owner/name[@rev]` sources pinned to one commit, and uploads of converted outputs.

Anchors: huggingface_hub `HfApi.resolve_revision` (hf_api.py) turns a branch/tag into a commit hash and falls back on
the cache's `refs/` when offline; `snapshot_download` (_snapshot_download.py) then fetches every file at that one
hash. safetensors' convert.py fetches the index at `--revision` and the shards at the default branch; we resolve the
revision once and pass the commit sha to every later call, so one source never mixes revisions (STYLE.md section 10).
Token, cache and offline mode are huggingface_hub's own: HF_TOKEN (or `hf auth login`), HF_HOME / HF_HUB_CACHE,
HF_HUB_OFFLINE=1.

This module does I/O and bookkeeping only, never tensor math. Every huggingface_hub failure becomes a one-line
HubError (exit 5) in `describe_hub_error`; a re-run resumes (downloads skip cached blobs, uploads skip committed files).
"""

from __future__ import annotations

import errno
import json
import os
import re
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Literal, Mapping

from . import __version__
from .errors import ConverterError, HubError, InputError, OutputError, UsageError, VerificationFailed
from .gemma4 import ROLE_ASSISTANT, ROLE_TARGET, read_spec
from .io.checkpoint import (INDEX_NAME, MANIFEST_NAME, NOT_COPIED_NAMES, NOT_COPIED_SUFFIXES, SINGLE_NAME,
                            VERIFICATION_NAME, Checkpoint, check_weight_map, read_checkpoint, read_json)
from .io.safetensors_header import ShardHeader, shard_from_entries
from .provenance import infer_base_model, public_manifest, scrub_paths

if TYPE_CHECKING:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

# huggingface_hub and httpx2 (~0.5 s to import) are imported where the Hub is used, so that `inspect`, `check-pair`,
# `--help` on a local path start in a fraction of a second (scripts/bench.py, startup rows).

Purpose = Literal["headers", "full"]

# What a conversion needs besides the weights; only top-level files (IGNORE_PATTERNS), never other formats.
SMALL_FILE_PATTERNS = (
    "config.json", "generation_config.json", INDEX_NAME, "tokenizer*", "special_tokens_map.json", "added_tokens.json",
    "vocab*", "merges.txt", "chat_template*", "processor_config.json", "preprocessor_config.json",
    "video_preprocessor_config.json", "README*", "LICENSE*", "NOTICE*", "USE_POLICY*", MANIFEST_NAME,
    VERIFICATION_NAME,
)
WEIGHT_PATTERNS = ("*.safetensors",)
IGNORE_PATTERNS = ("*/*",)  # fnmatch's `*` crosses `/`: keep sub-folders (other formats, originals) out

# owner/name[@revision]; the Hub's own validation (HFValidationError) has the last word on the exact rules
_REPO_REF = re.compile(r"(?P<repo_id>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[^\s@]+))?")
CARD_NAME = "README.md"
SOURCE_CARD_NAME = "README.source.md"  # the source's own README.md travels under this name beside our card


def make_api() -> HfApi:
    """The HfApi every verb uses unless one is injected (tests inject a fake through the click context)."""
    from huggingface_hub import HfApi

    return HfApi(library_name="gemma4-convert", library_version=__version__)


# ---------------------------------------------------------------------------------------------------------------------
# errors


def describe_hub_error(exc: BaseException, *, subject: str) -> ConverterError | None:
    """The one-line ConverterError for a huggingface_hub / network failure about `subject`; None if not one of ours.

    Order matters: GatedRepoError is a RepositoryNotFoundError, which is an HfHubHTTPError; IncompleteSnapshotError
    is a LocalEntryNotFoundError; OfflineModeIsEnabled is a ConnectionError.
    """
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        DisabledRepoError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        LocalTokenNotFoundError,
        NotASafetensorsRepoError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
        RevisionResolutionError,
        SafetensorsParsingError,
    )

    if isinstance(exc, GatedRepoError):
        return HubError(f"{subject}: gated repo; accept its terms on https://huggingface.co/{_repo_of(subject)} and "
                        f"use a token of that account (HF_TOKEN or `hf auth login`)")
    if isinstance(exc, RepositoryNotFoundError):
        return HubError(f"{subject}: no such local path, and no such Hub repo (or it is private and the token, "
                        f"HF_TOKEN, has no access to it)")
    if isinstance(exc, RevisionNotFoundError):
        return HubError(f"{subject}: no such revision (branch, tag or commit) in that repo")
    if isinstance(exc, DisabledRepoError):
        return HubError(f"{subject}: the repo is disabled on the Hub")
    if isinstance(exc, RemoteEntryNotFoundError):
        return HubError(f"{subject}: a file it needs is not in the repo ({_first_line(exc)})")
    if isinstance(exc, HfHubHTTPError):
        return HubError(_describe_status(exc, subject))
    if isinstance(exc, LocalTokenNotFoundError):
        return HubError(f"{subject}: no Hugging Face token; set HF_TOKEN or run `hf auth login`")
    if isinstance(exc, IncompleteSnapshotError):
        return HubError(f"{subject}: its cached snapshot is incomplete and the Hub was not reached "
                        f"({_offline_reason()}); rerun with network access to finish the download")
    if isinstance(exc, (RevisionResolutionError, LocalEntryNotFoundError)):
        return HubError(f"{subject}: not a local path, and not in the Hub cache ({constants.HF_HUB_CACHE}) while the "
                        f"Hub is not reachable ({_offline_reason()}); rerun with network access")
    if isinstance(exc, OfflineModeIsEnabled):
        return HubError(f"{subject}: HF_HUB_OFFLINE=1 but this needs the Hub; unset HF_HUB_OFFLINE")
    if isinstance(exc, (httpx2.TransportError, ConnectionError, TimeoutError)):
        return HubError(f"{subject}: cannot reach the Hub at {constants.ENDPOINT} ({type(exc).__name__}); "
                        f"check the network and rerun (completed transfers are kept)")
    if isinstance(exc, (NotASafetensorsRepoError, SafetensorsParsingError)):
        return InputError(f"{subject}: {_first_line(exc)}")
    if isinstance(exc, HFValidationError):
        return UsageError(f"{subject}: not a valid Hub repo id ({_first_line(exc)})")
    return None


def _describe_status(exc: HfHubHTTPError, subject: str) -> str:
    status = getattr(exc.response, "status_code", None)
    if status == 401:
        return f"{subject}: the Hub refused the token (401); set a valid HF_TOKEN or run `hf auth login`"
    if status == 403:
        return (f"{subject}: no permission (403); the token needs write access to this repo or namespace "
                f"(a fine-grained token must list it)")
    if status == 429:
        return f"{subject}: rate-limited by the Hub (429); wait a few minutes and rerun (it resumes)"
    if status is not None and status >= 500:
        return f"{subject}: the Hub failed ({status}); rerun later (it resumes)"
    return f"{subject}: Hub request failed ({status}): {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _offline_reason() -> str:
    from huggingface_hub import constants
    return "HF_HUB_OFFLINE=1" if constants.is_offline_mode() else "network down or Hub unreachable"


def _repo_of(subject: str) -> str:
    return subject.split(":", 1)[0].split("@", 1)[0]


def _hub_failures() -> tuple[type[BaseException], ...]:
    """What hub_errors turns into ConverterErrors (an except clause evaluates this only when something is raised)."""
    import httpx2
    from huggingface_hub.errors import (HfHubHTTPError, HFValidationError, LocalEntryNotFoundError,
                                        LocalTokenNotFoundError, NotASafetensorsRepoError, RevisionResolutionError,
                                        SafetensorsParsingError)

    return (HfHubHTTPError, LocalTokenNotFoundError, RevisionResolutionError, LocalEntryNotFoundError,
            httpx2.TransportError, ConnectionError, TimeoutError, NotASafetensorsRepoError,
            SafetensorsParsingError, HFValidationError)


@contextmanager
def hub_errors(subject: str) -> Iterator[None]:
    """Turns huggingface_hub and network exceptions raised inside into one-line ConverterErrors about `subject`."""
    try:
        yield
    except _hub_failures() as exc:
        error = describe_hub_error(exc, subject=subject)
        if error is None:  # pragma: no cover - every class in _HUB_FAILURES is described
            raise
        raise error from exc


def _xet_error(name: str) -> type[BaseException] | tuple[()]:
    """hf_xet's exception class `name`, imported when an except clause needs it (hf_xet is optional for
    huggingface_hub; without it no transfer can raise these, and the empty tuple matches nothing)."""
    try:
        import hf_xet
    except ImportError:  # pragma: no cover - installed with huggingface_hub on every platform we support
        return ()
    return getattr(hf_xet, name)


@contextmanager
def transfer_errors(subject: str, what: str, *, cache: Path | None = None) -> Iterator[None]:
    """Like hub_errors around ONE transfer call (a file download, a folder upload), naming `what` was moved.

    hf_xet raises XetAuthenticationError (a PermissionError), XetObjectNotFoundError (a FileNotFoundError) and,
    for everything else (network, CAS, reconstruction), a plain RuntimeError; the LFS path wraps its HTTP errors
    in a RuntimeError too (`raise RuntimeError(...) from exc`, _commit_api.py). Inside this one call a
    RuntimeError can only come from the transfer, so it is described by type and cause, never by its text.
    `cache`: where a download writes; no space or no permission there is an output problem (exit 4).
    """
    where = f"{subject}: {what}"
    try:
        yield
    except _xet_error("XetAuthenticationError") as exc:
        raise HubError(f"{where}: hf_xet storage refused the credentials ({_first_line(exc)}); the token "
                       f"(HF_TOKEN) needs access to this repo; rerun to resume") from exc
    except _xet_error("XetObjectNotFoundError") as exc:
        raise HubError(f"{where}: hf_xet storage has no such object ({_first_line(exc)}); rerun later "
                       f"(it resumes)") from exc
    except _hub_failures() as exc:
        error = describe_hub_error(exc, subject=where)
        if error is None:  # pragma: no cover - every class in _HUB_FAILURES is described
            raise
        raise error from exc
    except RuntimeError as exc:
        cause = exc.__cause__
        described = describe_hub_error(cause, subject=where) if cause is not None else None
        if described is not None:
            raise described from exc
        raise HubError(f"{where}: the transfer failed in {'hf_xet' if cause is None else type(cause).__name__} "
                       f"({type(exc).__name__}: {_first_line(exc)}); rerun to resume (finished files and "
                       f"chunks are kept)") from exc
    except OSError as exc:
        if cache is not None and exc.errno in (errno.ENOSPC, errno.EACCES, errno.EROFS):
            raise OutputError(f"{where}: cannot write the Hub cache {cache} ({exc.strerror}); free space or set "
                              f"HF_HUB_CACHE to another disk, then rerun (it resumes)") from exc
        raise


# ---------------------------------------------------------------------------------------------------------------------
# sources


@dataclass(frozen=True)
class RepoRef:
    repo_id: str
    revision: str | None  # None: the default branch

    @property
    def text(self) -> str:
        return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id


@dataclass(frozen=True)
class LocalSource:
    """A source on this machine: a local directory, or a Hub snapshot folder pinned to one commit."""

    path: Path
    repo_id: str | None = None
    revision: str | None = None  # what was asked for ("main" when nothing was)
    revision_sha: str | None = None  # the one commit every file was fetched at
    remote_shards: tuple[ShardHeader, ...] | None = None  # headers read over HTTP (weights not on this machine)
    remote_indexed: bool = False

    @property
    def label(self) -> str:
        return f"{self.repo_id}@{self.revision_sha[:12]}" if self.repo_id and self.revision_sha else str(self.path)

    def origin(self) -> dict[str, str]:
        """What conversion.json records under `source` besides the local path: empty for a local directory."""
        if self.repo_id is None or self.revision_sha is None:
            return {}
        from huggingface_hub import constants

        return {"repo_id": self.repo_id, "revision": self.revision_sha,
                "requested_revision": self.revision or constants.DEFAULT_REVISION}


def parse_repo_ref(text: str) -> RepoRef | None:
    """`owner/name[@rev]` that is not an existing local path -> RepoRef; anything else -> None (a local path)."""
    if Path(text).expanduser().exists() or ".." in text:
        return None
    match = _REPO_REF.fullmatch(text)
    if match is None:
        return None
    return RepoRef(repo_id=match["repo_id"], revision=match["revision"])


def resolve_source(text: str, *, purpose: Purpose, api: Any = None) -> LocalSource:
    """Makes SRC usable by read_checkpoint: a local path stays as is, a Hub repo id is fetched at one commit.

    Args:
        text: a local path, or `owner/name[@revision]` (branch, tag or commit) that is not a local path.
        purpose: "full" fetches config, weights and side files; "headers" fetches the small files only and reads
            shard headers with HTTP range requests (`get_safetensors_metadata`), never weights.
        api: an HfApi (default make_api()); tests pass a fake.

    Returns:
        LocalSource; open_checkpoint() turns it into a Checkpoint.

    Raises:
        HubError: repo, revision or token problems, network down, or offline with the files not cached.
        InputError: the repo is not a safetensors checkpoint.
    """
    ref = parse_repo_ref(text)
    if ref is None:
        return LocalSource(path=Path(text).expanduser())
    from huggingface_hub import constants

    api = api if api is not None else make_api()
    with hub_errors(ref.text):
        sha = _resolve_sha(api, ref)
        folder = Path(api.snapshot_download(ref.repo_id, revision=sha, allow_patterns=list(SMALL_FILE_PATTERNS),
                                            ignore_patterns=list(IGNORE_PATTERNS),
                                            local_files_only=constants.is_offline_mode()))
    if purpose == "full":
        _download_weights(api, ref, sha, folder)
    source = LocalSource(path=folder, repo_id=ref.repo_id, revision=ref.revision or constants.DEFAULT_REVISION,
                         revision_sha=sha)
    missing = _missing_files(folder)
    if not missing:
        return source
    if purpose == "full" or constants.is_offline_mode():
        _raise_incomplete(source, missing, weights=purpose == "full")
    with hub_errors(ref.text):
        shards, indexed = _remote_shards(api, ref.repo_id, sha, folder)
    return LocalSource(path=folder, repo_id=ref.repo_id, revision=source.revision, revision_sha=sha,
                       remote_shards=shards, remote_indexed=indexed)


def _download_weights(api: Any, ref: RepoRef, sha: str, folder: Path) -> None:
    """The weights, one file per call so that a failure names its file: the shards the index names, else
    model.safetensors; a repo with neither gets every top-level *.safetensors in one snapshot call."""
    from huggingface_hub import constants
    from huggingface_hub.errors import RemoteEntryNotFoundError

    offline = constants.is_offline_mode()
    cache = Path(constants.HF_HUB_CACHE)
    for name in _indexed_shards(folder):
        if (folder / name).is_file() or offline:
            continue  # cached; or offline, where resolve_source names the first missing file and why
        try:
            with transfer_errors(ref.text, name, cache=cache):
                api.hf_hub_download(ref.repo_id, name, revision=sha)
        except HubError as exc:
            if name != SINGLE_NAME or not isinstance(exc.__cause__, RemoteEntryNotFoundError):
                raise
            with transfer_errors(ref.text, "*.safetensors", cache=cache):  # unindexed, not model.safetensors
                api.snapshot_download(ref.repo_id, revision=sha, allow_patterns=list(WEIGHT_PATTERNS),
                                      ignore_patterns=list(IGNORE_PATTERNS), local_files_only=offline)


def _indexed_shards(folder: Path) -> list[str]:
    """Plain shard names from the snapshot's index ([model.safetensors] without one; [] for an index
    read_checkpoint will reject, or no config: it reports those as a bad checkpoint)."""
    if not (folder / "config.json").is_file():
        return []
    index_path = folder / INDEX_NAME
    if not index_path.is_file():
        return [SINGLE_NAME]
    try:
        names = sorted(set(json.loads(index_path.read_text(encoding="utf-8")).get("weight_map", {}).values()))
    except (ValueError, AttributeError, TypeError):
        return []
    return [name for name in names if isinstance(name, str) and Path(name).name == name]


def _resolve_sha(api: Any, ref: RepoRef) -> str:
    from huggingface_hub import constants
    # local_files_only when offline: the same cache lookup without a "could not reach the Hub" warning per source
    resolved = api.resolve_revision(ref.repo_id, revision=ref.revision, local_files_only=constants.is_offline_mode())
    return str(resolved.resolved)  # str(ResolvedRevision) is the name asked for, not the sha


def _missing_files(folder: Path) -> list[str]:
    """Files the snapshot should hold for read_checkpoint but does not (config first, then weights)."""
    if not (folder / "config.json").is_file():
        return ["config.json"]
    index_path = folder / INDEX_NAME
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8")).get("weight_map", {})
            names = sorted(set(weight_map.values()))
        except (ValueError, AttributeError, TypeError):
            return []  # read_checkpoint names the broken index itself
        return [name for name in names if Path(name).name == name and not (folder / name).is_file()]
    return [] if (folder / SINGLE_NAME).is_file() or any(folder.glob("*.safetensors")) else [SINGLE_NAME]


def _raise_incomplete(source: LocalSource, missing: list[str], *, weights: bool) -> None:
    from huggingface_hub import constants
    more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
    where = f"{source.label}: {missing[0]}{more} not in {source.path}"
    if constants.is_offline_mode():
        raise HubError(f"{where}; HF_HUB_OFFLINE=1 allows only cached files: "
                       f"rerun without HF_HUB_OFFLINE to {'download' if weights else 'read'} it")
    if missing == ["config.json"] or missing == [SINGLE_NAME]:
        return  # online and the repo itself lacks it: read_checkpoint reports a bad input checkpoint (exit 3)
    raise HubError(f"{where}: the download did not complete (network down?); rerun to resume")


def _remote_shards(api: Any, repo_id: str, sha: str, folder: Path) -> tuple[tuple[ShardHeader, ...], bool]:
    """Shard headers over HTTP range requests plus file sizes from the tree: no weight byte is downloaded."""
    metadata = api.get_safetensors_metadata(repo_id, revision=sha)
    names = sorted(metadata.files_metadata)
    sizes = {info.path: info.size for info in api.get_paths_info(repo_id, names, revision=sha)}
    shards = tuple(_shard_from_metadata(folder / name, metadata.files_metadata[name], sizes.get(name))
                   for name in names)
    check_weight_map(folder, shards, dict(metadata.weight_map))
    return shards, bool(metadata.sharded)


def _shard_from_metadata(path: Path, metadata: Any, size: int | None) -> ShardHeader:
    entries = {name: {"dtype": info.dtype, "shape": list(info.shape), "data_offsets": list(info.data_offsets)}
               for name, info in metadata.tensors.items()}
    end = max((int(entry["data_offsets"][1]) for entry in entries.values()), default=0)
    if size is None or size - end < 8:
        raise InputError(f"{path.name}: the Hub reports {size} bytes but its tensors end at data offset {end}")
    # safetensors files end exactly where the last tensor's bytes end
    return shard_from_entries(path, entries, data_start=size - end, size=size, metadata=dict(metadata.metadata or {}))


def open_checkpoint(source: LocalSource) -> Checkpoint:
    """The Checkpoint of a resolved source: read_checkpoint for local files, else config + remote headers.

    Raises:
        InputError: as read_checkpoint.
    """
    if source.remote_shards is None:
        return read_checkpoint(source.path)
    config_path = source.path / "config.json"
    config = read_json(config_path)
    if not isinstance(config, dict):
        raise InputError(f"{config_path}: expected a JSON object")
    spec = read_spec(config, source=f"{source.label}/config.json")
    manifest_path = source.path / MANIFEST_NAME
    side_files = tuple(sorted(p.name for p in source.path.iterdir()
                              if p.is_file() and not p.name.startswith(".") and p.name not in NOT_COPIED_NAMES
                              and not p.name.endswith(NOT_COPIED_SUFFIXES)))
    return Checkpoint(path=source.path, config=config, spec=spec, shards=source.remote_shards,
                      indexed=source.remote_indexed, side_files=side_files,
                      manifest=read_json(manifest_path) if manifest_path.exists() else None)


# ---------------------------------------------------------------------------------------------------------------------
# upload


@dataclass(frozen=True)
class UploadRequest:
    """What `upload` was asked to do (repo ids by role: "single" for a one-checkpoint DST)."""

    dst: Path
    repos: Mapping[str, str]
    private: bool = False
    revision: str | None = None  # branch to commit to (created from main if missing); None: main
    create_pr: bool = False
    commit_message: str | None = None
    verify_required: bool = True
    base_model: str | None = None  # overrides the source repo recorded in conversion.json


@dataclass(frozen=True)
class UploadFile:
    path_in_repo: str
    size: int
    local: Path | None  # None for the generated card (its text is on the item)
    content: bytes | None = None  # what is sent instead of `local`: conversion.json / verification.json without paths


@dataclass(frozen=True)
class UploadItem:
    role: str  # "single", "target" or "assistant": where it sits in DST
    kind: str  # the checkpoint's own role from conversion.json: "target" or "assistant"
    layout: str
    directory: Path
    repo_id: str
    files: tuple[UploadFile, ...]
    card: str

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class UploadPlan:
    request: UploadRequest
    items: tuple[UploadItem, ...]
    unknown_base: tuple[Path, ...] = ()  # checkpoints whose card says base model "unknown"


@dataclass(frozen=True)
class UploadResult:
    repo_id: str
    commit_url: str | None
    pr_url: str | None


def checkpoint_dirs(dst: Path) -> dict[str, Path]:
    """The converted checkpoints under DST: {"single": DST} or {"target": DST/target, "assistant": ...}.

    Raises:
        InputError: DST holds no conversion.json at its top or in target/ or assistant/.
    """
    if (dst / MANIFEST_NAME).is_file():
        return {"single": dst}
    found = {role: dst / role for role in (ROLE_TARGET, ROLE_ASSISTANT) if (dst / role / MANIFEST_NAME).is_file()}
    if not found:
        raise InputError(f"{dst}: no {MANIFEST_NAME} in it or in {ROLE_TARGET}/ or {ROLE_ASSISTANT}/ "
                         f"(is it a gemma4-convert output?)")
    return found


def plan_upload(request: UploadRequest) -> UploadPlan:
    """Reads DST's conversion.json / verification.json, checks them, renders the cards; contacts nothing.

    Raises:
        UsageError: a repo id missing for a checkpoint, or given for one that is not there; no verification.json.
        VerificationFailed: verification.json says the output failed.
        InputError: unreadable manifests, files the manifest lists that are missing.
    """
    from huggingface_hub import constants
    dirs = checkpoint_dirs(request.dst)
    unknown = sorted(set(request.repos) - set(dirs))
    if unknown or set(dirs) - set(request.repos):
        raise UsageError(_repo_usage(request, dirs))
    if request.create_pr and request.revision not in (None, constants.DEFAULT_REVISION):
        raise UsageError("--create-pr opens a pull request against main; drop --revision (or use --revision "
                         "refs/pr/N without --create-pr to add to an existing PR)")
    manifests = {role: _read_manifest(directory) for role, directory in dirs.items()}
    serve_repos = _serve_repos(request.repos, manifests)
    items, unknown = [], []
    for role, directory in dirs.items():
        manifest = manifests[role]
        from .card import render_card  # yaml and the layouts: only an upload needs them

        base = infer_base_model(manifest, override=request.base_model)
        if base is None:
            unknown.append(directory)
        private = _private_paths(request.dst, directory, manifest)
        public = public_manifest(manifest, base=base, private=private)
        verification = _read_verification(request, directory)
        public_verification = scrub_paths(verification, private) if verification is not None else None
        card = render_card(manifest=public, verification=public_verification, repo_id=request.repos[role],
                           target_repo=serve_repos.get(ROLE_TARGET), assistant_repo=serve_repos.get(ROLE_ASSISTANT),
                           base_model=base.repo_id if base else None,
                           source_front_matter=_front_matter(directory / CARD_NAME),
                           source_card=(directory / CARD_NAME).is_file())
        rewritten = {MANIFEST_NAME: public}
        if (directory / VERIFICATION_NAME).is_file():
            rewritten[VERIFICATION_NAME] = scrub_paths(read_json(directory / VERIFICATION_NAME), private)
        items.append(UploadItem(role=role, kind=str(manifest.get("role")), layout=str(manifest.get("layout")),
                                directory=directory, repo_id=request.repos[role],
                                files=_upload_files(directory, card, rewritten), card=card))
    return UploadPlan(request=request, items=tuple(items), unknown_base=tuple(unknown))


def _private_paths(dst: Path, directory: Path, manifest: Mapping[str, Any]) -> list[str]:
    """Paths of this machine that must not reach the Hub (provenance.scrub_paths rewrites them)."""
    paths = {str((manifest.get("source") or {}).get("path") or ""), os.path.expanduser("~")}
    for path in (dst, directory):
        paths |= {str(path.absolute()), str(path.resolve())}
    return sorted(p for p in paths if p not in ("", "/"))


def _repo_usage(request: UploadRequest, dirs: dict[str, Path]) -> str:
    if "single" in dirs:
        return f"{request.dst} holds one checkpoint: give REPO_ID (not --target-repo/--assistant-repo)"
    wanted = " and ".join(f"--{role}-repo" for role in dirs)
    return f"{request.dst} holds {', '.join(f'{r}/' for r in dirs)}: give {wanted} (not REPO_ID)"


def _serve_repos(repos: Mapping[str, str], manifests: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    if "single" in repos:
        return {manifests["single"].get("role", ROLE_TARGET): repos["single"]}
    return dict(repos)


def _read_manifest(directory: Path) -> dict[str, Any]:
    manifest = read_json(directory / MANIFEST_NAME)
    if not isinstance(manifest, dict) or manifest.get("tool") != "gemma4-convert":
        raise InputError(f"{directory / MANIFEST_NAME}: not a gemma4-convert manifest")
    for name in manifest.get("output", {}).get("files", {}):
        if not (directory / name).is_file():
            raise InputError(f"{directory}: {name} is listed in {MANIFEST_NAME} but missing")
    return manifest


def _read_verification(request: UploadRequest, directory: Path) -> dict[str, Any] | None:
    """verification.json beside the checkpoint, else at DST's top (a pair verified as a whole)."""
    path = next((p for p in (directory / VERIFICATION_NAME, request.dst / VERIFICATION_NAME) if p.is_file()), None)
    if path is None:
        if request.verify_required:
            raise UsageError(f"{directory}: no {VERIFICATION_NAME}; run `gemma4-convert verify` first "
                             f"(or pass --no-verify to upload unverified)")
        return None
    verification = read_json(path)
    if not isinstance(verification, dict) or not isinstance(verification.get("passed"), bool):
        raise InputError(f"{path}: expected a JSON object with a boolean `passed`")
    if request.verify_required and not verification["passed"]:
        raise VerificationFailed(f"{path}: verification FAILED (first failure: "
                                 f"{verification.get('first_failure') or 'see the file'}); refusing to upload "
                                 f"(--no-verify overrides)")
    return verification


def _front_matter(readme: Path) -> dict[str, Any] | None:
    """The YAML front matter of the source's README.md (license, language...), if it has one."""
    import yaml  # a huggingface_hub dependency

    if not readme.is_file():
        return None
    text = readme.read_text(encoding="utf-8", errors="replace")
    match = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", text, flags=re.S)
    if match is None:
        return None
    try:
        data = yaml.safe_load(match.group(1))
    except yaml.YAMLError:
        return None
    return data if isinstance(data, dict) else None


def _upload_files(directory: Path, card: str, rewritten: Mapping[str, Any]) -> tuple[UploadFile, ...]:
    """The card, then every top-level file; `rewritten` (name -> JSON document) replaces a file's content."""
    files = [UploadFile(path_in_repo=CARD_NAME, size=len(card.encode("utf-8")), local=None)]
    for path in sorted(directory.iterdir()):
        if not path.is_file() or path.name.startswith("."):
            continue
        name = SOURCE_CARD_NAME if path.name == CARD_NAME else path.name
        if path.name in rewritten:
            content = (json.dumps(rewritten[path.name], indent=2) + "\n").encode("utf-8")
            files.append(UploadFile(path_in_repo=name, size=len(content), local=path, content=content))
        else:
            files.append(UploadFile(path_in_repo=name, size=path.stat().st_size, local=path))
    return tuple(files)


@contextmanager
def staged_folder(item: UploadItem) -> Iterator[Path]:
    """A temporary folder of symlinks to the item's files, plus the card and the path-free JSON files: what
    upload_folder sends; DST untouched."""
    with tempfile.TemporaryDirectory(prefix="gemma4-upload-") as tmp:
        root = Path(tmp)
        for f in item.files:
            if f.content is not None:
                (root / f.path_in_repo).write_bytes(f.content)
            elif f.local is None:
                (root / f.path_in_repo).write_text(item.card, encoding="utf-8")
            else:
                os.symlink(f.local.resolve(), root / f.path_in_repo)
        yield root


def execute_upload(plan: UploadPlan, *, api: Any) -> list[UploadResult]:
    """Creates each repo if needed (and the branch), then uploads each item with upload_folder.

    upload_folder, not upload_large_folder: since huggingface_hub 1.x upload_folder is the streamed multi-commit
    path (hashed while chunked, split into several commits when large, resumed by re-running: committed files are
    skipped, uploaded chunks deduplicated), and it takes commit_message, revision and create_pr, which
    upload_large_folder never did.

    Raises:
        HubError: token, permission, rate limit, network (one line; rerun to resume).
    """
    from huggingface_hub import constants
    request = plan.request
    with hub_errors(plan.items[0].repo_id):  # the token check: fail before creating anything
        api.whoami()
    results = []
    for item in plan.items:
        with hub_errors(item.repo_id):
            api.create_repo(item.repo_id, repo_type="model", private=request.private, exist_ok=True)
            if request.revision and not request.create_pr and request.revision != constants.DEFAULT_REVISION \
                    and not request.revision.startswith("refs/pr/"):
                api.create_branch(item.repo_id, branch=request.revision, repo_type="model", exist_ok=True)
            with staged_folder(item) as folder, \
                    transfer_errors(item.repo_id, f"uploading {item.directory} ({len(item.files)} files)"):
                info = api.upload_folder(repo_id=item.repo_id, folder_path=folder, repo_type="model",
                                         revision=request.revision, create_pr=request.create_pr,
                                         commit_message=request.commit_message or _commit_message(item))
        results.append(UploadResult(repo_id=item.repo_id, commit_url=getattr(info, "commit_url", None),
                                    pr_url=getattr(info, "pr_url", None)))
    return results


def _commit_message(item: UploadItem) -> str:
    return f"Upload {item.kind} converted by gemma4-convert {__version__} (layout {item.layout})"

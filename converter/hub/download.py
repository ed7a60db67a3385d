"""Hugging Face Hub sources: `owner/name[@rev]` pinned to one commit, downloaded (or headers only) into the cache.

Anchors: huggingface_hub `HfApi.resolve_revision` (hf_api.py) turns a branch/tag into a commit hash and falls back on
the cache's `refs/` when offline; `snapshot_download` (_snapshot_download.py) then fetches every file at that one
hash. safetensors' convert.py fetches the index at `--revision` and the shards at the default branch; we resolve the
revision once and pass the commit sha to every later call, so one source never mixes revisions.
Token, cache and offline mode are huggingface_hub's own: HF_TOKEN (or `hf auth login`), HF_HOME / HF_HUB_CACHE,
HF_HUB_OFFLINE=1.

This module does I/O and bookkeeping only, never tensor math; a re-run resumes (downloads skip cached blobs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .. import __version__
from ..errors import HubError, InputError
from ..gemma4 import read_spec, Role
from ..read.checkpoint import (INDEX_NAME, MANIFEST_NAME, NOT_COPIED_NAMES, NOT_COPIED_SUFFIXES, SINGLE_NAME,
                               VERIFICATION_NAME, Checkpoint, check_weight_map, read_checkpoint, read_json)
from ..read.safetensors_header import ShardHeader, read_header, shard_from_entries
from .failures import hub_errors, hub_http_client, transfer_errors

if TYPE_CHECKING:
    from huggingface_hub import HfApi

# huggingface_hub and its HTTP client (httpx on 1.x, httpx2 on 2.x; ~0.5 s to import) are imported where the Hub is
# used, so that `inspect`, `check-pair`, `--help` on a local path start in a fraction of a second (scripts/bench.py).

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


HUB_PROBE_TIMEOUT_S = 3.0  # one request: without it every call retries its own 10 s timeouts (~48 s measured)
OFFLINE_NOTE = ("note: the Hub cannot be reached; using the Hugging Face cache alone (HF_HUB_OFFLINE=1 skips this "
                "probe)")
_probe: dict[str, str | None] = {}  # endpoint -> why it did not answer (None: it answered)


def hub_unreachable(api: Any) -> str | None:
    """Why the Hub did not answer one short request, or None when it did (or HF_HUB_OFFLINE=1, or `api` is not
    huggingface_hub's client: a client tests inject is its own network). Asked once per process.

    Any HTTP answer, an error status included, means the Hub is there; only a connection that fails or times out
    sends every later call to the cache alone (as HF_HUB_OFFLINE=1 does, without its setting).
    """
    from huggingface_hub import HfApi, constants
    from huggingface_hub.utils import get_session

    if api is None:  # the reason already found, for a message
        return next((why for why in _probe.values() if why), None)
    if constants.is_offline_mode() or not isinstance(api, HfApi):
        return None
    endpoint = api.endpoint or constants.ENDPOINT
    if endpoint not in _probe:
        httpx = hub_http_client()
        try:
            get_session().head(endpoint, timeout=HUB_PROBE_TIMEOUT_S)
            _probe[endpoint] = None
        except (httpx.TransportError, OSError) as exc:  # connect, DNS, timeout, proxy: the network's failures
            _probe[endpoint] = type(exc).__name__
    return _probe[endpoint]


def offline(api: Any) -> bool:
    """Whether huggingface_hub must answer from its cache alone: HF_HUB_OFFLINE=1, or the Hub did not answer."""
    from huggingface_hub import constants

    return constants.is_offline_mode() or hub_unreachable(api) is not None


def make_api() -> HfApi:
    """The HfApi every verb uses unless one is injected (tests inject a fake through the click context)."""
    from huggingface_hub import HfApi

    return HfApi(library_name="gemma4-convert", library_version=__version__)



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
    hub_unreachable: bool = False  # read from the cache alone: the Hub did not answer the probe (hub_unreachable)

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
        return LocalSource(path=Path(text).expanduser().resolve())  # child processes run elsewhere (read/sequential)
    from huggingface_hub import constants

    api = api if api is not None else make_api()
    try:
        with hub_errors(ref.text):
            sha = _resolve_sha(api, ref)
            folder = Path(api.snapshot_download(ref.repo_id, revision=sha, allow_patterns=list(SMALL_FILE_PATTERNS),
                                                ignore_patterns=list(IGNORE_PATTERNS), local_files_only=offline(api)))
    except HubError as error:
        resembles = _near_miss(ref, api) if _not_found(error.__cause__) else None
        if resembles is None:
            raise
        raise HubError(f"{error}; did you mean {resembles}?") from error.__cause__
    if purpose == "full":
        _download_weights(api, ref, sha, folder)
    source = LocalSource(path=folder, repo_id=ref.repo_id, revision=ref.revision or constants.DEFAULT_REVISION,
                         revision_sha=sha, hub_unreachable=hub_unreachable(api) is not None)
    missing = _missing_files(folder)
    if not missing:
        return source
    if purpose == "full" or offline(api):
        _raise_incomplete(source, missing, weights=purpose == "full")
    with hub_errors(ref.text):
        shards, indexed = _remote_shards(api, ref.repo_id, sha, folder)
    return LocalSource(path=folder, repo_id=ref.repo_id, revision=source.revision, revision_sha=sha,
                       remote_shards=shards, remote_indexed=indexed)


def _not_found(exc: BaseException | None) -> bool:
    """The repo id named nothing (no such repo, or none cached while offline): a typo is the likely cause."""
    from huggingface_hub.errors import (GatedRepoError, IncompleteSnapshotError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionResolutionError)

    if isinstance(exc, (GatedRepoError, IncompleteSnapshotError)):
        return False
    return isinstance(exc, (RepositoryNotFoundError, RevisionResolutionError, LocalEntryNotFoundError))


NEAR_MISS_CUTOFF = 0.85  # difflib ratios of google/gemma-4-31B-it to: ...-31b-it 0.95, ...-26B-A4B-it 0.83, ...-it-assistant 0.81


def _near_miss(ref: RepoRef, api: Any) -> str | None:
    """The cached (or, online, published) repo id `ref` most resembles: the same id in other case first, then the
    closest by difflib; None when nothing is close. Never raises: a failed search only loses the hint."""
    import difflib

    from huggingface_hub import constants

    cached = {p.name.removeprefix("models--").replace("--", "/", 1): "cached"
              for p in _listed(Path(constants.HF_HUB_CACHE)) if p.name.startswith("models--")}
    published: dict[str, str] = {}
    if not offline(api):
        owner, _, name = ref.repo_id.partition("/")
        try:
            published = {m.id: "on the Hub" for m in api.list_models(author=owner, search=name[:8], limit=50)}
        except Exception:  # noqa: BLE001 - a hint, not a requirement: the not-found error stands as it is
            published = {}
    known = {**published, **cached}
    known.pop(ref.repo_id, None)
    same = [repo for repo in known if repo.lower() == ref.repo_id.lower()]
    close = same or difflib.get_close_matches(ref.repo_id, list(known), n=1, cutoff=NEAR_MISS_CUTOFF)
    if not close:
        return None
    at = f"@{ref.revision}" if ref.revision else ""
    return f"{close[0]}{at} ({known[close[0]]})"


def _listed(folder: Path) -> list[Path]:
    try:
        return sorted(folder.iterdir())
    except OSError:
        return []


def _download_weights(api: Any, ref: RepoRef, sha: str, folder: Path) -> None:
    """The weights, one file per call so that a failure names its file: the shards the index names, else
    model.safetensors; a repo with neither gets every top-level *.safetensors in one snapshot call."""
    from huggingface_hub import constants
    from huggingface_hub.errors import RemoteEntryNotFoundError

    cached_only = offline(api)
    cache = Path(constants.HF_HUB_CACHE)
    for name in _indexed_shards(folder):
        if (folder / name).is_file() or cached_only:
            continue  # cached; or offline, where resolve_source names the first missing file and why
        try:
            with transfer_errors(ref.text, name, cache=cache):
                api.hf_hub_download(ref.repo_id, name, revision=sha)
        except HubError as exc:
            if name != SINGLE_NAME or not isinstance(exc.__cause__, RemoteEntryNotFoundError):
                raise
            with transfer_errors(ref.text, "*.safetensors", cache=cache):  # unindexed, not model.safetensors
                api.snapshot_download(ref.repo_id, revision=sha, allow_patterns=list(WEIGHT_PATTERNS),
                                      ignore_patterns=list(IGNORE_PATTERNS), local_files_only=cached_only)


def fetch_weights(source: LocalSource, *, api: Any = None) -> None:
    """Downloads the weights of a source opened for its headers (resolve_source purpose "headers"), at the one
    commit it is pinned to, and checks that each file's safetensors header is the one read over HTTP: a plan made
    from the headers is then the plan of these files, and one conversion never mixes revisions.

    Raises:
        HubError: the download failed or did not complete (offline: a file not cached).
        InputError: a downloaded file's header is not the one the plan was made from.
    """
    if source.remote_shards is None:
        return  # every file is on this machine already
    from huggingface_hub import constants

    api = api if api is not None else make_api()
    asked = None if source.revision == constants.DEFAULT_REVISION else source.revision  # messages name what was asked
    _download_weights(api, RepoRef(repo_id=str(source.repo_id), revision=asked), str(source.revision_sha),
                      source.path)
    missing = _missing_files(source.path)
    if missing:
        _raise_incomplete(source, missing, weights=True)
    for remote in source.remote_shards:
        local = read_header(remote.file)
        if (local.data_start, local.size, local.tensors) != (remote.data_start, remote.size, remote.tensors):
            raise InputError(f"{source.label}: {remote.file.name} as downloaded differs from the header read over "
                             "HTTP at the same commit; remove it from the Hugging Face cache and rerun")


def _indexed_shards(folder: Path) -> list[str]:
    """Plain shard names from the snapshot's index ([model.safetensors] without one; [] for an index
    read_checkpoint will reject, or no config: it reports those as a bad checkpoint)."""
    if not (folder / "config.json").is_file():
        return []
    index_path = folder / INDEX_NAME
    if not index_path.is_file():
        return [SINGLE_NAME]
    try:
        names = sorted(set(read_json(index_path).get("weight_map", {}).values()))
    except (InputError, AttributeError, TypeError):
        return []
    return [name for name in names if isinstance(name, str) and Path(name).name == name]


def _resolve_sha(api: Any, ref: RepoRef) -> str:
    from huggingface_hub import constants
    # local_files_only when offline: the same cache lookup without a "could not reach the Hub" warning per source
    resolved = api.resolve_revision(ref.repo_id, revision=ref.revision, local_files_only=offline(api))
    return str(resolved.resolved)  # str(ResolvedRevision) is the name asked for, not the sha


def _missing_files(folder: Path) -> list[str]:
    """Files the snapshot should hold for read_checkpoint but does not (config first, then weights)."""
    if not (folder / "config.json").is_file():
        return ["config.json"]
    index_path = folder / INDEX_NAME
    if index_path.is_file():
        try:
            weight_map = read_json(index_path).get("weight_map", {})
            names = sorted(set(weight_map.values()))
        except (InputError, AttributeError, TypeError):
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
    if source.hub_unreachable:
        raise HubError(f"{where}, and the Hub cannot be reached ({hub_unreachable(None)}): rerun with network "
                       "access to download it")
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


ASSISTANT_SUFFIX = "-assistant"  # how Google names the MTP assistant published beside a target


def published_assistant(target: RepoRef, *, api: Any = None) -> tuple[str, LocalSource, Checkpoint]:
    """The assistant published beside a Hub target, `OWNER/NAME` -> `OWNER/NAME-assistant` at its default branch:
    its config and small files fetched, its shard headers read; no weight is downloaded.

    Returns:
        (repo id, LocalSource with purpose "headers", its Checkpoint as opened to check what it is).

    Raises:
        HubError: no such repo (or not reachable, or not cached offline), or it is not a gemma4_assistant; the
            message names --assistant and --target-only.
    """
    repo_id = target.repo_id + ASSISTANT_SUFFIX
    remedy = "give --assistant OWNER/NAME (or a directory), or --target-only to convert the target alone"
    try:
        source = resolve_source(repo_id, purpose="headers", api=api)
        checkpoint = open_checkpoint(source)
    except (HubError, InputError) as exc:
        raise HubError(f"no assistant found for {target.text}: {exc}; {remedy}") from exc
    if checkpoint.spec.role != Role.ASSISTANT:
        raise HubError(f"{repo_id} is a {checkpoint.spec.kind}, not a gemma4_assistant; {remedy}")
    return repo_id, source, checkpoint

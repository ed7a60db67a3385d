"""Hub in and out, with no network at all.

Downloads: a real huggingface_hub cache (models--owner--name/{refs,snapshots,blobs}) built in tmp and read by the real
huggingface_hub code under HF_HUB_OFFLINE=1. Remote headers and uploads: a small fake HfApi that serves one repo from
a local directory and records every call. A socket guard fails any test that tries to open a connection.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from huggingface_hub import ResolvedRevision, constants
from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError, IncompleteSnapshotError,
                                    LocalEntryNotFoundError, LocalTokenNotFoundError, NotASafetensorsRepoError,
                                    OfflineModeIsEnabled, RepositoryNotFoundError, RevisionNotFoundError,
                                    RevisionResolutionError)
from hf_xet import XetAuthenticationError, XetObjectNotFoundError
from huggingface_hub.utils import SafetensorsFileMetadata, SafetensorsRepoMetadata, TensorInfo, filter_repo_objects

from converter.advice.compat import NOT_RUN, load_ledger
from converter.advice.report import inspect_checkpoint
from converter.cli import _common
from converter.errors import HubError, InputError, UsageError
from converter.hub.card import BASE_MODEL_RELATION, render_card
from converter.hub.download import open_checkpoint, parse_repo_ref, resolve_source
from converter.hub.errors import describe_hub_error, hub_http_client
from converter.pairing import serve_line
from converter.pipeline import ConvertRequest, execute, plan_conversion, serve_command
from converter.read.checkpoint import INDEX_NAME, MANIFEST_NAME, VERIFICATION_NAME, read_checkpoint
from converter.testing.synthetic import tiny_preset, write_pair

from _hub_cache import cache_repo

httpx = hub_http_client()  # httpx on huggingface_hub 1.x, httpx2 on 2.x
SHA_MAIN = hashlib.sha1(b"main").hexdigest()
SHA_V2 = hashlib.sha1(b"v2").hexdigest()
TARGET_REPO, ASSISTANT_REPO = "acme/gemma-4-tiny", "acme/gemma-4-tiny-assistant"


# ------------------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def offline_hub(monkeypatch, tmp_path):
    """HF_HUB_OFFLINE=1 with HF_HOME/HF_HUB_CACHE in tmp, for the environment and huggingface_hub's constants; no sockets."""
    home = tmp_path / "hf-home"
    cache = home / "hub"
    cache.mkdir(parents=True)
    for name, value in (("HF_HUB_OFFLINE", "1"), ("HF_HOME", str(home)), ("HF_HUB_CACHE", str(cache)),
                        ("HF_HUB_DISABLE_PROGRESS_BARS", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a test tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    return cache


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    """tiny 31B pair (target in 2 shards + index) with a README carrying license front matter."""
    root = tmp_path_factory.mktemp("hub-src")
    write_pair(root, preset=tiny_preset("31b"), num_shards=2)
    for role in ("target", "assistant"):
        (root / role / "README.md").write_text("---\nlicense: apache-2.0\npipeline_tag: text-generation\n"
                                               "extra_gated_prompt: not carried\n---\n# Upstream card\n")
    return root


def use_api(monkeypatch, api: Any) -> None:
    """Every verb builds its HfApi through _common.make_api: hand it the fake."""
    monkeypatch.setattr(_common, "make_api", lambda: api)


class RemoteRepo:
    """A fake HfApi serving repos from local directories (at one commit each) and recording every call."""

    def __init__(self, repos: dict[str, Path], download_root: Path, sha: str = SHA_MAIN,
                 fail: dict[str, BaseException] | None = None) -> None:
        self.repos, self.root, self.sha, self.calls = repos, download_root, sha, []
        self.fail = fail or {}  # file name -> the exception its download raises

    def _folder(self, repo_id: str, revision: str) -> Path:
        """Where huggingface_hub puts a snapshot: models--OWNER--NAME/snapshots/SHA under the cache root."""
        folder = self.root / ("models--" + repo_id.replace("/", "--")) / "snapshots" / revision
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def hf_hub_download(self, repo_id: str, filename: str, *, revision: str) -> str:
        self.calls.append(("hf_hub_download", repo_id, revision, filename))
        if filename in self.fail:
            raise self.fail[filename]
        target = self._folder(repo_id, revision) / filename
        shutil.copyfile(self.repos[repo_id] / filename, target)
        return str(target)

    def resolve_revision(self, repo_id: str, *, revision: str | None = None, **kwargs: Any) -> ResolvedRevision:
        self.calls.append(("resolve_revision", repo_id, revision))
        if repo_id not in self.repos:  # what the Hub answers for a repo that does not exist (or is private)
            raise http_error(RepositoryNotFoundError, 404)
        return ResolvedRevision(resolved=self.sha, initial=revision, repo_id=repo_id, repo_type="model")

    def snapshot_download(self, repo_id: str, *, revision: str, allow_patterns: list[str],
                          ignore_patterns: list[str], local_files_only: bool) -> str:
        assert not local_files_only
        self.calls.append(("snapshot_download", repo_id, revision, tuple(allow_patterns)))
        source = self.repos[repo_id]
        names = filter_repo_objects([p.name for p in source.iterdir()], allow_patterns=allow_patterns,
                                    ignore_patterns=ignore_patterns)
        folder = self._folder(repo_id, revision)
        for name in names:
            shutil.copyfile(source / name, folder / name)
        return str(folder)

    def get_safetensors_metadata(self, repo_id: str, *, revision: str) -> SafetensorsRepoMetadata:
        self.calls.append(("get_safetensors_metadata", repo_id, revision))
        source = self.repos[repo_id]
        files = {}
        for path in sorted(source.glob("*.safetensors")):
            with open(path, "rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(length))
            metadata = header.pop("__metadata__", {})
            files[path.name] = SafetensorsFileMetadata(metadata=metadata, tensors={
                name: TensorInfo(dtype=e["dtype"], shape=e["shape"], data_offsets=tuple(e["data_offsets"]))
                for name, e in header.items()})
        index = source / INDEX_NAME
        weight_map = (json.loads(index.read_text())["weight_map"] if index.exists() else
                      {t: name for name, f in files.items() for t in f.tensors})
        return SafetensorsRepoMetadata(metadata=None, sharded=index.exists(), weight_map=weight_map,
                                       files_metadata=files)

    def get_paths_info(self, repo_id: str, paths: list[str], *, revision: str) -> list[SimpleNamespace]:
        self.calls.append(("get_paths_info", repo_id, revision, tuple(paths)))
        return [SimpleNamespace(path=p, size=(self.repos[repo_id] / p).stat().st_size) for p in paths]


class FakeHfApi:
    """The upload side of HfApi: records calls and what upload_folder was given; `raises` injects one failure."""

    def __init__(self, raises: dict[str, BaseException] | None = None) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.uploads: list[dict[str, Any]] = []
        self.raises = raises or {}

    def _record(self, name: str, **kwargs: Any) -> None:
        self.calls.append((name, kwargs))
        if name in self.raises:
            raise self.raises[name]

    def whoami(self) -> dict[str, str]:
        self._record("whoami")
        return {"name": "me"}

    def create_repo(self, repo_id: str, **kwargs: Any) -> str:
        self._record("create_repo", repo_id=repo_id, **kwargs)
        return f"https://huggingface.co/{repo_id}"

    def create_branch(self, repo_id: str, **kwargs: Any) -> None:
        self._record("create_branch", repo_id=repo_id, **kwargs)

    def upload_folder(self, **kwargs: Any) -> SimpleNamespace:
        self._record("upload_folder", **{k: v for k, v in kwargs.items() if k != "folder_path"})
        folder = Path(kwargs["folder_path"])
        self.uploads.append({
            "repo_id": kwargs["repo_id"],
            "files": {p.name: (p.resolve() if p.is_symlink() else None) for p in sorted(folder.iterdir())},
            "card": (folder / "README.md").read_text(encoding="utf-8"),
            # what the Hub would store: every file's bytes (KB-sized test checkpoints)
            "contents": {p.name: p.read_bytes() for p in sorted(folder.iterdir())},
        })
        pr = "https://huggingface.co/x/discussions/1" if kwargs.get("create_pr") else None
        return SimpleNamespace(commit_url=f"https://huggingface.co/{kwargs['repo_id']}/commit/{SHA_V2}", pr_url=pr)


class ExplodingApi:
    """Any use of it fails the test: proves a code path contacts nothing."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"HfApi.{name} used")


def http_error(cls: type[HfHubHTTPError], status: int) -> HfHubHTTPError:
    request = httpx.Request("POST", "https://huggingface.co/api/repos/create")
    return cls(f"{status} Client Error\nmore server text", response=httpx.Response(status, request=request))


def verification_doc(*, passed: bool = True) -> dict[str, Any]:
    """verification.json as verify writes it (`factor`: allowed multiple of the noise floor; ratio = rel_rms / floor)."""
    layers = [{"name": f"target layer {i}", "max_abs": 1e-3 * (i + 1), "max_rel": 2e-3, "rel_rms": 1e-3 * (i + 1),
               "cosine": 0.99999 - i * 1e-6, "noise_floor": 1e-3, "ratio": float(i + 1), "factor": 2.0,
               "passed": i < 2, "note": None} for i in range(3)]
    if passed:
        layers[-1].update(rel_rms=1.5e-3, ratio=1.5, passed=True)
    return {"passed": passed, "device": "cuda", "dtype": "bf16", "torch": "2.13.0", "cuda": "13.0",
            "seed": 0, "wall_seconds": 12.5, "structural": {"passed": True, "problems": []}, "layers": layers,
            "first_failure": None if passed else "target layer 2: error 0.003 is 3.0x the noise floor",
            "tool_version": "0.1.0", "versions": {"device_name": "NVIDIA H200"}}


def convert_pair(sources: Path, out: Path, *, layout: str = "pad-global", verification: dict | None = None) -> Path:
    execute(plan_conversion(ConvertRequest(out=out, layout=layout, target=sources / "target",
                                           assistant=sources / "assistant")))
    if verification is not None:
        for directory in (out, out / "target", out / "assistant"):
            (directory / VERIFICATION_NAME).write_text(json.dumps(verification))
    return out


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory) -> Path:
    """A verified pad-global pair: DST/{target,assistant} with verification.json everywhere verify writes it."""
    return convert_pair(sources, tmp_path_factory.mktemp("hub-dst") / "dst", verification=verification_doc())


def without_path(report: dict) -> dict:
    return {k: v for k, v in report.items() if k != "path"}


# ---------------------------------------------------------------------------------------------------------- resolution


@pytest.mark.parametrize("text, expected", [
    ("google/gemma-4-31B-it", ("google/gemma-4-31B-it", None)),
    ("google/gemma-4-31B-it@v1.0", ("google/gemma-4-31B-it", "v1.0")),
    ("me/x@refs/pr/3", ("me/x", "refs/pr/3")),
    (f"me/x@{SHA_MAIN}", ("me/x", SHA_MAIN)),
    ("model", None), ("a/b/c", None), ("./a/b", None), ("/abs/x", None), ("../x/y", None), ("a/b@", None),
    ("~/x", None), ("a/../b", None),
])
def test_parse_repo_ref(text, expected):
    ref = parse_repo_ref(text)
    assert (ref.repo_id, ref.revision) == expected if expected else ref is None


def test_an_existing_local_path_shaped_like_a_repo_id_stays_local(tmp_path, monkeypatch):
    (tmp_path / "acme" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert parse_repo_ref("acme/model") is None
    source = resolve_source("acme/model", purpose="full", api=ExplodingApi())
    assert source.path == Path("acme/model") and source.repo_id is None and source.origin() == {}


def test_full_download_reads_the_real_cache_offline(sources, offline_hub):
    snapshot = cache_repo(offline_hub, TARGET_REPO, SHA_MAIN, sources / "target")
    source = resolve_source(TARGET_REPO, purpose="full")
    assert source.path == snapshot and source.revision_sha == SHA_MAIN and source.remote_shards is None
    assert source.origin() == {"repo_id": TARGET_REPO, "revision": SHA_MAIN, "requested_revision": "main"}
    local, cached = read_checkpoint(sources / "target"), read_checkpoint(source.path)
    assert {n: (r.dtype, r.shape, r.nbytes) for n, r in cached.tensors.items()} == \
        {n: (r.dtype, r.shape, r.nbytes) for n, r in local.tensors.items()}


def test_revision_resolves_to_one_commit_and_every_file_comes_from_it(sources, offline_hub, tmp_path):
    other = tmp_path / "v2"
    shutil.copytree(sources / "target", other)
    config = json.loads((other / "config.json").read_text())
    config["marker"] = "v2"
    (other / "config.json").write_text(json.dumps(config))
    cache_repo(offline_hub, TARGET_REPO, SHA_MAIN, sources / "target")
    cache_repo(offline_hub, TARGET_REPO, SHA_V2, other, refs=("v2",))
    for text, sha, marker in ((TARGET_REPO, SHA_MAIN, None), (f"{TARGET_REPO}@v2", SHA_V2, "v2"),
                              (f"{TARGET_REPO}@{SHA_V2}", SHA_V2, "v2")):
        source = resolve_source(text, purpose="full")
        assert source.path.name == sha and source.revision_sha == sha
        assert read_checkpoint(source.path).config.get("marker") == marker
        assert all(os.path.realpath(p).startswith(str(offline_hub)) for p in source.path.iterdir())


def test_every_call_after_resolution_uses_the_commit_sha(sources, tmp_path, monkeypatch):
    api = RemoteRepo({TARGET_REPO: sources / "target"}, tmp_path / "dl")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # "online": the fake never touches the network
    resolve_source(f"{TARGET_REPO}@v2", purpose="headers", api=api)
    assert api.calls[0] == ("resolve_revision", TARGET_REPO, "v2")
    assert [c[2] for c in api.calls[1:]] == [SHA_MAIN] * (len(api.calls) - 1)


def test_offline_missing_shard_is_a_clear_hub_error(sources, offline_hub):
    cache_repo(offline_hub, TARGET_REPO, SHA_MAIN, sources / "target", skip=("model-00002-of-00002.safetensors",))
    with pytest.raises(HubError, match=r"model-00002-of-00002.safetensors not in .*HF_HUB_OFFLINE=1"):
        resolve_source(TARGET_REPO, purpose="full")


def test_offline_repo_not_cached_is_a_clear_hub_error():
    with pytest.raises(HubError, match=r"^acme/nothing@v1: not a local path, and not in the Hub cache .*HF_HUB_OFFLINE"):
        resolve_source("acme/nothing@v1", purpose="full")


def test_offline_inspect_uses_cached_weights(sources, offline_hub, run_cli):
    cache_repo(offline_hub, TARGET_REPO, SHA_MAIN, sources / "target")
    source = resolve_source(TARGET_REPO, purpose="headers")
    assert source.remote_shards is None  # the weights are cached: plain read_checkpoint
    result = run_cli("inspect", TARGET_REPO, "--json")
    assert result.code == 0, result.err
    assert without_path(json.loads(result.out)) == without_path(inspect_checkpoint(read_checkpoint(sources / "target")))


def test_offline_inspect_without_cached_headers_says_so(sources, offline_hub, run_cli):
    cache_repo(offline_hub, TARGET_REPO, SHA_MAIN, sources / "target",
               skip=("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"))
    result = run_cli("inspect", TARGET_REPO)
    assert result.code == 5
    assert result.err.count("\n") == 1 and "HF_HUB_OFFLINE=1 allows only cached files" in result.err


@pytest.mark.parametrize("role", ["target", "assistant"])
def test_online_inspect_reads_headers_never_weights(sources, tmp_path, monkeypatch, run_cli, role):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # "online": the fake never touches the network
    api = RemoteRepo({TARGET_REPO: sources / role}, tmp_path / "dl")
    use_api(monkeypatch, api)
    result = run_cli("inspect", TARGET_REPO, "--json")
    assert result.code == 0, result.err
    assert without_path(json.loads(result.out)) == without_path(inspect_checkpoint(read_checkpoint(sources / role)))
    (download,) = [c for c in api.calls if c[0] == "snapshot_download"]
    assert not any(p.endswith(".safetensors") for p in download[3])
    assert not list((tmp_path / "dl").rglob("*.safetensors"))
    source = resolve_source(TARGET_REPO, purpose="headers", api=api)
    local = read_checkpoint(sources / role)
    def layout(checkpoint):
        return [(s.file.name, s.size, s.data_start, dict(s.metadata),
                 [(t.name, t.dtype, t.shape, t.offset, t.nbytes) for t in s.tensors]) for s in checkpoint.shards]

    remote = open_checkpoint(source)
    assert layout(remote) == layout(local) and remote.indexed == local.indexed
    assert remote.side_files == local.side_files


def test_convert_and_check_pair_from_repo_ids_record_the_source(sources, offline_hub, tmp_path, run_cli):
    cache_repo(offline_hub, TARGET_REPO, SHA_MAIN, sources / "target")
    cache_repo(offline_hub, ASSISTANT_REPO, SHA_V2, sources / "assistant", refs=("main", "v2"))
    out = tmp_path / "out"
    result = run_cli("convert", "--target", TARGET_REPO, "--assistant", f"{ASSISTANT_REPO}@v2", "--out", out,
                     "--layout", "pad-global")
    assert result.code == 0, result.err
    target = json.loads((out / "target" / MANIFEST_NAME).read_text())["source"]
    assistant = json.loads((out / "assistant" / MANIFEST_NAME).read_text())["source"]
    assert (target["repo_id"], target["revision"], target["requested_revision"]) == (TARGET_REPO, SHA_MAIN, "main")
    assert (assistant["repo_id"], assistant["revision"], assistant["requested_revision"]) == \
        (ASSISTANT_REPO, SHA_V2, "v2")
    assert run_cli("check-pair", TARGET_REPO, f"{ASSISTANT_REPO}@v2").code == 0


def _shard_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith("model")]


def test_convert_dry_run_from_repo_ids_reads_headers_only(sources, tmp_path, monkeypatch, run_cli):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # "online": the fake never touches the network
    api = RemoteRepo({TARGET_REPO: sources / "target", ASSISTANT_REPO: sources / "assistant"}, tmp_path / "hub")
    use_api(monkeypatch, api)
    out = tmp_path / "out"
    args = ("--out", out, "--layout", "pad-global", "--dry-run")
    result = run_cli("convert", "--target", TARGET_REPO, "--assistant", ASSISTANT_REPO, *args)
    assert result.code == 0, result.err
    assert "dry run: nothing written" in result.out and not out.exists()
    assert not [c for c in api.calls if c[0] == "hf_hub_download"]
    assert all(not any(p.endswith(".safetensors") for p in c[3]) for c in api.calls if c[0] == "snapshot_download")
    assert {c[1] for c in api.calls if c[0] == "get_safetensors_metadata"} == {TARGET_REPO, ASSISTANT_REPO}
    assert not list((tmp_path / "hub").rglob("*.safetensors")), "a weight file was downloaded"
    local = run_cli("convert", "--target", sources / "target", "--assistant", sources / "assistant", *args)
    assert _shard_lines(result.out) and _shard_lines(result.out) == _shard_lines(local.out)
    # the cost lines agree; the notes after them name each source's own path
    costs = [text.split("cost of pad-global")[1].split("\nnote: ")[0] for text in (result.out, local.out)]
    assert costs[0] == costs[1]


def test_convert_from_repo_ids_downloads_each_shard_after_planning(sources, tmp_path, monkeypatch, run_cli):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    api = RemoteRepo({TARGET_REPO: sources / "target", ASSISTANT_REPO: sources / "assistant"}, tmp_path / "hub")
    use_api(monkeypatch, api)
    out = tmp_path / "out"
    result = run_cli("convert", "--target", TARGET_REPO, "--assistant", ASSISTANT_REPO, "--out", out,
                     "--layout", "per-layer")
    assert result.code == 0, result.err
    downloads = [c[3] for c in api.calls if c[0] == "hf_hub_download"]
    assert sorted(downloads) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                 "model.safetensors"]
    first_download = next(i for i, c in enumerate(api.calls) if c[0] == "hf_hub_download")
    assert any(c[0] == "get_safetensors_metadata" for c in api.calls[:first_download])  # planned on headers first
    for role in ("target", "assistant"):
        assert read_checkpoint(out / role).tensors.keys() == read_checkpoint(sources / role).tensors.keys()


# ------------------------------------------------------------------------------------------ the published assistant


def _online(monkeypatch, tmp_path: Path, repos: dict[str, Path]) -> RemoteRepo:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # "online": the fake never touches the network
    api = RemoteRepo(repos, tmp_path / "hub")
    use_api(monkeypatch, api)
    return api


def _weights_fetched(api: RemoteRepo) -> list:
    return [c for c in api.calls if c[0] == "hf_hub_download"
            or (c[0] == "snapshot_download" and any(p.endswith(".safetensors") for p in c[3]))]


@pytest.mark.parametrize("serving, layout", [((), "per-layer"), (("--serving", "vllm==0.22.1"), "pad-global")])
def test_a_hub_target_alone_brings_its_published_assistant(sources, tmp_path, monkeypatch, run_cli, serving, layout):
    api = _online(monkeypatch, tmp_path, {TARGET_REPO: sources / "target", ASSISTANT_REPO: sources / "assistant"})
    result = run_cli("convert", TARGET_REPO, "--out", tmp_path / "out", "--dry-run", *serving)
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert f"assistant: {ASSISTANT_REPO} (published beside {TARGET_REPO}; --assistant names another, " \
           "--target-only converts the target alone)" in lines
    chosen = [line for line in lines if line.startswith("chosen: --layout ")]
    assert chosen[0].startswith(f"chosen: --layout {layout}: ")
    assert f"-> {tmp_path / 'out' / 'target'}" in result.out and f"-> {tmp_path / 'out' / 'assistant'}" in result.out
    assert not _weights_fetched(api)
    assert {c[1] for c in api.calls if c[0] == "get_safetensors_metadata"} == {TARGET_REPO, ASSISTANT_REPO}


def test_the_found_assistant_is_converted_beside_its_target(sources, tmp_path, monkeypatch, run_cli):
    _online(monkeypatch, tmp_path, {TARGET_REPO: sources / "target", ASSISTANT_REPO: sources / "assistant"})
    out = tmp_path / "out"
    result = run_cli("convert", TARGET_REPO, "--out", out)
    assert result.code == 0, result.err
    manifest = json.loads((out / "assistant" / MANIFEST_NAME).read_text())
    assert manifest["source"]["repo_id"] == ASSISTANT_REPO and manifest["layout"] == "per-layer"
    assert f"--speculative-config '{{\"method\": \"mtp\", \"model\": \"{out / 'assistant'}\"" in result.out


def test_a_missing_published_assistant_is_one_line_exit_5_before_any_download(sources, tmp_path, monkeypatch,
                                                                               run_cli):
    api = _online(monkeypatch, tmp_path, {TARGET_REPO: sources / "target"})
    out = tmp_path / "out"
    result = run_cli("convert", TARGET_REPO, "--out", out)
    assert result.code == 5 and len(result.err.strip().splitlines()) == 1, result.err
    assert f"no assistant found for {TARGET_REPO}: {ASSISTANT_REPO}: " in result.err
    assert "--assistant" in result.err and "--target-only" in result.err and "Traceback" not in result.err
    assert not _weights_fetched(api) and not out.exists()


def test_a_published_assistant_that_is_not_one_is_refused(sources, tmp_path, monkeypatch, run_cli):
    _online(monkeypatch, tmp_path, {TARGET_REPO: sources / "target", ASSISTANT_REPO: sources / "target"})
    result = run_cli("convert", TARGET_REPO, "--out", tmp_path / "out", "--dry-run")
    assert result.code == 5, result.err
    assert f"{ASSISTANT_REPO} is a Gemma 4 target (multimodal gemma4), not a gemma4_assistant" in result.err


def test_target_only_converts_a_hub_target_alone(sources, tmp_path, monkeypatch, run_cli):
    api = _online(monkeypatch, tmp_path, {TARGET_REPO: sources / "target"})
    result = run_cli("convert", TARGET_REPO, "--target-only", "--out", tmp_path / "out")
    assert result.code == 0, result.err
    assert ASSISTANT_REPO not in {c[1] for c in api.calls}
    assert (tmp_path / "out" / "config.json").is_file() and not (tmp_path / "out" / "assistant").exists()


def test_a_local_target_is_never_paired_by_guess(sources, tmp_path, monkeypatch, run_cli):
    use_api(monkeypatch, ExplodingApi())
    result = run_cli("convert", sources / "target", "--out", tmp_path / "out", "--dry-run")
    assert result.code == 0, result.err
    assert "assistant:" not in result.out


def test_assistant_and_target_only_together_is_a_usage_error(sources, tmp_path, run_cli):
    result = run_cli("convert", "--target", sources / "target", "--assistant", sources / "assistant",
                     "--target-only", "--out", tmp_path / "out")
    assert result.code == 2 and "not both" in result.err


HOLD_LOCK = ("import sys; from pathlib import Path; from converter.write.lock import output_lock\n"
             "with output_lock(Path(sys.argv[1])):\n    print('LOCKED', flush=True); sys.stdin.readline()\n")


def test_a_locked_dst_is_refused_before_any_weight_is_downloaded(sources, tmp_path, monkeypatch, run_cli):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    api = RemoteRepo({TARGET_REPO: sources / "target"}, tmp_path / "hub")
    use_api(monkeypatch, api)
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "LOCKED"
        result = run_cli("convert", TARGET_REPO, "--target-only", "--out", out, "--layout", "per-layer")
    finally:
        holder.communicate("\n", timeout=60)
    assert result.code == 4 and f"another gemma4-convert (pid {holder.pid} on " in result.err, result.err
    assert not [c for c in api.calls if c[0] == "hf_hub_download"]
    assert not list((tmp_path / "hub").rglob("*.safetensors")) and not out.exists()


@pytest.mark.parametrize("exc, cause", [
    (RuntimeError("Task error: File reconstruction error: CAS Client Error: connection reset"),
     "the transfer failed in hf_xet (RuntimeError: Task error: File reconstruction error"),
    (XetAuthenticationError("token refresh failed"), "hf_xet storage refused the credentials (token refresh failed)"),
    (http_error(HfHubHTTPError, 503), "the Hub failed (503); rerun later"),
    (httpx.ReadTimeout("slow"), "cannot reach the Hub at"),
])
def test_a_failed_shard_download_exits_5_naming_the_file(sources, tmp_path, monkeypatch, run_cli, exc, cause):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    shard = "model-00002-of-00002.safetensors"
    use_api(monkeypatch, RemoteRepo({TARGET_REPO: sources / "target"}, tmp_path / "hub", fail={shard: exc}))
    out = tmp_path / "out"
    result = run_cli("convert", TARGET_REPO, "--target-only", "--out", out, "--layout", "per-layer")
    assert result.code == 5, result.err
    assert result.err.startswith(f"error: {TARGET_REPO}: {shard}: ") and result.err.count("\n") == 1, result.err
    assert cause in result.err
    assert not out.exists() and not [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")]


# ---------------------------------------------------------------------------------------------------------- error table


@pytest.mark.parametrize("exc, kind, fragment", [
    (http_error(GatedRepoError, 403), HubError, "gated repo; accept its terms on https://huggingface.co/acme/m"),
    (http_error(RepositoryNotFoundError, 404), HubError, "no such Hub repo (or it is private"),
    (http_error(RevisionNotFoundError, 404), HubError, "no such revision"),
    (http_error(HfHubHTTPError, 401), HubError, "refused the token (401)"),
    (http_error(HfHubHTTPError, 403), HubError, "no permission (403)"),
    (http_error(HfHubHTTPError, 429), HubError, "rate-limited by the Hub (429)"),
    (http_error(HfHubHTTPError, 503), HubError, "the Hub failed (503); rerun later"),
    (http_error(HfHubHTTPError, 409), HubError, "Hub request failed (409): 409 Client Error"),
    (LocalTokenNotFoundError("no token"), HubError, "no Hugging Face token; set HF_TOKEN"),
    (RevisionResolutionError("x"), HubError, "not in the Hub cache"),
    (LocalEntryNotFoundError("x"), HubError, "not in the Hub cache"),
    (IncompleteSnapshotError("x", snapshot_path="/s"), HubError, "cached snapshot is incomplete"),
    (OfflineModeIsEnabled("x"), HubError, "HF_HUB_OFFLINE=1 but this needs the Hub"),
    (httpx.ConnectError("refused"), HubError, "cannot reach the Hub"),
    (httpx.ReadTimeout("slow"), HubError, "cannot reach the Hub"),
    (ConnectionResetError("reset"), HubError, "cannot reach the Hub"),
    (NotASafetensorsRepoError("'acme/m' is not a safetensors repo."), InputError, "not a safetensors repo"),
    (HFValidationError("Repo id must be ..."), UsageError, "not a valid Hub repo id"),
])
def test_hub_errors_become_one_line_messages(exc, kind, fragment):
    error = describe_hub_error(exc, subject="acme/m@main")
    assert type(error) is kind and fragment in str(error)
    assert str(error).startswith("acme/m@main: ") and "\n" not in str(error)


def test_a_hub_failure_exits_5_with_one_line(monkeypatch, run_cli):
    class Missing(RemoteRepo):
        def resolve_revision(self, repo_id: str, *, revision: str | None = None, **kwargs: Any) -> ResolvedRevision:
            raise http_error(RepositoryNotFoundError, 404)

    use_api(monkeypatch, Missing({}, Path("/nonexistent")))
    result = run_cli("inspect", "acme/missing")
    assert result.code == 5
    assert result.err == "error: acme/missing: no such local path, and no such Hub repo (or it is private and the " \
                         "token, HF_TOKEN, has no access to it)\n"


# -------------------------------------------------------------------------------------------------------------- card


def test_card_front_matter_serve_line_kv_cost_and_verification(converted):
    manifest = json.loads((converted / "target" / MANIFEST_NAME).read_text())
    manifest["source"].update(repo_id="google/gemma-4-31B-it", revision=SHA_MAIN)
    card = render_card(manifest=manifest, verification=verification_doc(), repo_id="me/t", target_repo="me/t",
                       assistant_repo="me/a", base_model="google/gemma-4-31B-it",
                       source_front_matter={"license": "apache-2.0", "extra_gated_prompt": "x"}, source_card=True)
    front, body = card.split("---\n", 2)[1:]
    meta = yaml.safe_load(front)
    assert meta["base_model"] == "google/gemma-4-31B-it" and meta["base_model_relation"] == BASE_MODEL_RELATION
    assert meta["license"] == "apache-2.0" and "extra_gated_prompt" not in meta
    assert meta["library_name"] == "transformers" and "layout-pad-global" in meta["tags"]
    assert f"[google/gemma-4-31B-it](https://huggingface.co/google/gemma-4-31B-it) at commit `{SHA_MAIN}`" in body
    assert ("vllm serve me/t --speculative-config '{\"method\": \"mtp\", \"model\": \"me/a\", "
            "\"num_speculative_tokens\": 4}' --attention-backend TRITON_ATTN") in body
    assert "| every layer holds the full context | 5.5 KiB | 12.0 KiB | x2.18 |" in body
    assert "**PASSED** on `cuda (NVIDIA H200)` (bf16, torch 2.13.0, CUDA 13.0, seed 0, 12.5 s, gemma4-convert 0.1.0)" \
        in body
    assert ("3 comparisons, 0 failed: lowest cosine 0.999988 (target layer 2); largest error x2.00 the original's own "
            "noise floor (target layer 1; allowed x2)") in body
    assert "| target layer 0 | 1.000e-03 | 2.000e-03 | 1.000e-03 | 0.999990 | 1.000e-03 | x1.00 | x2 | ok |" in body
    assert "`README.source.md`" in body


def test_card_quotes_the_ledger_rows_of_its_layout(converted):
    manifest = json.loads((converted / "target" / MANIFEST_NAME).read_text())
    card = render_card(manifest=manifest, verification=verification_doc(), repo_id="me/t", target_repo="me/t",
                       assistant_repo="me/a", base_model=None)
    section = card.split("## Proven with stock vLLM\n", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in load_ledger() if r.variant == "pad-global" and r.verdict != NOT_RUN]  # reasons prove nothing
    assert rows, "the ledger holds no pad-global row"
    for row in rows:
        assert f"| {row.check} | {row.vllm}" in section and f"| {row.transformers} |" in section
    assert "| loader | 0.27.0 |" in section and "| engine | 0.27.0 |" in section


def test_card_for_an_assistant_without_verification_or_base_model(converted):
    manifest = json.loads((converted / "assistant" / MANIFEST_NAME).read_text())
    card = render_card(manifest=manifest, verification=None, repo_id="me/a", target_repo=None, assistant_repo="me/a",
                       base_model=None)
    meta = yaml.safe_load(card.split("---\n", 2)[1])
    assert "base_model" not in meta and "base_model_relation" not in meta
    assert "a local checkpoint (`assistant`; base model: unknown)" in card and str(converted) not in card
    assert "vllm serve <TARGET converted the same way> --speculative-config" in card
    assert "None of its own" in card and "**Not verified**" in card


def test_card_serve_line_matches_the_convert_verb(sources, tmp_path):
    for layout in ("per-layer", "pad-global"):
        out = tmp_path / layout
        plan = plan_conversion(ConvertRequest(out=out, layout=layout, target=sources / "target",
                                              assistant=sources / "assistant"))
        assert serve_command(plan) == serve_line(target=str(out / "target"), assistant=str(out / "assistant"),
                                                 layout=layout)


# ------------------------------------------------------------------------------------------------------------ upload


def test_upload_pair_calls_and_staged_files(converted, monkeypatch, run_cli):
    api = FakeHfApi()
    use_api(monkeypatch, api)
    result = run_cli("upload", converted, "--target-repo", "me/t", "--assistant-repo", "me/a", "--private",
                     "--commit-message", "hello")
    assert result.code == 0, result.err
    assert [name for name, _ in api.calls] == ["whoami", "create_repo", "upload_folder", "create_repo", "upload_folder"]
    assert api.calls[1][1] == {"repo_id": "me/t", "repo_type": "model", "private": True, "exist_ok": True}
    assert api.calls[2][1] == {"repo_id": "me/t", "repo_type": "model", "revision": None, "create_pr": False,
                               "commit_message": "hello"}
    target_upload = api.uploads[0]
    expected = {p.name for p in (converted / "target").iterdir()} - {"README.md"} | {"README.md", "README.source.md"}
    assert set(target_upload["files"]) == expected
    assert target_upload["files"]["README.source.md"] == (converted / "target" / "README.md").resolve()
    assert target_upload["files"]["model-00001-of-00002.safetensors"] == \
        (converted / "target" / "model-00001-of-00002.safetensors").resolve()
    assert target_upload["files"]["README.md"] is None and target_upload["card"].startswith("---\n")
    assert "\"model\": \"me/a\"" in target_upload["card"] and "\"model\": \"me/a\"" in api.uploads[1]["card"]
    assert "uploaded me/t: https://huggingface.co/me/t/commit/" in result.out
    assert not (converted / "target" / "README.source.md").exists()  # DST is never modified


def test_upload_to_a_branch_and_as_a_pull_request(converted, monkeypatch, run_cli):
    api = FakeHfApi()
    use_api(monkeypatch, api)
    assert run_cli("upload", converted / "target", "me/t", "--revision", "dev").code == 0
    assert ("create_branch", {"repo_id": "me/t", "branch": "dev", "repo_type": "model", "exist_ok": True}) in api.calls
    assert api.calls[-1][1]["revision"] == "dev"
    api = FakeHfApi()
    use_api(monkeypatch, api)
    result = run_cli("upload", converted / "target", "me/t", "--create-pr")
    assert result.code == 0 and "discussions/1" in result.out
    assert "create_branch" not in [n for n, _ in api.calls] and api.calls[-1][1]["create_pr"] is True
    assert run_cli("upload", converted / "target", "me/t", "--create-pr", "--revision", "dev").code == 2


@pytest.mark.parametrize("setup, args, code, fragment", [
    ("none", [], 2, "no verification.json; run `gemma4-convert verify` first"),
    ("failed", [], 1, "verification FAILED (first failure: target layer 2: error 0.003 is 3.0x"),
    ("none", ["--no-verify"], 0, ""),
    ("failed", ["--no-verify"], 0, ""),
    ("ok", ["REPO"], 2, "give --target-repo and --assistant-repo (not REPO_ID)"),
    ("ok", ["--target-repo", "me/t"], 2, "give --target-repo and --assistant-repo"),
])
def test_upload_refusals(sources, tmp_path, monkeypatch, run_cli, setup, args, code, fragment):
    verification = {"none": None, "failed": verification_doc(passed=False), "ok": verification_doc()}[setup]
    dst = convert_pair(sources, tmp_path / "dst", verification=verification)
    api = FakeHfApi()
    use_api(monkeypatch, api)
    repos = [] if any(a.startswith("--target") or a == "REPO" for a in args) else \
        ["--target-repo", "me/t", "--assistant-repo", "me/a"]
    result = run_cli("upload", dst, *[("me/x" if a == "REPO" else a) for a in args], *repos)
    assert result.code == code, result.err
    assert fragment in result.err
    assert bool(api.calls) == (code == 0)


def test_upload_single_checkpoint_card_has_a_placeholder_partner(converted, monkeypatch, run_cli):
    api = FakeHfApi()
    use_api(monkeypatch, api)
    assert run_cli("upload", converted / "target", "me/t", "--target-repo", "me/t").code == 2
    assert run_cli("upload", converted / "assistant", "me/a").code == 0
    card = api.uploads[0]["card"]
    assert "vllm serve <TARGET converted the same way> --speculative-config '{\"method\": \"mtp\", \"model\": " \
           "\"me/a\"" in card
    assert "Convert and upload its target with the same `--layout pad-global`" in card


def _lfs_failure() -> RuntimeError:
    """What huggingface_hub's LFS upload raises: RuntimeError(...) from the HTTP error (_commit_api.py)."""
    try:
        raise RuntimeError("Error while uploading 'model.safetensors' to the Hub.") from http_error(HfHubHTTPError, 503)
    except RuntimeError as exc:
        return exc


UPLOADING = "error: me/t: uploading "


@pytest.mark.parametrize("method, exc, prefix, cause", [
    ("whoami", LocalTokenNotFoundError("x"), "error: me/t: no Hugging Face token; set HF_TOKEN", ""),
    ("whoami", http_error(HfHubHTTPError, 401), "error: me/t: the Hub refused the token (401)", ""),
    ("create_repo", http_error(HfHubHTTPError, 403), "error: me/t: no permission (403)", ""),
    ("upload_folder", http_error(HfHubHTTPError, 429), UPLOADING, "files): rate-limited by the Hub (429); wait"),
    ("upload_folder", httpx.ConnectError("no route"), UPLOADING, "files): cannot reach the Hub at"),
    # hf_xet's own exception types (the real classes from the installed hf_xet) and its plain RuntimeError
    ("upload_folder", XetAuthenticationError("token expired"), UPLOADING,
     "files): hf_xet storage refused the credentials (token expired)"),
    ("upload_folder", XetObjectNotFoundError("xorb 1f2e"), UPLOADING, "files): hf_xet storage has no such object"),
    ("upload_folder", RuntimeError("Task error: CAS Client Error: connection reset"), UPLOADING,
     "files): the transfer failed in hf_xet (RuntimeError: Task error: CAS Client Error: connection reset)"),
    ("upload_folder", _lfs_failure(), UPLOADING, "files): the Hub failed (503); rerun later"),
])
def test_upload_failures_exit_5_with_one_line(converted, monkeypatch, run_cli, method, exc, prefix, cause):
    use_api(monkeypatch, FakeHfApi(raises={method: exc}))
    result = run_cli("upload", converted / "target", "me/t", "--base-model", "acme/gemma-4-tiny")
    assert result.code == 5, result.err
    assert result.err.startswith(prefix) and result.err.count("\n") == 1, result.err
    assert cause in result.err
    if prefix == UPLOADING:
        assert f"uploading {converted / 'target'} (" in result.err  # names what was being sent


def test_dry_run_contacts_nothing_and_prints_files_sizes_and_cards(converted, monkeypatch, run_cli):
    use_api(monkeypatch, ExplodingApi())
    result = run_cli("upload", converted, "--target-repo", "me/t", "--assistant-repo", "me/a", "--dry-run")
    assert result.code == 0, result.err
    size = (converted / "target" / "model-00001-of-00002.safetensors").stat().st_size
    assert "model-00001-of-00002.safetensors" in result.out and f"{size / 2**20:.1f} MiB" in result.out
    assert result.out.count("--- end of card ---") == 2 and "(generated model card)" in result.out
    assert result.out.rstrip().endswith("dry run: nothing uploaded, the Hub was not contacted")


def test_dry_run_end_to_end_in_a_subprocess(converted, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "home"))
    done = subprocess.run([sys.executable, "-c", "from converter.cli import main; main()", "upload",
                           str(converted / "target"), "me/t", "--dry-run"],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    card = done.stdout.split("--- me/t/README.md ---\n", 1)[1].split("--- end of card ---", 1)[0]
    assert yaml.safe_load(card.split("---\n", 2)[1])["license"] == "apache-2.0"
    assert "vllm serve me/t --speculative-config" in card


def test_base_model_comes_from_the_hub_source_recorded_at_convert_time(sources, offline_hub, tmp_path, monkeypatch,
                                                                        run_cli):
    cache_repo(offline_hub, ASSISTANT_REPO, SHA_MAIN, sources / "assistant")
    out = tmp_path / "single"
    assert run_cli("convert", ASSISTANT_REPO, "--out", out, "--layout", "per-layer").code == 0
    use_api(monkeypatch, ExplodingApi())
    result = run_cli("upload", out, "me/a", "--dry-run", "--no-verify")
    assert result.code == 0, result.err
    meta = yaml.safe_load(result.out.split("--- me/a/README.md ---\n", 1)[1].split("---\n", 2)[1])
    assert meta["base_model"] == ASSISTANT_REPO and meta["base_model_relation"] == "quantized"
    assert f"at commit `{SHA_MAIN}`" in result.out and "Any transformers 5.x" in result.out
    override = run_cli("upload", out, "me/a", "--dry-run", "--no-verify", "--base-model", "google/other")
    assert "base_model: google/other" in override.out


def test_verify_from_repo_ids_then_upload_card_shows_its_report(sources, offline_hub, tmp_path, monkeypatch, run_cli):
    cache_repo(offline_hub, TARGET_REPO, SHA_MAIN, sources / "target")
    cache_repo(offline_hub, ASSISTANT_REPO, SHA_MAIN, sources / "assistant")
    out = tmp_path / "out"
    repos = ("--target", TARGET_REPO, "--assistant", ASSISTANT_REPO)
    assert run_cli("convert", *repos, "--out", out, "--layout", "pad-global").code == 0
    verified = run_cli("verify", *repos, "--converted", out, "--device", "cpu")
    assert verified.code == 0, verified.err
    use_api(monkeypatch, ExplodingApi())
    result = run_cli("upload", out, "--target-repo", "me/t", "--assistant-repo", "me/a", "--dry-run")
    assert result.code == 0, result.err
    target_card = result.out.split("--- me/t/README.md ---\n", 1)[1].split("--- end of card ---", 1)[0]
    assert "**PASSED** on `cpu" in target_card and "byte-identical copies" in target_card
    assert "| target layer 0 (sliding_attention) |" in target_card
    assert f"base_model: {TARGET_REPO}" in target_card


# ------------------------------------------------------------------------------------------ what leaves this machine


def _card_meta(text: str) -> dict:
    return yaml.safe_load(text.split("---\n", 2)[1])


def test_uploaded_files_hold_no_local_path(sources, tmp_path, monkeypatch, run_cli):
    """A local pair, converted and verified for real, then uploaded: no byte sent names a path of this machine."""
    local = tmp_path / "my-models"
    shutil.copytree(sources, local)
    out = tmp_path / "work" / "dst"
    assert run_cli("convert", "--target", local / "target", "--assistant", local / "assistant", "--out", out,
                   "--layout", "pad-global").code == 0
    assert run_cli("verify", "--target", local / "target", "--assistant", local / "assistant", "--converted", out,
                   "--device", "cpu").code == 0
    on_disk = json.loads((out / "target" / MANIFEST_NAME).read_text())
    assert on_disk["source"]["path"] == str((local / "target").resolve())  # kept locally: re-conversion refusal
    api = FakeHfApi()
    use_api(monkeypatch, api)
    result = run_cli("upload", out, "--target-repo", "me/t", "--assistant-repo", "me/a")
    assert result.code == 0, result.err
    private = [str(tmp_path), str(tmp_path.resolve()), os.path.expanduser("~") + "/"]
    for upload in api.uploads:
        for name, data in upload["contents"].items():
            for path in private:
                assert path.encode() not in data, f"{upload['repo_id']}/{name} holds {path}"
        manifest = json.loads(upload["contents"][MANIFEST_NAME])
        role = manifest["role"]
        assert manifest["source"]["name"] == role and "path" not in manifest["source"]
        assert manifest["source"]["files"] == on_disk["source"]["files"] if role == "target" else True
        assert json.loads(upload["contents"][VERIFICATION_NAME])["passed"] is True
    # the line that says so
    assert result.err.count("note: base model unknown for ") == 1 and result.err.count("\n") == 1
    assert "pass --base-model OWNER/NAME" in result.err
    assert "base model: unknown" in api.uploads[0]["card"] and "base_model" not in _card_meta(api.uploads[0]["card"])
    assert not (out / "target" / "README.source.md").exists()  # DST untouched
    assert json.loads((out / "target" / MANIFEST_NAME).read_text()) == on_disk


def test_base_model_inferred_from_a_local_hf_cache_snapshot_path(sources, offline_hub, tmp_path, monkeypatch,
                                                               run_cli):
    snapshot = cache_repo(offline_hub, ASSISTANT_REPO, SHA_V2, sources / "assistant")
    out = tmp_path / "single"
    assert run_cli("convert", snapshot, "--out", out, "--layout", "per-layer").code == 0  # a path, not a repo id
    assert "repo_id" not in json.loads((out / MANIFEST_NAME).read_text())["source"]
    api = FakeHfApi()
    use_api(monkeypatch, api)
    result = run_cli("upload", out, "me/a", "--no-verify")
    assert result.code == 0, result.err
    assert "note:" not in result.err
    card = api.uploads[0]["card"]
    assert _card_meta(card)["base_model"] == ASSISTANT_REPO and f"at commit `{SHA_V2}`" in card
    source = json.loads(api.uploads[0]["contents"][MANIFEST_NAME])["source"]
    assert (source["repo_id"], source["revision"]) == (ASSISTANT_REPO, SHA_V2) and "name" not in source
    assert str(offline_hub).encode() not in api.uploads[0]["contents"][MANIFEST_NAME]


def test_base_model_inferred_from_a_repo_id_shaped_name_or_path(sources, tmp_path, monkeypatch, run_cli):
    src = tmp_path / "downloaded-once"
    shutil.copytree(sources / "assistant", src)
    config = json.loads((src / "config.json").read_text())
    config["_name_or_path"] = "google/gemma-4-31B-it-assistant"
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "single"
    assert run_cli("convert", src, "--out", out, "--layout", "per-layer").code == 0
    use_api(monkeypatch, ExplodingApi())
    result = run_cli("upload", out, "me/a", "--dry-run", "--no-verify")
    assert result.code == 0 and "note:" not in result.err, result.err
    meta = _card_meta(result.out.split("--- me/a/README.md ---\n", 1)[1])
    assert meta["base_model"] == "google/gemma-4-31B-it-assistant"
    config["_name_or_path"] = "/home/someone/checkpoints/gemma"  # a path is no repo id
    (src / "config.json").write_text(json.dumps(config))
    assert run_cli("convert", src, "--out", out, "--layout", "per-layer", "--force").code == 0
    result = run_cli("upload", out, "me/a", "--dry-run", "--no-verify")
    assert result.code == 0 and result.err.startswith("note: base model unknown for ")
    assert "base_model" not in _card_meta(result.out.split("--- me/a/README.md ---\n", 1)[1])


# ------------------------------------------------------------------------------------------ each role's own base model

def _pair_cards(result) -> dict[str, dict]:
    """role -> front matter of the two cards a pair's `upload --dry-run` printed."""
    cards = {}
    for role, repo in (("target", "me/t"), ("assistant", "me/a")):
        text = result.out.split(f"--- {repo}/README.md ---\n", 1)[1].split("--- end of card ---", 1)[0]
        cards[role] = _card_meta(text)
    return cards


def _dry_run_pair(run_cli, out: Path, *options: str):
    result = run_cli("upload", out, "--target-repo", "me/t", "--assistant-repo", "me/a", "--dry-run", "--no-verify",
                     *options)
    assert result.code == 0, result.err
    return result


def test_each_card_names_its_own_base_for_a_hub_source(sources, offline_hub, tmp_path, monkeypatch, run_cli):
    cache_repo(offline_hub, TARGET_REPO, SHA_MAIN, sources / "target")
    cache_repo(offline_hub, ASSISTANT_REPO, SHA_MAIN, sources / "assistant")
    out = tmp_path / "out"
    assert run_cli("convert", "--target", TARGET_REPO, "--assistant", ASSISTANT_REPO, "--out", out,
                   "--layout", "per-layer").code == 0
    use_api(monkeypatch, ExplodingApi())
    cards = _pair_cards(_dry_run_pair(run_cli, out))
    assert (cards["target"]["base_model"], cards["assistant"]["base_model"]) == (TARGET_REPO, ASSISTANT_REPO)
    # --base-model names the target's base only; the assistant keeps its own
    cards = _pair_cards(_dry_run_pair(run_cli, out, "--base-model", "google/gemma-4-31B-it"))
    assert (cards["target"]["base_model"], cards["assistant"]["base_model"]) == ("google/gemma-4-31B-it",
                                                                                  ASSISTANT_REPO)


def test_each_card_names_its_own_base_for_a_local_source_with_provenance(sources, tmp_path, monkeypatch, run_cli):
    local = tmp_path / "downloaded"
    shutil.copytree(sources, local)
    for role, repo in (("target", "google/gemma-4-31B-it"), ("assistant", "google/gemma-4-31B-it-assistant")):
        config = json.loads((local / role / "config.json").read_text())
        config["_name_or_path"] = repo
        (local / role / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert run_cli("convert", "--target", local / "target", "--assistant", local / "assistant", "--out", out,
                   "--layout", "per-layer").code == 0
    use_api(monkeypatch, ExplodingApi())
    result = _dry_run_pair(run_cli, out)
    cards = _pair_cards(result)
    assert cards["target"]["base_model"] == "google/gemma-4-31B-it"
    assert cards["assistant"]["base_model"] == "google/gemma-4-31B-it-assistant"
    assert "warning:" not in result.err and "note:" not in result.err


def test_each_card_names_its_own_base_for_a_local_source_without_provenance(sources, tmp_path, monkeypatch,
                                                                            run_cli):
    out = tmp_path / "out"
    assert run_cli("convert", "--target", sources / "target", "--assistant", sources / "assistant",
                   "--out", out, "--layout", "per-layer").code == 0
    use_api(monkeypatch, ExplodingApi())
    cards = _pair_cards(_dry_run_pair(run_cli, out))
    assert "base_model" not in cards["target"] and "base_model" not in cards["assistant"]
    result = _dry_run_pair(run_cli, out, "--base-model", "google/gemma-4-31B-it")
    cards = _pair_cards(result)
    assert cards["target"]["base_model"] == "google/gemma-4-31B-it" and "base_model" not in cards["assistant"]
    assert result.err.startswith("note: base model unknown for ") and str(out / "assistant") in result.err
    assert str(out / "target") not in result.err
    cards = _pair_cards(_dry_run_pair(run_cli, out, "--base-model", "google/gemma-4-31B-it",
                                      "--assistant-base-model", "google/gemma-4-31B-it-assistant"))
    assert (cards["target"]["base_model"], cards["assistant"]["base_model"]) == (
        "google/gemma-4-31B-it", "google/gemma-4-31B-it-assistant")


def test_a_pair_of_mismatched_bases_is_a_warning_in_the_dry_run(sources, tmp_path, monkeypatch, run_cli):
    out = tmp_path / "out"
    assert run_cli("convert", "--target", sources / "target", "--assistant", sources / "assistant",
                   "--out", out, "--layout", "per-layer").code == 0
    use_api(monkeypatch, ExplodingApi())
    result = _dry_run_pair(run_cli, out, "--base-model", "google/gemma-4-31B-it",
                           "--assistant-base-model", "google/gemma-4-E4B-it-assistant")
    warnings = [line for line in result.err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "(31B)" in warnings[0] and "(E4B)" in warnings[0]
    assert "dry run: nothing uploaded" in result.out


@pytest.mark.parametrize("target, assistant, warns", [
    ("google/gemma-4-31B-it", "google/gemma-4-31B-it-assistant", False),
    ("google/gemma-4-26B-A4B-it", "google/gemma-4-26B-A4B-it-assistant", False),
    ("google/gemma-4-26B-A4B-it", "google/gemma-4-31B-it-assistant", True),
    ("RedHatAI/gemma-4-31B-it-FP8-block", "google/gemma-4-31B-it-assistant", False),
    ("google/gemma-4-E2B-it", "google/gemma-4-E4B-it-assistant", True),
    ("acme/my-model", "google/gemma-4-E4B-it-assistant", False),  # nothing to compare: no warning
    (None, "google/gemma-4-E4B-it-assistant", False),
])
def test_mismatched_bases_compares_gemma4_sizes(target, assistant, warns):
    from converter.hub.upload import mismatched_bases
    assert (mismatched_bases(target, assistant) is not None) == warns

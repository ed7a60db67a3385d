"""The Hub without a network, shared by tests/test_hub_*.py (fixtures registered by conftest's pytest_plugins).

Downloads: a real huggingface_hub cache (models--owner--name/{refs,snapshots,blobs}) built in tmp and read by the real
huggingface_hub code under HF_HUB_OFFLINE=1. Remote headers and uploads: a small fake HfApi that serves one repo from
a local directory and records every call. `offline_hub` also refuses every socket, so a test that tries to open a
connection fails.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from huggingface_hub import ResolvedRevision, constants
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError
from huggingface_hub.utils import SafetensorsFileMetadata, SafetensorsRepoMetadata, TensorInfo, filter_repo_objects

from converter.cli import _common
from converter.hub.failures import hub_http_client
from converter.gemma4 import Role
from converter.pipeline import ConvertRequest, execute, plan_conversion
from converter.proof.files import manifest_sha256
from converter.read.checkpoint import INDEX_NAME, VERIFICATION_NAME
from matrix.synthetic import tiny_preset, write_pair

httpx = hub_http_client()  # httpx on huggingface_hub 1.x, httpx2 on 2.x
SHA_MAIN = hashlib.sha1(b"main").hexdigest()
SHA_V2 = hashlib.sha1(b"v2").hexdigest()
TARGET_REPO, ASSISTANT_REPO = "acme/gemma-4-tiny", "acme/gemma-4-tiny-assistant"

# ------------------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture
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

    def list_models(self, *, author: str, search: str, limit: int) -> list[SimpleNamespace]:
        """The Hub's search: repos of `author` whose name contains `search`, case-insensitively."""
        self.calls.append(("list_models", author, search))
        return [SimpleNamespace(id=r) for r in self.repos
                if r.split("/")[0] == author and search.lower() in r.lower()][:limit]

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
    execute(plan_conversion(ConvertRequest(out=out, layout=layout,
                                           sources={Role.TARGET: sources / "target",
                                                    Role.ASSISTANT: sources / "assistant"})))
    if verification is not None:  # bound to the manifests it proves, as verify binds it
        verification = {**verification, "manifests": {role: manifest_sha256(out / role)
                                                      for role in ("target", "assistant")}}
        for directory in (out, out / "target", out / "assistant"):
            (directory / VERIFICATION_NAME).write_text(json.dumps(verification))
    return out


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory) -> Path:
    """A verified pad-global pair: DST/{target,assistant} with verification.json everywhere verify writes it."""
    return convert_pair(sources, tmp_path_factory.mktemp("hub-dst") / "dst", verification=verification_doc())


def without_path(report: dict) -> dict:
    return {k: v for k, v in report.items() if k != "path"}


def card_meta(text: str) -> dict:
    """The YAML front matter of a card."""
    return yaml.safe_load(text.split("---\n", 2)[1])

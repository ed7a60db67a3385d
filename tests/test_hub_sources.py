"""Hub sources: repo ids resolved to one commit, headers read over HTTP, weights downloaded only after planning.

No network: tests/_hub_fakes.py (a real offline cache, a fake HfApi, no sockets).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from huggingface_hub import constants

from converter.advice.report import inspect_checkpoint
from converter.errors import HubError
from converter.hub.download import open_checkpoint, parse_repo_ref, resolve_source
from converter.read.checkpoint import MANIFEST_NAME, read_checkpoint

from _hub_cache import cache_repo
from _hub_fakes import ASSISTANT_REPO, SHA_MAIN, SHA_V2, TARGET_REPO, ExplodingApi, RemoteRepo, use_api, without_path

pytestmark = pytest.mark.usefixtures("offline_hub")


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
    assert source.path == (tmp_path / "acme" / "model").resolve() and source.repo_id is None and source.origin() == {}


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


@pytest.mark.parametrize(("given", "meant"), [("acme/GEMMA-4-tiny", "acme/gemma-4-tiny (cached)"),
                                             ("acme/gemma-4-tiny-asistant@v2", "acme/gemma-4-tiny-assistant@v2 (cached)"),
                                             ("acme/nothing-like-it", None)])
def test_a_near_miss_hub_id_names_the_cached_id_it_resembles(sources, offline_hub, tmp_path, run_cli, given, meant):
    cache_repo(offline_hub, TARGET_REPO, SHA_MAIN, sources / "target")
    cache_repo(offline_hub, ASSISTANT_REPO, SHA_V2, sources / "assistant", refs=("main", "v2"))
    result = run_cli("convert", given, "--out", str(tmp_path / "out"), "--layout", "per-layer")
    assert result.code == 5 and result.err.count("\n") == 1, result.err
    assert "not in the Hub cache" in result.err
    assert (f"did you mean {meant}?" in result.err) if meant else ("did you mean" not in result.err)
    assert not (tmp_path / "out").exists()


def test_online_a_near_miss_hub_id_names_the_published_id(sources, tmp_path, monkeypatch, run_cli):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # "online": the fake never touches the network
    use_api(monkeypatch, RemoteRepo({TARGET_REPO: sources / "target"}, tmp_path / "dl"))
    result = run_cli("inspect", "acme/gemma-4-tinny")
    assert result.code == 5 and result.err.count("\n") == 1, result.err
    assert "no such Hub repo" in result.err and f"did you mean {TARGET_REPO} (on the Hub)?" in result.err


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

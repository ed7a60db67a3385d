"""The vLLM envs for the tests (scripts/matrix/envs.py finds them): a missing env skips the test with one line, or
fails it under GEMMA4_REQUIRE_VLLM=1 (CI, scripts/run_ledger.py)."""

from __future__ import annotations

import os

import pytest

from matrix import envs
from matrix.envs import LEGACY_TRANSFORMERS, PYTHONS_VAR, VllmEnv

__all__ = ["LEGACY_TRANSFORMERS", "PYTHONS_VAR", "VllmEnv", "find_env", "find_envs", "find_transformers_env",
           "missing_env"]

REQUIRE_VAR = "GEMMA4_REQUIRE_VLLM"


def missing_env(message: str) -> None:
    """Skip with one line, or fail the test under GEMMA4_REQUIRE_VLLM=1 (CI)."""
    if os.environ.get(REQUIRE_VAR) == "1":
        pytest.fail(f"{REQUIRE_VAR}=1: {message}", pytrace=False)
    pytest.skip(message)


def _or_missing(find, *args):
    try:
        return find(*args)
    except envs.MissingEnv as missing:
        missing_env(str(missing))


def find_env(package: str, vllm: str, transformers: str) -> VllmEnv:
    return _or_missing(envs.find_env, package, vllm, transformers)


def find_envs(package: str, vllm: str = "0.27.0") -> dict[str, VllmEnv]:
    return _or_missing(envs.find_envs, package, vllm)


def find_transformers_env(transformers: str) -> VllmEnv:
    return _or_missing(envs.find_transformers_env, transformers)

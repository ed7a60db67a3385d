"""The undocumented transformers behaviour the zero-cost dual keys rest on, pinned per transformers version.

converter/gemma4.py (DUAL_KEYS) relies on three things no transformers release promises (docs/DESIGN.md
"Zero-cost serving with the dual-keys recipe"):
`Gemma4TextConfig.__post_init__` pops only the LITERAL `global_head_dim` / `num_global_key_value_heads` (and
builds its own per_layer_config from them), an `attribute_map` from config.json becomes an instance attribute that
shadows the (empty) class map, and `allow_global_per_layer_attribute_access` lets callers read the flat sliding
`head_dim` / `num_key_value_heads` of a heterogeneous config. For each transformers version of the matrix,
scripts/consumers/vllm/transformers_probe.py runs in a python that has exactly that version and reports what AutoConfig
gives vLLM, transformers' own per-layer geometry, and the attention shapes of transformers' Gemma 4 model classes
built on the meta device. A release that changes any of it fails here, never silently at a user's.

Pythons: every vLLM env tests/_vllm_envs.py finds (GEMMA4_VLLM_PYTHONS, else the env cache); one per transformers
version is enough. A missing version skips with one line, or fails under
GEMMA4_REQUIRE_VLLM=1 (CI).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from converter.advice.serving import AMBIGUOUS
from converter.gemma4 import Role, read_spec
from converter.pipeline import ConvertRequest, execute, plan_conversion
from matrix.synthetic import tiny_preset, write_pair

from _vllm_envs import VllmEnv, missing_env
from matrix.envs import all_envs as _all_envs, version_key as _version_key

# needs the vLLM envs of four transformers releases: `make compat` runs it (docs/COMPATIBILITY.md)
pytestmark = pytest.mark.compat

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "scripts" / "consumers" / "vllm" / "transformers_probe.py"
# 5.14.1: the last release before per_layer_config; 5.15.0: the first with it; 5.19.0: one in between; "newest":
# the highest transformers among the envs (scripts/consumers/vllm builds the newest 5.x the index serves).
MATRIX = ("5.14.1", "5.15.0", "5.19.0", "newest")
FIRST_PER_LAYER = (5, 15)
PRESETS = {"31b": True, "e2b": False}  # preset -> multimodal target (31B: k_eq_v; E2B: KV-shared, no k_eq_v)
PROBE_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def transformers_pythons() -> dict[str, VllmEnv]:
    """MATRIX name -> one env with that transformers; skip (CI: fail) naming what is missing."""
    envs: dict[str, VllmEnv] = {}
    for env in _all_envs():  # any vLLM package and version: the probe needs only torch and transformers
        envs.setdefault(env.transformers, env)
    newest = max(envs, key=_version_key, default=None)
    found = {name: envs.get(newest if name == "newest" else name) for name in MATRIX}
    missing = [name for name, env in found.items() if env is None]
    if missing or newest in {"5.14.1", "5.15.0", "5.19.0"}:
        missing_env(f"transformers {', '.join(missing) or 'newer than 5.19.0'} not found among the vLLM envs "
                    f"(found: {', '.join(sorted(envs, key=_version_key)) or 'none'}); build them with scripts/consumers/vllm")
    return found  # type: ignore[return-value]


def _convert(source: Path, out: Path, **options: str) -> Path:
    request = ConvertRequest(out=out, layout="per-layer", layout_options=options,
                             sources={Role.TARGET: source / "target", Role.ASSISTANT: source / "assistant"})
    execute(plan_conversion(request))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[tuple[str, str, str], Path]:
    """(preset, variant, role) -> directory; variants: the original, per-layer (dual keys), --flat-keys-only."""
    root = tmp_path_factory.mktemp("pins")
    out: dict[tuple[str, str, str], Path] = {}
    for preset, multimodal in PRESETS.items():
        original = root / preset / "original"
        write_pair(original, preset=tiny_preset(preset), multimodal=multimodal)
        pairs = {"original": original, "dual": _convert(original, root / preset / "dual"),
                 "flat": _convert(original, root / preset / "flat", keys="flat")}
        for variant, pair in pairs.items():
            for role in ("target", "assistant"):
                out[(preset, variant, role)] = pair / role
    return out


@pytest.fixture(scope="module")
def probes(transformers_pythons, checkpoints) -> dict[str, dict]:
    """MATRIX name -> the probe's JSON for every checkpoint (one python start per version)."""
    results = {}
    for name, env in transformers_pythons.items():
        proc = subprocess.run([str(env.python), str(PROBE), *map(str, checkpoints.values())], capture_output=True,
                              text=True, timeout=PROBE_TIMEOUT_S)
        assert proc.returncode == 0, f"probe under transformers {env.transformers}: {proc.stderr[-3000:]}"
        document = json.loads(proc.stdout)
        assert document["transformers"] == env.transformers
        results[name] = document
    return results


def _expected(path: Path) -> tuple[dict, list[tuple[int, int, bool]], int, int]:
    """What vLLM must read (the flat keys), each layer's (head_dim, KV heads, KV-shared), heads and hidden size, as
    this project reads the config (converter/gemma4.py)."""
    config = json.loads((path / "config.json").read_text())
    spec = read_spec(config, source=str(path))
    a = spec.attention
    flat = {"head_dim": a.head_dim, "global_head_dim": a.global_head_dim, "num_key_value_heads": a.num_kv_heads,
            "num_global_key_value_heads": a.num_global_kv_heads, "attention_k_eq_v": a.k_eq_v,
            "layer_types": list(a.layer_types)}
    return flat, [(layer.head_dim, layer.num_kv_heads, layer.kv_shared) for layer in a.layers], a.num_heads, a.hidden_size


def _per_layer_since_5_15(version: str) -> bool:
    return _version_key(version)[:2] >= FIRST_PER_LAYER


@pytest.mark.vllm_loader
@pytest.mark.parametrize("name", MATRIX)
def test_gemma4_class_attribute_map_is_empty(probes, name):
    """The dual keys' instance attribute_map REPLACES the class one: a non-empty class map would lose its aliases."""
    assert probes[name]["class_attribute_map"] == {}


@pytest.mark.vllm_loader
@pytest.mark.parametrize("role", ["target", "assistant"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name", MATRIX)
def test_dual_keys_give_vllm_the_flat_geometry_and_transformers_its_own(probes, checkpoints, name, preset, role):
    path = checkpoints[(preset, "dual", role)]
    found = probes[name]["checkpoints"][str(path)]
    flat, layers, heads, hidden = _expected(path)
    assert found["config"]["error"] is None, found
    assert found["vllm_reads"] == flat  # what vLLM 0.27 reads (gemma4.py:573-592, gemma4_mtp.py:273-288)
    if _per_layer_since_5_15(probes[name]["transformers"]):  # transformers' own per_layer_config, rebuilt from the keys
        assert found["per_layer"] == [[head_dim, kv_heads] for head_dim, kv_heads, _ in layers]
    else:
        assert found["per_layer"] is None
    _assert_model_shapes(found["model"], layers, heads=heads, hidden=hidden)


def _assert_model_shapes(model: dict, layers: list[tuple[int, int, bool]], *, heads: int, hidden: int):
    """transformers builds no k/v projections for a KV-shared layer (assistants: every layer)."""
    assert model["error"] is None, model
    assert sorted(map(int, model["layers"])) == list(range(len(layers)))
    for index, (head_dim, kv_heads, q_only) in enumerate(layers):
        shapes = model["layers"][str(index)]
        assert shapes["q_proj"] == [heads * head_dim, hidden], (index, shapes)
        assert shapes["o_proj"] == [hidden, heads * head_dim], (index, shapes)
        assert shapes["q_norm"] == [head_dim], (index, shapes)
        if q_only:
            assert "k_proj" not in shapes, (index, shapes)
        else:
            assert shapes["k_proj"] == [kv_heads * head_dim, hidden], (index, shapes)


@pytest.mark.vllm_loader
@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name", MATRIX)
def test_original_model_shapes_equal_the_dual_keys_shapes(probes, checkpoints, name, preset):
    """The converted config builds exactly the model the original config builds, in transformers itself."""
    found = probes[name]["checkpoints"]
    for role in ("target", "assistant"):
        original = found[str(checkpoints[(preset, "original", role)])]["model"]
        assert original["error"] is None, original
        assert found[str(checkpoints[(preset, "dual", role)])]["model"]["layers"] == original["layers"]


@pytest.mark.vllm_loader
@pytest.mark.parametrize("name", MATRIX)
def test_bare_flat_keys_are_what_the_dual_keys_repair(probes, checkpoints, name):
    """Control: without the dual keys, >= 5.15 raises on the flat head_dim and hides global_head_dim; 5.14 reads them."""
    found = probes[name]["checkpoints"][str(checkpoints[("31b", "flat", "target")])]
    flat, *_ = _expected(checkpoints[("31b", "flat", "target")])
    if _per_layer_since_5_15(probes[name]["transformers"]):
        assert found["vllm_reads"]["head_dim"]["error"] == AMBIGUOUS
        assert found["vllm_reads"]["global_head_dim"] is None  # popped: vLLM would fall back to the sliding head_dim
    else:
        assert found["vllm_reads"] == flat

"""Issue 16: `inspect`'s vLLM 0.27 prediction for a checkpoint whose config contradicts its tensors, checked against
what the stock vLLM 0.27.0 loader really does (scripts/consumers/vllm/check.py inside the transformers 5.14.1 env).

Each row breaks one config key of a tiny synthetic pair, asks `gemma4-convert inspect --json` what vLLM will do
(inspect must exit 3: it reports problems), then loads the pair with the real loader:
- an error predicted -> that stage raised exactly that error (type and message);
- a silent truncation predicted -> the load passed, and the checker's comparison found exactly the parameters
  the predicted tensors feed differing from the checkpoint.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from matrix.synthetic import tiny_preset, write_pair
from converter.gemma4 import text_config_of
from _vllm_envs import LEGACY_TRANSFORMERS, find_env
from test_vllm_loader import LOADER_PACKAGE, run_checker

pytestmark = pytest.mark.vllm_loader


@pytest.fixture(scope="module")
def legacy_env():
    """The loader env with transformers 5.14.1 (skipped, or failed under GEMMA4_REQUIRE_VLLM=1, when absent)."""
    return find_env(LOADER_PACKAGE, "0.27.0", LEGACY_TRANSFORMERS)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("predict")
    write_pair(root, preset=tiny_preset("31b"), multimodal=False)
    return root



# (id, role broken, config edit, expected effect in inspect's `weights`, vLLM stage that loads the broken side)
CASES = [
    # full layers believe head_dim is half what the tensors have: k_norm (read first, sorted) hits the norm assert
    ("target-global-head-dim-halved", "target", lambda t: t.__setitem__("global_head_dim", t["global_head_dim"] // 2),
     "raises", "load_target"),
    # sliding layers believe in half the KV heads: k_proj/v_proj rows are silently cut to the first half
    ("target-kv-heads-halved", "target",
     lambda t: t.__setitem__("num_key_value_heads", t["num_key_value_heads"] // 2), "loads wrong", "load_target"),
    # the draft believes in twice the heads: its o_proj (read before q_proj) is too narrow for RowParallelLinear
    ("assistant-heads-doubled", "assistant",
     lambda t: t.__setitem__("num_attention_heads", t["num_attention_heads"] * 2), "raises", "load_draft"),
]


def _inspect(directory: Path) -> tuple[int, dict]:
    script = Path(sys.executable).parent / "gemma4-convert"
    proc = subprocess.run([str(script), "inspect", "--json", str(directory)], capture_output=True, text=True,
                          timeout=300)
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_inspect_predicts_what_the_real_loader_does(case, pristine, legacy_env, tmp_path):
    _, role, edit, effect, stage = case
    pair = tmp_path / "pair"
    shutil.copytree(pristine, pair)
    config_path = pair / role / "config.json"
    config = json.loads(config_path.read_text())
    edit(text_config_of(config))
    config_path.write_text(json.dumps(config))

    code, report = _inspect(pair / role)
    assert code == 3 and report["problems"], "inspect must exit 3 when it reports problems"
    verdict = report["vllm_0_27"]["transformers<5.15"]
    weights = report["vllm_0_27"]["weights"]
    assert weights and verdict["outcome"] == ("fails" if effect == "raises" else "loads wrong")

    checker_code, result, output = run_checker(legacy_env, pair, tmp_path / "result.json")
    assert result["versions"]["vllm"] == "0.27.0", output[-3000:]
    if effect == "raises":
        assert result["stage_failed"] == stage, output[-3000:]
        real = f"{result['error_type']}: {result['error']}".rstrip(": ")
        assert verdict["error"].rstrip(".") == real.rstrip("."), (verdict, real)
        return
    assert all(w["effect"] == "loads wrong" and "truncates" in w["detail"] for w in weights)
    side = result["target" if role == "target" else "draft"]
    assert result["stage_failed"] in (None, "compare_target", "compare_draft"), output[-3000:]
    mismatched = {m["name"] if isinstance(m, dict) else m for m in side["mismatches"]}
    # every truncated k_proj/v_proj feeds the layer's stacked qkv_proj; nothing else may differ
    layers = {w["tensor"].split(".layers.")[1].split(".")[0] for w in weights}
    assert mismatched and all(".qkv_proj." in name for name in mismatched), mismatched
    assert {name.split(".layers.")[1].split(".")[0] for name in mismatched} == layers

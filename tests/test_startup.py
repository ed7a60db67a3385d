"""The light verbs never import torch (~2 s) or, for a local path, huggingface_hub (~0.5 s).

Each verb runs in a fresh interpreter (sys.modules of this test process already holds torch) and reports which heavy
modules it loaded. The wall time these imports cost is measured by scripts/bench.py (startup rows), not here.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "huggingface_hub", "httpx", "httpx2", "safetensors", "transformers")
PROBE = """
import json, sys
from converter.cli import main
try:
    main(sys.argv[1:])
    code = 0
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "loaded": [m for m in %r if m in sys.modules]}), file=sys.stderr)
""" % (HEAVY,)


def _loaded(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, *map(str, args)], capture_output=True, text=True, timeout=120)
    return json.loads(done.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("verb", ["--help", "--version", "inspect", "inspect --json", "check-pair", "convert --help",
                                  "verify --help", "upload --help"])
def test_light_verbs_import_neither_torch_nor_the_hub(verb, synthetic_cache):
    pair = synthetic_cache("31b", "pair", num_shards=2)
    extra = {"inspect": [pair / "target"], "check-pair": [pair / "target", pair / "assistant"]}
    args = verb.split() + extra.get(verb.split()[0], [])
    result = _loaded(*args)
    assert result == {"code": 0, "loaded": []}, args


def test_per_layer_convert_needs_no_torch(synthetic_cache, tmp_path):
    """Nothing is decoded when a layout changes no tensor, so torch is not even imported."""
    pair = synthetic_cache("31b", "pair", num_shards=2)
    result = _loaded("convert", "--target", pair / "target", "--assistant", pair / "assistant", "--out",
                     tmp_path / "out", "--layout", "per-layer")
    assert result == {"code": 0, "loaded": []}
    assert (tmp_path / "out" / "target" / "conversion.json").is_file()


def test_pad_global_convert_does_import_torch(synthetic_cache, tmp_path):
    """The probe sees torch when it is used (so the two tests above can fail)."""
    pair = synthetic_cache("31b", "pair", num_shards=2)
    result = _loaded("convert", "--target", pair / "target", "--assistant", pair / "assistant", "--out",
                     tmp_path / "out", "--layout", "pad-global")
    assert result["code"] == 0 and "torch" in result["loaded"]

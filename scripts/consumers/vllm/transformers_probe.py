#!/usr/bin/env python3
"""What one installed transformers makes of Gemma 4 config.json files: the attributes vLLM reads, transformers' own
per-layer geometry, and the attention shapes of transformers' own model classes built on the meta device.

Runs inside a vLLM environment (any python with torch + one transformers); tests/test_transformers_pins.py runs it
once per transformers version of the matrix and asserts on its JSON, which pins the undocumented behaviour the
zero-cost "dual keys" (converter/gemma4.py) rest on: a release that changes it fails there, not at a user's.

usage: transformers_probe.py CHECKPOINT_DIR [...]   -> one JSON document on stdout
"""

from __future__ import annotations

import json
import re
import sys
import traceback
from importlib.metadata import version
from pathlib import Path
from typing import Any

# what vLLM 0.27 reads, in gemma4.py:573-592 / gemma4_mtp.py:273-288 and model_arch_config_convertor.py:608
VLLM_ATTRIBUTES = ("head_dim", "global_head_dim", "num_key_value_heads", "num_global_key_value_heads",
                   "attention_k_eq_v", "layer_types")
_ATTENTION = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)$")


def _error(exc: BaseException) -> dict[str, str]:
    return {"error": type(exc).__name__, "message": str(exc).splitlines()[0][:300] if str(exc) else ""}


def _read(config: Any, name: str) -> Any:
    """config.<name> the way vLLM reads it (`getattr(config, name, None)`): the value, None, or the exception."""
    try:
        return getattr(config, name, None)
    except Exception as exc:  # AmbiguousGlobalPerLayerAttributeError is a RuntimeError; report any, never hide one
        return _error(exc)


def _per_layer(text: Any) -> list[list[int]] | None:
    """transformers' own (head_dim, num_key_value_heads) per layer when it holds a heterogeneous config."""
    if not getattr(text, "is_heterogeneous", False):
        return None
    return [[layer.head_dim, layer.num_key_value_heads] for layer in text.per_layer_config]


def _shapes(model: Any) -> dict[str, dict[str, list[int]]]:
    layers: dict[str, dict[str, list[int]]] = {}
    for name, module in model.named_modules():
        match = _ATTENTION.search(name)
        if match is None or "vision" in name or "audio" in name or getattr(module, "weight", None) is None:
            continue
        layers.setdefault(match[1], {})[match[2]] = list(module.weight.shape)
    return dict(sorted(layers.items(), key=lambda kv: int(kv[0])))


def _build(cls: Any, config: Any) -> dict[str, Any]:
    import torch
    try:
        with torch.device("meta"):
            model = cls._from_config(config)
    except Exception as exc:
        return {"class": cls.__name__, **_error(exc)}
    return {"class": cls.__name__, "error": None, "layers": _shapes(model)}


def probe(path: Path) -> dict[str, Any]:
    import transformers
    from transformers import AutoConfig
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        return {"config": _error(exc)}
    text = config.get_text_config()
    result: dict[str, Any] = {
        "config": {"error": None, "class": type(config).__name__, "text_class": type(text).__name__},
        "vllm_reads": {name: _read(text, name) for name in VLLM_ATTRIBUTES},
        "per_layer": _per_layer(text),
        "model": _build(getattr(transformers, config.architectures[0]), config),
    }
    return result


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    from transformers import Gemma4TextConfig
    document = {"transformers": version("transformers"),
                # the dual keys' instance attribute_map replaces this class map: it must stay empty
                "class_attribute_map": dict(Gemma4TextConfig.attribute_map),
                "checkpoints": {}}
    for arg in argv:
        try:
            document["checkpoints"][arg] = probe(Path(arg))
        except Exception as exc:  # one broken checkpoint must not hide the others' results
            document["checkpoints"][arg] = {"config": _error(exc), "traceback": traceback.format_exc()}
    json.dump(document, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

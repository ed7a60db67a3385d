#!/usr/bin/env python3
"""Does mlx-lm (MLX's CPU backend) load a Gemma 4 target and generate what the original generates? (a consumer check)

A program of its own: it runs under the python of the MLX env (scripts/consumers/mlx/requirements.txt), never
imports the converter, and writes one JSON document. For the reference pair and each pair given: the target through
`mlx_lm.utils.load_model` (strict: every weight must have the shape the config implies), cast to float32 (MLX's CPU
gather-mm of MoE experts takes float32 only), the logits of a fixed prompt and NEW_TOKENS greedy tokens. A target
mlx-lm cannot load records the error (one line); the caller judges (tests/test_consumers.py).

usage: check.py --reference PAIR [--pair NAME=PAIR ...] --json OUT   (PAIR: a directory holding target/)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROMPT = [2, 17, 5, 33, 9, 41, 3, 12, 28, 7, 19, 36]  # the transformers check's prompt
NEW_TOKENS = 8


def check_target(path: Path) -> dict:
    import mlx.core as mx
    from mlx_lm.utils import load_model

    try:
        model, _ = load_model(path)
        model.set_dtype(mx.float32)
        tokens = list(PROMPT)
        for _ in range(NEW_TOKENS):  # greedy, the whole sequence each step: no cache to differ between layouts
            tokens.append(int(mx.argmax(model(mx.array([tokens]))[0, -1]).item()))
        logits = model(mx.array([PROMPT]))[0]
    except Exception as exc:  # noqa: BLE001 - any failure of the consumer is the finding, recorded as one line
        return {"target_error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]}
    return {"target_error": None, "greedy": tokens, "logits": logits.tolist()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path, required=True)
    parser.add_argument("--pair", action="append", default=[], metavar="NAME=PAIR")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    import mlx.core as mx
    import mlx_lm
    import transformers  # what mlx-lm reads tokenizers and configs with: the env's, recorded

    pairs = {"reference": args.reference, **{p.split("=", 1)[0]: Path(p.split("=", 1)[1]) for p in args.pair}}
    report = {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "transformers": transformers.__version__,
              "device": str(mx.default_device()),
              "pairs": {name: check_target(pair / "target") for name, pair in pairs.items()}}
    args.json.write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

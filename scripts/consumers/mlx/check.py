#!/usr/bin/env python3
"""Does mlx-lm (MLX's CPU backend) load a Gemma 4 target and generate what the original generates? (a consumer check)

A program of its own: it runs under the python of the MLX env (scripts/consumers/mlx/requirements.txt), never
imports the converter, and writes one JSON document. For the reference pair and each pair given: the target through
`mlx_lm.utils.load_model` (strict: every weight must have the shape the config implies), cast to float32 (MLX's CPU
gather-mm of MoE experts takes float32 only), the logits of a fixed prompt and NEW_TOKENS greedy tokens. A target
mlx-lm cannot load records the error (one line); the caller judges (tests/test_consumer_mlx.py).

usage: check.py --reference PAIR [--pair NAME=PAIR ...] --json OUT   (PAIR: a directory holding target/)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/consumers: run by path, not as a package
from consumer_io import NEW_TOKENS, PROMPT, one_line, parse_pairs  # noqa: E402


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
        return {"target_error": one_line(exc)}
    return {"target_error": None, "greedy": tokens, "logits": logits.tolist()}


def main(argv: list[str] | None = None) -> int:
    pairs, out = parse_pairs(__doc__.splitlines()[0], argv)
    import mlx.core as mx
    import mlx_lm
    import transformers  # what mlx-lm reads tokenizers and configs with: the env's, recorded

    report = {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "transformers": transformers.__version__,
              "device": str(mx.default_device()),
              "pairs": {name: check_target(pair / "target") for name, pair in pairs.items()}}
    out.write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

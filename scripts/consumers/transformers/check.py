#!/usr/bin/env python3
"""Does transformers load a Gemma 4 pair and compute what the original computes? (a consumer check)

A program of its own: it runs under the python of an environment that holds one transformers release and torch (a
cached vLLM env serves: only transformers is imported), never imports the converter, and prints one JSON document.
For the reference pair and each pair given, in float32 on the CPU:

- the target through `from_pretrained` (a multimodal target through AutoModelForImageTextToText, a text-only one
  through AutoModelForCausalLM): the logits of a fixed prompt (the reference's also in float64: its own float32
  rounding is the noise floor);
- the assistant through AutoModelForCausalLM `from_pretrained`, then greedy `generate(assistant_model=...)` of the
  target: its tokens, and plain greedy tokens of the target alone.

A pair that transformers cannot build records the error (one line) instead; the caller judges (tests/test_consumer_transformers.py).

usage: check.py --reference PAIR [--pair NAME=PAIR ...] --json OUT   (PAIR: a directory holding target/, assistant/)
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/consumers: run by path, not as a package
from consumer_io import NEW_TOKENS, PROMPT, one_line, parse_pairs  # noqa: E402


def load_target(path: Path, dtype: str = "float32"):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path)
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    if dtype == "float64":  # the grouped-mm experts kernel takes no float64: the eager loop where there is a choice
        try:
            return auto.from_pretrained(path, dtype=torch.float64, experts_implementation="eager").eval()
        except (TypeError, ValueError):
            pass
    return auto.from_pretrained(path, dtype=getattr(torch, dtype)).eval()


def float64_logits(path: Path, ids) -> tuple[list | None, str | None]:
    """(the reference's logits in float64, None), or (None, why not): the noise floor of its float32 logits."""
    import torch

    try:
        with torch.no_grad():
            return load_target(path, "float64")(input_ids=ids).logits[0].tolist(), None
    except Exception as exc:  # noqa: BLE001 - without a floor the caller judges by tokens only
        return None, one_line(exc)


def check_pair(pair: Path, *, float64: bool = False) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    result: dict = {"target_error": None, "assistant_error": None, "logits": None, "greedy": None, "assisted": None}
    ids = torch.tensor([PROMPT])
    try:
        target = load_target(pair / "target")
        with torch.no_grad():
            result["logits"] = target(input_ids=ids).logits[0].tolist()
            result["greedy"] = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0].tolist()

    except Exception as exc:  # noqa: BLE001 - any failure of the consumer is the finding, recorded as one line
        result["target_error"] = one_line(exc)
        return result
    if float64:  # the reference's own float32 rounding: the noise floor a layout is judged against
        result["logits_float64"], result["float64_error"] = float64_logits(pair / "target", ids)
    try:
        assistant = AutoModelForCausalLM.from_pretrained(pair / "assistant", dtype=torch.float32).eval()
        # transformers' candidate generator needs it set (else int(None) in candidate_generator.py)
        assistant.generation_config.num_assistant_tokens = 2
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        with torch.no_grad():
            result["assisted"] = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                                 assistant_model=assistant)[0].tolist()
    except Exception as exc:  # noqa: BLE001 - as above
        result["assistant_error"] = one_line(exc)
    return result


def main(argv: list[str] | None = None) -> int:
    pairs, out = parse_pairs(__doc__.splitlines()[0], argv)
    import torch
    import transformers

    torch.manual_seed(0)
    report = {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0], "pairs": {}}
    for name, pair in pairs.items():
        try:
            report["pairs"][name] = check_pair(pair, float64=name == "reference")
        except Exception:  # noqa: BLE001 - the report says what broke; the caller fails on it
            report["pairs"][name] = {"crash": traceback.format_exc()[-2000:]}
    out.write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

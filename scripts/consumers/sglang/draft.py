#!/usr/bin/env python3
"""Does SGLang draft with a Gemma 4 assistant (FROZEN_KV_MTP) on this machine's CPU? (the SGLang drafting check)

A program of its own: it runs under the python of an SGLang env (requirements-RELEASE.txt: the loader's modules and
the engine's own process and server dependencies; setup_env.py), never imports the converter, and writes one JSON
document. For the reference pair and each pair given, in a process of its own per attempt, no SGLang file changed,
SGLang's offline engine as its docs start it (`sglang.Engine`, what `python -m sglang.launch_server` runs):
target, `speculative_algorithm="FROZEN_KV_MTP"`, the assistant as `speculative_draft_model_path`, `device="cpu"`,
token ids in (`skip_tokenizer_init`: the synthetic pairs have no tokenizer), `enable_multimodal=False` (no image
processor either), greedy NEW_TOKENS tokens of PROMPT. Two ways onto the CPU, each an attempt:

- `device="cpu"`: SGLang's default engine told to use the CPU;
- `SGLANG_USE_CPU_ENGINE=1` as well: SGLang's own CPU engine (its docs' CPU set-up), which imports SGLang's CPU
  kernel build (`sgl_kernel`).

An attempt that generates records its tokens and SGLang's speculative counters; one that fails records the error
its engine's processes logged, one line, with the SGLang file and function it was raised in. The caller judges
(tests/test_consumer_sglang.py). torchvision and vllm._custom_ops: the import-only stand-ins of check.py.

usage: draft.py --reference PAIR [--pair NAME=PAIR ...] --json OUT   (PAIR: a directory holding target/ and assistant/)
       draft.py --one PAIR --json OUT                                 (one attempt, in this process)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # scripts/consumers: run by path, not as a package
sys.path.insert(0, str(HERE))
from consumer_io import NEW_TOKENS, PROMPT, in_own_process, logged_failure, one_line, parse_pairs  # noqa: E402
import standins  # noqa: E402

standins.install(["torchvision", "vllm._custom_ops"])  # here, not in attempt(): SGLang's spawned workers import this

ATTEMPTS = {"device=cpu": {}, "SGLANG_USE_CPU_ENGINE=1": {"SGLANG_USE_CPU_ENGINE": "1"}}
DRAFT_STEPS = 3  # as llama.cpp's --spec-draft-n-max 3 and mlx-vlm's block of 4


def attempt(pair: Path) -> dict:
    """One engine start and generation, in this process; the exception propagates (its log is the finding)."""
    import sglang

    engine = sglang.Engine(model_path=str(pair / "target"), speculative_algorithm="FROZEN_KV_MTP",
                           speculative_draft_model_path=str(pair / "assistant"), device="cpu",
                           skip_tokenizer_init=True, enable_multimodal=False, dtype="float32",
                           speculative_num_steps=DRAFT_STEPS, speculative_eagle_topk=1,
                           speculative_num_draft_tokens=DRAFT_STEPS + 1, max_total_tokens=256, log_level="error")
    try:
        out = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0})
    finally:
        engine.shutdown()
    meta = out.get("meta_info", {})
    return {"tokens": out.get("output_ids"), "spec": {k: v for k, v in meta.items() if k.startswith("spec_")}}


def run_attempt(pair: Path, env: dict[str, str]) -> dict:
    result, proc = in_own_process(__file__, pair, timeout=900, env=env)
    if result is not None:
        return result
    log = proc.stderr + proc.stdout
    return {"error": logged_failure(log, "sglang") or f"exit {proc.returncode}: "
                                                     f"{(log.strip().splitlines() or ['-'])[-1][:300]}"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--one":
        Path(argv[3]).write_text(json.dumps(attempt(Path(argv[1]))))
        return 0
    pairs, out = parse_pairs(__doc__.splitlines()[0], argv)
    from importlib.metadata import version

    report = {"sglang": version("sglang"), "transformers": version("transformers"), "torch": version("torch"),
              "attempts": list(ATTEMPTS), "pairs": {}}
    for name, pair in pairs.items():
        report["pairs"][name] = {label: run_attempt(pair, env) for label, env in ATTEMPTS.items()}
    out.write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # noqa: BLE001 - in --one, the traceback on stderr is what the parent reads
        if sys.argv[1:2] == ["--one"]:
            raise
        sys.exit(f"draft.py: {one_line(exc)}")

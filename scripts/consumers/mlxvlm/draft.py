#!/usr/bin/env python3
"""Does the assistant draft in mlx-vlm as the original pair's does? (the mlx-vlm drafting check)

A program of its own: it runs under the python of the mlx-vlm env (requirements.txt), never imports the converter,
and writes one JSON document. For the reference pair and each pair given, on MLX's CPU device, no mlx-vlm file
changed:

- the target through `mlx_vlm.utils.load_model`, the assistant through `speculative.drafters.load_drafter(path,
  kind="mtp")` (what `python -m mlx_vlm.generate --draft-model A --draft-kind mtp` loads), both cast to float32;
- without the draft: PROMPT's NEW_TOKENS greedy tokens from mlx-vlm's own `generate_step` (token ids in and out);
- with the assistant drafting (`draft_model=`, `draft_kind="mtp"`, `draft_block_size=BLOCK`): the same tokens, the
  drafter's accepted length per round, and every draft candidate (round, index in the block, token, its probability
  under the drafter's logits), recorded by wrapping the drafter's `draft_block` and the sampler mlx-vlm hands it.

A step mlx-vlm fails (loading, drafting) records its error, one line, with the mlx-vlm file and function it was
raised in; the caller judges (tests/test_consumer_mlx.py).

usage: draft.py --reference PAIR [--pair NAME=PAIR ...] --json OUT   (PAIR: a directory holding target/ and assistant/)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/consumers: run by path, not as a package
from consumer_io import NEW_TOKENS, PROMPT, failure, parse_pairs  # noqa: E402

BLOCK = 4  # the verified block: the bonus token and BLOCK - 1 drafts per round (as llama.cpp's --spec-draft-n-max 3)


def generate(model, drafter=None) -> dict:
    """mlx-vlm's greedy generation of PROMPT, with `drafter` drafting when given: {tokens[, drafts, accepted]}."""
    import mlx.core as mx
    from mlx_vlm.generate.ar import generate_step

    drafts: list[list] = []
    if drafter is not None:
        draft_block = drafter.draft_block

        def recording_draft_block(last_bonus, hidden, cache, block_size, sampler, *args, **kwargs):
            round_ = len({d[0] for d in drafts})
            seen = []

            def recording_sampler(logits):
                token = sampler(logits)
                probs = mx.softmax(logits[:, -1, :].astype(mx.float32), axis=-1)
                chosen = int(token.reshape(-1)[0].item())
                seen.append([round_, len(seen), chosen, round(float(probs[0, chosen].item()), 6)])
                return token

            out = draft_block(last_bonus, hidden, cache, block_size, recording_sampler, *args, **kwargs)
            if not seen:  # a drafter that picks greedily without the sampler: its tokens, no probability
                seen = [[round_, i, int(t), None] for i, t in enumerate(out.reshape(-1).tolist())]
            drafts.extend(seen)
            return out

        drafter.draft_block = recording_draft_block
    try:
        tokens = [int(token) for token, _ in generate_step(
            mx.array([PROMPT]), model, None, None, max_tokens=NEW_TOKENS, temperature=0.0,
            **({"draft_model": drafter, "draft_kind": "mtp", "draft_block_size": BLOCK} if drafter else {}))]
    finally:
        if drafter is not None:
            drafter.draft_block = draft_block
    result = {"tokens": list(PROMPT) + tokens}
    if drafter is not None:
        result.update(drafts=drafts, accepted=[float(a) for a in drafter.accept_lens])
    return result


def check_pair(pair: Path) -> dict:
    import mlx.core as mx
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.utils import load_model

    try:
        model = load_model(pair / "target")
    except Exception as exc:  # noqa: BLE001 - any failure of the consumer is the finding, recorded as one line
        return {"target_error": failure(exc, "mlx_vlm")}
    try:
        drafter, kind = load_drafter(str(pair / "assistant"), kind="mtp")
    except Exception as exc:  # noqa: BLE001
        return {"assistant_error": failure(exc, "mlx_vlm")}
    model.set_dtype(mx.float32)  # MLX's CPU gather-mm of MoE experts takes float32 only
    drafter.set_dtype(mx.float32)
    result: dict = {"kind": kind}
    for run, drafting in (("plain", None), ("drafting", drafter)):
        try:
            result[run] = generate(model, drafting)
        except Exception as exc:  # noqa: BLE001
            result[run] = {"error": failure(exc, "mlx_vlm")}
    return result


def main(argv: list[str] | None = None) -> int:
    pairs, out = parse_pairs(__doc__.splitlines()[0], argv)
    import mlx.core as mx
    import mlx_vlm

    report = {"mlx": mx.__version__, "mlx_vlm": mlx_vlm.__version__, "device": str(mx.default_device()),
              "block": BLOCK,
              "pairs": {name: check_pair(pair) for name, pair in pairs.items()}}
    out.write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

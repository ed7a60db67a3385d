"""llama.cpp converts an uploaded pair to GGUF and generates what the original generates (ledger check `consumer`;
docs/COMPATIBILITY.md, "Other consumers").

scripts/consumers/llamacpp/check.py runs under the llama.cpp env (llama-cpp-python built from its sdist, and the
convert_hf_to_gguf.py that sdist vendors; tests/_consumer_envs.py builds it once): for the engine cases of
cases.LLAMACPP_SOURCES, the original and both layouts, target and assistant through llama.cpp's GGUF converter
(float32), then the target in llama.cpp's runtime (CPU, float32 KV cache), given token ids:

- every variant: both roles convert; greedy tokens equal the original's; the assistant's KV geometry (KV heads and key
  length per layer type, from its GGUF) equals the target's layer of that type whose cache it reads;
- per-layer: every GGUF tensor (type, shape, bytes) and the model metadata identical to the original's, both roles;
- pad-global: its logits' distance from the original's is a figure (its tensors are padded; the tokens are the check).

The assistant is converted, not run: llama-cpp-python has no API that drafts with a gemma4-assistant model.
`make compat` runs the rows; CI checks their digests (tests/test_ledger.py).
"""

from __future__ import annotations

import pytest

from converter.advice.compat import FAIL, PASS, LedgerRow
from converter.testing.cases import LLAMACPP, LLAMACPP_SOURCES, LLAMACPP_TRANSFORMERS

from _consumer_envs import consumer_python
from _consumers import (AS_RESAVED, assert_varied, engine_case_row, max_diff, record_as_expected, run_check,
                        variants_and_digests)
from _ledger import skip_if_all_unchanged

CONSUMER = "llama.cpp"


def kv_geometry(gguf: dict, arch: str) -> dict[str, tuple[int, int]]:
    """{"sliding": (KV heads, key length), "full": ...} of the LAST layer of each type, from GGUF metadata."""
    meta = gguf["metadata"]
    pattern = meta[f"{arch}.attention.sliding_window_pattern"]
    heads = meta[f"{arch}.attention.head_count_kv"]
    heads = heads if isinstance(heads, list) else [heads] * len(pattern)
    found = {}
    for layer, sliding in enumerate(pattern):
        kind = "sliding" if sliding else "full"
        length = meta[f"{arch}.attention.key_length_swa" if sliding else f"{arch}.attention.key_length"]
        found[kind] = (heads[layer], length)
    return found


def judge(variant: str, got: dict, ref: dict) -> tuple[str, str, dict]:
    """(verdict, detail, figures) of one variant against the original's results in the same llama.cpp."""
    for step in ("target_error", "assistant_error", "runtime_error"):
        if got.get(step):
            return FAIL, f"{step.split('_')[0]}: {got[step]}", {}
    figures = {"max_abs_vs_original": max_diff(got["logits"], ref["logits"]),
               "greedy_identical": got["greedy"] == ref["greedy"]}
    problems = [] if figures["greedy_identical"] else [f"greedy tokens {got['greedy']} != the original's "
                                                       f"{ref['greedy']}"]
    target, draft = kv_geometry(got["target_gguf"], "gemma4"), kv_geometry(got["assistant_gguf"], "gemma4-assistant")
    problems += [f"the draft's {kind} layers have (KV heads, key length) {draft[kind]}, the target layer they read "
                 f"{target.get(kind)}" for kind in draft if draft[kind] != target.get(kind)]
    if variant != "pad-global":
        for role in ("target", "assistant"):
            mine, theirs = got[f"{role}_gguf"], ref[f"{role}_gguf"]
            differ = sorted(n for n in set(mine["tensors"]) | set(theirs["tensors"])
                            if mine["tensors"].get(n) != theirs["tensors"].get(n))
            if differ:
                problems.append(f"{role} GGUF: {len(differ)} tensor(s) differ from the original's, e.g. {differ[0]}")
            keys = sorted(k for k in set(mine["metadata"]) | set(theirs["metadata"])
                          if mine["metadata"].get(k) != theirs["metadata"].get(k))
            if keys:
                problems.append(f"{role} GGUF metadata differs from the original's: {', '.join(keys[:4])}")
    return (FAIL if problems else PASS), "; ".join(problems), figures


def llamacpp_row(name: str, variant: str, digest: str, verdict: str = PASS, detail: str = "",
                 figures: dict | None = None) -> LedgerRow:
    return engine_case_row(CONSUMER, LLAMACPP, LLAMACPP_TRANSFORMERS, name, variant, digest, verdict, detail, figures)


@pytest.mark.vllm_loader
@pytest.mark.compat
@pytest.mark.parametrize("name", LLAMACPP_SOURCES)
def test_llamacpp_converts_and_generates_like_the_original(engine_case, tmp_path, name):
    pair = engine_case(name)
    pairs, digests = variants_and_digests(pair)
    skip_if_all_unchanged([llamacpp_row(name, v, d) for v, d in digests.items()])
    report = run_check(consumer_python("llamacpp"), "llamacpp", pair.reference, pairs, tmp_path / "report.json")
    assert report["llama_cpp_python"] == LLAMACPP.split()[0] and report["transformers"] == LLAMACPP_TRANSFORMERS
    ref = report["pairs"]["reference"]
    assert not (ref["target_error"] or ref["assistant_error"] or ref.get("runtime_error")), ref
    assert_varied(ref["greedy"])
    if AS_RESAVED in pairs:  # llama.cpp falls back to per_layer_config: the re-saved input converts alike
        assert judge(AS_RESAVED, report["pairs"][AS_RESAVED], ref)[0] == PASS, report["pairs"][AS_RESAVED]
    rows = [llamacpp_row(name, v, d, *judge(v, report["pairs"][v], ref)) for v, d in digests.items()]
    record_as_expected(rows)


def _gguf(pattern: list[bool], heads: list[int], full: int = 512, sliding: int = 256, arch: str = "gemma4") -> dict:
    return {"tensors": {"w": ["F32", [2], "aa"]},
            "metadata": {f"{arch}.attention.sliding_window_pattern": pattern, f"{arch}.attention.head_count_kv": heads,
                         f"{arch}.attention.key_length": full, f"{arch}.attention.key_length_swa": sliding}}


def test_the_llamacpp_judge_can_fail():
    """Negative controls: other tokens, a per-layer tensor that differs, a draft reading a cache of another shape, a
    step llama.cpp failed; pad-global's padded tensors pass."""
    ref = {"greedy": [1, 2, 3], "logits": [[1.0, 2.0]], "target_gguf": _gguf([True, False], [16, 4]),
           "assistant_gguf": _gguf([True, False], [16, 4], arch="gemma4-assistant")}
    assert judge("per-layer", ref, ref)[0] == PASS
    assert judge("per-layer", {**ref, "greedy": [1, 2, 4]}, ref)[0] == FAIL
    changed = {**ref["target_gguf"], "tensors": {"w": ["F32", [2], "bb"]}}
    assert judge("per-layer", {**ref, "target_gguf": changed}, ref)[0] == FAIL
    assert judge("pad-global", {**ref, "target_gguf": changed}, ref)[0] == PASS
    wrong_draft = _gguf([True, False], [16, 16], arch="gemma4-assistant")
    assert judge("pad-global", {**ref, "assistant_gguf": wrong_draft}, ref)[0] == FAIL
    assert judge("per-layer", {**ref, "target_error": "KeyError: x"}, ref)[0] == FAIL

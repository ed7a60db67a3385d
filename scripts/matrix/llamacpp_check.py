"""llama.cpp converts an uploaded pair to GGUF and generates what the original generates (ledger check `consumer`;
docs/COMPATIBILITY.md, "Other consumers").

scripts/consumers/llamacpp/check.py runs under the llama.cpp env (llama-cpp-python built from its sdist, and the
convert_hf_to_gguf.py that sdist vendors; scripts/matrix/consumer_envs.py builds it once): for the engine cases of
cases.LLAMACPP_SOURCES, the original and both layouts, target and assistant through llama.cpp's GGUF converter
(float32), then the target in llama.cpp's runtime (CPU, float32 KV cache), given token ids:

- every variant: both roles convert; greedy tokens equal the original's; the assistant's KV geometry (KV heads and key
  length per layer type, from its GGUF) equals the target's layer of that type whose cache it reads;
- per-layer: every GGUF tensor (type, shape, bytes) and the model metadata identical to the original's, both roles;
- pad-global: its logits' distance from the original's is a figure (its tensors are padded; the tokens are the check).

llama-cpp-python has no API that drafts with a gemma4-assistant model: the drafting rows (ledger check `draft`) run
llama.cpp's own `llama-server`, built from the same vendored llama.cpp (scripts/consumers/llamacpp/build_server.py),
with the assistant drafting over its HTTP API (scripts/consumers/llamacpp/draft.py), beside two negative controls.
scripts/run_ledger.py measures every unit (LOADS, DRAFTS); tests/test_consumer_llamacpp.py runs them by hand and
tests the judges. CI checks the rows' digests (tests/test_ledger.py).
"""

from __future__ import annotations

import json
import subprocess
from functools import partial
from pathlib import Path

from converter.advice.ledger import CHECK_CONSUMER, CHECK_DRAFT, FAIL, PASS, LedgerRow
from matrix.digest import pair_digest
from matrix.cases import (DRAFT_CONTROLS, LLAMACPP, LLAMACPP_SOURCES, LLAMACPP_TRANSFORMERS, ORIGINAL, EnginePair,
                          build_engine_case, draft_control_pairs)
from matrix.consumer_envs import consumer_python
from matrix.consumer_rows import (AS_RESAVED, CONSUMERS, SAME_TENSORS, as_expected, carried_or_report,
                                  consumer_family, draft_distance, engine_case_row, engine_draft_row, expect_varied,
                                  max_diff, variants_and_digests)
from matrix.rows import CarriedOver, Measured, carried_group, expect, never_carried

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


# llamacpp_row(name, variant, digest, verdict=PASS, detail="", figures=None): a consumer row of llama.cpp
llamacpp_row = partial(engine_case_row, CONSUMER, LLAMACPP, LLAMACPP_TRANSFORMERS)


def measure_loads(name: str, pair: EnginePair, work: Path, carried_over: CarriedOver = never_carried) -> Measured:
    """llama.cpp converts the original and both layouts of engine case `name` to GGUF and generates its tokens."""
    pairs, digests = variants_and_digests(pair)
    kept, report = carried_or_report(f"llama.cpp-{name}", [llamacpp_row(name, v, d) for v, d in digests.items()],
                                     carried_over, lambda: consumer_python("llamacpp"), "llamacpp", pair.reference,
                                     pairs, work)
    if kept is not None:
        return kept
    expect(report["llama_cpp_python"] == LLAMACPP.split()[0] and report["transformers"] == LLAMACPP_TRANSFORMERS,
           report)
    ref = report["pairs"]["reference"]
    expect(not (ref["target_error"] or ref["assistant_error"] or ref.get("runtime_error")), ref)
    expect_varied(ref["greedy"])
    if AS_RESAVED in pairs:  # llama.cpp falls back to per_layer_config: the re-saved input converts alike
        expect(judge(AS_RESAVED, report["pairs"][AS_RESAVED], ref)[0] == PASS, report["pairs"][AS_RESAVED])
    return as_expected(f"llama.cpp-{name}", [llamacpp_row(name, v, d, *judge(v, report["pairs"][v], ref))
                                             for v, d in digests.items()])


# ---------------------------------------------------------------------------------------------- drafting (llama-server)

def server_binary(python: Path) -> Path:
    """llama-server of the llama.cpp env's own vendored llama.cpp (scripts/consumers/llamacpp/build_server.py)."""
    proc = subprocess.run([str(python), str(CONSUMERS / "llamacpp" / "build_server.py"), str(python.parents[1])],
                          capture_output=True, text=True, timeout=3600)
    expect(proc.returncode == 0, f"building llama-server: {proc.stderr.strip()[-1500:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def judge_drafting(variant: str, got: dict, ref: dict) -> tuple[str, str, dict]:
    """(verdict, detail, figures) of one pair drafting in llama-server against the original pair in the same run.

    Every pair: conversion and both server runs succeed, and greedy tokens with the draft equal those without it and
    the original's. Drafts, candidate by candidate (step, position, token, probability): a pair of the original's very
    tensors (the original, per-layer) drafts exactly as the original; any other (pad-global, the controls) differs
    from the original's drafts in no more candidates, and by no more probability, than the original's own drafts do
    under llama.cpp's float16 cache (its rounding noise; `drafting_f16_cache`).
    """
    problems = [f"{role} GGUF: {got[f'{role}_error']}" for role in ("target", "assistant") if got.get(f"{role}_error")]
    problems += [f"{run}: {got[run]['error']}" for run in ("plain", "drafting") if got.get(run, {}).get("error")]
    if problems or "plain" not in got:
        return FAIL, "; ".join(problems) or "not run", {}
    want, mine = ref["plain"]["tokens"], got["drafting"]["drafts"]
    differ, prob = draft_distance(mine, ref["drafting"]["drafts"])
    noise_differ, noise_prob = draft_distance(ref["drafting_f16_cache"]["drafts"], ref["drafting"]["drafts"])
    timings = got["drafting"]["timings"]
    figures = {"draft_n": timings["draft_n"], "draft_n_accepted": timings["draft_n_accepted"],
               "candidates": len(mine), "candidates_differ": differ, "max_prob_diff": round(prob, 4),
               "noise_candidates_differ": noise_differ, "noise_max_prob_diff": round(noise_prob, 4)}
    if got["plain"]["tokens"] != want or got["drafting"]["tokens"] != want:
        problems.append("greedy tokens differ from the original's" + (
            "" if got["plain"]["tokens"] == got["drafting"]["tokens"] else " and from its own without the draft"))
    if not mine:
        problems.append("no draft candidate logged")
    elif variant in SAME_TENSORS and (differ or prob):
        problems.append(f"drafts differ from the original pair's: {differ} of {len(mine)} candidates, probability "
                        f"by {prob:.3g}")
    elif differ > noise_differ or prob > noise_prob:
        problems.append(f"drafts differ from the original pair's beyond llama.cpp's rounding: {differ} of "
                        f"{len(mine)} candidates (float16 cache: {noise_differ}), probability by {prob:.3g} "
                        f"({noise_prob:.3g})")
    return (FAIL if problems else PASS), "; ".join(problems), figures


def draft_row(name: str, variant: str, digest: str, verdict: str, detail: str, figures: dict) -> LedgerRow:
    return engine_draft_row(CONSUMER, LLAMACPP, LLAMACPP_TRANSFORMERS, name, variant, digest, verdict, detail, figures)


def measure_drafts(name: str, pair: EnginePair, work: Path, carried_over: CarriedOver = never_carried) -> Measured:
    """llama-server with the assistant drafting (--spec-type draft-mtp): every variant's greedy tokens equal its own
    without the draft and the original pair's, and its draft candidates the original pair's; the two controls (the
    pad-global target beside the ORIGINAL assistant, an assistant with its query heads swapped) must not pass."""
    unit = f"llama-server-{name}"
    pairs, digests = variants_and_digests(pair)
    runs = {**{v: p for v, p in pairs.items() if v != AS_RESAVED}, **draft_control_pairs(pair, work / "controls")}
    digests = {**digests, **{c: pair_digest(runs[c] / "target", runs[c] / "assistant") for c in DRAFT_CONTROLS}}
    kept = carried_group([draft_row(name, v, d, PASS, "", {}) for v, d in digests.items()], carried_over)
    if kept is not None:
        return Measured(unit, kept, carried=True)
    python = consumer_python("llamacpp")
    report = run_draft(python, server_binary(python), pair.reference, {v: p for v, p in runs.items() if v != ORIGINAL},
                       work / "draft.json")
    ref = report["pairs"]["reference"]
    expect(not judge_drafting(ORIGINAL, ref, ref)[1], ref)  # the original pair drafts, and drafts something
    expect_varied(ref["plain"]["tokens"])
    return as_expected(unit, [draft_row(name, v, d, *judge_drafting(
        v, report["pairs"]["reference" if v == ORIGINAL else v], ref)) for v, d in digests.items()])


def run_draft(python: Path, server: Path, reference: Path, pairs: dict[str, Path], out: Path) -> dict:
    """The JSON report of scripts/consumers/llamacpp/draft.py under the llama.cpp env's python."""
    proc = subprocess.run([str(python), str(CONSUMERS / "llamacpp" / "draft.py"), "--server", str(server),
                           "--reference", str(reference), *(f"--pair={n}={p}" for n, p in pairs.items()),
                           "--json", str(out)], capture_output=True, text=True, timeout=3600)
    expect(proc.returncode == 0, proc.stderr[-3000:])
    return json.loads(out.read_text())


LOADS = consumer_family("llama.cpp", CHECK_CONSUMER,
                        "tests/test_consumer_llamacpp.py::test_llamacpp_converts_and_generates_like_the_original",
                        [(n,) for n in LLAMACPP_SOURCES], build_engine_case, measure_loads)
DRAFTS = consumer_family("llama-server", CHECK_DRAFT,
                         "tests/test_consumer_llamacpp.py::test_llamacpp_server_drafts_like_the_original_pair",
                         [(n,) for n in LLAMACPP_SOURCES], build_engine_case, measure_drafts)

"""The transformers consumer rows (ledger check `consumer`; docs/COMPATIBILITY.md, "Other consumers"): transformers
loads a converted pair and computes what it computes for the original.

Under every release of cases.CONSUMER_TRANSFORMERS, in an env that holds it (a built vLLM env serves:
scripts/consumers/transformers/check.py imports only transformers and torch): for each engine case of
CONSUMER_SOURCES (real head sizes, varied greedy output), the original, per-layer and pad-global pairs through
`from_pretrained`, in float32 on the CPU:

- the target's logits of a fixed prompt: per-layer identical to the original's; pad-global no further from the
  original's float64 logits than 2x the original's own float32 error (its noise floor);
- greedy `generate` of the target alone, and with `assistant_model=` the assistant: the original's tokens; where
  transformers cannot run the original's assistant either (cases.TRANSFORMERS_LIMITS), the layouts must fail alike;
- where the release cannot load the original's target at all (cases.TRANSFORMERS_FORM_LIMITS: a form newer than it),
  every variant must fail with the original's error (a `not run` row).

scripts/run_ledger.py measures every unit (one case under one release: its three rows judged together) with
`measure` (FAMILY); tests/test_consumer_transformers.py runs it by hand (`pytest -m compat`) and tests the judge.
"""

from __future__ import annotations

from pathlib import Path

from converter.advice.ledger import CHECK_CONSUMER, FAIL, NOT_RUN, PASS, LedgerRow
from matrix.digest import pair_digest
from matrix.cases import (CONSUMER_ROWS, ENGINE_SOURCES, ORIGINAL, TRANSFORMERS_FORM_LIMITS, TRANSFORMERS_LIMITS,
                          EnginePair, build_engine_case)
from matrix.consumer_rows import (as_expected, carried_or_report, consumer_family, expect_varied,
                                  judge_fails_as_original, max_diff, variants)
from matrix.envs import VllmEnv, find_transformers_env
from matrix.rows import CarriedOver, Measured, expect, never_carried, today

CONSUMER = "transformers"
FLOOR_FACTOR = 2.0  # pad-global's float32 logits may be this many times the original's own float32 error off float64


def judge(variant: str, got: dict, ref: dict) -> tuple[str, str, dict]:
    """(verdict, detail, figures) of one variant against the original's results in the same transformers."""
    if "crash" in got:
        return FAIL, f"check crashed: {got['crash'].splitlines()[-1]}", {}
    if got["target_error"]:
        return FAIL, f"target: {got['target_error']}", {}
    floor = max_diff(ref.get("logits"), ref.get("logits_float64"))
    against = ref["logits"] if variant in (ORIGINAL, "per-layer") else ref.get("logits_float64")
    delta = max_diff(got["logits"], against)
    figures = {"max_abs_vs_original": delta, "noise_floor": floor, "greedy_identical": got["greedy"] == ref["greedy"],
               "assisted_identical": got["assisted"] is not None and got["assisted"] == ref["assisted"],
               "assistant_error": got["assistant_error"]}
    problems = []
    if variant == "pad-global" and (floor is None or delta > FLOOR_FACTOR * floor):
        problems.append(f"logits {delta:.3g} off float64, over {FLOOR_FACTOR:g}x the original's float32 error "
                        f"{floor if floor is None else f'{floor:.3g}'}")
    elif variant != "pad-global" and delta != 0:
        problems.append(f"logits differ from the original's by up to {delta:.3g}")
    if not figures["greedy_identical"]:
        problems.append(f"greedy tokens {got['greedy']} != the original's {ref['greedy']}")
    if ref["assistant_error"] is None and not figures["assisted_identical"]:
        problems.append(got["assistant_error"] or f"assisted tokens {got['assisted']} != {ref['assisted']}")
    if ref["assistant_error"] is not None and got["assistant_error"] != ref["assistant_error"]:
        problems.append(f"assistant: {got['assistant_error']} where the original's fails with {ref['assistant_error']}")
    if variant == ORIGINAL and ref["assistant_error"] is not None:
        problems.append(f"assistant: {ref['assistant_error']}")  # the consumer's own limit: the original fails
    elif ref["assistant_error"] is not None and not problems:
        return PASS, f"assistant fails as the original's does: {ref['assistant_error']}", figures
    return (FAIL if problems else PASS), "; ".join(problems), figures


def consumer_row(name: str, variant: str, env: VllmEnv, version: str, digest: str, verdict: str = PASS,
                 detail: str = "", figures: dict | None = None) -> LedgerRow:
    if (name, version) in TRANSFORMERS_FORM_LIMITS:
        expected = NOT_RUN
    else:
        expected = FAIL if variant == ORIGINAL and version in TRANSFORMERS_LIMITS else PASS
    return LedgerRow(case=name, form=ENGINE_SOURCES[name].form, layout=variant, vllm="", transformers=version,
                     torch=env.torch, torch_pin=True, check=CHECK_CONSUMER, verdict=verdict, expected=expected,
                     digest=digest, measured=today(), vllm_package="", detail=detail, figures=figures or {},
                     consumer=CONSUMER, consumer_version=version)


def measure_unit(name: str, transformers: str, env: VllmEnv, pair: EnginePair, work: Path,
                 carried_over: CarriedOver = never_carried) -> Measured:
    """One case under one transformers release: its rows (one per variant), carried over where the ledger holds
    every one for these very outputs; RowMismatch where a row is not as expected."""
    unit = f"{name}-{transformers}"
    pairs = variants(pair)
    digests = {v: pair_digest(p / "target", p / "assistant") for v, p in pairs.items()}
    rows = [consumer_row(name, v, env, env.transformers, d) for v, d in digests.items()]
    kept, report = carried_or_report(unit, rows, carried_over, lambda: env.python, CONSUMER, pair.reference, pairs, work)
    if kept is not None:
        return kept
    expect(report["transformers"] == env.transformers, report["transformers"])
    ref = report["pairs"]["reference"]
    limit = TRANSFORMERS_FORM_LIMITS.get((name, transformers))
    if limit:
        expect("crash" not in ref and ref["target_error"], ref)  # the original itself: the release's limit, measured
        rows = [consumer_row(name, v, env, env.transformers, d, *judge_fails_as_original(
            {"target": report["pairs"][v].get("target_error")}, {"target": ref["target_error"]}, limit))
            for v, d in digests.items()]
    else:
        expect("crash" not in ref and ref["target_error"] is None, ref)
        expect_varied(ref["greedy"])
        rows = [consumer_row(name, v, env, env.transformers, d, *judge(v, report["pairs"][v], ref))
                for v, d in digests.items()]
    return as_expected(unit, rows)


FAMILY = consumer_family(
    "transformers", CHECK_CONSUMER,
    "tests/test_consumer_transformers.py::test_transformers_loads_and_generates_like_the_original",
    list(CONSUMER_ROWS), build_engine_case,
    lambda name, tf, pair, work, carried_over: measure_unit(name, tf, find_transformers_env(tf), pair, work,
                                                            carried_over))

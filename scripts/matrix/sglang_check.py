"""SGLang reads an uploaded pair's configs, builds both models and loads every tensor as the checkpoint holds it
(ledger check `consumer`; docs/COMPATIBILITY.md, "Other consumers").

scripts/consumers/sglang/check.py runs under an SGLang env per release of cases.SGLANG_RELEASES (requirements and
setup in scripts/consumers/sglang; scripts/matrix/consumer_envs.py builds each once), on the loader cases of
SGLANG_SOURCES, original, per-layer and pad-global: SGLang's ModelConfig and get_model on CPU, every loaded parameter
equal to its checkpoint tensor (nothing unused), and the draft's head size and KV heads equal to the target layer whose
cache it reads (SGLang's own build_frozen_kv_mtp_context; a pad-global target beside an unpadded assistant must fail
that). Where SGLang cannot load the original (cases.SGLANG_LIMITS), the original's row says so and the layouts must
load; where it cannot load that form at all (cases.SGLANG_FORM_LIMITS), every variant must fail with the original's
error (a `not run` row). Like the vLLM loader rows, no forward runs: SGLang's CPU engine needs its own kernel build.

The drafting rows (ledger check `draft`): scripts/consumers/sglang/draft.py starts SGLang's engine with the assistant
drafting (FROZEN_KV_MTP) on the CPU, both ways SGLang offers, for the original and both layouts of
SGLANG_DRAFT_SOURCES. No release drafts there, the original alike: each variant's row is `not run`, with the error
measured, and must fail exactly as the original does (a layout that failed earlier or otherwise would fail the row).

scripts/run_ledger.py measures every unit (LOADS, DRAFTS); tests/test_consumer_sglang.py runs them by hand and tests
the judges. CI checks the rows' digests (tests/test_ledger.py).
"""

from __future__ import annotations

from pathlib import Path

from converter.advice.ledger import CHECK_CONSUMER, CHECK_DRAFT, FAIL, NOT_RUN, PASS, LedgerRow
from matrix.digest import pair_digest
from matrix.cases import (ORIGINAL, SGLANG_DRAFT_SOURCES, SGLANG_FORM_LIMITS, SGLANG_LIMITS, SGLANG_RELEASES,
                          SGLANG_SOURCES, SOURCES, build_loader_case)
from matrix.consumer_envs import consumer_python
from matrix.consumer_rows import as_expected, carried_or_report, consumer_family, judge_fails_as_original
from matrix.rows import CarriedOver, Measured, expect, never_carried, today

CONSUMER = "sglang"
VARIANTS = (ORIGINAL, "per-layer", "pad-global")


def judge(got: dict) -> tuple[str, str, dict]:
    """(verdict, detail, figures) of one pair: SGLang loaded it, every tensor as the checkpoint holds it, the draft's
    KV geometry that of the target layer it reads."""
    if "error" in got:
        return FAIL, got["error"], {}
    figures = {f"{role}_compared": got[role]["counts"].get("equal", 0) + got[role]["counts"].get("equal-partial", 0)
               for role in ("target", "assistant")}
    figures["mismatched"] = sum(len(got[role]["not_equal"]) for role in ("target", "assistant"))
    figures["kv_sharing_ok"] = bool(got["geometry"]["layers"]) and all(g["match"] for g in got["geometry"]["layers"])
    problems = [f"{role}: {name} differs from the checkpoint ({note})" for role in ("target", "assistant")
                for name, _, note in got[role]["not_equal"][:2]]
    problems += [f"{role}: checkpoint tensor {name} loaded into nothing" for role in ("target", "assistant")
                 for name in got[role]["unused_checkpoint_tensors"][:2]]
    problems += [f"draft layer {g['draft_layer']} ({g['type']}) has {g['draft']}, the target layer {g['target_layer']} "
                 f"it reads {g['target']}" for g in got["geometry"]["layers"] if not g["match"]]
    if not got["geometry"]["layers"]:
        problems.append("the draft has no layers to compare")
    return (FAIL if problems else PASS), "; ".join(problems), figures


def sglang_row(name: str, variant: str, release: str, digest: str, verdict: str = PASS, detail: str = "",
               figures: dict | None = None, check: str = CHECK_CONSUMER) -> LedgerRow:
    if check == CHECK_DRAFT or (release, name) in SGLANG_FORM_LIMITS:
        expected = NOT_RUN
    else:
        expected = FAIL if variant == ORIGINAL and (release, name) in SGLANG_LIMITS else PASS
    return LedgerRow(case=name, form=SOURCES[name].form, layout=variant, vllm="", transformers=SGLANG_RELEASES[release],
                     torch="2.13.0+cpu", torch_pin=False, check=check, verdict=verdict, expected=expected,
                     digest=digest, measured=today(), vllm_package="", detail=detail, figures=figures or {},
                     consumer=CONSUMER, consumer_version=release)


def judge_sglang_drafting(got: dict, ref: dict) -> tuple[str, str, dict]:
    """A pair SGLang cannot draft on CPU, the original alike: every attempt must fail exactly as the original's."""
    return judge_fails_as_original({a: got.get(a, {}).get("error") for a in ref}, {a: ref[a]["error"] for a in ref},
                                   "SGLang's engine does not draft on CPU")


def _pairs(variants: dict[str, Path]) -> dict[str, Path]:
    pairs = {v: d for v, d in variants.items() if v in VARIANTS}
    expect(set(pairs) == set(VARIANTS), sorted(pairs))
    return pairs


def measure_loads(name: str, release: str, variants: dict[str, Path], work: Path,
                  carried_over: CarriedOver = never_carried) -> Measured:
    """SGLang `release` loads the original and both layouts of loader case `name`; a padded target beside an
    unpadded assistant must fail its KV geometry."""
    unit, pairs = f"loads-{name}-{release}", _pairs(variants)
    digests = {v: pair_digest(d / "target", d / "assistant") for v, d in pairs.items()}
    mixed = work / "mixed"  # the negative control: a padded target beside an unpadded assistant (per-layer's:
    mixed.mkdir(parents=True)  # the original's geometry, in the form every release reads)
    (mixed / "target").symlink_to(pairs["pad-global"] / "target")
    (mixed / "assistant").symlink_to(pairs["per-layer"] / "assistant")
    kept, report = carried_or_report(unit, [sglang_row(name, v, release, d) for v, d in digests.items()], carried_over,
                                     lambda: consumer_python(CONSUMER, release), CONSUMER, pairs[ORIGINAL],
                                     {**{v: d for v, d in pairs.items() if v != ORIGINAL}, "mixed": mixed}, work)
    if kept is not None:
        return kept
    expect(report["sglang"] == release and report["transformers"] == SGLANG_RELEASES[release], report)
    expect(report["torch"].endswith("+cpu"), report["torch"])
    results = {ORIGINAL: report["pairs"]["reference"], **{v: report["pairs"][v] for v in pairs if v != ORIGINAL}}
    limit = SGLANG_FORM_LIMITS.get((release, name))
    if limit:
        original = {"load": results[ORIGINAL].get("error")}
        expect(original["load"], results[ORIGINAL])  # the original itself: the release's limit, measured
        return as_expected(unit, [sglang_row(name, v, release, digests[v], *judge_fails_as_original(
            {"load": results[v].get("error")}, original, limit)) for v in VARIANTS])
    verdict, detail, _ = judge(report["pairs"]["mixed"])
    expect(verdict == FAIL and "draft layer" in detail, f"the mixed pair's KV geometry went unnoticed: {detail}")
    return as_expected(unit, [sglang_row(name, v, release, digests[v], *judge(results[v])) for v in VARIANTS])


def measure_drafts(name: str, release: str, variants: dict[str, Path], work: Path,
                   carried_over: CarriedOver = never_carried) -> Measured:
    """SGLang's engine with the assistant drafting (FROZEN_KV_MTP) on CPU: where the original cannot draft, each
    layout's row says so with the error measured, and fails exactly as the original does."""
    unit, pairs = f"drafts-{name}-{release}", _pairs(variants)
    digests = {v: pair_digest(d / "target", d / "assistant") for v, d in pairs.items()}
    kept, report = carried_or_report(unit, [sglang_row(name, v, release, d, NOT_RUN, check=CHECK_DRAFT)
                                            for v, d in digests.items()], carried_over,
                                     lambda: consumer_python(CONSUMER, release), CONSUMER, pairs[ORIGINAL],
                                     {v: d for v, d in pairs.items() if v != ORIGINAL}, work, program="draft.py")
    if kept is not None:
        return kept
    expect(report["sglang"] == release and report["torch"].endswith("+cpu"), report)
    ref = report["pairs"]["reference"]
    expect(set(ref) == set(report["attempts"]), ref)
    drafted = [a for a, got in ref.items() if "tokens" in got]
    expect(not drafted, f"SGLang {release} drafts on CPU ({drafted}): judge its drafts as llama.cpp's are, not this")
    return as_expected(unit, [sglang_row(name, v, release, digests[v], *judge_sglang_drafting(
        report["pairs"]["reference" if v == ORIGINAL else v], ref), check=CHECK_DRAFT) for v in VARIANTS])


LOADS = consumer_family("SGLang loads", CHECK_CONSUMER,
                        "tests/test_consumer_sglang.py::test_sglang_loads_every_tensor_like_the_checkpoint",
                        [(n, r) for n in SGLANG_SOURCES for r in sorted(SGLANG_RELEASES)], build_loader_case,
                        measure_loads)
DRAFTS = consumer_family("SGLang drafts", CHECK_DRAFT,
                         "tests/test_consumer_sglang.py::test_sglang_drafting_on_cpu_is_measured",
                         [(n, r) for n in SGLANG_DRAFT_SOURCES for r in sorted(SGLANG_RELEASES)], build_loader_case,
                         measure_drafts)

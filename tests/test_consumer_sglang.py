"""SGLang reads an uploaded pair's configs, builds both models and loads every tensor as the checkpoint holds it
(ledger check `consumer`; docs/COMPATIBILITY.md, "Other consumers").

scripts/consumers/sglang/check.py runs under an SGLang env per release of cases.SGLANG_RELEASES (requirements and
setup in scripts/consumers/sglang; tests/_consumer_envs.py builds each once), on the loader cases of SGLANG_SOURCES,
original, per-layer and pad-global: SGLang's ModelConfig and get_model on CPU, every loaded parameter equal to its
checkpoint tensor (nothing unused), and the draft's head size and KV heads equal to the target layer whose cache it
reads (SGLang's own build_frozen_kv_mtp_context; a pad-global target beside an unpadded assistant must fail
that). Where SGLang cannot load the original (cases.SGLANG_LIMITS), the
original's row says so and the layouts must load. Like the vLLM loader rows, no forward runs: SGLang's CPU engine
needs its own kernel build.

The drafting rows (ledger check `draft`): scripts/consumers/sglang/draft.py starts SGLang's engine with the assistant
drafting (FROZEN_KV_MTP) on the CPU, both ways SGLang offers, for the original and both layouts of
SGLANG_DRAFT_SOURCES. No release drafts there, the original alike: each variant's row is `not run`, with the error
measured, and must fail exactly as the original does (a layout that failed earlier or otherwise would fail the row).

`make compat` runs the rows; CI checks their digests (tests/test_ledger.py).
"""

from __future__ import annotations

import pytest

from converter.advice.ledger import CHECK_CONSUMER, CHECK_DRAFT, FAIL, NOT_RUN, PASS, LedgerRow
from converter.proof.digest import pair_digest
from matrix.cases import (ORIGINAL, SGLANG_DRAFT_SOURCES, SGLANG_LIMITS, SGLANG_RELEASES, SGLANG_SOURCES,
                                     SOURCES)

from _consumer_envs import consumer_python
from _consumers import judge_fails_as_original, record_as_expected, run_check
from _ledger import skip_if_all_unchanged, today

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
    if check == CHECK_DRAFT:
        expected = NOT_RUN
    else:
        expected = FAIL if variant == ORIGINAL and (release, name) in SGLANG_LIMITS else PASS
    return LedgerRow(case=name, form=SOURCES[name].form, layout=variant, vllm="", transformers=SGLANG_RELEASES[release],
                     torch="2.13.0+cpu", torch_pin=False, check=check, verdict=verdict, expected=expected,
                     digest=digest, measured=today(), vllm_package="", detail=detail, figures=figures or {},
                     consumer=CONSUMER, consumer_version=release)


@pytest.mark.vllm_loader
@pytest.mark.compat
@pytest.mark.parametrize("name", SGLANG_SOURCES)
@pytest.mark.parametrize("release", sorted(SGLANG_RELEASES))
def test_sglang_loads_every_tensor_like_the_checkpoint(loader_case, tmp_path, release, name):
    pairs = {v: d for v, d in loader_case(name).items() if v in VARIANTS}
    assert set(pairs) == set(VARIANTS), sorted(pairs)
    digests = {v: pair_digest(d / "target", d / "assistant") for v, d in pairs.items()}
    skip_if_all_unchanged([sglang_row(name, v, release, d) for v, d in digests.items()])
    mixed = tmp_path / "mixed"  # the negative control: a padded target beside an unpadded assistant (per-layer's:
    mixed.mkdir()  # the original's geometry, in the form every release reads)
    (mixed / "target").symlink_to(pairs["pad-global"] / "target")
    (mixed / "assistant").symlink_to(pairs["per-layer"] / "assistant")
    report = run_check(consumer_python(CONSUMER, release), CONSUMER, pairs[ORIGINAL],
                       {**{v: d for v, d in pairs.items() if v != ORIGINAL}, "mixed": mixed}, tmp_path / "report.json")
    assert report["sglang"] == release and report["transformers"] == SGLANG_RELEASES[release], report
    assert report["torch"].endswith("+cpu"), report["torch"]
    results = {ORIGINAL: report["pairs"]["reference"], **{v: report["pairs"][v] for v in pairs if v != ORIGINAL}}
    verdict, detail, _ = judge(report["pairs"]["mixed"])
    assert verdict == FAIL and "draft layer" in detail, f"the mixed pair's KV geometry went unnoticed: {detail}"
    rows = [sglang_row(name, v, release, digests[v], *judge(results[v])) for v in VARIANTS]
    record_as_expected(rows)


def test_the_sglang_judge_can_fail():
    """Negative controls: a tensor that differs, a checkpoint tensor loaded into nothing, a draft that reads a cache
    of another shape, a step SGLang failed."""
    good = {"target": {"counts": {"equal": 3}, "not_equal": [], "unused_checkpoint_tensors": []},
            "assistant": {"counts": {"equal": 2}, "not_equal": [], "unused_checkpoint_tensors": []},
            "geometry": {"layers": [{"draft_layer": 0, "type": "full_attention", "target_layer": 5,
                                     "draft": {"head_dim": 512}, "target": {"head_dim": 512}, "match": True}]}}
    assert judge(good)[0] == PASS
    bad = {**good, "target": {**good["target"], "not_equal": [["w", "MISMATCH", "x"]]}}
    assert judge(bad)[0] == FAIL
    assert judge({**good, "assistant": {**good["assistant"], "unused_checkpoint_tensors": ["k"]}})[0] == FAIL
    mismatch = [{**good["geometry"]["layers"][0], "target": {"head_dim": 256}, "match": False}]
    assert judge({**good, "geometry": {"layers": mismatch}})[0] == FAIL
    assert judge({"error": "load target: AssertionError: x"})[0] == FAIL


# ------------------------------------------------------------------------------------------------------ drafting

def judge_sglang_drafting(got: dict, ref: dict) -> tuple[str, str, dict]:
    """A pair SGLang cannot draft on CPU, the original alike: every attempt must fail exactly as the original's."""
    return judge_fails_as_original({a: got.get(a, {}).get("error") for a in ref}, {a: ref[a]["error"] for a in ref},
                                   "SGLang's engine does not draft on CPU")


@pytest.mark.vllm_loader
@pytest.mark.compat
@pytest.mark.parametrize("name", SGLANG_DRAFT_SOURCES)
@pytest.mark.parametrize("release", sorted(SGLANG_RELEASES))
def test_sglang_drafting_on_cpu_is_measured(loader_case, tmp_path, release, name):
    """SGLang's engine with the assistant drafting (FROZEN_KV_MTP) on CPU: where the original cannot draft, each
    layout's row says so with the error measured, and fails exactly as the original does."""
    pairs = {v: d for v, d in loader_case(name).items() if v in VARIANTS}
    digests = {v: pair_digest(d / "target", d / "assistant") for v, d in pairs.items()}
    skip_if_all_unchanged([sglang_row(name, v, release, d, NOT_RUN, check=CHECK_DRAFT) for v, d in digests.items()])
    report = run_check(consumer_python(CONSUMER, release), CONSUMER, pairs[ORIGINAL],
                       {v: d for v, d in pairs.items() if v != ORIGINAL}, tmp_path / "report.json", program="draft.py")
    assert report["sglang"] == release and report["torch"].endswith("+cpu"), report
    ref = report["pairs"]["reference"]
    assert set(ref) == set(report["attempts"]), ref
    drafted = [a for a, got in ref.items() if "tokens" in got]
    assert not drafted, f"SGLang {release} drafts on CPU ({drafted}): judge its drafts as llama.cpp's are, not this"
    rows = [sglang_row(name, v, release, digests[v], *judge_sglang_drafting(
        report["pairs"]["reference" if v == ORIGINAL else v], ref), check=CHECK_DRAFT) for v in VARIANTS]
    record_as_expected(rows)


def test_the_sglang_drafting_judge_can_fail():
    """A layout that fails otherwise than the original, or not at all, fails its row; the same errors are `not run`."""
    ref = {"device=cpu": {"error": "RuntimeError: 0 active drivers"}, "cpu engine": {"error": "ModuleNotFoundError: x"}}
    assert judge_sglang_drafting(ref, ref)[0] == NOT_RUN
    assert "0 active drivers" in judge_sglang_drafting(ref, ref)[1]
    assert judge_sglang_drafting({**ref, "device=cpu": {"error": "ValueError: shape"}}, ref)[0] == FAIL
    assert judge_sglang_drafting({**ref, "device=cpu": {"tokens": [1, 2]}}, ref)[0] == FAIL

"""`inspect --serving vllm==X` for every minor release 0.21-0.33 gives the ledger's measured recommendation.

The expectation is read here from the ledger's own rows of the release (converter/advice/ledger.json, `make
compat`), by case and layout, independently of advice/evidence.py's matching by config form: no conversion where
every row of the original passed, else per-layer where all its rows passed, else pad-global.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from converter.advice.ledger import CHECK_LOADER, PASS, load_ledger
from converter.advice.ledger import release_requirements, version_key
from matrix.cases import RELEASE_SOURCES, RELEASES, SOURCES, build_loader_case

NO_CONVERSION = "none"


def measured_layout(case: str, vllm: str, *, variants: tuple[str, ...] = ("original", "per-layer", "pad-global")
                    ) -> str | None:
    """The first of `variants` whose every loader row of `case` on `vllm` passed ("none" for the original)."""
    rows = [r for r in load_ledger() if r.check == CHECK_LOADER and r.case == case and r.vllm == vllm and r.tp == 1
            and not r.options]
    for layout in variants:
        mine = [r for r in rows if r.layout == layout]
        if mine and all(r.verdict == PASS for r in mine):
            return NO_CONVERSION if layout == "original" else layout
    return None


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("release-advice")
    return {name: build_loader_case(name, root, variants=())["original"] for name in RELEASE_SOURCES}


@pytest.mark.parametrize("case", RELEASE_SOURCES)
@pytest.mark.parametrize("release", RELEASES, ids=[r.vllm for r in RELEASES])
def test_inspect_recommends_what_the_ledger_measured_for_the_release(originals, run_cli, release, case):
    expected = measured_layout(case, release.vllm)
    assert expected is not None, f"the ledger proves no layout of {case} on vLLM {release.vllm}: run make compat"
    result = run_cli("inspect", originals[case] / "target", "--serving", f"vllm=={release.vllm}", "--json")
    assert result.code == 0, result.err
    rec = json.loads(result.out)["recommendation"]
    assert (rec["layout"], rec["proven"]) == (expected, True), rec["why"]
    assert rec["environment"]["tested"] is True and rec["environment"]["outcome"]["detail"].startswith("measured:")
    assert rec["no_conversion_needed"] == (expected == NO_CONVERSION)


@pytest.mark.parametrize("case", RELEASE_SOURCES)
@pytest.mark.parametrize("release", RELEASES, ids=[r.vllm for r in RELEASES])
def test_convert_without_layout_writes_what_the_ledger_measured_for_the_release(originals, run_cli, tmp_path,
                                                                               release, case):
    """No --layout: the first layout the release's rows prove, said in one line; a source that already serves
    there is said to, and nothing is written (--layout converts anyway)."""
    expected = measured_layout(case, release.vllm, variants=("per-layer", "pad-global"))
    source = originals[case]
    args = ("convert", "--target", source / "target", "--assistant", source / "assistant", "--out", tmp_path / "out",
            "--serving", f"vllm=={release.vllm}")
    result = run_cli(*args, "--dry-run")
    assert result.code == 0, result.err
    chosen = [line for line in result.out.splitlines() if line.startswith("chosen: --layout ")]
    if measured_layout(case, release.vllm) == NO_CONVERSION:
        assert result.out.startswith(f"vLLM {release.vllm}: the source serves as it is (measured); nothing to "
                                     "convert, nothing written"), result.out
        assert not chosen and f"vllm serve {source / 'target'} " in result.out
        forced = run_cli(*args, "--layout", expected, "--dry-run")  # an explicit layout plans it, as before
        assert forced.code == 0 and f"layout {expected}: " in forced.out
        assert f"the source already serves as it is with vLLM {release.vllm}" in forced.out
        return
    assert len(chosen) == 1 and chosen[0].startswith(f"chosen: --layout {expected}: "), result.out
    assert f"layout {expected}: " in result.out  # the plan is made with it
    assert "the source already serves as it is" not in result.out


def test_a_patch_release_the_ledger_lacks_is_answered_by_its_proven_minor(originals, run_cli):
    """vLLM 0.22.0 is not in the ledger; 0.22.1 is, and says so (0.21/0.22 draft bug: pad-global for 31B)."""
    result = run_cli("inspect", originals["31b-mm-2shards"] / "target", "--serving", "vllm==0.22.0", "--json")
    rec = json.loads(result.out)["recommendation"]
    assert rec["environment"]["proven_release"] == "0.22.1"
    assert rec["layout"] == measured_layout("31b-mm-2shards", "0.22.1")
    assert "vLLM 0.22.0 itself is not in the ledger; 0.22.1 is the proven release of its minor" in rec["why"]


def test_declared_transformers_narrows_the_answer(originals, run_cli):
    """vLLM 0.27.0: the original serves under transformers 5.14.1, not under the newest."""
    target = originals["31b-mm-2shards"] / "target"
    old = json.loads(run_cli("inspect", target, "--serving", "vllm==0.27.0,transformers==5.14.1", "--json").out)
    new = json.loads(run_cli("inspect", target, "--serving", "vllm==0.27.0,transformers==5.24.0", "--json").out)
    assert old["recommendation"]["layout"] == NO_CONVERSION
    assert new["recommendation"]["layout"] == "per-layer"
    assert new["recommendation"]["environment"]["outcome"]["error"] == "AmbiguousGlobalPerLayerAttributeError"


@pytest.mark.parametrize("spec, message", [
    ("vllm=0.27.0", "want vllm==VERSION[,transformers==VERSION]"),
    ("torch==2.13.0", "want vllm==VERSION[,transformers==VERSION]"),
    ("transformers==5.24.0", "names no vllm==VERSION"),
    ("vllm==latest", "want vllm==VERSION[,transformers==VERSION]"),
])
def test_a_malformed_serving_spec_is_one_line(originals, run_cli, spec, message):
    result = run_cli("inspect", originals["31b-mm-2shards"] / "target", "--serving", spec)
    assert result.code == 2 and message in result.err and len(result.err.strip().splitlines()) == 1


@pytest.mark.parametrize("release", RELEASES, ids=[r.vllm for r in RELEASES])
def test_a_transformers_outside_the_releases_own_range_is_a_usage_error(originals, run_cli, release):
    """Issue 53: vLLM 0.34.0 requires transformers >=5.16.1,<5.23.0; `--serving vllm==0.34.0,transformers==5.14.1`
    names an env that cannot exist. The range is the one the ledger carries from the release's wheel metadata."""
    assert release_requirements()[release.vllm] == release.transformers_range
    target = originals["31b-mm-2shards"] / "target"
    for measured in release.transformers:  # what the matrix ran it under lies inside
        if measured != "newest":
            assert run_cli("inspect", target, "--serving", f"vllm=={release.vllm},transformers=={measured}").code == 0
    outside = {"0.34.0": "5.14.1", "0.33.0": "5.21.0", "0.31.0": "5.10.3", "0.21.0": "5.2.0"}.get(release.vllm)
    if outside is None:
        return
    result = run_cli("inspect", target, "--serving", f"vllm=={release.vllm},transformers=={outside}")
    assert result.code == 2 and len(result.err.strip().splitlines()) == 1, result.err
    assert f"vLLM {release.vllm} requires transformers {release.transformers_range}" in result.err


def test_serving_and_serving_python_are_exclusive(originals, run_cli, tmp_path):
    result = run_cli("inspect", originals["31b-mm-2shards"] / "target", "--serving", "vllm==0.27.0",
                     "--serving-python", tmp_path / "python")
    assert result.code == 2 and "not both" in result.err


def test_every_release_source_is_a_loader_case():
    assert set(RELEASE_SOURCES) <= set(SOURCES)


HUB_CASES = {"mixed": "31b-mm-2shards", "uniform": "e2b"}  # the Hub columns: 31B / 26B-A4B geometry, E2B geometry


def hub_column_oracle(vllm: str, kv_heads: str) -> str | None:
    """From the raw rows, independently of advice/: among the loader cases whose original has a Hub checkpoint's
    config (flat keys) and this KV-head pattern, the first variant whose every row on `vllm` passed."""
    rows = [r for r in load_ledger() if r.check == CHECK_LOADER and r.vllm == vllm and r.tp == 1
            and r.consumer == "vllm" and r.scope == "pair"]  # a quantized assistant's rows do not speak for the target
    cases = {r.case for r in rows if r.layout == "original" and r.kv_heads == kv_heads and r.config_form == "flat-keys"}
    for variant in ("original", "per-layer", "pad-global"):
        got = [r for r in rows if r.case in cases and f"{r.layout} {r.options}".strip() == variant]
        if got and all(r.verdict == PASS for r in got):
            return NO_CONVERSION if variant == "original" else variant
    return None


def test_the_tables_hub_columns_are_what_convert_chooses(originals, run_cli, tmp_path):
    """For every release of the generated table, its Hub 31B / E2B columns equal the raw rows' answer and what
    `convert --serving vllm==X --dry-run` chooses for a 31B-geometry and an E2B-geometry checkpoint (one decision)."""
    from matrix.doc_tables import release_table

    lines = release_table(load_ledger())
    assert {line["vllm"] for line in lines} >= {r.vllm for r in RELEASES}
    for line in lines:
        for kv_heads, case in HUB_CASES.items():
            column = line["advice"][kv_heads]
            assert column == hub_column_oracle(line["vllm"], kv_heads), (line["vllm"], kv_heads, column)
            source = originals[case]
            result = run_cli("convert", "--target", source / "target", "--assistant", source / "assistant",
                             "--out", tmp_path / "out", "--serving", f"vllm=={line['vllm']}", "--dry-run")
            assert result.code == 0, result.err
            serves = f"vLLM {line['vllm']}: the source serves as it is (measured); nothing to convert" in result.out
            chosen = [c for c in result.out.splitlines() if c.startswith("chosen: --layout ")]
            assert len(chosen) == (0 if serves else 1), result.out
            assert serves == (column == NO_CONVERSION), (line["vllm"], case, result.out)
            if not serves:
                assert chosen[0].startswith(f"chosen: --layout {column}: "), (line["vllm"], case, chosen)


def test_where_no_row_answers_the_rules_do_and_say_predicted(originals, run_cli, tmp_path):
    """A release the ledger never ran (0.40.0, past its newest): the rules answer (vLLM >= 0.28 reads per-layer-type
    geometry itself), the decision says "predicted", never "measured"; convert's chosen line says so too."""
    assert "0.40.0" not in {r.vllm for r in load_ledger()}
    target = originals["31b-mm-2shards"] / "target"
    rec = json.loads(run_cli("inspect", target, "--serving", "vllm==0.40.0", "--json").out)["recommendation"]
    assert (rec["layout"], rec["basis"], rec["proven"]) == (NO_CONVERSION, "predicted", False), rec
    assert "predicted from the rules" in rec["why"] and "measured" not in rec["why"].replace("not measured", "")
    assert rec["environment"]["tested"] is False
    measured = json.loads(run_cli("inspect", target, "--serving", "vllm==0.22.1", "--json").out)["recommendation"]
    assert measured["basis"] == "measured" and "predicted" not in measured["why"]
    source = originals["31b-mm-2shards"]
    result = run_cli("convert", "--target", source / "target", "--assistant", source / "assistant",
                     "--out", tmp_path / "out", "--serving", "vllm==0.40.0", "--dry-run")
    assert result.code == 0, result.err
    assert result.out.startswith("vLLM 0.40.0: the source serves as it is (predicted from the rules, not measured); "
                                 "nothing to convert"), result.out
    assert "serve it as it is (predicted for vLLM 0.40.0, no ledger row of that release; check it there first: " \
        "make vllm-check" in result.out and "with stock vLLM 0.40.0:" not in result.out
    forced = run_cli("convert", "--target", source / "target", "--assistant", source / "assistant",
                     "--out", tmp_path / "out", "--serving", "vllm==0.40.0", "--layout", "per-layer", "--dry-run")
    chosen = [line for line in forced.out.splitlines() if line.startswith("note: for vLLM 0.40.0")]
    assert forced.code == 0 and "layout per-layer: " in forced.out
    nothing = json.loads(run_cli("inspect", target, "--serving", "vllm==0.20.0", "--json").out)["recommendation"]
    assert nothing["layout"] is None and nothing["basis"] is None  # neither rows nor rules answer before 0.21


def test_a_release_without_rows_is_never_called_proven_or_chosen_by_the_ledger(originals, tmp_path, run_cli):
    """Issue 53: a release past the ledger's newest has no row; the answer is a prediction, and every word says so."""
    newest = max((row.vllm for row in load_ledger() if row.vllm), key=version_key)
    unseen = f"0.{version_key(newest)[1] + 1}.0"
    assert unseen not in {row.vllm for row in load_ledger()}
    source = originals["31b-mm-2shards"]
    rec = json.loads(run_cli("inspect", source / "target", "--serving", f"vllm=={unseen}", "--json").out)
    environment = rec["recommendation"]["environment"]
    assert environment["tested"] is False and environment["proven_release"] is None
    assert rec["recommendation"]["basis"] == "predicted"
    result = run_cli("convert", "--target", source / "target", "--assistant", source / "assistant", "--out",
                     tmp_path / "out", "--serving", f"vllm=={unseen}", "--layout", "pad-global", "--dry-run")
    assert result.code == 0, result.err
    assert "the ledger chooses" not in result.out
    assert f"note: for vLLM {unseen} per-layer: predicted from the rules" in result.out

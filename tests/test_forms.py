"""The forms Google ships beyond the release matrix's three (issue 53; docs/DESIGN.md
"Which rows speak for a checkpoint, and the forms Google ships beyond the first three"): the 12B pair is answered by 12B
rows only, a geometry no row has says so, QAT weights are told what pad-global does to their Q4_0 grid, and a quantized
assistant gets the ledger's measured refusal instead of a serve line.

Every pair is scripts/matrix/cases.py's, as the ledger's rows were measured on it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from converter.advice.ledger import SCOPE_ASSISTANT, load_ledger, version_key
from converter.gemma4 import RELEASED_KV_GEOMETRY
from matrix.cases import SOURCES, build_loader_case
from matrix.synthetic import PRESETS, on_q4_0_grid, tiny_preset, write_pair

FORMS = ("12b-unified", "31b-qat-q4_0", "31b-w4a16-assistant", "31b-mm-2shards")
PADDED_O_PROJ = "model.language_model.layers.0.self_attn.o_proj.weight"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, dict[str, Path]]:
    root = tmp_path_factory.mktemp("forms")
    return {name: build_loader_case(name, root) for name in FORMS}


def test_each_published_size_has_the_geometry_its_rows_are_matched_by():
    for name, preset in PRESETS.items():
        full_kv = preset.num_global_kv_heads if preset.k_eq_v else preset.num_kv_heads
        assert RELEASED_KV_GEOMETRY[name] == (preset.num_kv_heads, full_kv,
                                              preset.global_head_dim // preset.head_dim), name
    assert RELEASED_KV_GEOMETRY["12b"] == (8, 1, 2)  # its 8-to-1 split: no 31B / 26B-A4B row has it


@pytest.mark.parametrize("vllm, transformers", [("0.27.0", "5.14.1"), ("0.27.0", None), ("0.34.0", "5.22.2")])
def test_inspect_on_a_12b_pair_cites_12b_rows_only(built, run_cli, vllm, transformers):
    serving = f"vllm=={vllm}" + (f",transformers=={transformers}" if transformers else "")
    result = run_cli("inspect", built["12b-unified"]["original"] / "target", "--serving", serving, "--json")
    assert result.code == 0, result.err
    recommendation = json.loads(result.out)["recommendation"]
    cited = " ".join([recommendation["why"], *recommendation["environment"]["evidence"]])
    assert "12b-unified" in cited and recommendation["basis"] == "measured", cited
    other_cases = {row.case for row in load_ledger()} - {"12b-unified"}
    assert not [case for case in other_cases if f"{case} " in cited or f"{case};" in cited or f"{case})" in cited]


def test_a_geometry_no_row_has_is_predicted_and_says_so(tmp_path, run_cli):
    """A 12B-like pair with 4 sliding KV heads (no published size has 4 / 1): before, 31B rows answered it."""
    write_pair(tmp_path / "pair", preset=replace(tiny_preset("12b"), num_kv_heads=4), multimodal=False)
    result = run_cli("inspect", tmp_path / "pair" / "target", "--serving", "vllm==0.27.0,transformers==5.14.1",
                     "--json")
    assert result.code == 0, result.err
    recommendation = json.loads(result.out)["recommendation"]
    assert recommendation["basis"] == "predicted" and recommendation["environment"]["proven_release"] is None
    assert "no row of this geometry (4 sliding / 1 full KV heads, full heads 2x as wide)" in \
        recommendation["environment"]["outcome"]["detail"], recommendation


def test_the_forms_join_the_ledger_on_every_release_but_the_gaps():
    from matrix.cases import FORM_GAPS, RELEASES

    rows = [r for r in load_ledger() if r.case in ("12b-unified", "31b-qat-q4_0")]
    # vLLM's rows (the other consumers' rows name no vLLM release); every row's verdict is checked below
    assert {(r.case, r.vllm) for r in rows if r.consumer == "vllm"} == {(c, r.vllm) for c in ("12b-unified", "31b-qat-q4_0")
                                                for r in RELEASES if r.vllm not in FORM_GAPS}
    assert all(r.verdict == r.expected for r in rows)
    # each layout passes, or is `not run` exactly where the consumer cannot run the original either; only the
    # drafting controls (other layout names) are meant to fail
    layouts = [r for r in rows if r.layout in ("per-layer", "pad-global")]
    # below the 12B family's floors (vLLM 0.23, transformers 5.10) and in 0.21/0.22's draft KV-head bug the layouts
    # fail as predicted (their `expected`, checked above); from vLLM 0.27.0 and transformers 5.10 on, each passes
    served = [r for r in layouts if version_key(r.vllm or "0.27.0") >= (0, 27) and version_key(r.transformers) >= (5, 10)]
    assert served and all(r.verdict == "pass" for r in served)
    assert all(r.verdict == "pass" for r in layouts if r.expected == "pass")
    originals = {(r.case, r.check, r.consumer, r.consumer_version, r.vllm, r.transformers): r.verdict
                 for r in rows if r.layout == "original"}
    assert all(originals[(r.case, r.check, r.consumer, r.consumer_version, r.vllm, r.transformers)] == "not run"
               for r in layouts if r.verdict == "not run")
    assert {r.layout for r in rows} > {"original", "per-layer", "pad-global"}  # the drafting controls are rows too


# ------------------------------------------------------------------------------------ QAT weights and pad-global

def _tensor(checkpoint: Path, name: str) -> torch.Tensor:
    for shard in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as handle:
            if name in handle.keys():
                return handle.get_tensor(name)
    raise KeyError(name)


def test_pad_global_takes_qat_weights_off_their_q4_0_grid_as_the_note_says(built):
    """gguf's own Q4_0 quantizer re-quantizes the QAT source losslessly and pad-global's spread o_proj not."""
    source = _tensor(built["31b-qat-q4_0"]["original"] / "target", PADDED_O_PROJ)
    padded = _tensor(built["31b-qat-q4_0"]["pad-global"] / "target", PADDED_O_PROJ)
    kept = _tensor(built["31b-qat-q4_0"]["per-layer"] / "target", PADDED_O_PROJ)
    assert torch.equal(on_q4_0_grid(source).to(source.dtype), source)
    assert torch.equal(kept, source)
    assert not torch.equal(on_q4_0_grid(padded).to(padded.dtype), padded)
    assert torch.equal(padded[:, ::2], source)  # the values themselves stay exact


def test_inspect_and_convert_name_what_leaves_the_grid(built, run_cli, tmp_path):
    qat = built["31b-qat-q4_0"]["original"]
    report = json.loads(run_cli("inspect", qat / "target", "--json").out)
    notes = [w for w in report["warnings"] if "Q4_0 grid" in w]
    assert len(notes) == 1 and "pad-global spreads the input columns of 5 tensors" in notes[0]
    assert PADDED_O_PROJ in notes[0] and "per-layer keeps every tensor as it is" in notes[0]
    for layout, noted in (("pad-global", True), ("per-layer", False)):
        result = run_cli("convert", "--target", qat / "target", "--assistant", qat / "assistant", "--out",
                         tmp_path / layout, "--layout", layout, "--dry-run")
        assert result.code == 0, result.err
        assert ("Q4_0 grid" in result.out + result.err) is noted, (layout, result.out, result.err)
    bf16 = built["31b-mm-2shards"]["original"]
    assert not [w for w in json.loads(run_cli("inspect", bf16 / "target", "--json").out)["warnings"] if "Q4_0" in w]


# ------------------------------------------------------------------------------------ quantized assistants

MEASURED_REFUSAL = "There is no module or parameter named 'model.post_projection.weight' in Gemma4MTP"


def test_the_ledger_holds_the_measured_refusal_of_a_quantized_assistant():
    rows = [r for r in load_ledger() if r.case == "31b-w4a16-assistant" and not r.options]  # as published
    assert rows and all(r.verdict == "fail" == r.expected for r in rows)
    scoped = [r for r in rows if r.scope == SCOPE_ASSISTANT]
    assert {r.layout for r in scoped} == {"original", "per-layer"}
    assert all(MEASURED_REFUSAL in r.detail for r in scoped)


@pytest.mark.parametrize("layout", [None, "per-layer"])
def test_convert_quotes_the_refusal_and_prints_no_serve_line(built, run_cli, tmp_path, layout):
    pair = built["31b-w4a16-assistant"]["original"]
    result = run_cli("convert", "--target", pair / "target", "--assistant", pair / "assistant", "--out",
                     tmp_path / "out", *(("--layout", layout) if layout else ()))
    assert result.code == 0, result.err
    said = result.out + result.err
    assert f"refuses such a pair, converted or not (measured: load_draft: ValueError: {MEASURED_REFUSAL}" in said
    assert "no serve line:" in result.out and "vllm serve" not in result.out, result.out
    assert SOURCES["31b-w4a16-assistant"].w4a16_assistant


@pytest.mark.parametrize("serving", ["vllm==0.21.0", "vllm==0.27.0,transformers==5.8.0"])
def test_a_12b_pair_below_its_family_floors_gets_no_serve_line(built, run_cli, tmp_path, serving):
    """vLLM < 0.23 and transformers < 5.10 serve no 12B pair in any layout (measured: the ledger's 0.21.0 and
    0.27.0 + 5.8.0 rows): convert writes the layout asked for and says why it prints no `vllm serve` line."""
    pair = built["12b-unified"]["original"]
    result = run_cli("convert", "--target", pair / "target", "--assistant", pair / "assistant", "--out",
                     tmp_path / "out", "--layout", "per-layer", "--serving", serving)
    assert result.code == 0, result.err
    assert "no serve line: no layout of this tool is proven to serve" in result.out, result.out
    assert "gemma4_unified" in result.out and "vllm serve" not in result.out, result.out


def test_a_bf16_pair_keeps_its_serve_line(built, run_cli, tmp_path):
    pair = built["31b-mm-2shards"]["original"]
    result = run_cli("convert", "--target", pair / "target", "--assistant", pair / "assistant", "--out",
                     tmp_path / "out", "--layout", "per-layer")
    assert result.code == 0 and "vllm serve" in result.out and "no serve line" not in result.out

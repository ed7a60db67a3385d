"""The card and `inspect` of an output show how to run the pair with its assistant drafting in each consumer whose
ledger rows prove it for that layout, quoting those rows; nowhere else.

The oracle reads the raw ledger rows itself: vLLM engine rows that passed, other consumers' rows that passed with
assisted generation equal to the original's (`assisted_identical`), and `draft` rows that passed.
"""

from __future__ import annotations

import json

import pytest

from converter.advice.ledger import load_ledger

from _hub_fakes import ASSISTANT_REPO, TARGET_REPO

pytestmark = pytest.mark.usefixtures("offline_hub")


def proven_consumers(variant: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for r in load_ledger():
        if f"{r.layout} {r.options}".strip() != variant or r.verdict != "pass":
            continue
        drafting = (r.consumer == "vllm" and r.check == "engine") or r.check == "draft" or (
            r.check == "consumer" and r.figures.get("assisted_identical") is True
            and r.figures.get("assistant_error") is None)
        if drafting:
            found.setdefault(r.consumer, set()).add(r.consumer_version or r.vllm)
    return found


@pytest.mark.parametrize("layout", ["per-layer", "pad-global"])
def test_card_and_inspect_list_each_consumer_proven_drafting(sources, tmp_path, run_cli, layout):
    out = tmp_path / "out"
    assert run_cli("convert", "--target", sources / "target", "--assistant", sources / "assistant", "--out", out,
                   "--layout", layout).code == 0
    expected = proven_consumers(layout)
    assert {"vllm", "transformers"} <= set(expected)  # the ledger proves both today
    dry = run_cli("upload", out, "--target-repo", TARGET_REPO, "--assistant-repo", ASSISTANT_REPO, "--dry-run",
                  "--no-verify")
    assert dry.code == 0, dry.err
    card = dry.out.split(f"--- {TARGET_REPO}/README.md ---\n", 1)[1].split("--- end of card ---", 1)[0]
    section = card.split("## Run the pair with its assistant drafting", 1)[1].split("\n## ", 1)[0]
    listed = {line.split("**")[1] for line in section.splitlines() if line.startswith("**")}
    assert listed == set(expected), (listed, expected)
    for consumer, versions in expected.items():
        line = next(line for line in section.splitlines() if line.startswith(f"**{consumer}**"))
        assert all(v in line for v in versions), (line, versions)
    assert "assistant_model=assistant" in section and f'from_pretrained("{ASSISTANT_REPO}")' in section
    report = json.loads(run_cli("inspect", out / "target", "--json").out)
    assert {p["consumer"]: set(p["versions"]) for p in report["drafting"]} == expected
    vllm = next(p for p in report["drafting"] if p["consumer"] == "vllm")
    assert str(out / "target") in vllm["command"] and str(out / "assistant") in vllm["command"]


def test_an_unproven_variant_and_a_source_list_nothing(sources, tmp_path, run_cli):
    """--flat-keys-only has no drafting rows; a checkpoint this tool did not write gets no commands."""
    assert proven_consumers("per-layer --flat-keys-only") == {}
    out = tmp_path / "flat"
    assert run_cli("convert", "--target", sources / "target", "--assistant", sources / "assistant", "--out", out,
                   "--flat-keys-only").code == 0
    assert json.loads(run_cli("inspect", out / "target", "--json").out)["drafting"] == []
    assert json.loads(run_cli("inspect", sources / "target", "--json").out)["drafting"] == []
    dry = run_cli("upload", out, "--target-repo", TARGET_REPO, "--assistant-repo", ASSISTANT_REPO, "--dry-run",
                  "--no-verify")
    assert "records no run of this layout with the assistant drafting" in dry.out

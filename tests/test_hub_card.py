"""The model card: front matter, serve line, KV cost, the ledger rows and verification it quotes, each role's own base model.

No network: tests/_hub_fakes.py (a real offline cache, a fake HfApi, no sockets).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from converter.advice.ledger import NOT_RUN, load_ledger
from converter.advice.ledger import version_key
from converter.hub.card import render_card
from converter.pairing import serve_line
from converter.gemma4 import Role
from converter.pipeline import ConvertRequest, plan_conversion, serve_command
from converter.read.checkpoint import MANIFEST_NAME

from _hub_cache import cache_repo
from _hub_fakes import ASSISTANT_REPO, SHA_MAIN, TARGET_REPO, ExplodingApi, card_meta, use_api, verification_doc

pytestmark = pytest.mark.usefixtures("offline_hub")


# -------------------------------------------------------------------------------------------------------------- card


def test_card_front_matter_serve_line_kv_cost_and_verification(converted):
    manifest = json.loads((converted / "target" / MANIFEST_NAME).read_text())
    manifest["source"].update(repo_id="google/gemma-4-31B-it", revision=SHA_MAIN)
    card = render_card(manifest=manifest, verification=verification_doc(), repo_id="me/t", target_repo="me/t",
                       assistant_repo="me/a", base_model="google/gemma-4-31B-it",
                       source_front_matter={"license": "apache-2.0", "extra_gated_prompt": "x"}, source_card=True)
    front, body = card.split("---\n", 2)[1:]
    meta = yaml.safe_load(front)
    # a re-layout changes no dtype: no `quantized` (nor any other) relation is claimed (docs/HUB.md)
    assert meta["base_model"] == "google/gemma-4-31B-it" and "base_model_relation" not in meta
    assert meta["license"] == "apache-2.0" and "extra_gated_prompt" not in meta
    assert meta["library_name"] == "transformers" and "layout-pad-global" in meta["tags"]
    assert f"[google/gemma-4-31B-it](https://huggingface.co/google/gemma-4-31B-it) at commit `{SHA_MAIN}`" in body
    assert ("vllm serve me/t --speculative-config '{\"method\": \"mtp\", \"model\": \"me/a\", "
            "\"num_speculative_tokens\": 4}' --attention-backend TRITON_ATTN") in body
    assert "| every layer holds the full context | 5.5 KiB | 12.0 KiB | x2.18 |" in body
    assert "**PASSED** on `cuda (NVIDIA H200)` (bf16, torch 2.13.0, CUDA 13.0, seed 0, 12.5 s, gemma4-convert 0.1.0)" \
        in body
    assert ("3 comparisons, 0 failed: lowest cosine 0.999988 (target layer 2); largest error x2.00 the original's own "
            "noise floor (target layer 1; allowed x2)") in body
    assert "| target layer 0 | 1.000e-03 | 2.000e-03 | 1.000e-03 | 0.999990 | 1.000e-03 | x1.00 | x2 | ok |" in body
    assert "`README.source.md`" in body


def test_card_quotes_the_ledger_rows_of_its_layout(converted):
    manifest = json.loads((converted / "target" / MANIFEST_NAME).read_text())
    card = render_card(manifest=manifest, verification=verification_doc(), repo_id="me/t", target_repo="me/t",
                       assistant_repo="me/a", base_model=None)
    section = card.split("## Proven with stock vLLM\n", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in load_ledger() if r.variant == "pad-global" and r.verdict != NOT_RUN  # reasons prove nothing
            and r.consumer == "vllm"]
    assert rows, "the ledger holds no pad-global row"
    lines = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| vLLM ")]
    assert [line.split(" | ")[0][2:] for line in lines] == sorted({r.vllm for r in rows}, key=version_key)
    for row in rows:  # each release's line names every transformers it was measured with
        line = next(line for line in lines if line.startswith(f"| {row.vllm} |"))
        assert row.transformers in line.split(" | ")[1]
    engine = [r for r in rows if r.vllm == "0.27.0" and r.check == "engine" and r.tp == 1]
    assert f"| {sum(r.verdict == 'pass' for r in engine)}/{len(engine)} |" in next(
        line for line in lines if line.startswith("| 0.27.0 |"))
    assert len(section.splitlines()) < 30 and "Error" not in section  # counts, never a consumer's exception text


def test_card_for_an_assistant_without_verification_or_base_model(converted):
    manifest = json.loads((converted / "assistant" / MANIFEST_NAME).read_text())
    card = render_card(manifest=manifest, verification=None, repo_id="me/a", target_repo=None, assistant_repo="me/a",
                       base_model=None)
    meta = yaml.safe_load(card.split("---\n", 2)[1])
    assert "base_model" not in meta and "base_model_relation" not in meta
    assert "a local checkpoint (`assistant`; base model: unknown)" in card and str(converted) not in card
    assert "vllm serve <TARGET converted the same way> --speculative-config" in card
    assert "None of its own" in card and "**Not verified**" in card


def test_card_serve_line_matches_the_convert_verb(sources, tmp_path):
    for layout in ("per-layer", "pad-global"):
        out = tmp_path / layout
        plan = plan_conversion(ConvertRequest(out=out, layout=layout,
                                              sources={Role.TARGET: sources / "target",
                                                       Role.ASSISTANT: sources / "assistant"}))
        assert serve_command(plan) == serve_line(target=str(out / "target"), assistant=str(out / "assistant"),
                                                 layout=layout)


# ------------------------------------------------------------------------------------------ each role's own base model

def _pair_cards(result) -> dict[str, dict]:
    """role -> front matter of the two cards a pair's `upload --dry-run` printed."""
    cards = {}
    for role, repo in (("target", "me/t"), ("assistant", "me/a")):
        text = result.out.split(f"--- {repo}/README.md ---\n", 1)[1].split("--- end of card ---", 1)[0]
        cards[role] = card_meta(text)
    return cards


def _dry_run_pair(run_cli, out: Path, *options: str):
    result = run_cli("upload", out, "--target-repo", "me/t", "--assistant-repo", "me/a", "--dry-run", "--no-verify",
                     *options)
    assert result.code == 0, result.err
    return result


def test_each_card_names_its_own_base_for_a_hub_source(sources, offline_hub, tmp_path, monkeypatch, run_cli):
    cache_repo(offline_hub, TARGET_REPO, SHA_MAIN, sources / "target")
    cache_repo(offline_hub, ASSISTANT_REPO, SHA_MAIN, sources / "assistant")
    out = tmp_path / "out"
    assert run_cli("convert", "--target", TARGET_REPO, "--assistant", ASSISTANT_REPO, "--out", out,
                   "--layout", "per-layer").code == 0
    use_api(monkeypatch, ExplodingApi())
    cards = _pair_cards(_dry_run_pair(run_cli, out))
    assert (cards["target"]["base_model"], cards["assistant"]["base_model"]) == (TARGET_REPO, ASSISTANT_REPO)
    # --base-model names the target's base only; the assistant keeps its own
    cards = _pair_cards(_dry_run_pair(run_cli, out, "--base-model", "google/gemma-4-31B-it"))
    assert (cards["target"]["base_model"], cards["assistant"]["base_model"]) == ("google/gemma-4-31B-it",
                                                                                  ASSISTANT_REPO)


def test_each_card_names_its_own_base_for_a_local_source_with_provenance(sources, tmp_path, monkeypatch, run_cli):
    local = tmp_path / "downloaded"
    shutil.copytree(sources, local)
    for role, repo in (("target", "google/gemma-4-31B-it"), ("assistant", "google/gemma-4-31B-it-assistant")):
        config = json.loads((local / role / "config.json").read_text())
        config["_name_or_path"] = repo
        (local / role / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert run_cli("convert", "--target", local / "target", "--assistant", local / "assistant", "--out", out,
                   "--layout", "per-layer").code == 0
    use_api(monkeypatch, ExplodingApi())
    result = _dry_run_pair(run_cli, out)
    cards = _pair_cards(result)
    assert cards["target"]["base_model"] == "google/gemma-4-31B-it"
    assert cards["assistant"]["base_model"] == "google/gemma-4-31B-it-assistant"
    assert "warning:" not in result.err and "note:" not in result.err


def test_each_card_names_its_own_base_for_a_local_source_without_provenance(sources, tmp_path, monkeypatch,
                                                                            run_cli):
    out = tmp_path / "out"
    assert run_cli("convert", "--target", sources / "target", "--assistant", sources / "assistant",
                   "--out", out, "--layout", "per-layer").code == 0
    use_api(monkeypatch, ExplodingApi())
    cards = _pair_cards(_dry_run_pair(run_cli, out))
    assert "base_model" not in cards["target"] and "base_model" not in cards["assistant"]
    result = _dry_run_pair(run_cli, out, "--base-model", "google/gemma-4-31B-it")
    cards = _pair_cards(result)
    assert cards["target"]["base_model"] == "google/gemma-4-31B-it" and "base_model" not in cards["assistant"]
    assert result.err.startswith("note: base model unknown for ") and str(out / "assistant") in result.err
    assert str(out / "target") not in result.err
    cards = _pair_cards(_dry_run_pair(run_cli, out, "--base-model", "google/gemma-4-31B-it",
                                      "--assistant-base-model", "google/gemma-4-31B-it-assistant"))
    assert (cards["target"]["base_model"], cards["assistant"]["base_model"]) == (
        "google/gemma-4-31B-it", "google/gemma-4-31B-it-assistant")


def test_a_pair_of_mismatched_bases_is_a_warning_in_the_dry_run(sources, tmp_path, monkeypatch, run_cli):
    out = tmp_path / "out"
    assert run_cli("convert", "--target", sources / "target", "--assistant", sources / "assistant",
                   "--out", out, "--layout", "per-layer").code == 0
    use_api(monkeypatch, ExplodingApi())
    result = _dry_run_pair(run_cli, out, "--base-model", "google/gemma-4-31B-it",
                           "--assistant-base-model", "google/gemma-4-E4B-it-assistant")
    warnings = [line for line in result.err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "(31B)" in warnings[0] and "(E4B)" in warnings[0]
    assert "dry run: nothing uploaded" in result.out


@pytest.mark.parametrize("target, assistant, warns", [
    ("google/gemma-4-31B-it", "google/gemma-4-31B-it-assistant", False),
    ("google/gemma-4-26B-A4B-it", "google/gemma-4-26B-A4B-it-assistant", False),
    ("google/gemma-4-26B-A4B-it", "google/gemma-4-31B-it-assistant", True),
    ("RedHatAI/gemma-4-31B-it-FP8-block", "google/gemma-4-31B-it-assistant", False),
    ("google/gemma-4-E2B-it", "google/gemma-4-E4B-it-assistant", True),
    ("acme/my-model", "google/gemma-4-E4B-it-assistant", False),  # nothing to compare: no warning
    (None, "google/gemma-4-E4B-it-assistant", False),
])
def test_mismatched_bases_compares_gemma4_sizes(target, assistant, warns):
    from converter.hub.publish import mismatched_bases
    assert (mismatched_bases(target, assistant) is not None) == warns

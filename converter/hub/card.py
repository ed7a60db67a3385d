"""The model card (README.md) an upload writes, rendered from conversion.json and verification.json (pure, no I/O).

Front matter follows the Hub's model-card metadata (https://huggingface.co/docs/hub/model-cards): `base_model` is the
source repo; `base_model_relation` is left out, since none of "adapter", "merge", "quantized", "finetune" describes a
re-layout (no dtype changed, nothing trained; docs/HUB.md, "The model card"). The prose says so plainly.

`convert` writes this card as each role's README.md (placeholders for the repo ids); `upload` renders it again with
the repo ids and verification.json.
"""

from __future__ import annotations

from typing import Any, Mapping

import yaml

from .. import __version__
from ..advice.ledger import CHECK_DRAFT, PASS, load_ledger
from ..advice.tables import consumer_table
from ..advice.ledger import CHECK_ENGINE, CHECK_LOADER, NOT_RUN, VLLM, version_key
from ..advice.consumers import command_language, drafting_command, drafting_proofs
from ..cost import human_bytes, kv_costs
from ..errors import InputError, UsageError
from ..gemma4 import PER_LAYER_TRANSFORMERS, read_spec, Role
from ..layouts import Layout, default_layout
from ..layouts.base import layout_from_manifest
from ..pairing import serve_line

# Keys of the source card's front matter that still hold for the converted weights.
CARRIED_KEYS = ("license", "license_name", "license_link", "language", "pipeline_tag")


PLACEHOLDER_OWNER = "OWNER"  # convert's card: the repo ids `upload DST OWNER/NAME` fills in


def output_card(manifest: Mapping[str, Any], *, name: str, partner: str | None, source_card: bool,
                source_front_matter: Mapping[str, Any] | None, base_model: str | None) -> str:
    """The card `convert` writes as README.md: the output's own, with placeholder repo ids (OWNER/NAME, the
    assistant OWNER/NAME-assistant as `upload DST OWNER/NAME` names them) and no verification yet.

    Args:
        manifest: the checkpoint's conversion.json document.
        name: the repo name this checkpoint would get; partner: its partner's, in a pair.
        source_card: whether the source had a README.md (kept beside as README.source.md); source_front_matter: its
            front matter (read.front_matter.front_matter_of).
        base_model: the source's Hub repo id, if known.
    """
    own = f"{PLACEHOLDER_OWNER}/{name}"
    other = f"{PLACEHOLDER_OWNER}/{partner}" if partner else None
    target, assistant = (own, other) if manifest.get("role") == Role.TARGET else (other, own)
    return render_card(manifest=manifest, verification=None, repo_id=own, target_repo=target, assistant_repo=assistant,
                       base_model=base_model, source_front_matter=source_front_matter,
                       source_card=source_card, verified=False)


def render_card(*, manifest: Mapping[str, Any], verification: Mapping[str, Any] | None, repo_id: str,
                target_repo: str | None, assistant_repo: str | None, base_model: str | None,
                source_front_matter: Mapping[str, Any] | None = None, source_card: bool = False,
                engine_report: Mapping[str, Any] | None = None, verified: bool | None = None) -> str:
    """README.md for one converted checkpoint.

    Args:
        manifest: its conversion.json.
        verification: its verification.json (None when uploaded with --no-verify and none exists).
        repo_id: the repo this card goes to.
        target_repo, assistant_repo: the pair's repos for the serve command (None: a placeholder).
        base_model: the source's Hub repo id, if known.
        source_front_matter: the source README's YAML front matter; license/language keys are carried over.
        source_card: the source's README.md is uploaded beside the card as README.source.md.
        engine_report: the JSON report of `make serve-check` for this pair (DST/serve_check.json), if one was run.
        verified: False for convert's card (verify has not run yet); None: verification None means --no-verify.

    Returns:
        The card text: YAML front matter, then Markdown.
    """
    role = str(manifest.get("role"))
    layout = _layout(manifest)
    variant = layout.variant if layout else str(manifest.get("layout"))
    sections = [
        f"# {repo_id.split('/')[-1]}\n\n{_summary(manifest, role, base_model)}",
        f"## Layout: {variant}\n\n{_layout_text(layout)}",
        _serve_section(role, layout, str(manifest.get("layout")), target_repo, assistant_repo,
                       manifest.get("tensor_parallel_size")),
        *([_drafting_section(variant, str(manifest.get("layout")), target_repo, assistant_repo)]
          if layout is not None else []),
        _proof_section(variant, manifest.get("serving")),
        f"## KV-cache cost\n\n{_kv_text(manifest, role, layout)}",
        _verification_section(verification, pending=verified is False),
        *([_engine_section(engine_report)] if engine_report else []),
        _provenance_section(manifest, verification, source_card=source_card),
    ]
    return _front_matter(manifest, base_model, source_front_matter) + "\n" + "\n\n".join(sections) + "\n"


def _front_matter(manifest: Mapping[str, Any], base_model: str | None,
                  source_front_matter: Mapping[str, Any] | None) -> str:
    meta: dict[str, Any] = {}
    if base_model:
        meta["base_model"] = base_model
    meta["library_name"] = "transformers"
    for key in CARRIED_KEYS:
        if source_front_matter and source_front_matter.get(key) is not None:
            meta[key] = source_front_matter[key]
    meta["tags"] = ["gemma4", "gemma4-convert", "vllm", "speculative-decoding", "mtp",
                    f"layout-{manifest.get('layout')}"]
    return "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True) + "---\n"


def _summary(manifest: Mapping[str, Any], role: str, base_model: str | None) -> str:
    kind = "Gemma 4 target" if role == Role.TARGET else "Gemma 4 MTP assistant (draft model)"
    source = manifest.get("source", {})
    if base_model:
        revision = source.get("revision") if source.get("repo_id") == base_model else None
        origin = f"[{base_model}](https://huggingface.co/{base_model})" + (f" at commit `{revision}`" if revision else "")
    else:
        name = source.get("name") or str(source.get("path", "?")).rstrip("/").split("/")[-1]
        origin = f"a local checkpoint (`{name}`; base model: unknown)"
    actions: dict[str, int] = {}
    for tensor in manifest.get("tensors", []):
        actions[tensor.get("action", "?")] = actions.get(tensor.get("action", "?"), 0) + 1
    counts = ", ".join(f"{n} {a}" for a, n in sorted(actions.items()))
    return (f"{kind} `{manifest.get('model_type')}` from {origin}, re-laid out by gemma4-convert "
            f"{manifest.get('version')} into the **{manifest.get('layout')}** layout so stock vLLM loads it "
            f"correctly (the releases proven are listed below). Nothing was trained and no dtype changed: tensors {counts}; "
            f"{human_bytes(manifest.get('output', {}).get('total_size', 0))} of weights.")


def _layout(manifest: Mapping[str, Any]) -> Layout | None:
    """The layout conversion.json records, with its options; None for one this version does not know (the card then
    names it as recorded and loses only the layout's own texts)."""
    try:
        return layout_from_manifest(manifest)
    except UsageError:
        return None


def _layout_text(layout: Layout | None) -> str:
    if layout is None:
        return ""
    return "\n\n".join(part for part in (f"*{layout.description}*" if layout.description else "", layout.card_text)
                       if part)


def _serve_section(role: str, layout: Layout | None, recorded: str, target_repo: str | None,
                   assistant_repo: str | None, tp: int | None = None) -> str:
    other_role = Role.ASSISTANT if role == Role.TARGET else Role.TARGET
    other = assistant_repo if role == Role.TARGET else target_repo
    partner = (f"Its {other_role} is [{other}](https://huggingface.co/{other}), converted the same way."
               if other else f"Convert and upload its {other_role} with the same `--layout {recorded}`.")
    lines = [f"## Serve with vLLM\n\nThis repo is the **{role}**. {partner}\n",
             "```bash", serve_line(target=target_repo, assistant=assistant_repo, layout=recorded, tp=tp), "```"]
    if layout is not None and layout.serve_note:
        lines.append(f"\n{layout.serve_note}")
    lines.append(f"\n{RESAVE_NOTE}")
    return "\n".join(lines)


def _drafting_section(variant: str, recorded: str, target_repo: str | None, assistant_repo: str | None) -> str:
    """Each consumer the ledger proves running this layout's pair with the assistant drafting: the command, and the
    rows behind it (advice/consumers.py; `inspect` of the output lists the same)."""
    proofs = drafting_proofs(variant)
    if not proofs:
        return ("## Run the pair with its assistant drafting\n\nThis version of gemma4-convert records no run of this "
                "layout with the assistant drafting (`gemma4-convert compat`).")
    target = target_repo or "<TARGET converted the same way>"
    assistant = assistant_repo or "<ASSISTANT converted the same way>"
    parts = ["## Run the pair with its assistant drafting\n\nWhere the compatibility ledger ran this layout's pair "
             "with the assistant drafting and got the original pair's greedy tokens (and, in vLLM's engine and "
             "llama.cpp's server, its every draft), on synthetic pairs with Gemma 4's real names and ratios:"]
    for proof in proofs:
        parts.append(f"**{proof.consumer}**: {proof.evidence()}\n\n```{command_language(proof.consumer)}\n"
                     f"{drafting_command(proof.consumer, target, assistant, recorded)}\n```")
    return "\n\n".join(parts)


RESAVE_NOTE = (f"Use and re-upload `config.json` as it is: re-saving it with transformers >= "
               f"{PER_LAYER_TRANSFORMERS} (`save_pretrained`, "
               "as fine-tuning and quantization scripts do) drops the flat keys vLLM <= 0.27, MLX and SGLang 0.5.1x read. "
               "`gemma4-convert inspect` names what changed; "
               f"`gemma4-convert convert DIR --layout {default_layout().name}` mends it (config only, seconds).")


def _proof_section(variant: str, serving: Mapping[str, Any] | None = None) -> str:
    """The compatibility ledger for this layout, one line per vLLM release (the serving release the conversion was
    made for in bold), then one line per other consumer: counts only; the rows are `gemma4-convert compat`'s."""
    rows = [r for r in load_ledger() if r.variant == variant and r.verdict != NOT_RUN and r.consumer == VLLM]
    if not rows:
        return ("## Proven with stock vLLM\n\nThis version of gemma4-convert records no stock-vLLM run of this layout "
                "(`gemma4-convert compat`).")
    mine = str((serving or {}).get("vllm") or "")
    table = ["| vLLM | transformers | stock loader | CPU engine | TP 2/4/8 | measured |", "|---|---|---|---|---|---|"]
    for vllm in sorted({r.vllm for r in rows}, key=version_key):
        release = [r for r in rows if r.vllm == vllm]
        cells = [_count_cell([r for r in release if r.check == check and r.tp == 1]) for check in (CHECK_LOADER,
                                                                                                 CHECK_ENGINE)]
        cells.append(_count_cell([r for r in release if r.tp != 1]))
        name = f"**{vllm}** (yours)" if vllm == mine else vllm
        transformers = ", ".join(sorted({r.transformers for r in release if r.transformers}, key=version_key))
        table.append(f"| {name} | {transformers} | {' | '.join(cells)} | {max(r.measured for r in release)} |")
    consumers = _consumer_lines(variant)
    return ("## Proven with stock vLLM\n\nThe converter's compatibility ledger for this layout, as cases passed of "
            "cases run on synthetic pairs with Gemma 4's real names and ratios, each row tied to the digest of the "
            "output this converter version writes: the stock vLLM loader (every loaded tensor equal to the "
            "checkpoint's), the vLLM CPU engine (the original pair's greedy tokens and drafts) and vLLM's layers "
            "built as every rank of a tensor-parallel size. `gemma4-convert compat` lists every row.\n\n"
            + "\n".join(table) + ("\n\nOther consumers: " + "; ".join(consumers) + "." if consumers else ""))


def _count_cell(rows: list) -> str:
    """"6/6", or "**2/6** (kv_sharing)": the failing stage, never the exception's text."""
    if not rows:
        return "-"
    failing = [r for r in rows if r.verdict != PASS]
    text = f"{len(rows) - len(failing)}/{len(rows)}"
    if not failing:
        return text
    stage = failing[0].detail.split(":", 1)[0].strip()
    return f"**{text}**" + (f" ({stage})" if stage and len(stage) <= 40 else "")


def _consumer_lines(variant: str) -> list[str]:
    """One phrase per other consumer the ledger proved this layout with: loading it, then drafting with it."""
    ledger = load_ledger()
    phrases = [f"{c['consumer']} {c['version']} loads it ({c[variant]['passed']}/{c[variant]['rows']})"
               for c in consumer_table(ledger) if c.get(variant, {}).get("rows")]
    drafted = [r for r in ledger if r.check == CHECK_DRAFT and r.variant == variant and r.verdict != NOT_RUN]
    for consumer, version in sorted({(r.consumer, r.consumer_version) for r in drafted}):
        mine = [r for r in drafted if (r.consumer, r.consumer_version) == (consumer, version)]
        phrases.append(f"{consumer} {version} drafts with it ({sum(r.verdict == PASS for r in mine)}/{len(mine)})")
    return phrases


def _kv_text(manifest: Mapping[str, Any], role: str, layout: Layout | None) -> str:
    if role != Role.TARGET:
        return "None of its own: every assistant layer reads the target's KV cache."
    config = manifest.get("source", {}).get("config") or {}
    try:
        attention = read_spec(config, source="conversion.json source.config").attention
    except InputError:  # a manifest without a readable source config only loses this section
        return "Not recorded (conversion.json has no readable source config)."
    if layout is None:
        return "Not known to this version of gemma4-convert (its layout is not one it has)."
    rows = ["| KV cache per token (bf16) | source | this checkpoint | ratio |", "|---|---:|---:|---:|"]
    for cost in kv_costs(attention, layout.output_attention(attention)):
        label = "every layer holds the full context" if cost.context is None else \
            f"{cost.context // 1024}k context, sliding layers keep their window"
        rows.append(f"| {label} | {human_bytes(cost.before)} | {human_bytes(cost.after)} | "
                    f"x{cost.after / cost.before if cost.before else 1:.2f} |")
    note = layout.kv_note
    return "\n".join(rows) + f"\n\n({note}.)"


def _acceptance_cell(acceptance: Mapping[str, Any] | None) -> str:
    if not acceptance:
        return "-"
    rates = " / ".join(f"{r:.2f}" for r in acceptance.get("per_position", []))
    return f"{rates} (mean length {acceptance.get('mean_accepted_length', 0):.2f})"


def _engine_section(report: Mapping[str, Any]) -> str:
    """The serve-check verdicts: the converted pair generating in vLLM against the original, draft acceptance per
    position (1..k) and mean accepted length of both over the same prompts."""
    lines = ["## Engine check (serve-check)", "",
             f"`make serve-check` ran the original pair in {report.get('ref_env')} and this pair in each env below: "
             f"{len(report.get('prompt_lengths', []))} prompts, {report.get('max_tokens')} greedy tokens each, "
             f"k={report.get('num_speculative_tokens')} draft tokens; draft acceptance is vLLM's own spec-decode "
             "counters (acceptance rate at draft positions 1..k, mean accepted length including the bonus token).",
             "", "| env | dtype | tokens | drafts differ | acceptance (this pair) | acceptance (original) | verdict |",
             "|---|---|---|---|---|---|---|"]
    for v in report.get("verdicts", []):
        lines.append(f"| {v.get('env')} | {v.get('dtype')} | {'identical' if v.get('tokens_identical') else 'differ'} "
                     f"| {v.get('draft_mismatch')} | {_acceptance_cell(v.get('acceptance'))} | "
                     f"{_acceptance_cell(v.get('ref_acceptance'))} | {'PASS' if v.get('passed') else 'FAIL'} |")
    return "\n".join(lines)


def _verification_section(verification: Mapping[str, Any] | None, *, pending: bool = False) -> str:
    """verification.json as written by `gemma4-convert verify`: `factor` is the allowed multiple of the noise floor."""
    if verification is None and pending:
        return ("## Verification\n\nNot yet verified: `gemma4-convert verify --target T --assistant A --converted "
                "DST` checks every tensor and the numerics against the source, and `gemma4-convert upload DST "
                "OWNER/NAME` puts its figures here (and the repo ids above).")
    if verification is None:
        return ("## Verification\n\n**Not verified**: uploaded with `--no-verify`; run `gemma4-convert verify` on "
                "a download before trusting it.")
    v = verification
    device_name = (v.get("versions") or {}).get("device_name")
    device = f"{v.get('device')}" + (f" ({device_name})" if device_name and device_name != v.get("device") else "")
    lines = ["## Verification", "",
             f"**{'PASSED' if v.get('passed') else 'FAILED'}** on `{device}` ({v.get('dtype')}, torch {v.get('torch')}, "
             f"CUDA {v.get('cuda') or 'none'}, seed {v.get('seed')}, {float(v.get('wall_seconds') or 0):.1f} s, "
             f"gemma4-convert {v.get('tool_version')})."]
    structural = v.get("structural") or {}
    counts = (f" ({structural['tensors_checked']} tensors: {structural.get('copied')} byte-identical copies, "
              f"{structural.get('transformed')} recomputed transforms)" if "tensors_checked" in structural else "")
    problems = structural.get("problems") or []
    lines.append(f"\nStructural check{counts}: {'passed' if structural.get('passed') else 'FAILED'}"
                 + (":" if problems else "."))
    lines.extend(f"- {p}" for p in problems)
    layers = v.get("layers") or []
    if layers:
        lines += _layer_lines(layers)
    if v.get("first_failure"):
        lines.append(f"\nFirst failure: {v['first_failure']}")
    return "\n".join(lines)


def _ratio(row: Mapping[str, Any]) -> float:
    """error / noise floor as verify judged it: its `ratio` (rel_rms / floor), else recomputed from what is there."""
    if row.get("ratio") is not None:
        return float(row["ratio"])
    error = row.get("rel_rms", row.get("max_abs", 0.0))
    return float(error) / max(float(row.get("noise_floor", 0.0)), 1e-30)


def _layer_lines(layers: list[Mapping[str, Any]]) -> list[str]:
    worst = min(layers, key=lambda r: float(r.get("cosine", 1.0)))
    largest = max(layers, key=_ratio)
    failed = sum(1 for r in layers if not r.get("passed"))
    lines = [f"\nForward pass against the source, {len(layers)} comparisons, {failed} failed: lowest cosine "
             f"{float(worst.get('cosine', 0)):.6f} ({worst.get('name')}); largest error x{_ratio(largest):.2f} the "
             f"original's own noise floor ({largest.get('name')}; allowed x{float(largest.get('factor', 0)):g}).",
             "", "<details><summary>Per-layer figures</summary>", "",
             "| comparison | max abs | max rel | rel rms | cosine | noise floor | error / floor | allowed | |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in layers:
        note = f" {r['note']}" if r.get("note") else ""
        rel_rms = f"{float(r['rel_rms']):.3e}" if r.get("rel_rms") is not None else "-"
        lines.append(f"| {r.get('name')} | {float(r.get('max_abs', 0)):.3e} | {float(r.get('max_rel', 0)):.3e} | "
                     f"{rel_rms} | {float(r.get('cosine', 0)):.6f} | {float(r.get('noise_floor', 0)):.3e} | x{_ratio(r):.2f} | "
                     f"x{float(r.get('factor', 0)):g} | {'ok' if r.get('passed') else 'FAIL'}{note} |")
    return lines + ["", "</details>"]


def _provenance_section(manifest: Mapping[str, Any], verification: Mapping[str, Any] | None, *,
                        source_card: bool) -> str:
    files = ["`conversion.json` (every tensor's source, action and sha256)"]
    if verification is not None:
        files.append("`verification.json` (the figures above)")
    if source_card:
        files.append("`README.source.md` (the source's own model card, license terms included)")
    return (f"## Provenance\n\nConverted {manifest.get('created')} by gemma4-convert {manifest.get('version')}; "
            f"card written by gemma4-convert {__version__}. This repo also holds {', '.join(files)}.")

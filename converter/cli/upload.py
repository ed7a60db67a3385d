"""`gemma4-convert upload DST [REPO_ID]`: push a verified conversion to the Hub with a generated model card."""

from __future__ import annotations

from pathlib import Path

import click

from ..cost import human_bytes
from ..gemma4 import Role
from ..hub.publish import UploadPlan, UploadRequest, execute_upload, plan_upload
from ._common import PATH, hub_api


@click.command("upload")
@click.argument("dst", type=PATH)
@click.argument("repo_id", required=False)
@click.option("--target-repo", metavar="OWNER/NAME", help="Repo for DST/target (a converted pair).")
@click.option("--assistant-repo", metavar="OWNER/NAME", help="Repo for DST/assistant (a converted pair).")
@click.option("--private", is_flag=True, help="Create missing repos as private (an existing repo keeps its setting).")
@click.option("--revision", metavar="BRANCH", help="Commit to this branch (created from main if missing).")
@click.option("--create-pr", is_flag=True, help="Open a pull request against main instead of committing to it.")
@click.option("--commit-message", metavar="M", help="Commit title (default names the layout and tool version).")
@click.option("--dry-run", is_flag=True, help="Print files, sizes and the model card; contact nothing.")
@click.option("--no-verify", is_flag=True, help="Upload even without a passing verification.json.")
@click.option("--any-name", is_flag=True,
              help="Upload even where vLLM 0.33 and older would take the assistant's repo id for another speculative "
                   "method's draft (it holds eagle-, eagle3, dflash or dspark): a warning instead of a refusal.")
@click.option("--no-hash", is_flag=True,
              help="Check the files against conversion.json by size only, not by re-hashing every byte first.")
@click.option("--base-model", metavar="OWNER/NAME",
              help="Source repo for the target's card base_model (a single DST: its card's), over what is inferred: "
                   "the Hub repo recorded in conversion.json, else a Hugging Face cache path or _name_or_path.")
@click.option("--assistant-base-model", metavar="OWNER/NAME",
              help="Source repo for the assistant's card base_model, over what is inferred the same way.")
@click.pass_context
def command(ctx: click.Context, dst: Path, repo_id: str | None, target_repo: str | None, assistant_repo: str | None,
            private: bool, revision: str | None, create_pr: bool, commit_message: str | None, dry_run: bool,
            no_verify: bool, any_name: bool, no_hash: bool, base_model: str | None, assistant_base_model: str | None) -> None:
    """Upload a converted checkpoint (DST REPO_ID) or pair (DST REPO_ID: the assistant to REPO_ID-assistant; or
    DST --target-repo T --assistant-repo A).

    \b
    Refuses a DST without a passing verification.json of these very files (run `gemma4-convert verify` first) unless
    --no-verify, and a file missing, added or changed since convert.
    Token: HF_TOKEN or `hf auth login`. An interrupted upload resumes when rerun.
    Examples:
      gemma4-convert upload DST me/gemma-4-31B-it-vllm
      gemma4-convert upload DST --target-repo me/gemma-4-31B-it-pad-global \\
          --assistant-repo me/gemma-4-31B-it-assistant-pad-global --dry-run
      gemma4-convert upload DST/target me/gemma-4-31B-it-per-layer --private
    """
    repos = {role: repo for role, repo in ((Role.SINGLE, repo_id), (Role.TARGET, target_repo),
                                            (Role.ASSISTANT, assistant_repo)) if repo}
    request = UploadRequest(dst=dst, repos=repos, private=private, revision=revision, create_pr=create_pr,
                            commit_message=commit_message, verify_required=not no_verify, base_model=base_model,
                            assistant_base_model=assistant_base_model, hashed=not no_hash,
                            any_name=any_name)
    from tqdm import tqdm  # ~0.1 s: imported by the runs that show progress, not by --help

    with tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc="re-hashing", disable=None, leave=False) as bar:
        plan = plan_upload(request, on_bytes=bar.update)
    render_plan(plan, with_cards=dry_run)
    if plan.unknown_base:
        click.echo(f"note: base model unknown for {', '.join(str(d) for d in plan.unknown_base)} (a local source: "
                   "no Hub repo recorded, not a Hugging Face cache snapshot, no repo id in its _name_or_path); the "
                   "card says \"unknown\"; pass --base-model OWNER/NAME (target) or --assistant-base-model to name "
                   "it", err=True)
    for warning in plan.warnings:
        click.echo(f"warning: {warning}", err=True)
    if dry_run:
        click.echo("dry run: nothing uploaded, the Hub was not contacted")
        return
    for result in execute_upload(plan, api=hub_api(ctx)):
        url = result.pr_url or result.commit_url or f"https://huggingface.co/{result.repo_id}"
        click.echo(f"uploaded {result.repo_id}: {url}")


def render_plan(plan: UploadPlan, *, with_cards: bool) -> None:
    request = plan.request
    where = "a pull request against main" if request.create_pr else f"branch {request.revision or 'main'}"
    for item in plan.items:
        click.echo(f"{item.directory} ({item.kind}, {item.layout}) -> {item.repo_id} "
                   f"({'private' if request.private else 'public'} if created; {where})")
        for f in item.files:
            note = "  (generated model card)" if f.local is None else "  (local paths removed)" if f.content else ""
            click.echo(f"  {f.path_in_repo:<40} {human_bytes(f.size):>10}{note}")
        click.echo(f"  {len(item.files)} files, {human_bytes(item.total_size)}")
    for item in plan.items if with_cards else ():
        click.echo(f"--- {item.repo_id}/README.md ---")
        click.echo(item.card, nl=False)
        click.echo("--- end of card ---")

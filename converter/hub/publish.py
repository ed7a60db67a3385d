"""Uploads of converted outputs: the upload plan (manifests checked, cards rendered; contacts nothing) and its run.

This module does I/O and bookkeeping only; a re-run resumes (uploads skip committed files).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from .. import __version__
from ..errors import InputError, UsageError, VerificationFailed
from ..gemma4 import Role
from ..read.front_matter import front_matter_of
from ..read.checkpoint import CARD_NAME, MANIFEST_NAME, SOURCE_CARD_NAME, VERIFICATION_NAME, read_json
from ..pairing import misread_draft_name
from ..proof.files import file_problems, manifest_sha256
from .download import ASSISTANT_SUFFIX
from .failures import hub_errors, transfer_errors
from .provenance import infer_base_model, public_manifest, scrub_paths

ENGINE_REPORT_NAME = "serve_check.json"  # `make serve-check REPORT=DST/serve_check.json`: quoted on both cards


@dataclass(frozen=True)
class UploadRequest:
    """What `upload` was asked to do (repo ids by role: Role.SINGLE for a one-checkpoint DST)."""

    dst: Path
    repos: Mapping[str, str]
    private: bool = False
    revision: str | None = None  # branch to commit to (created from main if missing); None: main
    create_pr: bool = False
    commit_message: str | None = None
    verify_required: bool = True
    base_model: str | None = None  # the target's (or a single checkpoint's) base, over what conversion.json records
    assistant_base_model: str | None = None  # the assistant's base, over what its conversion.json records
    any_name: bool = False  # an assistant repo id vLLM misreads as another draft method: a warning, not a refusal
    hashed: bool = True  # re-hash every file against conversion.json before the first byte goes out (--no-hash: sizes)


@dataclass(frozen=True)
class UploadFile:
    path_in_repo: str
    size: int
    local: Path | None  # None for the generated card (its text is on the item)
    content: bytes | None = None  # what is sent instead of `local`: conversion.json / verification.json without paths


@dataclass(frozen=True)
class UploadItem:
    role: Role  # where it sits in DST
    kind: str  # the checkpoint's own role from conversion.json: "target" or "assistant"
    layout: str
    directory: Path
    repo_id: str
    files: tuple[UploadFile, ...]
    card: str

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class UploadPlan:
    request: UploadRequest
    items: tuple[UploadItem, ...]
    unknown_base: tuple[Path, ...] = ()  # checkpoints whose card says base model "unknown"
    warnings: tuple[str, ...] = ()  # e.g. a target and an assistant whose base models do not belong together


@dataclass(frozen=True)
class UploadResult:
    repo_id: str
    commit_url: str | None
    pr_url: str | None


def checkpoint_dirs(dst: Path) -> dict[Role, Path]:
    """The converted checkpoints under DST: {SINGLE: DST} or {TARGET: DST/target, ASSISTANT: ...}.

    Raises:
        InputError: DST holds no conversion.json at its top or in target/ or assistant/.
    """
    if (dst / MANIFEST_NAME).is_file():
        return {Role.SINGLE: dst}
    found = {role: dst / role for role in (Role.TARGET, Role.ASSISTANT) if (dst / role / MANIFEST_NAME).is_file()}
    if not found:
        raise InputError(f"{dst}: no {MANIFEST_NAME} in it or in {Role.TARGET}/ or {Role.ASSISTANT}/ "
                         f"(is it a gemma4-convert output?)")
    return found


def plan_upload(request: UploadRequest, *, on_bytes: Callable[[int], None] = lambda n: None) -> UploadPlan:
    """Reads DST's conversion.json / verification.json, checks the files against them, renders the cards; contacts
    nothing. `on_bytes` counts the bytes re-hashed.

    Raises:
        UsageError: a repo id missing for a checkpoint, or given for one that is not there; no verification.json.
        VerificationFailed: verification.json says the output failed, or proves another conversion.json; a file is
            missing, added, or changed since convert.
        InputError: unreadable manifests.
    """
    from huggingface_hub import constants
    dirs = checkpoint_dirs(request.dst)
    request = _pair_repos(request, dirs)
    unknown = sorted(set(request.repos) - set(dirs))
    if unknown or set(dirs) - set(request.repos):
        raise UsageError(_repo_usage(request, dirs))
    if request.create_pr and request.revision not in (None, constants.DEFAULT_REVISION):
        raise UsageError("--create-pr opens a pull request against main; drop --revision (or use --revision "
                         "refs/pr/N without --create-pr to add to an existing PR)")
    manifests = {role: _read_manifest(directory) for role, directory in dirs.items()}
    misread = _misread_names(request, manifests)
    serve_repos = _serve_repos(request.repos, manifests)
    engine_report = _read_engine_report(request.dst)
    items, unknown, bases = [], [], {}
    for role, directory in dirs.items():
        manifest = manifests[role]
        from .card import render_card  # the layouts and the ledger: only writing a card needs them

        base = infer_base_model(manifest, override=_base_override(request, role, str(manifest.get("role"))))
        bases[str(manifest.get("role"))] = base
        if base is None:
            unknown.append(directory)
        private = _private_paths(request.dst, directory, manifest)
        public = public_manifest(manifest, base=base, private=private)
        _refuse_changed_files(directory, manifest, hashed=request.hashed, on_bytes=on_bytes)
        verification = _read_verification(request, directory, manifest)
        public_verification = scrub_paths(verification, private) if verification is not None else None
        source_card = _source_card(directory)
        card = render_card(manifest=public, verification=public_verification, repo_id=request.repos[role],
                           target_repo=serve_repos.get(Role.TARGET), assistant_repo=serve_repos.get(Role.ASSISTANT),
                           base_model=base.repo_id if base else None,
                           source_front_matter=front_matter_of(source_card) if source_card else None,
                           source_card=source_card is not None,
                           engine_report=scrub_paths(engine_report, private) if engine_report else None)
        rewritten = {MANIFEST_NAME: public}
        if verification is not None:  # the proof of these bytes, wherever it was found, and no other
            rewritten[VERIFICATION_NAME] = public_verification
        items.append(UploadItem(role=role, kind=str(manifest.get("role")), layout=str(manifest.get("layout")),
                                directory=directory, repo_id=request.repos[role],
                                files=_upload_files(directory, card, rewritten), card=card))
    warnings = misread + (() if Role.SINGLE in dirs else tuple(filter(None, [mismatched_bases(
        *(b.repo_id if b else None for b in (bases.get(Role.TARGET), bases.get(Role.ASSISTANT))))])))
    return UploadPlan(request=request, items=tuple(items), unknown_base=tuple(unknown), warnings=warnings)


def _misread_names(request: UploadRequest, manifests: Mapping[Role, Mapping[str, Any]]) -> tuple[str, ...]:
    """An assistant's repo id that vLLM would serve as another method's draft: refused, or with --any-name a
    warning (pairing.misread_draft_name)."""
    found = []
    for role, manifest in manifests.items():
        why = misread_draft_name(request.repos[role]) if manifest.get("role") == Role.ASSISTANT else None
        if why and not request.any_name:
            raise UsageError(f"the assistant's repo {why} (or pass --any-name)")
        if why:
            found.append(f"the assistant's repo {why}")
    return tuple(found)


def _pair_repos(request: UploadRequest, dirs: Mapping[Role, Path]) -> UploadRequest:
    """DST REPO_ID for a pair: the target to REPO_ID, the assistant to REPO_ID-assistant (the name convert looks a
    Hub target's assistant up by); --target-repo / --assistant-repo name others."""
    if set(request.repos) != {Role.SINGLE} or Role.SINGLE in dirs or set(dirs) != {Role.TARGET, Role.ASSISTANT}:
        return request
    repo_id = request.repos[Role.SINGLE]
    return replace(request, repos={Role.TARGET: repo_id, Role.ASSISTANT: repo_id + ASSISTANT_SUFFIX})


def _base_override(request: UploadRequest, where: str, kind: str) -> str | None:
    """The override for one checkpoint: --assistant-base-model for an assistant; --base-model for the target (in a
    pair) or for the one checkpoint of a single DST when no assistant override names it."""
    if kind == Role.ASSISTANT and request.assistant_base_model:
        return request.assistant_base_model
    if where == Role.SINGLE or kind == Role.TARGET:
        return request.base_model
    return None


_GEMMA4_SIZE = re.compile(r"gemma-?4-(e\d+b|\d+b(?:-a\d+b)?)(?![a-z0-9])", re.IGNORECASE)


def mismatched_bases(target: str | None, assistant: str | None) -> str | None:
    """A warning when the two base models name different Gemma 4 sizes (e.g. a 31B target, an E4B assistant)."""
    sizes = [m.group(1).upper() if (m := _GEMMA4_SIZE.search(name or "")) else None for name in (target, assistant)]
    if None in sizes or sizes[0] == sizes[1]:
        return None
    return (f"the target's base model {target} ({sizes[0]}) and the assistant's {assistant} ({sizes[1]}) are "
            "different Gemma 4 sizes: an assistant only drafts for the target it was trained with; check "
            "--base-model / --assistant-base-model or the pair you converted")


def _read_engine_report(dst: Path) -> dict[str, Any] | None:
    """DST/serve_check.json when the user saved `make serve-check`'s report there (docs/VLLM_CHECK.md)."""
    path = dst / ENGINE_REPORT_NAME
    if not path.is_file():
        return None
    report = read_json(path)
    if not isinstance(report, dict) or not isinstance(report.get("verdicts"), list):
        raise InputError(f"{path}: not a serve-check report (no verdicts); remove it or run make serve-check again")
    return report


def _private_paths(dst: Path, directory: Path, manifest: Mapping[str, Any]) -> list[str]:
    """Paths of this machine that must not reach the Hub (provenance.scrub_paths rewrites them)."""
    paths = {str((manifest.get("source") or {}).get("path") or ""), os.path.expanduser("~")}
    for path in (dst, directory):
        paths |= {str(path.absolute()), str(path.resolve())}
    return sorted(p for p in paths if p not in ("", "/"))


def _repo_usage(request: UploadRequest, dirs: dict[str, Path]) -> str:
    if Role.SINGLE in dirs:
        return f"{request.dst} holds one checkpoint: give REPO_ID (not --target-repo/--assistant-repo)"
    wanted = " and ".join(f"--{role}-repo" for role in dirs)
    return f"{request.dst} holds {', '.join(f'{r}/' for r in dirs)}: give {wanted} (not REPO_ID)"


def _serve_repos(repos: Mapping[str, str], manifests: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    if Role.SINGLE in repos:
        return {manifests[Role.SINGLE].get("role", Role.TARGET): repos[Role.SINGLE]}
    return dict(repos)


def _read_manifest(directory: Path) -> dict[str, Any]:
    manifest = read_json(directory / MANIFEST_NAME)
    if not isinstance(manifest, dict) or manifest.get("tool") != "gemma4-convert":
        raise InputError(f"{directory / MANIFEST_NAME}: not a gemma4-convert manifest")
    return manifest


def _refuse_changed_files(directory: Path, manifest: Mapping[str, Any], *, hashed: bool,
                          on_bytes: Callable[[int], None]) -> None:
    """What goes out must be what convert wrote and verify proved: every file as conversion.json records it."""
    problems = file_problems(directory, manifest, hashed=hashed, on_bytes=on_bytes)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise VerificationFailed(f"{directory}: {problems[0]}{more}; refusing to upload what was not converted and "
                                 "verified: convert and verify again")


def _read_verification(request: UploadRequest, directory: Path, manifest: Mapping[str, Any]) -> dict[str, Any] | None:
    """verification.json beside the checkpoint, else at DST's top (a pair verified as a whole), when it proves this
    checkpoint's conversion.json (its sha256 is recorded under the checkpoint's role)."""
    path = next((p for p in (directory / VERIFICATION_NAME, request.dst / VERIFICATION_NAME) if p.is_file()), None)
    if path is None:
        if request.verify_required:
            raise UsageError(f"{directory}: no {VERIFICATION_NAME}; run `gemma4-convert verify` first "
                             f"(or pass --no-verify to upload unverified)")
        return None
    verification = read_json(path)
    if not isinstance(verification, dict) or not isinstance(verification.get("passed"), bool):
        raise InputError(f"{path}: expected a JSON object with a boolean `passed`")
    proved = (verification.get("manifests") or {}).get(str(manifest.get("role")))
    if proved != manifest_sha256(directory):
        if request.verify_required:
            raise VerificationFailed(f"{path}: proves {'another' if proved else 'an unnamed'} {MANIFEST_NAME}, not "
                                     f"{directory / MANIFEST_NAME} (another output's proof, or one made before the "
                                     "output changed); run `gemma4-convert verify` again")
        return None  # --no-verify: uploaded unverified, and no proof of other bytes rides along
    if request.verify_required and not verification["passed"]:
        raise VerificationFailed(f"{path}: verification FAILED (first failure: "
                                 f"{verification.get('first_failure') or 'see the file'}); refusing to upload "
                                 f"(--no-verify overrides)")
    return verification


def _source_card(directory: Path) -> Path | None:
    """The source's own card in an output: README.source.md (convert writes this tool's card as README.md); an
    output of an earlier version holds the source's card as README.md itself."""
    for name in (SOURCE_CARD_NAME, CARD_NAME):
        if (directory / name).is_file():
            return directory / name if name == SOURCE_CARD_NAME or not _is_our_card(directory / name) else None
    return None


def _is_our_card(path: Path) -> bool:
    return "gemma4-convert" in ((front_matter_of(path) or {}).get("tags") or [])


def _upload_files(directory: Path, card: str, rewritten: Mapping[str, Any]) -> tuple[UploadFile, ...]:
    """The card, then every top-level file; `rewritten` (name -> JSON document) replaces a file's content."""
    files = [UploadFile(path_in_repo=CARD_NAME, size=len(card.encode("utf-8")), local=None)]
    for path in sorted(directory.iterdir()):
        if not path.is_file() or path.name.startswith("."):
            continue
        if path.name == VERIFICATION_NAME and VERIFICATION_NAME not in rewritten:
            continue  # a proof of other bytes (uploaded --no-verify): not this output's
        if path.name == CARD_NAME and (directory / SOURCE_CARD_NAME).is_file():
            continue  # convert's card: the one rendered above replaces it
        name = SOURCE_CARD_NAME if path.name == CARD_NAME else path.name
        if path.name in rewritten:
            content = (json.dumps(rewritten[path.name], indent=2) + "\n").encode("utf-8")
            files.append(UploadFile(path_in_repo=name, size=len(content), local=path, content=content))
        else:
            files.append(UploadFile(path_in_repo=name, size=path.stat().st_size, local=path))
    return tuple(files)


@contextmanager
def staged_folder(item: UploadItem) -> Iterator[Path]:
    """A temporary folder of symlinks to the item's files, plus the card and the path-free JSON files: what
    upload_folder sends; DST untouched."""
    with tempfile.TemporaryDirectory(prefix="gemma4-upload-") as tmp:
        root = Path(tmp)
        for f in item.files:
            if f.content is not None:
                (root / f.path_in_repo).write_bytes(f.content)
            elif f.local is None:
                (root / f.path_in_repo).write_text(item.card, encoding="utf-8")
            else:
                os.symlink(f.local.resolve(), root / f.path_in_repo)
        yield root


def execute_upload(plan: UploadPlan, *, api: Any) -> list[UploadResult]:
    """Creates each repo if needed (and the branch), then uploads each item with upload_folder.

    upload_folder, not upload_large_folder: since huggingface_hub 1.x upload_folder is the streamed multi-commit
    path (hashed while chunked, split into several commits when large, resumed by re-running: committed files are
    skipped, uploaded chunks deduplicated), and it takes commit_message, revision and create_pr, which
    upload_large_folder never did.

    Raises:
        HubError: token, permission, rate limit, network (one line; rerun to resume).
    """
    from huggingface_hub import constants
    request = plan.request
    with hub_errors(plan.items[0].repo_id):  # the token check: fail before creating anything
        api.whoami()
    results = []
    for item in plan.items:
        with hub_errors(item.repo_id):
            api.create_repo(item.repo_id, repo_type="model", private=request.private, exist_ok=True)
            if request.revision and not request.create_pr and request.revision != constants.DEFAULT_REVISION \
                    and not request.revision.startswith("refs/pr/"):
                api.create_branch(item.repo_id, branch=request.revision, repo_type="model", exist_ok=True)
            with staged_folder(item) as folder, \
                    transfer_errors(item.repo_id, f"uploading {item.directory} ({len(item.files)} files)"):
                info = api.upload_folder(repo_id=item.repo_id, folder_path=folder, repo_type="model",
                                         revision=request.revision, create_pr=request.create_pr,
                                         commit_message=request.commit_message or _commit_message(item))
        results.append(UploadResult(repo_id=item.repo_id, commit_url=getattr(info, "commit_url", None),
                                    pr_url=getattr(info, "pr_url", None)))
    return results


def _commit_message(item: UploadItem) -> str:
    return f"Upload {item.kind} converted by gemma4-convert {__version__} (layout {item.layout})"

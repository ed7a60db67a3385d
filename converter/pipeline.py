"""The only module that calls every stage: sources (read, hub) -> decision (advice) -> plan -> (transform while)
write -> manifest -> rename. `convert` is the verb's one library call; `plan_conversion` and `execute` are its two
halves for callers that hold local paths already (tests, benchmarks)."""

from __future__ import annotations

import importlib
import math
import os
import shutil
import threading
from concurrent.futures import Future
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from .advice.pitfalls import q4_0_grid_notes, quantized_assistant_refusal, serving_pitfalls
from .advice.serving import NO_CONVERSION, Decision, ServingEnv, decide, serving_notes, shape_of
from .cost import KvCost, human_bytes, kv_costs
from .errors import InputError, OutputError, UnsupportedLayoutError, UsageError
from .gemma4 import Role
from .hub.download import (ASSISTANT_SUFFIX, LocalSource, fetch_weights, open_checkpoint, parse_repo_ref,
                           published_assistant, resolve_source)
from .layouts import Layout, default_layout, get_layout
from .layouts.base import layout_from_manifest
from .pairing import PairReport, check_pair, misread_draft_name, serve_line
from .parallel import tp_problems
from .plan import CheckpointPlan, ShardPlan, index_document
from .quantization import weights_per_element
from .read.checkpoint import (CARD_NAME, INDEX_NAME, MANIFEST_NAME, SOURCE_CARD_NAME, Checkpoint, carried_side_files,
                              check_roles, read_checkpoint, sub_directories)
from .read.identity import identities, refuse_changed
from .read.sequential import PendingSha256, hashing_ahead, known_sha256
from .validate.attention import has_fused_qkv
from .write.budget import budget
from .write.engine import Writers, place_whole, rewrite_shard
from .write.lock import output_lock
from .write.manifest import MADE_WRITTEN, manifest_document
from .write.placement import LINK_MODES, place_file, reflink_possible
from .write.staging import make_directory, output_errors, staged_directory, write_json, write_text


@dataclass(frozen=True)
class ConvertRequest:
    """What `convert` is asked to do: the verb's options as data (cli/convert.py). `convert` takes it as the user
    gave it (a source a directory or a Hub id, the layout None for advice's choice); `plan_conversion` and `execute`
    take it resolved (`convert` resolves it): every source a local directory, the layout named."""

    out: Path
    # Role.SINGLE (one checkpoint converted straight into OUT), or TARGET and/or ASSISTANT: a directory, or (for
    # `convert` only) a Hub repo OWNER/NAME[@REVISION]
    sources: Mapping[Role, str | Path]
    layout: str | None = None  # None: advice's decision for `serving` (the cheapest layout without one)
    # options of the layout (Layout.option_choices), e.g. {"keys": "flat"} for per-layer --flat-keys-only
    layout_options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    serving: ServingEnv | None = None  # --serving / --serving-python: the environment the layout is chosen for
    target_only: bool = False  # a Hub target alone stays alone (its published assistant is not looked up)
    force: bool = False
    max_shard_bytes: int | None = None
    link: str = "auto"  # how unchanged files get into the output: write.placement.LINK_MODES
    hashed: bool = True  # sha256 of every source and output file read or written (--no-hash: null in the manifest)
    tp: int | None = None  # the tensor-parallel size the user serves with (--tp): checked, named in the serve line
    any_name: bool = False  # --any-name: an output path vLLM misreads as another draft method warns, not refuses
    dry_run: bool = False
    dequantize_assistant: bool = False  # --dequantize-assistant: the assistant's weights written plain float
    # filled in by `convert` as it resolves the sources:
    # role -> {"repo_id", "revision", ...} for Hub sources (hub.LocalSource.origin)
    origins: Mapping[Role, Mapping[str, str]] = field(default_factory=dict, hash=False)
    # source path -> its Checkpoint when already read another way (Hub headers over HTTP, hub.open_checkpoint);
    # every other source is read with read_checkpoint
    opened: Mapping[Path, Checkpoint] = field(default_factory=dict, hash=False)

    @property
    def single(self) -> bool:
        """One checkpoint converted straight into OUT (given as SRC)."""
        return Role.SINGLE in self.sources


@dataclass(frozen=True)
class PlannedCheckpoint:
    source: Checkpoint
    plan: CheckpointPlan
    role: Role  # Role.SINGLE: one checkpoint converted straight into the output dir

    @property
    def subdir(self) -> str:
        return self.role.subdir

    @property
    def parameters_added(self) -> int:
        """Model weights the layout adds: elements, a packed code word counted as the codes it holds, so fp8, packed
        int4 and mixed-dtype checkpoints count right (bytes / an element size would not)."""
        before = self.source.spec.quantization
        after = before if not self.plan.dequantized else None
        return sum(math.prod(t.shape) * weights_per_element(after, t.name, t.dtype)
                   - math.prod(t.source.shape) * weights_per_element(before, t.source.ref.name, t.source.ref.dtype)
                   for t in self.plan.tensors)


@dataclass(frozen=True)
class ConversionPlan:
    request: ConvertRequest
    items: tuple[PlannedCheckpoint, ...]
    pair: PairReport | None
    warnings: tuple[str, ...]

    def item(self, role: str) -> PlannedCheckpoint | None:
        return next((i for i in self.items if i.plan.role == role), None)

    @property
    def source_bytes(self) -> int:
        return sum(i.plan.source_bytes for i in self.items)

    @property
    def output_bytes(self) -> int:
        return sum(i.plan.total_size for i in self.items)

    @property
    def layout(self) -> Layout:
        return get_layout(self.request.layout, self.request.layout_options)

    def kv_costs(self) -> tuple[KvCost, ...]:
        """The target's KV cache per token, source and output (one output geometry per layout)."""
        target = self.item(Role.TARGET)
        if target is None:
            return ()
        attention = target.source.spec.attention
        return kv_costs(attention, self.layout.output_attention(attention))

    def output_dir(self, item: PlannedCheckpoint) -> Path:
        return self.request.out / item.subdir if item.subdir else self.request.out


@dataclass(frozen=True)
class ConvertResult:
    plan: ConversionPlan
    output_files: dict[str, dict[str, str | None]]  # subdir -> file name -> sha256 (None: linked, never read)
    made: dict[str, str] = field(default_factory=dict)  # "subdir/name" -> how (conversion.json `output.made`)


def plan_conversion(request: ConvertRequest) -> ConversionPlan:
    """Reads headers, checks inputs and output, plans every tensor; writes nothing.

    Raises:
        UsageError, InputError, OutputError: with one-line messages naming the file at fault.
    """
    sources = _sources(request)
    if request.layout is None:
        raise ValueError("plan_conversion takes a resolved request (a layout named): `convert` resolves one")
    if request.link not in LINK_MODES:
        raise UsageError(f"unknown --link {request.link!r}; choose one of {', '.join(LINK_MODES)}")
    layout = get_layout(request.layout, request.layout_options)
    checkpoints = {role: request.opened.get(path) or read_checkpoint(path) for role, path in sources.items()}
    _check_output(request, list(sources.values()))
    warnings: list[str] = []
    for checkpoint in checkpoints.values():
        _refuse_reconversion(checkpoint)
        if left := sub_directories(checkpoint.path):
            warnings.append(f"{checkpoint.path}: {', '.join(f'{name}/' for name in left)} not carried into the output "
                            "(an output carries the checkpoint's top-level files)")
    check_roles(checkpoints, {role: str(c.path) for role, c in checkpoints.items()})
    dequantizing = _dequantized_roles(checkpoints, request)
    for role, checkpoint in checkpoints.items():
        layout.admit(checkpoint)  # validate -> pair -> plan: inspect's first problem is convert's refusal
        if checkpoint.spec.role == Role.ASSISTANT and role not in dequantizing:  # said before writing, as inspect
            warnings.extend(serving_pitfalls(checkpoint.config, checkpoint.spec))  # says it (a quantized draft)
    pair = None
    if Role.TARGET in checkpoints and Role.ASSISTANT in checkpoints:
        pair = check_pair(checkpoints[Role.TARGET].spec, checkpoints[Role.ASSISTANT].spec)
        if not pair.ok:
            raise InputError(f"{checkpoints[Role.ASSISTANT].path} cannot serve with {checkpoints[Role.TARGET].path}: "
                             + "; ".join(pair.problems))
        warnings.extend(pair.notes)
    elif layout.pair_must_match:
        role = next(iter(checkpoints.values())).spec.role
        other = Role.ASSISTANT if role == Role.TARGET else Role.TARGET
        warnings.append(f"{layout.name} converted only the {role}: its {other} MUST get the same {layout.name} "
                        f"conversion, or the pair computes garbage (gemma4-convert check-pair will flag it)")
    elif next(iter(checkpoints.values())).spec.role == Role.ASSISTANT:
        warnings.append(f"{layout.name} converted only the assistant: convert its target the same way "
                        f"(--target T --layout {layout.name}); a vLLM that needs this assistant converted cannot load "
                        f"the original target either")
    if request.tp is not None:
        _refuse_tensor_parallel(checkpoints, request, layout)
    items = tuple(PlannedCheckpoint(source=c, role=role, plan=layout.plan(
        c, max_shard_bytes=request.max_shard_bytes, dequantize=role in dequantizing)) for role, c in checkpoints.items())
    for item in items:
        warnings.extend(item.plan.warnings)
        warnings.extend(q4_0_grid_notes(item.source, only=layout.name))  # said before writing, as inspect says it
    plan = ConversionPlan(request=request, items=items, pair=pair, warnings=tuple(warnings))
    plan = _check_draft_name(plan)
    _check_free_space(request.out, plan.output_bytes - _linked_bytes(request, items))
    return plan


def _linked_bytes(request: ConvertRequest, items: tuple[PlannedCheckpoint, ...]) -> int:
    """Bytes of unchanged files that take no new space: every one under reflink, hardlink and symlink, and under
    auto where the source really clones into OUT's filesystem (else auto copies, and copies take space)."""
    unchanged = [shard for item in items for shard in item.plan.shards if shard.same_as is not None]
    if request.link == "copy" or not unchanged:
        return 0
    if request.link == "auto" and not reflink_possible(unchanged[0].same_as, _existing_parent(request.out)):
        return 0
    return sum(shard.nbytes for shard in unchanged)


def _dequantized_roles(checkpoints: Mapping[Role, Checkpoint], request: ConvertRequest) -> set[Role]:
    """The roles --dequantize-assistant rewrites: the assistant's (given as --assistant or as SRC)."""
    if not request.dequantize_assistant:
        return set()
    roles = {role for role, c in checkpoints.items() if c.spec.role == Role.ASSISTANT}
    if not roles:
        raise UsageError("--dequantize-assistant: no assistant to dequantize; give --assistant A (or an assistant "
                         "as SRC)")
    return roles


def _sources(request: ConvertRequest) -> dict[Role, Path]:
    if request.single and len(request.sources) > 1:
        raise UsageError("give either SRC or --target/--assistant, not both")
    if not request.sources:
        raise UsageError("nothing to convert: give SRC, or --target and/or --assistant")
    return {role: Path(path) for role, path in request.sources.items()}


def _check_draft_name(plan: ConversionPlan) -> ConversionPlan:
    """An assistant written where vLLM's serve line would name it as another speculative method's draft is refused
    (pairing.misread_draft_name), or with --any-name written with a warning."""
    for item in plan.items:
        why = misread_draft_name(str(plan.output_dir(item))) if item.source.spec.role == Role.ASSISTANT else None
        if why and not plan.request.any_name:
            raise UsageError(f"--out {plan.request.out}: the assistant's path {why} (or pass --any-name)")
        if why:
            plan = replace(plan, warnings=plan.warnings + (f"the assistant's path {why}",))
    return plan


def _check_output(request: ConvertRequest, sources: list[Path]) -> None:
    out = request.out.resolve()
    for source in sources:
        src = source.resolve()
        if out == src or src in out.parents:
            raise UsageError(f"output {request.out} is inside the source {source}; choose a directory outside it")
        if out in src.parents:
            raise UsageError(f"source {source} is inside the output {request.out}; choose another output directory")
    if request.out.exists() and not request.force:
        raise OutputError(f"{request.out} already exists; choose a new directory or pass --force to replace it")
    if request.out.exists() and not request.out.is_dir():
        raise OutputError(f"{request.out} exists and is not a directory")
    if request.out.exists() and not _is_replaceable(request.out):
        raise OutputError(f"refusing to --force-replace {request.out}: it is neither empty nor an output of "
                          "gemma4-convert (no conversion.json); remove it yourself or choose a new directory")


def _is_replaceable(directory: Path) -> bool:
    """--force only ever replaces an empty directory or an earlier output of this tool (never, say, /data)."""
    manifests = [directory / MANIFEST_NAME, directory / Role.TARGET / MANIFEST_NAME,
                 directory / Role.ASSISTANT / MANIFEST_NAME]
    return not any(directory.iterdir()) or any(path.is_file() for path in manifests)


def _existing_parent(out: Path) -> Path:
    parent = out.resolve().parent
    while not parent.exists():
        parent = parent.parent
    return parent


def _check_free_space(out: Path, needed: int) -> None:
    parent = _existing_parent(out)
    free = shutil.disk_usage(parent).free
    if free < needed:
        raise OutputError(f"{parent}: not enough space: {human_bytes(free)} free but the output needs "
                          f"{human_bytes(needed)}")


def _refuse_reconversion(checkpoint: Checkpoint) -> None:
    """An output of this tool is converted again only when its config no longer is what its layout wrote (a config
    re-saved by transformers >= PER_LAYER_TRANSFORMERS): that conversion mends it; anything else would stack layouts."""
    manifest = checkpoint.manifest
    if manifest and manifest.get("tool") == "gemma4-convert" and _still_as_written(checkpoint, manifest):
        original = manifest.get("source", {}).get("path", "the original checkpoint")
        raise InputError(f"{checkpoint.path} is already an output of gemma4-convert (layout "
                         f"{manifest.get('layout')}); convert {original} instead")


def _still_as_written(checkpoint: Checkpoint, manifest: Mapping[str, Any]) -> bool:
    try:
        return layout_from_manifest(manifest).matches(checkpoint.spec)
    except UnsupportedLayoutError:  # a layout this version does not know: leave it alone
        return True


def execute(plan: ConversionPlan, *, on_bytes: Callable[[int], None] = lambda n: None) -> ConvertResult:
    """Writes the planned output under a staging name beside it, then renames it into place.

    The output's lock (write/lock.py) is held throughout: a second writer into the same DST is refused at once.

    Raises:
        OutputError: when writing fails (nothing is left behind), or another process is writing DST.
    """
    with output_lock(plan.request.out):
        return _write(plan, on_bytes)


def _source_files(plan: ConversionPlan) -> list[Path]:
    """Every source file the output is made of: its shards and its side files."""
    return [path for item in plan.items for path in
            [shard.file for shard in item.source.shards] + [item.source.path / name for name in item.plan.side_files]]


def _write(plan: ConversionPlan, on_bytes: Callable[[int], None]) -> ConvertResult:
    """execute's work, under the output lock its caller holds."""
    outputs: dict[str, dict[str, str | None]] = {}
    made: dict[str, str] = {}
    paired = plan.pair is not None
    if any(not tensor.is_copy for item in plan.items for tensor in item.plan.tensors):
        _import_in_background("converter.transforms")
    if plan.request.out.exists() and not plan.request.force:  # another run finished it since we planned
        raise OutputError(f"{plan.request.out} already exists; choose a new directory or pass --force")
    sources = identities(_source_files(plan))  # before the first read; compared after the last
    with staged_directory(plan.request.out, replace=plan.request.force) as staging, ExitStack() as stack:
        # every source file this conversion reads whole, hashed from the start on the cores the writes leave
        threads = budget()
        ahead = hashing_ahead(_files_to_hash(plan, staging), stack, threads=threads.hash_threads) \
            if plan.request.hashed else {}
        finishing, writers = [], Writers.started(stack, threads)
        on_bytes = _one_at_a_time(on_bytes)  # the writers' threads report progress
        for item in plan.items:
            directory = staging / item.subdir if item.subdir else staging
            make_directory(directory)
            finishing.append((item.subdir, _write_checkpoint(
                item, directory, link=plan.request.link, hashed=plan.request.hashed, paired=paired,
                warnings=plan.warnings, on_bytes=on_bytes, tp=plan.request.tp, ahead=ahead, writers=writers,
                origin=plan.request.origins.get(item.role), card=_card_writer(plan, item),
                serving=_serving_record(plan.request.serving))))
        for subdir, write_manifest in finishing:  # every file is started: now wait for the writes and hashes
            outputs[subdir], how = write_manifest()
            made.update({f"{subdir}/{name}".lstrip("/"): h for name, h in how.items()})
        refuse_changed(sources)  # still staged: a source that changed meanwhile leaves nothing behind
    return ConvertResult(plan=plan, output_files=outputs, made=made)


# ---------------------------------------------------------------------------------------- the verb's library call

@dataclass(frozen=True)
class PreparedConversion:
    """What `convert` settled before writing anything: the verb prints it before the progress bar starts."""

    request: ConvertRequest  # as the user gave it (plan.request: as resolved)
    plan: ConversionPlan | None  # None: the source serves as it is where the request serves, so nothing is planned
    # advice's decision where one was asked for (no --layout, or --serving): its layout is the one planned unless
    # --layout named another
    decision: Decision | None
    paired_assistant: tuple[str, str] | None  # (assistant repo, target repo): the Hub assistant paired automatically
    notes: tuple[str, ...]  # without --serving: what the user may not need (a source serving as it is, ...)
    source_serve_line: str | None = None  # plan None: the `vllm serve` line for the sources themselves
    sources: tuple[LocalSource, ...] = ()  # as resolved (a Hub source read from the cache alone says so)
    names: Mapping[Role, str] = field(default_factory=dict)  # each role's source as the user named it
    # the ledger's measured refusal of a pair with this quantized assistant (advice/pitfalls.py): no serve line
    assistant_refusal: str | None = None


def convert(request: ConvertRequest, *, api: Any = None,
            on_prepared: Callable[[PreparedConversion], None] = lambda p: None,
            on_bytes: Callable[[int], None] = lambda n: None) -> tuple[PreparedConversion, ConvertResult | None]:
    """The verb: opens each source once (Hub: headers only, pinned to one commit), pairs a Hub target's published
    assistant, decides the layout, plans once; then, unless a dry run, locks OUT, downloads the Hub weights at the
    commits the plan was made from, and writes.

    Args:
        request: as the user gave it (sources may be Hub ids, the layout None).
        api: an HfApi for Hub sources (None: huggingface_hub's own, made only when a source is a Hub repo).
        on_prepared: called with the decision and the plan before anything is locked, downloaded or written.
        on_bytes: progress, in source bytes processed (plan.source_bytes in all).

    Returns:
        (what was prepared, the written result; None for a dry run).

    Raises:
        UsageError, InputError, OutputError, HubError: one line each, naming the file or repo at fault.
    """
    sources = {role: resolve_source(str(text), purpose="headers", api=api) for role, text in request.sources.items()}
    opened = {role: open_checkpoint(source) for role, source in sources.items()}
    check_roles(opened, _source_texts(request))
    paired = None
    if not request.target_only:
        paired = _pair_published_assistant(request, sources, opened, api)
    decision = _decision(opened, request)
    # the sources' own measured refusal (a quantized assistant): no serve line for them, and no note that they serve
    source_refusal = next((r for r in (quantized_assistant_refusal(c.spec) for c in opened.values()) if r), None)
    refusal = None if request.dequantize_assistant else source_refusal
    if _serves_as_it_is(decision, request):
        return PreparedConversion(request=request, plan=None, decision=decision, paired_assistant=paired, notes=(),
                                  source_serve_line=_source_serve_line(sources, opened),
                                  sources=tuple(sources.values()), assistant_refusal=refusal), None
    resolved = replace(
        request, layout=request.layout or (decision.writes if decision else default_layout().name),
        sources={role: source.path for role, source in sources.items()},
        opened={sources[role].path: checkpoint for role, checkpoint in opened.items()},
        origins={role: source.origin() for role, source in sources.items() if source.origin()})
    plan = plan_conversion(resolved)
    notes = () if request.serving is not None or source_refusal else tuple(serving_notes(
        [(f"the {'source' if i.role is Role.SINGLE else i.role}", shape_of(i.source.spec, fused=has_fused_qkv(i.source)))
         for i in plan.items], plan.request.layout))
    prepared = PreparedConversion(request=request, plan=plan, decision=decision, paired_assistant=paired, notes=notes,
                                  sources=tuple(sources.values()), names=_given_names(request, sources),
                                  assistant_refusal=refusal)
    on_prepared(prepared)
    if request.dry_run:
        return prepared, None
    with output_lock(request.out):  # before any download: a second run into OUT stops here, not after fetching weights
        for source in sources.values():
            fetch_weights(source, api=api)
        return prepared, _write(plan, on_bytes)


def _source_texts(request: ConvertRequest) -> dict[Role, str]:
    return {role: str(text) for role, text in request.sources.items()}


def _given_names(request: ConvertRequest, sources: Mapping[Role, LocalSource]) -> dict[Role, str]:
    """Each source as the user named it (a Hub id, not its snapshot folder), for the lines convert prints."""
    given = _source_texts(request)
    if Role.SINGLE in given and Role.SINGLE not in sources:  # a Hub target given as SRC, paired: now the target
        given[Role.TARGET] = given.pop(Role.SINGLE)
    return {role: given.get(role) or source.repo_id or str(source.path) for role, source in sources.items()}


def _pair_published_assistant(request: ConvertRequest, sources: dict[Role, LocalSource], opened: dict[Role, Checkpoint],
                              api: Any) -> tuple[str, str] | None:
    """A Hub target given without an assistant becomes a pair with OWNER/NAME-assistant, in place in `sources` and
    `opened`; local directories and an assistant given alone are left as they are."""
    role = Role.SINGLE if Role.SINGLE in request.sources else Role.TARGET
    ref = parse_repo_ref(str(request.sources.get(role, "")))
    if ref is None or Role.ASSISTANT in request.sources or opened[role].spec.role != Role.TARGET:
        return None
    repo_id, found, checkpoint = published_assistant(ref, api=api)
    if role is Role.SINGLE:
        sources[Role.TARGET], opened[Role.TARGET] = sources.pop(role), opened.pop(role)
    sources[Role.ASSISTANT], opened[Role.ASSISTANT] = found, checkpoint
    return repo_id, ref.repo_id


def _decision(opened: Mapping[Role, Checkpoint], request: ConvertRequest) -> Decision | None:
    """advice's decision for the checkpoint whose geometry the ledger matches (the target's where there is one),
    where one is asked for: no --layout, or a serving environment to say it for."""
    if request.layout is not None and request.serving is None:
        return None
    checkpoint = next(opened[r] for r in (Role.TARGET, Role.SINGLE, Role.ASSISTANT) if r in opened)
    return decide(shape_of(checkpoint.spec, fused=has_fused_qkv(checkpoint)), request.serving)


def _serves_as_it_is(decision: Decision | None, request: ConvertRequest) -> bool:
    """No work for nothing: the environment named (or found beside the tool) serves the source as it is, and no
    --layout asks for a conversion anyway."""
    return (decision is not None and decision.layout == NO_CONVERSION and request.layout is None
            and request.serving is not None and not request.dequantize_assistant)


def _source_serve_line(sources: Mapping[Role, LocalSource], opened: Mapping[Role, Checkpoint]) -> str:
    """`vllm serve` for the sources as they are: a Hub repo by its id (at the default branch) or the snapshot that
    was read (another revision), a local checkpoint by its path."""
    refs: dict[str, str] = {}
    for role, source in sources.items():
        ref = source.repo_id if source.repo_id and source.revision in (None, "main") else str(source.path)
        refs[opened[role].spec.role] = ref
    return serve_line(target=refs.get(Role.TARGET), assistant=refs.get(Role.ASSISTANT), layout=None)


def _import_in_background(module: str) -> None:
    """Starts importing `module` (torch, ~2 s of CPU) in a thread while the first files are copied; the later
    `import` in the main thread waits on Python's per-module import lock for it to finish, or imports it again
    itself if this failed (that import raises the real error, in one line, where it is needed)."""
    def load() -> None:
        try:
            importlib.import_module(module)
        except BaseException:  # noqa: BLE001 - not this thread's to report
            pass
    threading.Thread(target=load, name=f"import {module}", daemon=True).start()


def _refuse_tensor_parallel(checkpoints: Mapping[str, Checkpoint], request: ConvertRequest, layout: Layout) -> None:
    """--tp N that vLLM would refuse at start-up for the output's geometry: one line, before anything is written.

    Raises:
        InputError: the first such division.
    """
    for checkpoint in checkpoints.values():
        if checkpoint.spec.role != Role.TARGET:
            continue  # vLLM asserts the target's divisions; the draft's follow the same KV formulas unchecked
        attention = layout.output_attention(checkpoint.spec.attention)
        problems = tp_problems(attention, request.tp, what=f"the {request.layout} output of {checkpoint.path}")
        if problems:
            raise InputError(problems[0])


def _copies(link: str, source: Path, directory: Path) -> bool:
    """Whether place_file copies `source` into `directory` under `link` (auto copies where it cannot reflink)."""
    return link == "copy" or (link == "auto" and not reflink_possible(source, directory))


def _files_to_hash(plan: ConversionPlan, staging: Path) -> dict[Path, int]:
    """path -> size of every source file the conversion reads whole and whose sha256 is not known already (a Hugging
    Face cache names it): unchanged files it copies (a copy's sha256 is its source's) and the sources of rewritten
    shards. Linked files are never read."""
    files: dict[Path, int] = {}
    for item in plan.items:
        sizes = {shard.file: shard.size for shard in item.source.shards}
        for shard in item.plan.shards:
            if shard.same_as is not None:
                read = [shard.same_as] if _copies(plan.request.link, shard.same_as, staging) else []
            else:
                read = [tensor.source.ref.file for tensor in shard.tensors]
            files.update({path: sizes[path] for path in read if not known_sha256(path)})
    return files


def _write_checkpoint(item: PlannedCheckpoint, directory: Path, *, link: str, hashed: bool, paired: bool,
                      warnings: tuple[str, ...], on_bytes: Callable[[int], None],
                      ahead: Mapping[Path, PendingSha256], writers: Writers,
                      origin: Mapping[str, str] | None = None, tp: int | None = None,
                      card: Callable[[dict[str, Any]], str] | None = None,
                      serving: Mapping[str, Any] | None = None
                      ) -> Callable[[], tuple[dict[str, str | None], dict[str, str]]]:
    """Starts writing item's files into directory (its shards by `writers`, the small files at once); returns what
    waits for them and for the hashes, then writes the manifest (called after every checkpoint's files are started,
    so no copy waits for a hash and no checkpoint for another)."""
    plan, source = item.plan, item.source
    sizes = {shard.file: shard.size for shard in source.shards}
    files: dict[str, PendingSha256 | Future | str | None] = {}
    made: dict[str, str] = {}
    source_hashes: dict[str, PendingSha256 | str | None] = {}
    placing: list[tuple[ShardPlan, Future]] = []
    for shard in plan.shards:
        if shard.same_as is not None:  # an unchanged source file: copied or linked whole, hashed once if read
            placing.append((shard, writers.copies.submit(
                place_whole, shard, directory, link=link, expected_size=sizes[shard.same_as],
                hashed=hashed and shard.same_as not in ahead, on_bytes=on_bytes)))
            continue
        for path in dict.fromkeys(t.source.ref.file for t in shard.tensors):
            if path.name not in source_hashes:  # hashed ahead (or known) while its bytes are rewritten
                source_hashes[path.name] = (known_sha256(path) or ahead[path]) if hashed else None
        files[shard.file_name] = writers.rewrites.submit(
            rewrite_shard, shard, directory / shard.file_name, metadata=plan.metadata, hashed=hashed,
            on_bytes=on_bytes, buffers=writers.buffers, render_threads=writers.budget.render_threads)
        made[shard.file_name] = MADE_WRITTEN
    if plan.indexed:
        files[INDEX_NAME], made[INDEX_NAME] = write_json(directory / INDEX_NAME, index_document(plan)), MADE_WRITTEN
    files["config.json"], made["config.json"] = write_json(directory / "config.json", plan.config), MADE_WRITTEN
    for name, placed in carried_side_files(plan.side_files).items():
        made[placed], digest = place_file(source.path / name, directory / placed, link=link, hashed=hashed)
        source_hashes[name] = files[placed] = digest

    def write_manifest() -> tuple[dict[str, str | None], dict[str, str]]:
        for shard, placed in placing:
            made[shard.file_name], digest = placed.result()
            if made[shard.file_name] == "copy" and shard.same_as in ahead:
                digest = ahead[shard.same_as]
            files[shard.file_name] = source_hashes[shard.same_as.name] = digest
        resolved = {name: _resolved(digest) for name, digest in files.items()}
        document = manifest_document(
            item.plan, item.source, source_hashes={name: _resolved(digest) for name, digest in source_hashes.items()},
            output_hashes=resolved, output_sizes=_sizes(directory, resolved), made=made, link=link, hashed=hashed,
            paired=paired, warnings=warnings, origin=origin, tp=tp, serving=serving)
        if card is not None:  # rendered from the manifest it then joins: the card never describes its own sha256
            resolved[CARD_NAME] = write_text(directory / CARD_NAME, card(document))
            made[CARD_NAME] = MADE_WRITTEN
            document["output"]["files"][CARD_NAME], document["output"]["made"][CARD_NAME] = resolved[CARD_NAME], \
                MADE_WRITTEN
            document["output"]["sizes"][CARD_NAME] = (directory / CARD_NAME).stat().st_size
        write_json(directory / MANIFEST_NAME, document)
        return resolved, made

    return write_manifest


def _sizes(directory: Path, names: Mapping[str, Any]) -> dict[str, int]:
    """The size of every file written into directory (a linked one: its source's), as conversion.json records it."""
    with output_errors(directory):
        return {name: os.stat(directory / name).st_size for name in names}


def _serving_record(serving: ServingEnv | None) -> dict[str, Any] | None:
    """conversion.json `serving`: the vLLM + transformers the layout was chosen for, and how they were named."""
    if serving is None:
        return None
    how = "beside the tool" if serving.beside_tool else "--serving-python" if serving.python else "--serving"
    return {"vllm": serving.vllm, "transformers": serving.transformers, "named_by": how}


def _card_writer(plan: ConversionPlan, item: PlannedCheckpoint) -> Callable[[dict[str, Any]], str]:
    """The card of item's output, from its manifest: named after OUT (a pair's assistant OUT-assistant, as
    `upload OUT OWNER/NAME` names the repos), quoting the source's card's license."""
    from .hub.card import output_card  # the ledger tables: only a written output needs them
    from .hub.provenance import infer_base_model
    from .read.front_matter import front_matter_of

    name = plan.request.out.absolute().name
    names = {Role.TARGET: name, Role.ASSISTANT: name + ASSISTANT_SUFFIX} if item.role is not Role.SINGLE else \
        {item.plan.role: name}
    partner = names.get(Role.ASSISTANT if item.plan.role == Role.TARGET else Role.TARGET)
    kept = next((n for n in (SOURCE_CARD_NAME, CARD_NAME) if n in item.plan.side_files), None)
    front_matter = front_matter_of(item.source.path / kept) if kept else None

    def render(manifest: dict[str, Any]) -> str:
        base = infer_base_model(manifest)
        return output_card(manifest, name=names[item.plan.role], partner=partner, source_card=kept is not None,
                           source_front_matter=front_matter, base_model=base.repo_id if base else None)
    return render


def _one_at_a_time(report: Callable[[int], None]) -> Callable[[int], None]:
    """report, called by one thread at a time (a tqdm bar's update is not thread-safe)."""
    lock = threading.Lock()

    def locked(count: int) -> None:
        with lock:
            report(count)
    return locked


def _resolved(digest: PendingSha256 | Future | str | None) -> str | None:
    return digest.result() if isinstance(digest, (PendingSha256, Future)) else digest


def serve_command(plan: ConversionPlan) -> str:
    """The `vllm serve` line for what was converted, with the output paths."""
    target, assistant = plan.item(Role.TARGET), plan.item(Role.ASSISTANT)
    if plan.request.single:
        only = plan.items[0]
        target = only if only.plan.role == Role.TARGET else None
        assistant = only if only.plan.role == Role.ASSISTANT else None
    return serve_line(target=str(plan.output_dir(target)) if target else None,
                      assistant=str(plan.output_dir(assistant)) if assistant else None, layout=plan.request.layout,
                      tp=plan.request.tp)

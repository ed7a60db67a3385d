"""Tensor parallelism, rank by rank: a converted pair as vLLM's own layers and weight loaders build it for every rank
of TP N, against the UNSHARDED original.

vLLM never checks that a draft layer's per-rank KV heads and head size equal those of the target layer whose cache it
reads (0.27.0: ``gemma4_mtp.py`` ~173-177 computes them from the ASSISTANT's config; ``v1/spec_decode/gemma4.py``
~304-358 points the draft at the target's cache): a mismatch reads the wrong bytes without an error. This check builds
target and draft with the TP group's world size and rank set to N and r, as each worker has them (construction and
weight loading only: no collective, no forward pass of vLLM's), and for every rank:

  geometry   each draft layer's (head_size, KV heads) on this rank == the target layer's whose cache it reads, and the
             target's KV heads per rank == max(1, KV heads // N), vLLM's own formula (``gemma4.py`` ~394-407);
  attention  for each draft layer and the target layer whose cache it reads: the rank's q, k, v and o_proj slices, as
             loaded, through the layer's own per-head norms and rotary embedding (vLLM's forward_native), then
             causal attention (scaling 1.0, as Gemma 4) and the rank's part of o_proj. The parts summed over the
             ranks (what RowParallelLinear's all-reduce does) must equal the same computation on the ORIGINAL pair
             built unsharded (TP 1) by the same layers: max |difference| <= TOLERANCE x max |output|. The draft's
             queries meet the keys and values its rank's target layer computed, as the shared cache hands them over.

The original pair is also run through the check (its own rows): vLLM's sharding of an unconverted pair is exact too.

Runs INSIDE a vLLM env (scripts/consumers/vllm/envs.sh), reusing check.py's configuration and stand-ins; never imports the
converter package. Exit 0 every rank of every size passes, 1 a check failed, 2 a stage raised, 3 bad arguments.

usage: python scripts/consumers/vllm/tp_check.py --original DIR --pair DIR [--pair DIR ...] --tp 2 --tp 4 --tp 8
           [--json FILE]        (each DIR holds target/ and assistant/)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import check  # noqa: E402 - this folder's loader check: configuration, stand-ins, KV-sharing pairs

EXIT_OK, EXIT_FAIL, EXIT_STAGE, EXIT_USAGE = 0, 1, 2, 3
TOLERANCE = 1e-5  # fp32: the sum over ranks adds the same products in another order (measured <= 1.3e-6)
TOKENS = 7
SEED = 0


@dataclass
class RankLayer:
    """What one rank holds of one attention layer, as vLLM built and loaded it (float32 copies), and the layer itself
    (its per-head norms and rotary embedding)."""

    module: Any
    num_heads: int
    num_kv_heads: int
    head_size: int
    q: Any  # [num_heads * head_size, hidden]
    k: Any | None  # [num_kv_heads * head_size, hidden] (None: a Q-only draft layer)
    v: Any | None
    o: Any  # [hidden, num_heads * head_size]


def attention_modules(model: Any) -> dict[int, Any]:
    """text layer index -> its self_attn module (towers excluded)."""
    out = {}
    for name, module in model.named_modules():
        if name.endswith(".self_attn") and not name.startswith(check._TOWER_PREFIXES):
            out[int(check._LAYER_RE.search(name + ".").group(1))] = module
    return out


def rank_layer(module: Any) -> RankLayer:
    attn = module.attn
    heads, kv_heads, size = int(attn.num_heads), int(attn.num_kv_heads), int(attn.head_size)
    o = module.o_proj.weight.detach().float().clone()
    if hasattr(module, "qkv_proj"):
        qkv = module.qkv_proj.weight.detach().float()
        q_rows, kv_rows = heads * size, kv_heads * size
        q, k, v = qkv[:q_rows], qkv[q_rows:q_rows + kv_rows], qkv[q_rows + kv_rows:q_rows + 2 * kv_rows]
        return RankLayer(module, heads, kv_heads, size, q.clone(), k.clone(), v.clone(), o)
    return RankLayer(module, heads, kv_heads, size, module.q_proj.weight.detach().float().clone(), None, None, o)


def _heads(x: Any, weight: Any, heads: int, size: int, norm: Any) -> Any:
    """x @ weight.T per head, through the layer's own per-head RMSNorm (vLLM's forward_native)."""
    return norm.forward_native((x @ weight.T).unflatten(-1, (heads, size))).flatten(-2, -1)


def target_kv(layer: RankLayer, x: Any, positions: Any) -> tuple[Any, Any]:
    """K (normed, rotated) and V (normed) of a target layer: what it writes to its KV cache (Gemma4Attention)."""
    module = layer.module
    k = _heads(x, layer.k, layer.num_kv_heads, layer.head_size, module.k_norm)
    v = _heads(x, layer.v, layer.num_kv_heads, layer.head_size, module.v_norm)
    _, k = module.rotary_emb.forward_native(positions, k.clone(), k)
    return k, v


def query(layer: RankLayer, x: Any, positions: Any) -> Any:
    """Q, normed and rotated, as the layer computes it (target: Gemma4Attention; draft: gemma4_mtp's Q-only layer)."""
    q = _heads(x, layer.q, layer.num_heads, layer.head_size, layer.module.q_norm)
    return layer.module.rotary_emb.forward_native(positions, q, None)[0]


def attend(q: Any, k: Any, v: Any, o_w: Any, *, heads: int, kv_heads: int, size: int) -> Any:
    """Causal attention (Gemma 4's scaling 1.0) of q over the cache's k, v, through o_w: this rank's o_proj part."""
    import torch

    tokens = q.shape[0]
    q = q.view(tokens, heads, size).transpose(0, 1)
    k = k.view(tokens, kv_heads, size).transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
    v = v.view(tokens, kv_heads, size).transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
    scores = (q @ k.transpose(1, 2)).masked_fill(torch.triu(torch.ones(tokens, tokens, dtype=torch.bool), 1),
                                                 float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(0, 1).reshape(tokens, heads * size) @ o_w.T


def outputs(target: dict[int, RankLayer], draft: dict[int, RankLayer], reads: list[tuple[int, int]], x_t: Any,
            x_d: Any) -> dict[str, Any]:
    """This rank's partial attention outputs: every target layer a draft layer reads, and every draft layer."""
    import torch

    positions = torch.arange(x_t.shape[0])
    out: dict[str, Any] = {}
    for d_layer, t_layer in reads:
        t, d = target[t_layer], draft[d_layer]
        k, v = target_kv(t, x_t, positions)
        out[f"target.{t_layer}"] = attend(query(t, x_t, positions), k, v, t.o, heads=t.num_heads,
                                          kv_heads=t.num_kv_heads, size=t.head_size)
        out[f"draft.{d_layer}"] = attend(query(d, x_d, positions), k, v, d.o, heads=d.num_heads,
                                         kv_heads=t.num_kv_heads, size=t.head_size)
    return out


# ------------------------------------------------------------------------------------------ one pair at one TP size

def set_rank(tp: int, rank: int) -> None:
    """The TP group's world size and rank as worker `rank` of `tp` has them; every get_tensor_model_parallel_*()
    (linear, embedding, Gemma4Attention, the draft) reads them from this group object."""
    from vllm.distributed import parallel_state

    group = parallel_state.get_tp_group()
    group.world_size, group.rank_in_group = tp, rank


def load_rank(args: argparse.Namespace, pair: Path, tp: int, rank: int) -> tuple[dict[int, RankLayer],
                                                                                  dict[int, RankLayer]]:
    one = argparse.Namespace(target=pair / "target", assistant=pair / "assistant", dtype="float32",
                             max_model_len=1024, loaders_only=args.loaders_only)
    vcfg, spec, _, _ = check.configure(one, lambda line: None)  # the TP group exists from here on
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

    set_rank(tp, rank)
    try:
        with set_current_vllm_config(vcfg):
            target = get_model(vllm_config=vcfg)
            draft = get_model(vllm_config=vcfg, model_config=spec.draft_model_config,
                              load_config=spec.draft_load_config)
    finally:
        set_rank(1, 0)
    return ({i: rank_layer(m) for i, m in attention_modules(target).items()},
            {i: rank_layer(m) for i, m in attention_modules(draft).items()})


def check_pair(args: argparse.Namespace, pair: Path, tp: int, reference: dict[str, Any]) -> dict[str, Any]:
    """Every rank of `pair` at TP `tp`: the geometry, and its partial outputs summed against `reference` (the
    original at TP 1)."""
    import torch

    t_cfg, d_cfg = configs(pair)
    t_types = list(t_cfg["layer_types"])
    shared = int(t_cfg.get("num_kv_shared_layers") or 0)
    reads = draft_reads(t_cfg, d_cfg)
    x_t, x_d = inputs(t_cfg, d_cfg)
    sums: dict[str, Any] = {}
    problems: list[str] = []
    geometry: list[dict[str, Any]] = []
    for rank in range(tp):
        target, draft = load_rank(args, pair, tp, rank)
        for layer, held in target.items():
            kv = kv_heads_of(t_cfg, t_types[layer])
            if layer < len(t_types) - shared and held.num_kv_heads != max(1, kv // tp):
                problems.append(f"rank {rank}: target layer {layer} holds {held.num_kv_heads} KV heads, "
                                f"vLLM's formula gives {max(1, kv // tp)} of {kv}")
        consistent = []
        for d_layer, t_layer in reads:
            d, t = draft[d_layer], target[t_layer]
            ok = (d.head_size, d.num_kv_heads) == (t.head_size, t.num_kv_heads)
            geometry.append({"rank": rank, "draft_layer": d_layer, "target_layer": t_layer,
                             "draft": [d.head_size, d.num_kv_heads], "target": [t.head_size, t.num_kv_heads],
                             "ok": ok})
            if ok:
                consistent.append((d_layer, t_layer))
            else:
                problems.append(f"rank {rank}: draft layer {d_layer} is [{d.head_size}, {d.num_kv_heads} KV heads] "
                                f"but reads target layer {t_layer}'s cache of [{t.head_size}, {t.num_kv_heads}]")
        with torch.no_grad():
            for key, value in outputs(target, draft, consistent, x_t, x_d).items():
                _add(sums, key, value)
    errors = {}
    for key, want in reference.items():
        if key not in sums:
            continue  # a geometry problem, reported above
        errors[key] = float((sums[key] - want).abs().max() / want.abs().max())
        if errors[key] > TOLERANCE:
            problems.append(f"{key}: the ranks' outputs summed differ from the unsharded original's by "
                            f"{errors[key]:.2e} of its largest value")
    return {"pair": pair.name, "tp": tp, "passed": not problems, "problems": problems, "relative_errors": errors,
            "geometry": geometry}


def configs(pair: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The text configs of target and assistant (flat keys: what vLLM 0.27 reads)."""
    return (check.text_config_of(check.read_config(pair / "target")),
            check.text_config_of(check.read_config(pair / "assistant")))


def draft_reads(t_cfg: dict[str, Any], d_cfg: dict[str, Any]) -> list[tuple[int, int]]:
    """(draft layer, target layer whose KV cache it reads), as vLLM pairs them (check.kv_sharing_pairs)."""
    shared = int(t_cfg.get("num_kv_shared_layers") or 0)
    return [(d, t) for d, t in check.kv_sharing_pairs(list(t_cfg["layer_types"]), shared,
                                                      list(d_cfg["layer_types"])) if t is not None]


def inputs(t_cfg: dict[str, Any], d_cfg: dict[str, Any]) -> tuple[Any, Any]:
    """Fixed hidden states for the target's layers and the draft's (seeded: the same for every pair and rank)."""
    import torch

    generator = torch.Generator().manual_seed(SEED)
    return (torch.randn(TOKENS, int(t_cfg["hidden_size"]), generator=generator),
            torch.randn(TOKENS, int(d_cfg["hidden_size"]), generator=generator))


def reference_outputs(args: argparse.Namespace, original: Path) -> dict[str, Any]:
    """The original pair built unsharded (TP 1) by the same vLLM layers: what every TP's ranks must add up to."""
    import torch

    t_cfg, d_cfg = configs(original)
    target, draft = load_rank(args, original, 1, 0)
    with torch.no_grad():
        return outputs(target, draft, draft_reads(t_cfg, d_cfg), *inputs(t_cfg, d_cfg))


def _add(sums: dict[str, Any], key: str, value: Any) -> None:
    sums[key] = sums[key] + value if key in sums else value


def kv_heads_of(text_cfg: dict[str, Any], layer_type: str) -> int:
    """A layer type's KV heads in a config's flat keys (what vLLM 0.27 reads)."""
    if layer_type == "full_attention" and text_cfg.get("num_global_key_value_heads"):
        return int(text_cfg["num_global_key_value_heads"])
    return int(text_cfg["num_key_value_heads"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--original", type=Path, required=True, help="the original pair (target/ and assistant/)")
    ap.add_argument("--pair", type=Path, action="append", default=[], help="a pair to check (repeatable; the "
                    "original is always checked too)")
    ap.add_argument("--tp", type=int, action="append", help="tensor-parallel sizes (repeatable; default 2, 4, 8)")
    ap.add_argument("--json", type=Path, help="write the report here")
    ap.add_argument("--loaders-only", action="store_true", help="as check.py: tensors as the weight loaders left "
                    "them, stand-ins where no CPU kernel exists")
    args = ap.parse_args(argv)
    args.tp = args.tp or [2, 4, 8]
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else EXIT_OK
    for pair in (args.original, *args.pair):
        for side in ("target", "assistant"):
            if not (pair / side / "config.json").is_file():
                print(f"error: {pair / side}/config.json not found", file=sys.stderr)
                return EXIT_USAGE
    report: dict[str, Any] = {"versions": check.versions(), "tolerance": TOLERANCE, "results": []}
    code = EXIT_OK
    try:
        reference = reference_outputs(args, args.original)
        for pair in (args.original, *args.pair):
            for tp in args.tp:
                result = check_pair(args, pair, tp, reference)
                report["results"].append(result)
                worst = max(result["relative_errors"].values(), default=0.0)
                print(f"{'PASS' if result['passed'] else 'FAIL'} {pair.name} TP {tp}: {len(result['geometry'])} "
                      f"draft/target layer pairs over {tp} ranks, max relative error {worst:.1e}"
                      + "".join(f"\n    {p}" for p in result["problems"]), flush=True)
                code = code if result["passed"] else EXIT_FAIL
    except Exception as exc:  # noqa: BLE001 - reported with its stage, like check.py
        root = check.root_exception(exc) if isinstance(exc, check.StageError) else exc
        report["error"] = f"{type(root).__name__}: {str(root).strip()[:600]}"
        report["traceback"] = traceback.format_exc(limit=8)
        print(f"error: {report['error']}", file=sys.stderr)
        code = EXIT_STAGE
    report["exit_code"] = code
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return code


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.exit(main())

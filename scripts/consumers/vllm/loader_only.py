"""``check.py --loaders-only``: run vLLM's stock create_weights and weight loaders for quantized linear layers that
have no CPU GEMM kernel, and keep the parameters exactly as the loaders filled them.

Where vLLM 0.27.0 refuses on a CPU (read from its code, site-packages/vllm):

- compressed-tensors FP8 block (``CompressedTensorsW8A8Fp8.create_weights``,
  ``quantization/compressed_tensors/schemes/compressed_tensors_w8a8_fp8.py``): the ``weight`` and ``weight_scale``
  parameters (with their weight loaders) are registered first; the LAST statement picks the GEMM,
  ``init_fp8_linear_kernel`` -> ``choose_scaled_mm_linear_kernel`` over ``_POSSIBLE_FP8_BLOCK_KERNELS[CPU]`` =
  [``CPUFp8BlockScaledMMKernel``], whose ``is_supported`` needs AMX tiles (``kernels/linear/scaled_mm/cpu.py``) and
  whose ``can_implement`` needs 128-column, 32k-row blocks. Its ``process_weights_after_loading`` VNNI-repacks the
  weight for AMX (``torch.ops._C.convert_weight_packed``).
- Model Optimizer NVFP4 (``ModelOptNvFp4LinearMethod.__init__``, ``quantization/modelopt.py``): the linear method
  picks its kernel in its constructor, ``init_nvfp4_linear_kernel`` (``kernels/linear/__init__.py``), from
  ``_POSSIBLE_NVFP4_KERNELS``, which has no CPU entry at all (CUDA and ROCm only): "Failed to find a kernel that can
  implement the NVFP4 linear layer". create_weights itself needs no kernel.
- compressed-tensors int8 weight-only (``CompressedTensorsWNA16.create_weights``, ``compressed_tensors_wNa16.py``):
  ``choose_mp_linear_kernel`` returns the kernel CLASS; on CPU every candidate refuses ``uint8b128``
  (``CPUWNA16LinearKernel`` takes uint4 / uint4b8 only), "Failed to find a kernel that can implement the WNA16
  linear layer". The parameters are registered after the choice, by the same create_weights.

So the kernel choice, not the loaders, is what a CPU lacks. :func:`install` wraps exactly those three selection
functions where the schemes look them up: the stock selection runs first; only when it raises ValueError is a
:class:`LoaderOnlyKernel` returned, and the refusal (function, message) is recorded. The stand-in declares no
input quant key, does nothing after loading and raises on use. The loader's ``process_weights_after_loading`` is
also wrapped to take a copy of every parameter and persistent buffer before it runs: that copy, the tensors as the
weight loaders left them, is what check.py compares. The stock post-processing then still runs (with the stand-in,
the part that needs the missing kernel, the AMX repack or an NVFP4 GEMM's swizzle, is what does not). Where the
post-processing itself calls a CPU kernel's op that the CUDA wheel's ``torch.ops._C`` lacks (vLLM 0.33's CPU MoE
experts prepack their weights with ``prepack_moe_weight``), that call is the refusal recorded, and it ends the
post-processing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

# (module that looks the selection function up, its name there, whether it returns the kernel's class)
_SELECTION_SITES = (
    ("vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_fp8",
     "init_fp8_linear_kernel", False),
    ("vllm.model_executor.layers.quantization.modelopt", "init_nvfp4_linear_kernel", False),
    ("vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16",
     "choose_mp_linear_kernel", True),
)
_LOADER_MODULE = "vllm.model_executor.model_loader.base_loader"


class LoaderOnlyKernel:
    """Takes the place of a GEMM kernel vLLM could not select; it never computes."""

    def __init__(self, refused_by: str, reason: str) -> None:
        self.refused_by = refused_by
        self.reason = reason

    def input_quant_key(self) -> None:  # expose_input_quant_key: the layer quantizes nothing for it
        return None

    def process_weights_after_loading(self, layer: Any) -> None:  # the repack/swizzle needs the missing kernel
        return None

    def apply_weights(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"loader-only stand-in for a kernel {self.refused_by} refused: {self.reason}")


@dataclass
class Recorder:
    """What install() saw: each refusal once with its count, and per model the pre-processing copy."""

    refusals: dict[tuple[str, str], int] = field(default_factory=dict)
    loaded: dict[int, dict[str, Any]] = field(default_factory=dict)  # id(model) -> name -> tensor copy
    classes: dict[int, dict[str, str]] = field(default_factory=dict)  # id(model) -> name -> parameter class name

    def summary(self) -> list[dict[str, Any]]:
        return [{"selection": fn, "reason": reason, "layers": n} for (fn, reason), n in self.refusals.items()]


def _stand_in_class(refused_by: str, reason: str) -> type:
    """LoaderOnlyKernel as a class for a selection that returns one (the scheme constructs it with its config)."""
    class LoaderOnlyKernelType(LoaderOnlyKernel):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(refused_by, reason)
    return LoaderOnlyKernelType


def _selection_with_stand_in(real: Callable[..., Any], name: str, rec: Recorder, *,
                             returns_class: bool) -> Callable[..., Any]:
    def select(*args: Any, **kwargs: Any) -> Any:
        try:
            return real(*args, **kwargs)
        except ValueError as exc:  # the documented "no kernel can implement" refusal; anything else propagates
            reason = " ".join(str(exc).split())
            rec.refusals[(name, reason)] = rec.refusals.get((name, reason), 0) + 1
            return _stand_in_class(name, reason) if returns_class else LoaderOnlyKernel(name, reason)
    return select


_INSTALLED: list[Recorder] = []  # once per process (check.py --batch): the wrappers stay, the record restarts


def install(snapshot: Callable[[Any], dict[str, Any]]) -> Recorder:
    """Wraps the kernel selections and the loader's post-processing; `snapshot(model)` names the tensors to copy.
    A second call installs nothing more and empties the record for the next check.

    Returns:
        The Recorder check.py reads after get_model.
    """
    import importlib

    if _INSTALLED:
        rec = _INSTALLED[0]
        rec.refusals.clear()
        rec.loaded.clear()
        rec.classes.clear()
        return rec
    rec = Recorder()
    _INSTALLED.append(rec)
    for module_name, fn_name, returns_class in _SELECTION_SITES:
        module = importlib.import_module(module_name)
        setattr(module, fn_name, _selection_with_stand_in(getattr(module, fn_name), fn_name, rec,
                                                          returns_class=returns_class))
    loader = importlib.import_module(_LOADER_MODULE)
    real_process = loader.process_weights_after_loading

    def process(model: Any, *args: Any, **kwargs: Any) -> Any:
        tensors = snapshot(model)
        rec.loaded[id(model)] = {n: t.detach().clone() for n, t in tensors.items()}
        rec.classes[id(model)] = {n: type(t).__name__ for n, t in tensors.items()}
        try:
            return real_process(model, *args, **kwargs)
        except AttributeError as exc:
            # a CPU kernel's repack op the CUDA wheel's torch.ops._C lacks (0.33's CPU MoE experts call
            # prepack_moe_weight): the post-processing needs the missing kernel, the loaded copy is taken
            if "_OpNamespace" not in str(exc):
                raise
            key = ("process_weights_after_loading", " ".join(str(exc).split()))
            rec.refusals[key] = rec.refusals.get(key, 0) + 1
            return None

    loader.process_weights_after_loading = process
    return rec

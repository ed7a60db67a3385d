"""Import-only stand-in for torchvision (scripts/consumers/vllm/cpu_shim.py puts this folder on sys.path).

transformers 5.14.1's ``models/gemma4/image_processing_gemma4.py`` imports
``torchvision.transforms.v2.functional`` at import time, and vLLM 0.27.0's ``gemma4_mm.py``
imports that processor; the torchvision wheels on the registry are CUDA builds that fail
beside the CPU torch. This package lets those imports succeed. Every attribute is a
placeholder; calling one raises, so nothing can silently compute with it. A weight-load
check processes no image. vLLM inspects model classes in a subprocess, which is why this
is a folder on PYTHONPATH and not an in-process hook.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.28.0+standin"
STANDIN = True


class Unavailable:
    """Attribute access nests; calling raises."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __getattr__(self, name: str) -> Unavailable:
        if name.startswith("__"):
            raise AttributeError(name)
        return Unavailable(f"{self._qualname}.{name}")

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(
            f"{self._qualname} was called, but torchvision here is an import-only stand-in "
            "(scripts/consumers/vllm/standins/torchvision): a load check processes no image"
        )

    def __repr__(self) -> str:
        return f"<torchvision stand-in {self._qualname}>"


class _StandinModule(types.ModuleType):
    def __getattr__(self, name: str) -> Unavailable:
        if name.startswith("__"):
            raise AttributeError(name)
        return Unavailable(f"{self.__name__}.{name}")


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every ``torchvision.<sub>`` as a stand-in package."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 (importlib API)
        if not fullname.startswith(__name__ + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):  # noqa: ANN001
        module = _StandinModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:  # noqa: ANN001
        return None


def __getattr__(name: str) -> Unavailable:
    if name.startswith("__"):
        raise AttributeError(name)
    return Unavailable(f"{__name__}.{name}")


if not any(isinstance(f, _SubmoduleFinder) for f in sys.meta_path):
    sys.meta_path.append(_SubmoduleFinder())

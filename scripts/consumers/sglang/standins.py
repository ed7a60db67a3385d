"""Import-only stand-ins for what SGLang imports on CPU but never calls while loading weights.

install(names) puts a meta-path finder in front of sys.meta_path. A top-level name ("torchvision": only CUDA wheels
of it exist beside the CPU torch here; sglang.srt.configs imports it through an InternVL helper) serves that
package and every submodule; a dotted name ("vllm._custom_ops": RotaryEmbedding's constructor imports
`rotary_embedding` from it when the platform is neither CUDA nor SGLang's own CPU build) serves exactly that
module, its parents empty. Every attribute is a placeholder, and calling one raises: a load that reached a stand-in
would fail loudly, not compute with it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class Unavailable:
    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Unavailable(f"{self._qualname}.{name}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:  # a decorator gives the function back
            return args[0]
        raise RuntimeError(f"{self._qualname} called, but it is an import-only stand-in")

    def __mro_entries__(self, bases):  # a class that subclasses a stand-in still defines
        return (object,)


class _StandinModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Unavailable(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names):
        self.trees = {n for n in names if "." not in n}
        self.exact = {n for n in names if "." in n}
        self.parents = {".".join(n.split(".")[:i]) for n in self.exact for i in range(1, n.count(".") + 1)}

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.trees or fullname in self.exact or fullname in self.parents:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name) if spec.name in self.parents else _StandinModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+standin"
        return module

    def exec_module(self, module):
        pass


def install(names) -> None:
    sys.meta_path.insert(0, _Finder(names))

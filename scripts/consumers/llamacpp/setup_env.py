#!/usr/bin/env python3
"""Unpack the GGUF converter of the llama.cpp this env runs (llama-cpp-python's sdist vendors it) into ENV/llama.cpp.

Run by scripts/matrix/consumer_envs.py under the env's python once its requirements are installed: the sdist of the
installed llama-cpp-python version, from the package index, gives `convert_hf_to_gguf.py`, its `conversion/`
package and `gguf-py/` (the converter imports that gguf, not PyPI's).

usage: setup_env.py ENV
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib.metadata import version
from pathlib import Path

VENDORED = ("convert_hf_to_gguf.py", "conversion", "gguf-py", "LICENSE")


def main(argv: list[str]) -> int:
    dest = Path(argv[0]) / "llama.cpp"
    wanted = version("llama-cpp-python")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={wanted}", "-d", tmp], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        root = f"llama_cpp_python-{wanted}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(root)
                       and m.name[len(root):].split("/")[0] in VENDORED]
            tar.extractall(tmp, members=members, filter="data")
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(Path(tmp) / root, dest)
    (dest / "VERSION").write_text(f"llama-cpp-python {wanted}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

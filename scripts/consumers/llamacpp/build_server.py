#!/usr/bin/env python3
"""Build `llama-server` from the llama.cpp that the env's llama-cpp-python vendors, into ENV/llama.cpp/bin (once).

The drafting check (draft.py) runs the server as users run it, and the pair must meet the same llama.cpp that the
GGUF converter and the runtime checks use: the sdist of the installed llama-cpp-python version (from the package
index, or pip's cache) gives `vendor/llama.cpp`, built offline with cmake (no web UI, no curl, static libraries:
one binary), CPU only. About 5 minutes on 2 cores. A finished build leaves a stamp naming this script's digest; a
changed script builds again.

usage: build_server.py ENV      (prints the path of llama-server)
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib.metadata import version
from pathlib import Path

CMAKE_FLAGS = ("-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DBUILD_SHARED_LIBS=OFF", "-DCMAKE_BUILD_TYPE=Release")


def main(argv: list[str]) -> int:
    env = Path(argv[0])
    binary = env / "llama.cpp" / "bin" / "llama-server"
    stamp = binary.with_name("llama-server.stamp")
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    if binary.is_file() and stamp.is_file() and stamp.read_text().strip() == digest:
        print(binary)
        return 0
    wanted = version("llama-cpp-python")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={wanted}", "-d", tmp], check=True, stdout=sys.stderr)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        root = f"llama_cpp_python-{wanted}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, members=[m for m in tar.getmembers() if m.name.startswith(root)], filter="data")
        source, build = Path(tmp) / root, Path(tmp) / "build"
        jobs = str(max(1, len(os.sched_getaffinity(0))))
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS], check=True, stdout=sys.stderr)
        subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], check=True,
                       stdout=sys.stderr)
        binary.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build / "bin" / "llama-server", binary)
    stamp.write_text(digest + "\n")
    print(binary)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

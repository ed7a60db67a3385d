#!/usr/bin/env python3
"""Install SGLang RELEASE into ENV without its dependencies, once requirements-RELEASE.txt is in.

SGLang's own requirements pin CUDA builds (torch, sglang-kernel, flashinfer, cuda-python): resolving them would
replace the CPU torch the requirements pinned. What its Gemma 4 model, config and loader modules import on CPU is in
requirements-RELEASE.txt; the rest (kernels behind `is_cuda()`) is never imported by scripts/consumers/sglang/check.py.

usage: setup_env.py ENV RELEASE
"""

from __future__ import annotations

import subprocess
import sys


def main(argv: list[str]) -> int:
    _, release = argv
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", f"sglang=={release}"], check=True)
    import torch

    if not torch.__version__.endswith("+cpu"):
        print(f"torch {torch.__version__} is not the CPU build the requirements pinned", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

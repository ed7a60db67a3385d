#!/usr/bin/env python3
"""Does the assistant draft in llama.cpp's server as the original pair's does? (the llama.cpp drafting check)

A program of its own: it runs under the python of the llama.cpp env (requirements.txt, setup_env.py) with the
`llama-server` built from the same vendored llama.cpp (build_server.py), never imports the converter, and writes
one JSON document. For the reference pair and each pair given, target and assistant go through llama.cpp's own
`convert_hf_to_gguf.py` (check.py's staging: float32, a test tokenizer); then `llama-server` runs as a user runs it,
over its HTTP API, started and stopped here:

- without a draft model: PROMPT's NEW_TOKENS greedy tokens (`/completion`, token ids in and out);
- with the assistant drafting (`--spec-draft-model A.gguf --spec-type draft-mtp --spec-draft-n-max N_MAX`): the
  same request; its tokens, the response's `timings.draft_n` / `draft_n_accepted`, and every draft candidate the
  server logs at `-v` (`spec ...: - seq_id S, draft candidate I, pos P: TOKEN (PROB)`, llama.cpp's
  common/speculative.cpp, its source unchanged) in order.

The KV cache is float32 (`-ctk f32 -ctv f32`, as check.py runs the target), flash attention off and one thread
decodes, so a run is deterministic. The reference pair runs once more with llama.cpp's default float16 cache: how far
rounding alone moves its drafts (random-weight drafts are nearly flat, and each draft step feeds the next), the bound
a pair whose tensors were rewritten (pad-global) is held to. A step llama.cpp fails (converting, loading, drafting)
records its error, one line; the caller judges (tests/test_consumer_llamacpp.py).

usage: draft.py --server LLAMA_SERVER --reference PAIR [--pair NAME=PAIR ...] --json OUT
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/consumers: run by path, not as a package
sys.path.insert(0, str(Path(__file__).resolve().parent))
from check import convert  # noqa: E402
from consumer_io import NEW_TOKENS, PROMPT, free_port, one_line  # noqa: E402

N_MAX = 3  # draft tokens per step (--spec-draft-n-max)
CANDIDATE = re.compile(r"draft candidate\s+(\d+), pos\s+(\d+):\s+(-?\d+) \(\s*([-+\d.eE]+)\)")
START_TIMEOUT_S = 120
REQUEST_TIMEOUT_S = 300



def serve(server: Path, target: Path, assistant: Path | None, log: Path, *, cache: str = "f32") -> dict:
    """One llama-server run: started, asked for PROMPT's greedy continuation, stopped. {tokens, timings, drafts}
    or {error} (the server's last log line, or the HTTP failure). `cache`: the KV cache's type, target and draft."""
    port = free_port()
    command = [str(server), "-m", str(target), "--host", "127.0.0.1", "--port", str(port), "-c", "256",
               "-t", "1", "-tb", "1", "-ctk", cache, "-ctv", cache, "-np", "1", "--no-webui", "-v", "-fa", "off"]
    if assistant is not None:
        command += ["--spec-draft-model", str(assistant), "--spec-type", "draft-mtp", "--spec-draft-n-max",
                    str(N_MAX), "-ctkd", cache, "-ctvd", cache]
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        error = _wait_ready(proc, port, log)
        if error:
            return {"error": error, "command": command[1:]}
        body = json.dumps({"prompt": list(PROMPT), "n_predict": NEW_TOKENS, "temperature": 0.0, "top_k": 1,
                           "return_tokens": True, "cache_prompt": False, "seed": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                answer = json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError) as exc:
            return {"error": _last_line(log) if proc.poll() is not None else one_line(exc)}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    drafts = [[int(i), int(pos), int(token), float(prob)] for i, pos, token, prob in CANDIDATE.findall(log.read_text())]
    return {"tokens": list(PROMPT) + [int(t) for t in answer.get("tokens", [])],
            "timings": {k: answer.get("timings", {}).get(k) for k in ("draft_n", "draft_n_accepted", "predicted_n")},
            "drafts": drafts, "exit": proc.returncode}


def _wait_ready(proc: subprocess.Popen, port: int, log: Path) -> str | None:
    """None once /health answers 200; else why not (the server exited, or never got ready)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"llama-server exited with {proc.returncode}: {_last_line(log)}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return None
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    return f"llama-server not ready after {START_TIMEOUT_S} s: {_last_line(log)}"


def _last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() or "failed" in line.lower() or "assert" in line.lower()]
    return ((errors or lines or ["no output"])[-1])[:300]


def check_pair(server: Path, pair: Path, work: Path, *, noise: bool = False) -> dict:
    result: dict = {}
    ggufs = {}
    for role in ("target", "assistant"):
        gguf_file, error, _ = convert(pair / role, work, role)
        result[f"{role}_error"] = error
        ggufs[role] = gguf_file
    if ggufs["target"] is None or ggufs["assistant"] is None:
        return result
    result["plain"] = serve(server, ggufs["target"], None, work / "plain.log")
    result["drafting"] = serve(server, ggufs["target"], ggufs["assistant"], work / "drafting.log")
    if noise:  # the same pair through llama.cpp's default float16 cache: how far its own rounding moves the drafts
        result["drafting_f16_cache"] = serve(server, ggufs["target"], ggufs["assistant"], work / "noise.log",
                                             cache="f16")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", type=Path, required=True)
    parser.add_argument("--reference", type=Path, required=True)
    parser.add_argument("--pair", action="append", default=[], metavar="NAME=PAIR")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    pairs = {"reference": args.reference, **dict(item.split("=", 1) for item in args.pair)}
    report = {"server": str(args.server), "n_max": N_MAX, "pairs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, pair in pairs.items():
            (Path(tmp) / name).mkdir()
            report["pairs"][name] = check_pair(args.server, Path(pair), Path(tmp) / name, noise=name == "reference")
    args.json.write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

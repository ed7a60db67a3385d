#!/usr/bin/env python3
"""Benchmark `gemma4-convert` against `cp -r` (the physical floor) and a naive load_file/save_file script.

Builds synthetic checkpoints with the factory (full-size 31B assistant; 31B-width text targets with the full
262144 x 5376 embedding and N decoder layers, at two sizes so RSS can be compared across layer counts), then
runs every contender as a fresh child process, several times each, and reports medians of wall time,
throughput (decimal GB of input per second), ratio to `cp`, CPU seconds and the child's peak RSS (ru_maxrss
from wait4, i.e. from the kernel).

Fairness: every run writes to a fresh directory that is removed afterwards; the timed region is the command
plus an fsync of every file it wrote (convert fsyncs its shards itself; cp and the naive script do not, and
without it they would "finish" in the page cache); with --cache cold (default) the page cache is dropped
(`sync; echo 3 > /proc/sys/vm/drop_caches`, root only) before each run, then the programs (python, torch, the
CLI, not the data) are loaded once untimed; with --cache warm the source is read once before each run instead. Repetitions are interleaved (rep 1 of every contender, then rep 2, ...).

Example:
  python scripts/bench.py                                  # ~8.7 GB target, 3 reps, cold cache, docs/BENCHMARKS.md
  python scripts/bench.py --target-layers 1 --small-target-layers 0 --repeats 1 --markdown /tmp/b.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
CLI = str(Path(sys.executable).parent / "gemma4-convert")
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


@dataclass(frozen=True)
class Source:
    name: str
    path: Path
    description: str
    make_args: tuple[str, ...]


@dataclass(frozen=True)
class Run:
    source: str
    contender: str
    rep: int
    wall_s: float
    cpu_s: float
    maxrss_kb: int
    returncode: int


CONTENDERS = ("cp", "dd-direct", "per-layer", "pad-global", "verify", "naive-per-layer", "naive-pad-global")


def contender_command(contender: str, src: Path, out: Path, *, seq_len: int, converted: Path | None) -> list[str]:
    if contender == "cp":
        return ["cp", "-r", str(src), str(out)]
    if contender == "dd-direct":  # copy with O_DIRECT on both sides, 4 MiB requests: what convert's I/O does
        return ["sh", "-c", 'mkdir "$2" && for f in "$1"/*; do dd if="$f" of="$2/${f##*/}" bs=4M iflag=direct '
                'oflag=direct status=none || exit 1; done', "dd-direct", str(src), str(out)]
    if contender in ("per-layer", "pad-global"):
        return [CLI, "convert", str(src), "--out", str(out), "--layout", contender]
    if contender == "verify":
        return [CLI, "verify", str(src), str(converted), "--device", "cpu", "--seq-len", str(seq_len),
                "--json", str(out / "verification.json")]
    if contender.startswith("naive-"):
        return [PY, str(REPO / "scripts" / "naive_convert.py"), str(src), str(out), "--layout",
                contender.removeprefix("naive-")]
    raise ValueError(contender)


# ------------------------------------------------------------------------------------------------ measuring

def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def warm_programs() -> None:
    """Reloads the interpreter, torch and the CLI into the page cache (not the data): cold data, warm programs."""
    subprocess.run([CLI, "--version"], check=True, capture_output=True)
    subprocess.run([PY, "-c", "import safetensors.torch, converter.transforms"], check=True, capture_output=True,
                   cwd=REPO)


def read_through(path: Path) -> None:
    """Pulls every file under path into the page cache (warm mode)."""
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        with open(file, "rb") as handle:
            while handle.read(64 << 20):
                pass


def fsync_tree(path: Path) -> None:
    if not path.exists():
        return
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def timed_child(command: list[str], *, flush: Path, log: Path) -> tuple[float, float, int, int]:
    """(wall s, user+sys s, ru_maxrss KB, exit code) of one fresh child; wall includes fsync of `flush`."""
    with open(log, "ab") as sink:
        sink.write(("$ " + shlex.join(command) + "\n").encode())
        sink.flush()
        start = time.perf_counter()
        child = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        fsync_tree(flush)
        wall = time.perf_counter() - start
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss, child.returncode


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ------------------------------------------------------------------------------------------------ sources

def plan_sources(args: argparse.Namespace) -> list[Source]:
    base = args.work_dir / "sources"
    width = ("--width-divisor", str(args.width_divisor)) if args.width_divisor != 1 else ()
    sources = [Source("assistant", base / "assistant", "31B assistant, full size",
                      ("--preset", "31b", "--role", "assistant", *width))]
    for layers, shards in ((args.small_target_layers, args.small_target_shards),
                           (args.target_layers, args.target_shards)):
        if layers > 0:
            sources.append(Source(f"target-{layers}L", base / f"target-{layers}L",
                                  f"31B-width target, full embedding, {layers} decoder layers, {shards} shards",
                                  ("--preset", "31b", "--role", "target", "--text-only", "--num-layers", str(layers),
                                   "--num-shards", str(shards), *width)))
    return [s for s in sources if s.name in args.sources or s.name.split("-")[0] in args.sources]


def build(source: Source, log: Path) -> None:
    """Writes the source with the factory unless a previous run completed it (marker beside it)."""
    marker = source.path.with_name(source.path.name + ".complete")
    if marker.exists() and marker.read_text() == " ".join(source.make_args):
        return
    shutil.rmtree(source.path, ignore_errors=True)
    print(f"building {source.name}: make_synthetic.py {' '.join(source.make_args)}", flush=True)
    with open(log, "ab") as sink:
        subprocess.run([PY, str(REPO / "scripts" / "make_synthetic.py"), *source.make_args, "--out", str(source.path)],
                       check=True, stdout=sink, stderr=subprocess.STDOUT)
    marker.write_text(" ".join(source.make_args))


# ------------------------------------------------------------------------------------------------ running

def bench_source(source: Source, args: argparse.Namespace, log: Path) -> list[Run]:
    runs: list[Run] = []
    outs = args.work_dir / "out"
    converted = outs / f"{source.name}.verify-input"
    if "verify" in args.contenders:
        shutil.rmtree(converted, ignore_errors=True)
        with open(log, "ab") as sink:
            subprocess.run([CLI, "convert", str(source.path), "--out", str(converted), "--layout", "pad-global"],
                           check=True, stdout=sink, stderr=subprocess.STDOUT)
    try:
        for rep in range(1, args.repeats + 1):
            for contender in args.contenders:
                out = outs / f"{source.name}.{contender}"
                shutil.rmtree(out, ignore_errors=True)
                if contender == "verify":
                    out.mkdir(parents=True)
                if args.cache == "cold":
                    drop_caches()
                    warm_programs()
                else:
                    read_through(source.path)
                command = contender_command(contender, source.path, out, seq_len=args.seq_len, converted=converted)
                wall, cpu, rss, code = timed_child(command, flush=out, log=log)
                shutil.rmtree(out, ignore_errors=True)
                run = Run(source.name, contender, rep, wall, cpu, rss, code)
                runs.append(run)
                print(f"  {source.name:<12} {contender:<17} rep {rep}: {wall:7.2f} s  cpu {cpu:7.2f} s  "
                      f"rss {rss / 1024:7.0f} MiB  exit {code}  (load {os.getloadavg()[0]:.2f})", flush=True)
                if code != 0:
                    raise SystemExit(f"{contender} on {source.name} exited {code}; see {log}")
    finally:
        shutil.rmtree(converted, ignore_errors=True)
    return runs


# ------------------------------------------------------------------------------------------------ start-up

STARTUP_REPEATS = 7


def bench_startup(args: argparse.Namespace, log: Path) -> list[dict]:
    """Median wall time of the light verbs on a tiny checkpoint (programs warm), against a bare interpreter."""
    tiny = Source("tiny", args.work_dir / "sources" / "tiny", "tiny synthetic 31B pair", ("--preset", "31b", "--tiny"))
    build(tiny, log)
    target, assistant = str(tiny.path / "target"), str(tiny.path / "assistant")
    commands = {"python -c pass": [PY, "-c", "pass"], "--version": [CLI, "--version"], "--help": [CLI, "--help"],
                "inspect": [CLI, "inspect", target], "inspect --json": [CLI, "inspect", target, "--json"],
                "check-pair": [CLI, "check-pair", target, assistant]}
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(STARTUP_REPEATS):  # interleaved, so a burst of load hits every command alike
        for name, command in commands.items():
            start = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True)
            times[name].append(time.perf_counter() - start)
    rows = [{"command": name, "median_s": statistics.median(t), "min_s": min(t), "max_s": max(t)}
            for name, t in times.items()]
    for row in rows:
        print(f"  startup {row['command']:<16} {row['median_s']:.3f} s (min {row['min_s']:.3f})", flush=True)
    return rows


def startup_table(rows: list[dict]) -> str:
    lines = [f"| command (tiny checkpoint) | wall s, median of {STARTUP_REPEATS} (min-max) |", "|---|---|"]
    lines += [f"| `{r['command']}` | {r['median_s']:.3f} ({r['min_s']:.3f}-{r['max_s']:.3f}) |" for r in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ reporting

def machine(work_dir: Path) -> dict[str, str]:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem_kb = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal")))
    mount = subprocess.run(["findmnt", "-no", "SOURCE,FSTYPE,OPTIONS", "--target", str(work_dir)],
                           capture_output=True, text=True).stdout.strip()
    torch_version = subprocess.run([PY, "-c", "import torch, safetensors; print(torch.__version__, "
                                    "safetensors.__version__)"], capture_output=True, text=True).stdout.split()
    return {"cpu": f"{cpu} ({os.cpu_count()} cores)", "ram": f"{mem_kb / 2**20:.1f} GiB",
            "kernel": platform.release(), "python": platform.python_version(),
            "torch": torch_version[0] if torch_version else "?",
            "safetensors": torch_version[1] if len(torch_version) > 1 else "?", "mount": mount}


def summarize(runs: list[Run], sizes: dict[str, int]) -> list[dict]:
    rows = []
    for source in dict.fromkeys(r.source for r in runs):
        cp = [r.wall_s for r in runs if r.source == source and r.contender == "cp"]
        cp_median = statistics.median(cp) if cp else None
        for contender in dict.fromkeys(r.contender for r in runs if r.source == source):
            mine = [r for r in runs if r.source == source and r.contender == contender]
            wall = statistics.median(r.wall_s for r in mine)
            rows.append({"source": source, "input_gb": sizes[source] / 1e9, "contender": contender, "runs": len(mine),
                         "wall_s": wall, "min_s": min(r.wall_s for r in mine), "max_s": max(r.wall_s for r in mine),
                         "gb_per_s": sizes[source] / 1e9 / wall, "vs_cp": wall / cp_median if cp_median else None,
                         "cpu_s": statistics.median(r.cpu_s for r in mine),
                         "rss_mib": max(r.maxrss_kb for r in mine) / 1024})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| source (input GB) | contender | wall s, median (min-max) | GB/s in | x cp | CPU s | peak RSS MiB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['vs_cp']:.2f}" if r["vs_cp"] is not None else "-"
        lines.append(f"| {r['source']} ({r['input_gb']:.2f}) | {r['contender']} | {r['wall_s']:.2f} "
                     f"({r['min_s']:.2f}-{r['max_s']:.2f}) | {r['gb_per_s']:.3f} | {ratio} | {r['cpu_s']:.1f} "
                     f"| {r['rss_mib']:.0f} |")
    return "\n".join(lines)


def render(rows: list[dict], *, args: argparse.Namespace, info: dict[str, str], sources: list[Source],
           loads: tuple[tuple[float, ...], tuple[float, ...]], startup: float, command: str) -> str:
    cache = ("cold: `sync; echo 3 > /proc/sys/vm/drop_caches` before every run, then `gemma4-convert --version` and "
             "`python -c 'import safetensors.torch, converter.transforms'` untimed, so the data is cold and the "
             "programs are not" if args.cache == "cold" else
             "warm: the source read once into the page cache before every run")
    parts = [
        BEGIN,
        f"Command: `{command}`",
        "",
        f"Machine: {info['cpu']}, {info['ram']} RAM, filesystem `{info['mount']}`, kernel {info['kernel']}, "
        f"Python {info['python']}, torch {info['torch']}, safetensors {info['safetensors']}.",
        f"Load average (1/5/15 min) at start {'/'.join(f'{x:.2f}' for x in loads[0])}, "
        f"at end {'/'.join(f'{x:.2f}' for x in loads[1])}.",
        "",
        f"Page cache: {cache}. Each contender is a fresh child process writing a fresh directory; wall time "
        "includes an fsync of every output file; medians of "
        f"{args.repeats} interleaved repetitions; peak RSS is the largest ru_maxrss (kernel, via wait4) of the "
        f"child over its repetitions. `verify` is `gemma4-convert verify SRC DST --device cpu --seq-len "
        f"{args.seq_len}` of a pad-global output (structural streaming of source and output, then layer numerics).",
        f"Interpreter + torch import alone (`gemma4-convert --version`, warm, median of 3): {startup:.2f} s, "
        "included in every gemma4-convert and naive row.",
        "",
        "Sources (`scripts/make_synthetic.py` arguments):",
        "",
    ]
    parts += [f"- `{s.name}`: {s.description} (`{' '.join(s.make_args)}`)" for s in sources]
    parts += ["", table(rows), END]
    return "\n".join(parts)


def write_markdown(path: Path, section: str) -> None:
    if path.exists() and BEGIN in (text := path.read_text()) and END in text:
        head, rest = text.split(BEGIN, 1)
        path.write_text(head + section + rest.split(END, 1)[1])
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("# Benchmarks\n\nGenerated by `scripts/bench.py`.\n\n" + section + "\n")


def median_startup() -> float:
    times = []
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run([CLI, "--version"], check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------------ main

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/gemma4-bench"),
                        help="sources (kept for re-runs) and outputs (removed after each run)")
    parser.add_argument("--target-layers", type=int, default=6, help="decoder layers of the large target "
                        "(6, five sliding + one full layer: 8.7 GB; each layer adds about 1 GB to the 2.82 GB "
                        "embedding)")
    parser.add_argument("--target-shards", type=int, default=4)
    parser.add_argument("--small-target-layers", type=int, default=2, help="the second target size (2: one sliding "
                        "and one full layer, like the large one); 0 skips it")
    parser.add_argument("--small-target-shards", type=int, default=2)
    parser.add_argument("--sources", nargs="+", default=["assistant", "target"],
                        help="which sources to run: assistant, target (both targets), or target-NL")
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", choices=["cold", "warm"], default="cold")
    parser.add_argument("--width-divisor", type=int, default=1, help="shrink widths (smoke tests only)")
    parser.add_argument("--seq-len", type=int, default=4, help="verify --seq-len")
    parser.add_argument("--markdown", type=Path, default=REPO / "docs" / "BENCHMARKS.md",
                        help="written, or its bench:begin/end section replaced")
    parser.add_argument("--json", type=Path, default=None, help="also write every run and the summary here")
    parser.add_argument("--keep-sources", action="store_true", help="keep the synthetic sources afterwards")
    parser.add_argument("--build-only", action="store_true", help="build (or reuse) the sources and stop")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    command = "python scripts/bench.py " + shlex.join(sys.argv[1:])
    if args.cache == "cold":
        try:
            drop_caches()
        except OSError as exc:
            raise SystemExit(f"cannot drop the page cache ({exc}); run as root or pass --cache warm") from exc
    args.work_dir.mkdir(parents=True, exist_ok=True)
    log = args.work_dir / "bench.log"
    sources = plan_sources(args)
    for source in sources:
        build(source, log)
    if args.build_only:
        return
    sizes = {s.name: tree_bytes(s.path) for s in sources}
    load_start = os.getloadavg()
    startup = median_startup()
    runs: list[Run] = []
    for source in sources:
        print(f"{source.name}: {sizes[source.name] / 1e9:.2f} GB", flush=True)
        runs += bench_source(source, args, log)
    load_end = os.getloadavg()
    rows = summarize(runs, sizes)
    section = render(rows, args=args, info=machine(args.work_dir), sources=sources, loads=(load_start, load_end),
                     startup=startup, command=command)
    print(section)
    write_markdown(args.markdown, section)
    if args.json:
        args.json.write_text(json.dumps({"runs": [asdict(r) for r in runs], "summary": rows}, indent=2) + "\n")
    if not args.keep_sources:
        for source in sources:
            shutil.rmtree(source.path, ignore_errors=True)
            source.path.with_name(source.path.name + ".complete").unlink(missing_ok=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Benchmark `gemma4-convert` against the disk's floor (its own output files written with O_DIRECT from mappings of
the source, fsynced: scripts/floor_write.py), `cp -r` + `sync` and a naive load_file/save_file script.

Builds synthetic checkpoints with the factory (full-size 31B assistant; 31B-width text targets with the full
262144 x 5376 embedding and N decoder layers, at two sizes so RSS can be compared across layer counts), then
runs every contender as a fresh child process, several times each, and reports medians of wall time,
throughput (decimal GB of input per second), ratio to `cp`, CPU seconds and the child's peak RSS (ru_maxrss
from wait4, i.e. from the kernel).

Fairness: every run writes to a fresh directory that is removed afterwards; the timed region is the command
plus an fsync of every file it wrote (convert fsyncs its shards itself; cp and the naive script do not, and
without it they would "finish" in the page cache). Each contender runs with the page cache warm (its inputs read
once right before, as after a download) and cold (`sync; echo 3 > /proc/sys/vm/drop_caches` where root may, and
posix_fadvise(DONTNEED) on every input file either way; then the programs, not the data, are loaded untimed).
Repetitions are interleaved (rep 1 of every contender warm then cold, then rep 2, ...), so a burst of load from
other jobs hits all of them alike. The start-up rows time the light verbs on a tiny checkpoint.

Example:
  python scripts/bench.py --reflink-dir /mnt/xfs     # 4.8 GB target + 0.94 GB assistant, 3 reps, docs/BENCHMARKS.md
  python scripts/bench.py --width-divisor 16 --repeats 1 --markdown /tmp/b.md       # smoke test, a minute
"""

from __future__ import annotations

import argparse
import hashlib
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
    make_args: tuple[str, ...]  # empty for the pair: hard links to the target's and the assistant's files
    parts: tuple["Source", ...] = ()  # the pair's target and assistant (path/target, path/assistant)
    hub_cache: bool = False  # the pair laid out as a Hugging Face cache snapshot (symlinks to blobs/<sha256>)


@dataclass(frozen=True)
class Run:
    source: str
    contender: str
    cache: str
    rep: int
    wall_s: float
    cpu_s: float
    maxrss_kb: int
    returncode: int


CONTENDERS = ("floor-per-layer", "floor-pad-global", "cp-sync", "cp", "dd-direct", "per-layer", "per-layer-no-hash",
              "per-layer-reflink", "per-layer-hardlink", "per-layer-symlink", "pad-global", "pad-global-no-hash",
              "verify", "naive-per-layer", "naive-pad-global")
PAIR_CONTENDERS = ("floor-per-layer", "floor-pad-global", "cp-sync", "cp", "per-layer", "per-layer-no-hash",
                   "pad-global", "pad-global-no-hash", "verify")
DEFAULT_CONTENDERS = ("floor-per-layer", "floor-pad-global", "cp-sync", "cp", "per-layer", "per-layer-no-hash",
                      "per-layer-reflink", "per-layer-hardlink", "per-layer-symlink", "pad-global", "pad-global-no-hash",
                      "naive-pad-global", "verify")


def contender_command(contender: str, src: Path, out: Path, *, seq_len: int, converted: Path | None,
                      assistant: Path | None = None, pair: bool = False, floor_spec: Path | None = None) -> list[str]:
    if contender.startswith("floor-"):  # the layout's own output files, O_DIRECT from mappings of the source
        return [PY, str(REPO / "scripts" / "floor_write.py"), str(src), str(out), str(floor_spec)]
    if pair and contender not in ("cp-sync", "cp", "verify", "dd-direct", "naive-per-layer", "naive-pad-global"):
        # target and assistant in one command, as a user converts them: one start-up, one torch import
        single = contender_command(contender, src, out, seq_len=seq_len, converted=converted)
        at = single.index(str(src))
        return single[:at] + ["--target", str(src / "target"), "--assistant", str(src / "assistant")] + single[at + 1:]
    if contender == "cp":
        return ["cp", "-rL", str(src), str(out)]  # -L: a Hub cache snapshot holds symlinks
    if contender == "cp-sync":  # the floor at convert's durability: a copy, then everything on disk
        return ["sh", "-c", 'cp -rL "$1" "$2" && sync', "cp-sync", str(src), str(out)]
    if contender == "dd-direct":  # copy with O_DIRECT on both sides, 4 MiB requests: what convert's I/O does
        return ["sh", "-c", 'mkdir "$2" && for f in "$1"/*; do dd if="$f" of="$2/${f##*/}" bs=4M iflag=direct '
                'oflag=direct status=none || exit 1; done', "dd-direct", str(src), str(out)]
    if contender in ("per-layer", "pad-global"):  # --link auto: a copy on a filesystem without reflinks
        return [CLI, "convert", str(src), "--out", str(out), "--layout", contender]
    if contender.endswith("-no-hash"):
        return [CLI, "convert", str(src), "--out", str(out), "--layout", contender.removesuffix("-no-hash"),
                "--no-hash"]
    if contender.startswith("per-layer-"):
        return [CLI, "convert", str(src), "--out", str(out), "--layout", "per-layer", "--link",
                contender.removeprefix("per-layer-")]
    if contender == "verify":  # the pair when the assistant is benchmarked too: target layers, then the assistant
        sources = ["--target", str(src)] + (["--assistant", str(assistant)] if assistant else [])
        if pair:
            sources = ["--target", str(src / "target"), "--assistant", str(src / "assistant")]
        return [CLI, "verify", *sources, "--converted", str(converted), "--device", "cpu", "--seq-len", str(seq_len),
                "--json", str(out / "verification.json")]
    if contender.startswith("naive-"):
        return [PY, str(REPO / "scripts" / "naive_convert.py"), str(src), str(out), "--layout",
                contender.removeprefix("naive-")]
    raise ValueError(contender)


# ------------------------------------------------------------------------------------------------ measuring

def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def evict(path: Path) -> None:
    """posix_fadvise(DONTNEED) on every file under path: the unprivileged way to make one tree cold."""
    for file in sorted(p for p in path.rglob("*") if p.is_file() and not p.is_symlink()):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def make_cold(paths: list[Path], can_drop: bool) -> None:
    if can_drop:
        drop_caches()
    for path in paths:  # also after drop_caches: it is a no-op then, and the only way without root
        evict(path)


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
    chosen = [s for s in sources if s.name in args.sources or s.name.split("-")[0] in args.sources]
    if "pair" in args.sources and args.target_layers > 0:
        parts = (sources[-1], sources[0])  # the large target, the assistant
        chosen.append(Source(f"pair-{args.target_layers}L", base / f"pair-{args.target_layers}L",
                             f"`{parts[0].name}` + `assistant` converted together (--target/--assistant; hard links "
                             "to their files)", (), parts))
    if "pair-hub" in args.sources and args.target_layers > 0:
        parts = (sources[-1], sources[0])
        chosen.append(Source(f"pair-{args.target_layers}L-hub", base / f"pair-{args.target_layers}L-hub" / "snapshot",
                             f"the same pair as a Hugging Face cache snapshot: each file a symlink to "
                             "`blobs/<its sha256>` (a hard link to the part's file), as `hf download` leaves it",
                             (), parts, hub_cache=True))
    return chosen


def hub_blob_link(file: str, destination: str) -> None:
    """Lays file out as the Hub cache does: blobs/<sha256> (a hard link here) and a relative symlink to it."""
    blobs = Path(destination).parents[2] / "blobs"  # <root>/snapshot/<role>/<name> -> <root>/blobs
    blobs.mkdir(exist_ok=True)
    sha256 = hashlib.sha256()
    with open(file, "rb") as handle:
        while block := handle.read(1 << 24):
            sha256.update(block)
    blob = blobs / sha256.hexdigest()
    if not blob.exists():
        os.link(file, blob)
    os.symlink(os.path.relpath(blob, Path(destination).parent), destination)


def build(source: Source, log: Path) -> None:
    """Writes the source with the factory unless a previous run completed it (marker beside it)."""
    if source.parts:
        for part in source.parts:
            build(part, log)
        if not source.path.is_dir():  # hard links: no new space, and the page cache of the parts is the pair's
            source.path.mkdir(parents=True)
            for role, part in zip(("target", "assistant"), source.parts):
                shutil.copytree(part.path, source.path / role,
                                copy_function=hub_blob_link if source.hub_cache else os.link)
        return
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

def source_for(contender: str, source: Source, args: argparse.Namespace, log: Path) -> Path:
    """Where a contender reads the source: the reflink contender needs it on a filesystem with reflinks."""
    if contender != "per-layer-reflink":
        return source.path
    copy = args.reflink_dir / "sources" / source.name
    if not (copy.parent / f"{source.name}.complete").exists():
        shutil.rmtree(copy, ignore_errors=True)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(source.path, copy)
        (copy.parent / f"{source.name}.complete").write_text("")
    return copy


def bench_source(source: Source, args: argparse.Namespace, log: Path, *, assistant: Source | None,
                 can_drop: bool) -> list[Run]:
    runs: list[Run] = []
    outs = args.work_dir / "out"
    converted = outs / f"{source.name}.verify-input"
    contenders = [c for c in args.contenders if c != "per-layer-reflink" or args.reflink_dir]
    if source.parts:  # the pair: the conversions and their floor (verify runs on the target's row, with the pair)
        contenders = [c for c in contenders if c in PAIR_CONTENDERS]
    elif not source.name.startswith("target"):  # the assistant is verified with its target, on the target's row
        contenders = [c for c in contenders if c != "verify"]
    pair = assistant if assistant is not None and source.name.startswith("target") else None
    if "verify" in contenders:
        shutil.rmtree(converted, ignore_errors=True)
        sources = ["--target", str(source.path)] + (["--assistant", str(pair.path)] if pair else [])
        if source.parts:
            sources = ["--target", str(source.path / "target"), "--assistant", str(source.path / "assistant")]
        with open(log, "ab") as sink:
            subprocess.run([CLI, "convert", *sources, "--out", str(converted), "--layout", "pad-global"],
                           check=True, stdout=sink, stderr=subprocess.STDOUT)
    specs = {c: floor_spec(source, c.removeprefix("floor-"), args, log) for c in contenders if c.startswith("floor-")}
    try:
        for rep in range(1, args.repeats + 1):
            for cache in args.cache:
                for contender in contenders:  # interleaved: cp, convert, ... then again, so load hits all alike
                    runs.append(run_one(source, contender, cache, rep, args, log, converted=converted, pair=pair,
                                        can_drop=can_drop, floor_spec=specs.get(contender)))
    finally:
        shutil.rmtree(converted, ignore_errors=True)
    return runs


def floor_spec(source: Source, layout: str, args: argparse.Namespace, log: Path) -> Path:
    """The names and sizes of `layout`'s output files for source, from one untimed conversion (removed again):
    what the floor contender writes."""
    out = args.work_dir / "out" / f"{source.name}.{layout}.shape"
    shutil.rmtree(out, ignore_errors=True)
    command = contender_command(f"{layout}-no-hash", source.path, out, seq_len=args.seq_len, converted=None,
                                pair=bool(source.parts))
    with open(log, "ab") as sink:
        subprocess.run(command, check=True, stdout=sink, stderr=subprocess.STDOUT)
    files = [[str(p.relative_to(out)), p.stat().st_size] for p in sorted(out.rglob("*")) if p.is_file()]
    shutil.rmtree(out)
    spec = args.work_dir / f"floor-{source.name}-{layout}.json"
    spec.write_text(json.dumps({"files": files}))
    return spec


def run_one(source: Source, contender: str, cache: str, rep: int, args: argparse.Namespace, log: Path, *,
            converted: Path, pair: Source | None, can_drop: bool, floor_spec: Path | None = None) -> Run:
    src = source_for(contender, source, args, log)
    out = (args.reflink_dir if contender == "per-layer-reflink" else args.work_dir) / "out" / \
        f"{source.name}.{contender}"
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    if contender == "verify":
        out.mkdir(parents=True)
    inputs = [src] + ([converted] + ([pair.path] if pair else []) if contender == "verify" else [])
    if cache == "cold":
        make_cold(inputs, can_drop)
        warm_programs()
    else:
        for path in inputs:
            read_through(path)
    command = contender_command(contender, src, out, seq_len=args.seq_len, converted=converted,
                                assistant=pair.path if pair else None, pair=bool(source.parts), floor_spec=floor_spec)
    wall, cpu, rss, code = timed_child(command, flush=out, log=log)
    shutil.rmtree(out, ignore_errors=True)
    print(f"  {source.name:<12} {cache:<4} {contender:<19} rep {rep}: {wall:7.2f} s  cpu {cpu:7.2f} s  "
          f"rss {rss / 1024:7.0f} MiB  exit {code}  (load {os.getloadavg()[0]:.2f})", flush=True)
    if code != 0:
        raise SystemExit(f"{contender} on {source.name} exited {code}; see {log}")
    return Run(source.name, contender, cache, rep, wall, cpu, rss, code)


# ------------------------------------------------------------------------------------------------ start-up

STARTUP_REPEATS = 7


def bench_startup(args: argparse.Namespace, log: Path) -> list[dict]:
    """Median wall time of the light verbs on a tiny checkpoint (programs warm), against a bare interpreter."""
    tiny = Source("tiny", args.work_dir / "sources" / "tiny", "tiny synthetic 31B pair", ("--preset", "31b", "--tiny"))
    build(tiny, log)
    target, assistant = str(tiny.path / "target"), str(tiny.path / "assistant")
    commands = {"python -c pass": [PY, "-c", "pass"], "--version": [CLI, "--version"], "--help": [CLI, "--help"],
                "inspect": [CLI, "inspect", target], "inspect --json": [CLI, "inspect", target, "--json"],
                "check-pair": [CLI, "check-pair", target, assistant],
                # the whole per-layer conversion of the tiny pair, fsyncs included: a bound on its time to first byte
                "convert per-layer": ["sh", "-c", 'rm -rf "$1" && exec "$2" convert --target "$3" --assistant "$4" '
                                      '--out "$1" --layout per-layer', "convert", str(args.work_dir / "out" / "tiny"),
                                      CLI, target, assistant]}
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


def floor_of(contender: str) -> str:
    """The floor a contender is divided by: its layout's output files written at the disk's floor (per-layer's
    files for a copy or verify, whose bytes are the source's)."""
    return "floor-pad-global" if "pad-global" in contender else "floor-per-layer"


def summarize(runs: list[Run], sizes: dict[str, int]) -> list[dict]:
    rows = []
    for source, cache in dict.fromkeys((r.source, r.cache) for r in runs):
        same = [r for r in runs if (r.source, r.cache) == (source, cache)]

        def median_of(contender: str, field: str) -> float | None:
            values = [getattr(r, field) for r in same if r.contender == contender]
            return statistics.median(values) if values else None

        for contender in dict.fromkeys(r.contender for r in same):
            mine = [r for r in same if r.contender == contender]
            wall, cpu = median_of(contender, "wall_s"), median_of(contender, "cpu_s")
            floor_wall, floor_cpu = median_of(floor_of(contender), "wall_s"), median_of(floor_of(contender), "cpu_s")
            cp_wall = median_of("cp-sync", "wall_s")
            rows.append({"source": source, "cache": cache, "input_gb": sizes[source] / 1e9, "contender": contender,
                         "runs": len(mine), "floor": floor_of(contender) if floor_wall else None,
                         "wall_s": wall, "min_s": min(r.wall_s for r in mine), "max_s": max(r.wall_s for r in mine),
                         "gb_per_s": sizes[source] / 1e9 / wall,
                         "vs_floor": wall / floor_wall if floor_wall else None,
                         "vs_cp_sync": wall / cp_wall if cp_wall else None,
                         "cpu_s": cpu, "cpu_s_per_gb": cpu / (sizes[source] / 1e9),
                         "cpu_vs_floor": cpu / floor_cpu if floor_cpu else None,
                         "rss_mib": max(r.maxrss_kb for r in mine) / 1024})
    return rows


def table(rows: list[dict]) -> str:
    def ratio(value: float | None) -> str:
        return f"{value:.2f}" if value is not None else "-"

    lines = ["| source (input GB) | contender | wall s, median (min-max) | GB/s in | x floor | x cp-sync | CPU s "
             f"| CPU s/GB | CPU x floor | cores | peak RSS MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['source']} ({r['input_gb']:.2f}) | {r['contender']} | {r['wall_s']:.2f} "
                     f"({r['min_s']:.2f}-{r['max_s']:.2f}) | {r['gb_per_s']:.3f} | {ratio(r['vs_floor'])} "
                     f"| {ratio(r['vs_cp_sync'])} | {r['cpu_s']:.1f} | {r['cpu_s_per_gb']:.2f} "
                     f"| {ratio(r['cpu_vs_floor'])} | {len(os.sched_getaffinity(0))} | {r['rss_mib']:.0f} |")
    return "\n".join(lines)


def render(rows: list[dict], *, args: argparse.Namespace, info: dict[str, str], sources: list[Source],
           loads: tuple[tuple[float, ...], tuple[float, ...]], startup: list[dict], command: str,
           can_drop: bool) -> str:
    cold = ("`sync; echo 3 > /proc/sys/vm/drop_caches` plus posix_fadvise(DONTNEED) on every input file" if can_drop
            else "posix_fadvise(DONTNEED) on every input file (no root: the page cache cannot be dropped whole)")
    parts = [
        BEGIN,
        f"Command: `{command}`",
        "",
        f"Machine: {info['cpu']}, {info['ram']} RAM, filesystem `{info['mount']}`, kernel {info['kernel']}, "
        f"Python {info['python']}, torch {info['torch']}, safetensors {info['safetensors']}.",
        f"Load average (1/5/15 min) at start {'/'.join(f'{x:.2f}' for x in loads[0])}, "
        f"at end {'/'.join(f'{x:.2f}' for x in loads[1])}.",
        "",
        f"Page cache: **warm** = every input read once into the page cache right before the run (as after a "
        f"download); **cold** = {cold} right before the run, then `gemma4-convert --version` and `python -c 'import "
        "safetensors.torch, converter.transforms'` untimed, so the data is cold and the programs are not. Each "
        "contender is a fresh child process writing a fresh directory; wall time includes an fsync of every output "
        f"file; medians of {args.repeats} repetitions, interleaved (rep 1 of every contender warm then cold, then "
        "rep 2, ...); `x floor` and `CPU x floor` divide by the median wall and CPU seconds of the floor of the same source, cache state and layout: `floor-per-layer` / `floor-pad-global` (`scripts/floor_write.py`: that layout's own output files, names and sizes, written with O_DIRECT from read-only mappings of the source, 4 requests of 4 MiB in flight, every file fsynced; per-layer's files for `cp` and `verify`); `x cp-sync` divides by `cp -rL SRC DST && sync`, which moves with the page cache's writeback; cores: the CPUs the process may use; CPU s is user + system of the child and its children (wait4), not the kernel's own writeback threads; peak RSS is the largest "
        "ru_maxrss (kernel, via wait4) of the child over its repetitions. `per-layer` and `pad-global` run with the "
        "default `--link auto` (a copy here: the filesystem has no reflinks); `per-layer-reflink` reads a copy of the "
        f"source on {args.reflink_dir or '(not run)'} (a loop-mounted XFS image with reflink=1) and writes beside it. "
        f"`verify` is `gemma4-convert verify --target T [--assistant A] --converted DST --device cpu --seq-len "
        f"{args.seq_len}` of a pad-global conversion of the pair (structural streaming of both sides, then the "
        "layer numerics and the assistant).",
        "",
        "Sources (`scripts/make_synthetic.py` arguments):",
        "",
    ]
    parts += [f"- `{s.name}`: {s.description}" + (f" (`{' '.join(s.make_args)}`)" if s.make_args else "")
              for s in sources]
    for cache in args.cache:
        parts += ["", f"### {cache} cache", "", table([r for r in rows if r["cache"] == cache])]
    if startup:
        parts += ["", "### start-up (no torch, no huggingface_hub for a local path)", "", startup_table(startup)]
    parts += [END]
    return "\n".join(parts)


def write_markdown(path: Path, section: str) -> None:
    if path.exists() and BEGIN in (text := path.read_text()) and END in text:
        head, rest = text.split(BEGIN, 1)
        path.write_text(head + section + rest.split(END, 1)[1])
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("# Benchmarks\n\nGenerated by `scripts/bench.py`.\n\n" + section + "\n")


# ------------------------------------------------------------------------------------------------ main

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/gemma4-bench"),
                        help="sources (kept for re-runs) and outputs (removed after each run)")
    parser.add_argument("--target-layers", type=int, default=2, help="decoder layers of the large target "
                        "(2, one sliding + one full layer: 4.8 GB; 6: 8.7 GB; each layer adds about 1 GB to the "
                        "2.82 GB embedding)")
    parser.add_argument("--target-shards", type=int, default=4)
    parser.add_argument("--small-target-layers", type=int, default=0, help="a second target size, to compare RSS "
                        "across layer counts; 0 (default) skips it")
    parser.add_argument("--small-target-shards", type=int, default=2)
    parser.add_argument("--sources", nargs="+", default=["assistant", "target", "pair"],
                        help="which sources to run: assistant, target (both targets), target-NL, pair (the large "
                             "target and the assistant in one convert) or pair-hub (that pair as a Hugging Face cache "
                             "snapshot, whose file names give the source hashes)")
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(DEFAULT_CONTENDERS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", nargs="+", choices=["warm", "cold"], default=["warm", "cold"])
    parser.add_argument("--reflink-dir", type=Path, default=None,
                        help="a directory on a filesystem with reflinks (XFS reflink=1, btrfs) for per-layer-reflink; "
                             "without it that contender is skipped")
    parser.add_argument("--no-startup", action="store_true", help="skip the start-up rows")
    parser.add_argument("--assistant-in-pair-only", action="store_true",
                        help="use the assistant only as the verify pair's second half (no assistant rows)")
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
    try:
        drop_caches()
        can_drop = True
    except OSError as exc:
        print(f"cannot drop the page cache ({exc}); cold runs use posix_fadvise(DONTNEED) per input file", flush=True)
        can_drop = False
    args.work_dir.mkdir(parents=True, exist_ok=True)
    log = args.work_dir / "bench.log"
    sources = plan_sources(args)
    for source in sources:
        build(source, log)
    if args.build_only:
        return
    sizes = {s.name: tree_bytes(s.path) for s in sources}
    load_start = os.getloadavg()
    startup = [] if args.no_startup else bench_startup(args, log)
    assistant = next((s for s in sources if s.name == "assistant"), None)
    runs: list[Run] = []
    for source in sources:
        if source is assistant and len(sources) > 1 and args.assistant_in_pair_only:
            continue
        print(f"{source.name}: {sizes[source.name] / 1e9:.2f} GB", flush=True)
        runs += bench_source(source, args, log, assistant=assistant, can_drop=can_drop)
    load_end = os.getloadavg()
    rows = summarize(runs, sizes)
    section = render(rows, args=args, info=machine(args.work_dir), sources=sources, loads=(load_start, load_end),
                     startup=startup, command=command, can_drop=can_drop)
    print(section)
    write_markdown(args.markdown, section)
    if args.json:
        args.json.write_text(json.dumps({"runs": [asdict(r) for r in runs], "summary": rows, "startup": startup},
                                        indent=2) + "\n")
    if not args.keep_sources:
        for source in sources:
            shutil.rmtree(source.path, ignore_errors=True)
            source.path.with_name(source.path.name + ".complete").unlink(missing_ok=True)


if __name__ == "__main__":
    main()

"""Tensor parallelism rank by rank (ledger check `loader`, rows with `tp`): vLLM's own layers and weight loaders build
every rank of TP 2, 4 and 8 from the original and from each conversion, and what the ranks hold adds up to the
unsharded original (scripts/consumers/vllm/tp_check.py, in the vLLM 0.27.0 env of cases.RANK_ENV). vLLM checks none
of this. scripts/run_ledger.py measures every case (FAMILY); tests/test_tp_ranks.py runs it by hand with the two
negative controls (a padded target beside an unpadded assistant; two KV heads swapped), which must fail it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Iterator

from converter.advice.ledger import CHECK_LOADER, FAIL, PASS, LedgerRow
from matrix.digest import pair_digest
from matrix.cases import ORIGINAL, RANK_ENV, RANK_SOURCES, RANK_TP_SIZES, SOURCES, build_loader_case
from matrix.envs import MissingEnv, VllmEnv, find_env
from matrix.rows import CarriedOver, Family, Measured, RowMismatch, carried_group, expect, never_carried, today

REPO = Path(__file__).resolve().parents[2]
TP_CHECK = REPO / "scripts" / "consumers" / "vllm" / "tp_check.py"
LAYOUTS = ("per-layer", "pad-global")
TIMEOUT_S = 1800


def run_tp_check(env: VllmEnv, original: Path, pairs: list[Path], sizes: tuple[int, ...], out: Path,
                 *extra: str) -> tuple[int, dict, str]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(env.python), str(TP_CHECK), "--original", str(original), "--json", str(out / "tp.json"), *extra]
    for pair in pairs:
        cmd += ["--pair", str(pair)]
    for tp in sizes:
        cmd += ["--tp", str(tp)]
    proc = subprocess.run(["flock", "/tmp/gemma4-vllm.lock", *cmd], capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    output = proc.stdout + proc.stderr
    expect((out / "tp.json").exists(), f"tp_check wrote no report (exit {proc.returncode}):\n{output[-4000:]}")
    return proc.returncode, json.loads((out / "tp.json").read_text()), output


def rank_row(source: str, layout: str, env: VllmEnv, tp: int, digest: str, result: dict | None = None) -> LedgerRow:
    figures, detail = {}, ""
    if result is not None:
        figures = {"ranks": tp, "layer_pairs_per_rank": len(result["geometry"]) // tp,
                   "max_relative_error": max(result["relative_errors"].values(), default=0.0)}
        detail = "; ".join(result["problems"]) or "per rank: draft and target KV geometry equal; summed attention " \
                                                 "outputs equal the unsharded original's"
    return LedgerRow(case=source, form=SOURCES[source].form, layout=layout, vllm=env.vllm,
                     transformers=env.transformers, torch=env.torch, torch_pin=env.torch_pin, check=CHECK_LOADER,
                     verdict=PASS if result is None or result["passed"] else FAIL, expected=PASS, digest=digest,
                     measured=today(), vllm_package=env.package, detail=detail, figures=figures, tp=tp,
                     scope="ranks")


def measure_ranks(source_name: str, env: VllmEnv, work: Path, carried_over: CarriedOver = never_carried) -> Measured:
    """Every rank of every TP size of the original and both layouts of one case."""
    built = build_loader_case(source_name, work / "cases", variants=LAYOUTS)
    variants = (ORIGINAL, *LAYOUTS)
    digests = {v: pair_digest(built[v] / "target", built[v] / "assistant") for v in variants}
    kept = carried_group([rank_row(source_name, v, env, tp, d) for v, d in digests.items() for tp in RANK_TP_SIZES],
                         carried_over)
    if kept is not None:
        return Measured(f"ranks-{source_name}", kept, carried=True)
    code, report, output = run_tp_check(env, built[ORIGINAL], [built[v] for v in LAYOUTS], RANK_TP_SIZES, work)
    expect("error" not in report, output[-4000:])
    results = {(r["pair"], r["tp"]): r for r in report["results"]}
    expect(set(results) == {(built[v].name, tp) for v in variants for tp in RANK_TP_SIZES}, sorted(results))
    for (name, tp), result in results.items():
        expect(result["passed"], f"{name} at TP {tp}: {result['problems']}")
        # every rank compared at least one draft layer with the target layer it reads, and both outputs were summed
        expect(len(result["geometry"]) >= tp and all(g["ok"] for g in result["geometry"]), result["geometry"])
        expect({k.split(".")[0] for k in result["relative_errors"]} == {"target", "draft"}, result)
    expect(code == 0, output[-3000:])
    return Measured(f"ranks-{source_name}", tuple(
        rank_row(source_name, v, env, tp, digests[v], results[(built[v].name, tp)])
        for v in variants for tp in RANK_TP_SIZES))


def select(cases: tuple[str, ...], vllm: str) -> list[str]:
    return [name for name in RANK_SOURCES if (not cases or name in cases) and (not vllm or vllm == RANK_ENV[1])]


def measure(names: list[str], work: Path, carried_over: CarriedOver) -> Iterator[Measured]:
    for name in names:
        try:
            yield measure_ranks(name, find_env(*RANK_ENV), work / name, carried_over)
        except (MissingEnv, RowMismatch) as mismatch:
            yield Measured(f"ranks-{name}", mismatch=str(mismatch))


FAMILY = Family("TP ranks", CHECK_LOADER,
                ("tests/test_tp_ranks.py::test_every_rank_adds_up_to_the_unsharded_original",),
                select, measure)

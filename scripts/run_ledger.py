#!/usr/bin/env python3
"""`make compat`: run the whole proof matrix and write the compatibility ledger (docs/COMPATIBILITY.md).

cases -> envs -> units -> rows -> ledger.json -> docs tables. Builds (or reuses) every vLLM env named on the command
line (scripts/consumers/vllm/envs.sh specs); measures every row family itself (FAMILIES, scripts/matrix/*_check.py:
the stock loader, TP ranks, engine, install, transformers, SGLang, mlx-lm / mlx-vlm, llama.cpp / llama-server: each
unit built, run in its consumer's env, judged, and carried over unchanged where the ledger holds it); runs the
controls, which record no row (the negative cases, kernel refusals, `predict` and the pins checked against each
env: pytest); and, when every unit showed what it must and every control held, writes converter/advice/ledger.json,
docs/COMPATIBILITY.md and the README's release table. Incremental by default: a row whose output digest and
environment equal the committed row's is carried over, not re-run (`--all` re-runs all).

usage: scripts/run_ledger.py --docs-only      (run nothing: the docs from the committed ledger)
       scripts/run_ledger.py [--all] [--resume ROWS] [--timings FILE] [--check CHECK] [--case NAME ...] [--vllm X]
                         SPEC [SPEC ...]
--check loader|install|consumer|engine|draft: run only that check's rows and replace only its rows (the others stay as
the ledger has them).
--case NAME: run only the rows of that case (cases.py SOURCES / ENGINE_SOURCES; repeatable) and replace only its
rows: a new case joins the ledger without every env of the matrix (SPEC: the envs its rows run in).
--vllm X: run only the rows of vLLM release X and replace only its rows (`make release VLLM=X`, scripts/release.py).
exit: 0 ledger written; 1 a unit or a control failed or an env could not be built (the ledger is left as it was, and
the rows that passed are kept in RESUME_FILE for `--resume`); 2 usage.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from converter.advice.ledger import (CHECK_CONSUMER, CHECK_DRAFT, CHECK_ENGINE, CHECK_INSTALL, CHECK_LOADER,  # noqa: E402
                                     LEDGER_PATH, LedgerRow, load_ledger)
from matrix import (engine_check, envs, install_check, llamacpp_check, loader_check, mlx_check,  # noqa: E402
                    rank_check, sglang_check, transformers_check)
from matrix.cases import RELEASES  # noqa: E402
from matrix.ledger_file import ledger_document  # noqa: E402
from matrix.rows import Family, carried_over_from, carried_rows  # noqa: E402
from matrix.doc_tables import render_markdown, with_release_table  # noqa: E402

DOC = REPO / "docs" / "COMPATIBILITY.md"
README = REPO / "README.md"
RESUME_FILE = Path.home() / ".cache" / "gemma4-convert" / "compat-resume.jsonl"
# the row families the runner measures (cases -> envs -> units -> rows); their tests run the same functions by hand
FAMILIES = (loader_check.FAMILY, rank_check.FAMILY, engine_check.FAMILY, install_check.FAMILY,
            transformers_check.FAMILY, sglang_check.LOADS, sglang_check.DRAFTS, mlx_check.LOADS, mlx_check.DRAFTS,
            llamacpp_check.LOADS, llamacpp_check.DRAFTS)
# The controls, which record no row and gate the ledger: the negative cases every check must fail (a padded target
# beside an unpadded assistant, swapped KV heads or experts), the stock kernel refusals, and the rules of `predict`
# and the transformers pins checked against each env (pytest, marker vllm_loader or vllm_engine). --check: its own.
CONSUMER_TESTS = tuple(f"tests/{p.name}" for p in sorted((REPO / "tests").glob("test_consumer_*.py")))
CONTROLS = ("tests/test_vllm_loader.py", "tests/test_vllm_predictions.py", "tests/test_transformers_pins.py",
            "tests/test_vllm_engine.py", "tests/test_tp_ranks.py", "tests/test_install.py", *CONSUMER_TESTS)
CHECK_CONTROLS = {CHECK_LOADER: ("tests/test_vllm_loader.py", "tests/test_vllm_predictions.py",
                                 "tests/test_transformers_pins.py", "tests/test_tp_ranks.py"),
                  CHECK_INSTALL: ("tests/test_install.py",), CHECK_CONSUMER: CONSUMER_TESTS,
                  CHECK_ENGINE: ("tests/test_vllm_engine.py",),
                  CHECK_DRAFT: ("tests/test_consumer_llamacpp.py", "tests/test_consumer_mlx.py",
                                "tests/test_consumer_sglang.py")}


def build_envs(specs: list[str]) -> tuple[list[str], float]:
    start = time.monotonic()
    proc = subprocess.run(["bash", str(REPO / "scripts" / "consumers" / "vllm" / "envs.sh"), *specs], stdout=subprocess.PIPE,
                          text=True)
    if proc.returncode != 0:
        sys.exit("compat: the vLLM envs could not be built (see the vllm_envs: FAILED line above)")
    return proc.stdout.split(), time.monotonic() - start


PYTEST_NO_TESTS = 5


def run_controls(pythons: list[str], junit: Path, *, tests: tuple[str, ...] = CONTROLS, cases: tuple[str, ...] = (),
                 vllm: str = "") -> int:
    """pytest's exit code over the controls of the selection, in the envs `pythons` (a missing env fails)."""
    env = dict(os.environ, GEMMA4_VLLM_PYTHONS=os.pathsep.join(pythons), GEMMA4_REQUIRE_VLLM="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "vllm_loader or vllm_engine",
           f"--junitxml={junit}", *[f"--deselect={test}" for family in FAMILIES for test in family.tests], *tests]
    # test ids carry the case name and the vLLM release (e.g. test_stock_kernel_selection_refuses_on_this_cpu[31b-fp8])
    keywords = [f"({' or '.join(cases)})"] if cases else []
    keywords += [vllm] if vllm else []
    if keywords:
        cmd += ["-k", " and ".join(keywords)]
    code = subprocess.run(cmd, cwd=REPO, env=env).returncode
    return 0 if code == PYTEST_NO_TESTS else code  # 5: the selection holds no control


def measure_families(families: list[Family], pythons: list[str], work: Path, *, cases: tuple[str, ...], vllm: str,
                     reuse: bool, resume: Path | None) -> tuple[list[LedgerRow], int, dict[str, float]]:
    """The rows of every family the runner measures itself, in the envs `pythons`, measured or carried over: (their
    ledger rows, units that did not show what they must, seconds per family). A unit whose env is not among
    `pythons` fails, naming the envs.sh spec that builds it."""
    os.environ[envs.PYTHONS_VAR] = os.pathsep.join(pythons)
    envs.all_envs.cache_clear()
    carried_over = carried_over_from(carried_rows(resume) if reuse else ())
    recorded, failed, seconds = [], 0, {}
    for family in families:
        started, kept, fresh, missed, selected = time.monotonic(), 0, 0, 0, family.select(cases, vllm)
        try:
            for outcome in family.measure(selected, work / family.name.replace(' ', '-'), carried_over):
                if outcome.mismatch:
                    print(f"compat: FAILED {family.name} {outcome.name}: {outcome.mismatch[-2000:]}", file=sys.stderr)
                    missed += 1
                    continue
                recorded += outcome.rows
                kept += len(outcome.rows) if outcome.carried else 0
                fresh += 0 if outcome.carried else len(outcome.rows)
        except Exception as crash:  # noqa: BLE001  a consumer past its timeout, a harness bug: the family's other
            # units are not measured and the run fails, but the rows measured so far reach the resume file
            print(f"compat: FAILED {family.name}: it stopped at {type(crash).__name__}: {crash}", file=sys.stderr)
            missed += 1
        seconds[family.name] = round(time.monotonic() - started, 1)
        print(f"compat: {family.name} ({family.check}): {len(selected)} units, {fresh} rows measured, {kept} carried "
              f"over, {missed} units failed")
        failed += missed
    return recorded, failed, seconds


def merged(ledger: tuple[LedgerRow, ...], new: list[LedgerRow], selected) -> list[LedgerRow]:
    """The ledger after a run of a selection (--check, --case, --vllm): the rows the run measured or carried over,
    in place of the ledger's rows of the same selection, case, check and TP size; every other row as the ledger has
    it (a selection's test that recorded nothing, as the TP test under --vllm, leaves its rows alone)."""
    produced = {(row.case, row.check, row.tp) for row in new if selected(row)}
    kept = [row for row in ledger if not selected(row) or (row.case, row.check, row.tp) not in produced]
    return kept + [row for row in new if selected(row)]


def module_seconds(junit: Path) -> dict[str, float]:
    """Seconds per test module from pytest's junit report."""
    seconds: dict[str, float] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "?").rsplit(".", 1)[-1]
        seconds[module] = seconds.get(module, 0.0) + float(case.get("time", 0))
    return seconds


def write_docs(rows: list, *, doc: Path = DOC, readme: Path = README) -> None:
    """docs/COMPATIBILITY.md and the README's release table, generated from the ledger's rows."""
    doc.write_text(render_markdown(rows), encoding="utf-8")
    readme.write_text(with_release_table(readme.read_text(encoding="utf-8"), rows), encoding="utf-8")


def write_ledger(rows: list, releases: dict[str, str], *, ledger: Path = LEDGER_PATH, doc: Path = DOC,
                 readme: Path = README) -> None:
    """ledger.json, then the docs rendered from the rows as that file holds them (sorted): what `--docs-only`
    renders from the committed ledger, byte for byte."""
    ledger.write_text(json.dumps(ledger_document(rows, releases), indent=1) + "\n", encoding="utf-8")
    write_docs(list(load_ledger(ledger)), doc=doc, readme=readme)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="*", metavar="SPEC", help="PACKAGE:VERSION:TRANSFORMERS (envs.sh)")
    parser.add_argument("--docs-only", action="store_true",
                        help="run nothing: rewrite docs/COMPATIBILITY.md and README's release table from the ledger")
    parser.add_argument("--all", action="store_true", help="re-run every row, even those the ledger already proves")
    parser.add_argument("--resume", type=Path, metavar="ROWS",
                        help=f"carry over the passed rows of an earlier failed run (it saves them in {RESUME_FILE})")
    parser.add_argument("--timings", type=Path, help="write env build and per-module seconds to this JSON file")
    parser.add_argument("--check", choices=sorted(CHECK_CONTROLS),
                        help="run only this check's rows and controls; the ledger's other rows are kept as they are")
    parser.add_argument("--case", action="append", default=[], metavar="NAME",
                        help="run only this case's rows (repeatable); the ledger's other rows are kept as they are")
    parser.add_argument("--vllm", default="", metavar="X",
                        help="run only the rows of vLLM release X; the ledger's other rows are kept as they are")
    args = parser.parse_args(argv)
    if args.docs_only:
        write_docs(load_ledger())
        print(f"compat: {DOC.relative_to(REPO)} and {README.relative_to(REPO)} rewritten from "
              f"{LEDGER_PATH.relative_to(REPO)}")
        return 0
    if not args.specs:
        parser.error("name the envs to run in (SPEC ...), or --docs-only")

    started = time.monotonic()
    pythons, env_seconds = build_envs(args.specs)
    reuse = not args.all or args.resume is not None
    with tempfile.TemporaryDirectory(prefix="gemma4-compat-") as tmp:
        junit = Path(tmp) / "junit.xml"
        families = [family for family in FAMILIES if args.check in (None, family.check)]
        rows, failed, family_seconds = measure_families(families, pythons, Path(tmp), cases=tuple(args.case),
                                                        vllm=args.vllm, reuse=reuse, resume=args.resume)
        code = run_controls(pythons, junit, tests=CHECK_CONTROLS[args.check] if args.check else CONTROLS,
                            cases=tuple(args.case), vllm=args.vllm)
        code = code or (1 if failed else 0)
        lines = [json.dumps(asdict(row)) for row in rows]
        if args.check or args.case or args.vllm:
            rows = merged(load_ledger(), rows, lambda r: (not args.check or r.check == args.check)
                          and (not args.case or r.case in args.case) and (not args.vllm or r.vllm == args.vllm))
        modules = dict(module_seconds(junit) if junit.exists() else {}, **family_seconds)
    wall = time.monotonic() - started
    if args.timings:
        args.timings.write_text(json.dumps({"envs_s": round(env_seconds, 1), "modules_s": modules,
                                            "wall_s": round(wall, 1), "rows": len(rows)}, indent=2) + "\n")
    if code != 0:
        RESUME_FILE.parent.mkdir(parents=True, exist_ok=True)
        RESUME_FILE.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        print(f"compat: the matrix failed (a unit or a control, exit {code}); {LEDGER_PATH.relative_to(REPO)} left as "
              f"it was; the {len(lines)} rows that passed are in {RESUME_FILE}: fix, then `make compat "
              f"COMPAT_ARGS='--resume {RESUME_FILE}'` re-runs only the rest", file=sys.stderr)
        return 1
    releases = {release.vllm: release.transformers_range for release in RELEASES if release.transformers_range}
    write_ledger(rows, releases)
    fresh = sum(row.measured == datetime.date.today().isoformat() for row in rows)
    print(f"compat: {len(rows)} rows ({fresh} measured today, the rest carried over) -> "
          f"{LEDGER_PATH.relative_to(REPO)}, {DOC.relative_to(REPO)}; envs {env_seconds:.0f} s, total {wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

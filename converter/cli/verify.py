"""`gemma4-convert verify`: structural then numerical proof that a conversion is equivalent to its source."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import UsageError, VerificationFailed
from ..gemma4 import Role
from ..hub.download import LocalSource
from ..proof.verification import VerifyReport, VerifyRequest, load_pairs, verify
from ..read.checkpoint import VERIFICATION_NAME
from ..write.staging import write_json
from ._common import PATH, SOURCE, resolve_cli_source


@click.command("verify")
@click.argument("paths", nargs=-1, type=PATH)
@click.option("--target", type=SOURCE, help="Original target checkpoint (directory or Hub repo OWNER/NAME[@REV]).")
@click.option("--assistant", type=SOURCE, help="Original assistant checkpoint (directory or Hub repo).")
@click.option("--converted", type=PATH, help="Output directory of `convert` (holding target/ and/or assistant/).")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True,
              help="auto uses CUDA when torch sees a GPU.")
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True,
              help="Precision of the checked runs (the truth runs one step higher: fp32 / fp64).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--seq-len", type=click.IntRange(min=4), default=64, show_default=True,
              help="Tokens of random hidden state per attention layer.")
@click.option("--tolerance-factor", type=click.FloatRange(min=1.0), default=2.0, show_default=True,
              help="Converted error allowed, as a multiple of the original model's own noise floor.")
@click.option("--tp", "tp_sizes", type=click.IntRange(min=1), multiple=True, metavar="N",
              help="Tensor-parallel size you serve with (repeatable): the pair's per-rank KV geometry is compared at "
                   "it, and a size vLLM refuses for the target fails. Default: compare at 1, 2, 4 and 8.")
@click.option("--json", "json_path", type=click.Path(path_type=Path, dir_okay=False),
              help="Also write the report here (it is always written as verification.json in the output).")
def command(paths: tuple[Path, ...], target: LocalSource | None, assistant: LocalSource | None, converted: Path | None,
            device: str, dtype: str, seed: int, seq_len: int, tolerance_factor: float, tp_sizes: tuple[int, ...],
            json_path: Path | None) -> None:
    """Verify a conversion: every tensor accounted for, bits exact, and outputs equivalent layer by layer.

    \b
    Examples:
      gemma4-convert verify --target T --assistant A --converted DST
      gemma4-convert verify SRC DST --device cpu --dtype fp32
    """
    if paths and len(paths) != 2:
        raise UsageError("give SRC DST (two paths), or --target/--assistant with --converted")
    if paths and converted:
        raise UsageError("give SRC DST or --converted, not both")
    single, out = (paths[0], paths[1]) if paths else (None, converted)
    names = {role: source.repo_id or str(source.path) for role, source in
             ((Role.TARGET, target), (Role.ASSISTANT, assistant)) if source is not None}
    if single is not None:  # SRC may be a Hub repo id, fetched at one commit like --target/--assistant
        names[Role.SINGLE] = str(single)
        single = resolve_cli_source(str(single), purpose="full", ctx=click.get_current_context()).path
    if out is None:
        raise UsageError("missing --converted DST")
    request = VerifyRequest(converted=out, target=target and target.path, assistant=assistant and assistant.path,
                            single=single, device=device, dtype=dtype, seed=seed, seq_len=seq_len,
                            tolerance_factor=tolerance_factor, tp_sizes=tp_sizes, names=names)
    pairs = load_pairs(request)
    total = sum(output.total_bytes for _, output in pairs.values())
    from tqdm import tqdm  # ~0.1 s: imported by the runs that show progress, not by --help

    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="structure", disable=None,
              leave=False) as bar:
        layers = tqdm(desc="layers", unit="layer", disable=None, leave=False)
        report = verify(request, on_bytes=bar.update, on_layer=lambda name: layers.update(1))
        layers.close()
    document = report.to_json()
    for directory in _report_dirs(out, pairs):
        write_json(directory / VERIFICATION_NAME, document)
    if json_path is not None:
        write_json(json_path, document)
    render(report)
    if not report.passed:
        raise VerificationFailed(f"verification failed: {report.first_failure}")


def _report_dirs(out: Path, pairs: dict) -> list[Path]:
    if set(pairs) == {"target", "assistant"} or (out / "target").is_dir() or (out / "assistant").is_dir():
        return [out] + [out / role for role in pairs if (out / role).is_dir()]
    return [out]


def render(report: VerifyReport) -> None:
    s = report.structural
    click.echo(f"structure: {'OK' if s.passed else 'FAILED'} ({s.tensors_checked} tensors: {s.copied} byte-identical "
               f"copies, {s.transformed} recomputed transforms)")
    for problem in s.problems[:20]:
        click.echo(f"  - {problem.describe()}")
    if len(s.problems) > 20:
        click.echo(f"  ... {len(s.problems) - 20} more")
    click.echo(f"numerics on {report.device} ({report.versions.get('device_name')}), {report.dtype}, seed {report.seed}"
               f", {report.seq_len} tokens; pass when rel rms error <= {report.tolerance_factor}x the original's own "
               f"(the floor)")
    click.echo(f"  {'block':<36} {'max abs':>10} {'max rel':>10} {'rel rms':>10} {'cosine':>12} {'floor':>10} "
               f"{'x floor':>8}")
    for c in report.layers:
        click.echo(f"  {c.name:<36} {c.max_abs:>10.3g} {c.max_rel:>10.3g} {c.rel_rms:>10.3g} {c.cosine:>12.9f} "
                   f"{c.noise_floor:>10.3g} {c.ratio:>8.2f}{'' if c.passed else '  FAIL'}"
                   + (f" ({c.note})" if c.note else ""))
    click.echo(f"{'PASSED' if report.passed else 'FAILED'} in {report.wall_seconds:.1f} s (torch "
               f"{report.versions.get('torch')}, cuda {report.versions.get('cuda')})")



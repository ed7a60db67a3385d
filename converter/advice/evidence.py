"""What the ledger measured for a config form in one serving environment, and the nearest proven rows where it
measured nothing.

`inspect`, `convert` and the card answer from here: a verdict is what the real stock vLLM loader did with a
synthetic pair of the same config form and KV-head pattern (converter/advice/ledger.json, `make compat`), never a
rule applied to a release nobody ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ..gemma4 import RELEASED_KV_GEOMETRY, UNIFIED_TRANSFORMERS, UNIFIED_VLLM
from .ledger import CHECK_LOADER, PASS, LedgerRow, load_ledger, version_key

NEAREST_SHOWN = 3


@dataclass(frozen=True)
class Shape:
    """What decides how a vLLM release treats a checkpoint: its config form (advice/serving.py FORM_*) and whether
    its KV-head count differs between layer types ("mixed") or not ("uniform")."""

    form: str
    kv_heads: str
    # (sliding KV heads, full KV heads, head-size ratio) of the source (AttentionConfig.kv_geometry): rows of another
    # geometry do not speak for it; None: every geometry's rows do (a homogeneous checkpoint)
    geometry: tuple[int, int, int] | None = None
    unified: bool = False  # the 12B family (ModelSpec.unified): its own transformers and vLLM floors


@dataclass(frozen=True)
class Evidence:
    """The ledger rows of one shape in one environment (empty: not proven there) and the nearest proven ones."""

    rows: tuple[LedgerRow, ...]
    nearest: tuple[LedgerRow, ...]
    # the ledger holds no row of the shape's geometry at all: `nearest` are rows of other geometries
    other_geometry: bool = False

    @property
    def proven(self) -> bool:
        return bool(self.rows)

    @property
    def loads(self) -> bool:
        return self.proven and all(r.verdict == PASS for r in self.rows)

    @property
    def failing(self) -> tuple[LedgerRow, ...]:
        return tuple(r for r in self.rows if r.verdict != PASS)


def serving_rows(rows: Iterable[LedgerRow] | None = None) -> tuple[LedgerRow, ...]:
    """The ledger's loader rows that stand for a published checkpoint of their shape (TP 1, scope "pair")."""
    return tuple(r for r in (load_ledger() if rows is None else rows)
                 if r.check == CHECK_LOADER and r.tp == 1 and r.scope == "pair" and r.config_form and r.kv_heads)


def evidence(shape: Shape, vllm: str, transformers: str | None, rows: Iterable[LedgerRow] | None = None) -> Evidence:
    """The rows of `shape` measured with vLLM `vllm` (and `transformers`, or any transformers when None), and when
    there are none, the NEAREST_SHOWN nearest of that shape: the same release first, then the closest releases."""
    same = [r for r in serving_rows(rows) if (r.config_form, r.kv_heads) == (shape.form, shape.kv_heads)
            and same_family(r, shape)]
    own = [r for r in same if shape.geometry is None or row_geometry(r) == shape.geometry]
    exact = tuple(r for r in own if r.vllm == vllm and (transformers is None or r.transformers == transformers))
    if exact:
        return Evidence(exact, ())
    nearest = tuple(sorted(own or same, key=lambda r: _distance(r, vllm, transformers))[:NEAREST_SHOWN])
    return Evidence((), nearest, other_geometry=bool(same) and not own)


def row_geometry(row: LedgerRow) -> tuple[int, int, int] | None:
    """The attention geometry of the published size a row's source stands for (its form's first word)."""
    return RELEASED_KV_GEOMETRY.get(row.form.split(",", 1)[0].strip())


def row_unified(row: LedgerRow) -> bool:
    """The row's source is of the 12B family (gemma4_unified)."""
    return "unified" in row.form


FLOOR_TRANSFORMERS, FLOOR_VLLM = "transformers", "vllm"


def family_floor(unified: bool, vllm: str, transformers: str | None) -> str | None:
    """The 12B family's floor an environment sits under (FLOOR_TRANSFORMERS first, as vLLM meets it first), or
    None: another family, or an environment above both (docs/DESIGN.md "The 12B family's floors")."""
    if not unified:
        return None
    if transformers and version_key(transformers)[:2] < version_key(UNIFIED_TRANSFORMERS)[:2]:
        return FLOOR_TRANSFORMERS
    return FLOOR_VLLM if version_key(vllm)[:2] < version_key(UNIFIED_VLLM)[:2] else None


def same_family(row: LedgerRow, shape: Shape) -> bool:
    """The row speaks for `shape`'s family: the 12B family's rows only for it and the others' only for theirs, and
    not its rows below the transformers it needs, which say nothing of a layout (`predict` answers there)."""
    return row_unified(row) == shape.unified and \
        family_floor(shape.unified, row.vllm, row.transformers) != FLOOR_TRANSFORMERS


def _distance(row: LedgerRow, vllm: str, transformers: str | None) -> tuple:
    wanted, got = version_key(vllm), version_key(row.vllm)
    minor_gap = abs(_minor_index(got) - _minor_index(wanted))
    tf_gap = 0 if transformers is None else abs(_minor_index(version_key(row.transformers))
                                                 - _minor_index(version_key(transformers)))
    return (minor_gap, got != wanted, tf_gap, row.case, row.layout)


def _minor_index(key: tuple[int, ...]) -> int:
    major, minor = (tuple(key) + (0, 0))[:2]
    return major * 1000 + minor


def describe_rows(rows: Iterable[LedgerRow]) -> list[str]:
    """One phrase per row: "vLLM 0.22.1 + transformers 5.24.0: pass (31b-mm-2shards per-layer)"."""
    return [f"vLLM {r.vllm} + transformers {r.transformers}: {r.verdict} ({r.case} {r.variant})" for r in rows]

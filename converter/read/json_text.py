"""JSON as config files, indexes and safetensors headers must hold it: strict, so that what is read can be written
back as JSON, and every failure one InputError naming the file.

Python's json module accepts NaN, Infinity and -Infinity (RFC 8259 has no such numbers; a config holding one would
be copied into the output as text no other JSON parser reads) and raises RecursionError on deep nesting.
"""

from __future__ import annotations

import json
from typing import Any, NoReturn

from ..errors import InputError


class _NotJson(ValueError):
    pass


def _refuse_constant(name: str) -> NoReturn:
    raise _NotJson(f"{name} is not a JSON number; write a finite value")


def parse_json(text: str | bytes, where: object, *, what: str = "invalid JSON") -> Any:
    """Parses `text`, read from `where` (named in every message).

    Raises:
        InputError: not JSON (what it says, `what` first), NaN / Infinity, or nesting too deep to parse.
    """
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except _NotJson as exc:
        raise InputError(f"{where}: {exc}") from exc
    except RecursionError as exc:
        raise InputError(f"{where}: {what} (nested too deeply to parse)") from exc
    except ValueError as exc:  # JSONDecodeError, bad UTF-8 in bytes, ints over 4300 digits
        raise InputError(f"{where}: {what} ({exc})") from exc

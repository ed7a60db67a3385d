"""A model card's front matter: the license and language a converted checkpoint's card carries over from its
source's (hub/card.py), and whether a card is this tool's.

Read with yaml, as huggingface_hub reads it, without huggingface_hub: its card module costs a local `convert` ~0.15 s
of imports (yaml alone ~0.01 s), and a local convert imports no Hub code (docs/HUB.md, "The model card")."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_FRONT_MATTER = re.compile(r"^---\s*\n(.*?)\n---\s*(\n|$)", flags=re.S)


def front_matter_of(card: Path) -> dict[str, Any] | None:
    """The YAML front matter of the card at `card` (license, language, tags...), or None where it has none readable."""
    import yaml  # only a card being read needs it

    match = _FRONT_MATTER.match(card.read_text(encoding="utf-8", errors="replace"))
    if match is None:
        return None
    try:
        data = yaml.safe_load(match.group(1))
    except yaml.YAMLError:
        return None
    return data if isinstance(data, dict) else None

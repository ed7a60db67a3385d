"""Re-save config.json documents with the installed transformers' own config classes and `save_pretrained`.

This is how a user ends up with the per_layer_config dialect: load a Hub checkpoint's config with a current transformers
and save it (docs/DESIGN.md "Config dialects" and "Gemma 4 checkpoints in the wild": zero-padded layer keys, flat global
keys popped, the vision rope written as "axial"). The factory (converter.synthetic) uses it so that test inputs come
from the real producer, never from a hand-written imitation.

The file imports only the standard library and transformers, so it also runs BY PATH under another
interpreter (a cached vLLM env holding another transformers version): `python scripts/matrix/resave.py`
reads {"name": config, ...} as JSON on stdin and prints {"transformers": version, "configs": {...}}.
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
from pathlib import Path
from typing import Any


def resave_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json as `AutoConfig.from_pretrained(dir).save_pretrained(out)` of this process's transformers writes it.

    Args:
        config: a Gemma 4 target or assistant config.json document (not modified: transformers' config classes
            edit the dicts they are given in place, docs/DESIGN.md "Gemma 4 checkpoints in the wild").

    Returns:
        The re-saved document.
    """
    from transformers import AutoConfig

    with tempfile.TemporaryDirectory(prefix="gemma4-resave-") as tmp:
        source, out = Path(tmp, "source"), Path(tmp, "out")
        source.mkdir()
        (source / "config.json").write_text(json.dumps(copy.deepcopy(config)))
        AutoConfig.from_pretrained(str(source)).save_pretrained(str(out))
        return json.loads((out / "config.json").read_text())


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def main() -> int:
    configs = json.load(sys.stdin)
    result = {"transformers": transformers_version(),
              "configs": {name: resave_config(config) for name, config in configs.items()}}
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

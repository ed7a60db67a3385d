"""scripts/floor_write.py, the bench's disk floor: it writes exactly the named files and sizes, from the source's bytes."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCK = 4 * 1024 * 1024


def test_floor_write_writes_every_named_file_at_its_size_from_the_source_bytes(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    data = random.Random(0).randbytes(BLOCK + 8192)
    (source / "model.safetensors").write_bytes(data)
    (source / "config.json").write_text("{}")  # smaller than a block: never a source of bytes
    spec = tmp_path / "spec.json"
    sizes = {"target/model.safetensors": len(data) + 4096 + 5, "target/config.json": 123, "assistant/a.bin": 4096}
    spec.write_text(json.dumps({"files": [[name, size] for name, size in sizes.items()]}))
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(REPO / "scripts" / "floor_write.py"), str(source), str(out), str(spec)],
                   check=True, timeout=120)
    written = {str(p.relative_to(out)): p.stat().st_size for p in out.rglob("*") if p.is_file()}
    assert written == sizes
    usable = data[:len(data) - len(data) % 4096]  # whole 4 KiB pages of the source, in order, wrapping around
    first = (out / "target" / "model.safetensors").read_bytes()
    assert first[:len(usable)] == usable
    pages = {usable[i:i + 4096] for i in range(0, len(usable), 4096)}
    assert all(first[i:i + 4096] in pages for i in range(0, len(first) - 4096, 4096))

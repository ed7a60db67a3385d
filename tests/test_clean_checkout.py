"""A test run leaves the checkout as it found it (conftest.py's session check; issue: serve_check_work/ litter)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from _checkout import checkout_changes

REPO = Path(__file__).resolve().parents[1]


def test_litter_in_the_checkout_is_seen(tmp_path):
    """The session check sees a new file in a checkout and not an ignored cache (a check that could not fail would
    prove nothing)."""
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("cache/\n")
    before = checkout_changes(repo)
    (repo / "cache").mkdir()
    (repo / "cache" / "x").write_text("ignored")
    assert checkout_changes(repo) == before
    (repo / "serve_check_work").mkdir()
    (repo / "serve_check_work" / "job.json").write_text("{}")
    assert checkout_changes(repo) - before == {"?? serve_check_work/job.json"}


def test_a_pytest_run_that_litters_fails(tmp_path):
    """A throwaway test that writes into the checkout makes the whole pytest run fail, naming the file."""
    probe = REPO / "tests" / f"test_zz_litter_probe_{tmp_path.name}.py"
    litter = REPO / f"litter-{tmp_path.name}.txt"
    probe.write_text(f"def test_litter():\n    open({str(litter)!r}, 'w').write('x')\n")
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(probe)],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
    finally:
        probe.unlink(missing_ok=True)
        litter.unlink(missing_ok=True)
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "left files in the checkout" in proc.stdout and litter.name in proc.stdout

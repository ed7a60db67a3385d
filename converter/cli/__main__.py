"""`python -m converter.cli` = `gemma4-convert` (for environments without the console script on PATH)."""

from . import main

main()

"""The repo explains itself: every Markdown file its code and docs cite is a file it holds.

A reader of the checkout can open each reference (docs/DESIGN.md holds the facts the code rests on, with their
sources); a public URL is a reference anyone can open, so Markdown names inside URLs are not checked.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".txt", ".cfg", ".ini", ".yml", ".yaml", ""}
URL = re.compile(r"https?://\S+")
# a name not preceded by "/": an absolute path (/tmp/b.md) is a file of the reader's machine, not of the repo
MARKDOWN_NAME = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+(?:\.[\w-]+)*\.md)\b")
# model cards inside checkpoints and Hub repos the tool reads or writes (`me/t/README.md`), not files of this repo
CHECKPOINT_FILES = {"README.md", "README.source.md"}


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [REPO / n for n in names if Path(n).suffix in TEXT_SUFFIXES and (REPO / n).is_file()]


def markdown_references(text: str) -> list[str]:
    return MARKDOWN_NAME.findall(URL.sub(" ", text))


def resolves(reference: str, cited_in: Path) -> bool:
    """Relative to the citing file (a link), the repo root (`docs/CLI.md`), or docs/ (a page named bare)."""
    return any((base / reference).is_file() for base in (cited_in.parent, REPO, REPO / "docs"))


def dangling_references() -> list[str]:
    found = []
    for path in tracked_text_files():
        if path == Path(__file__).resolve():
            continue  # this file's examples name missing pages on purpose
        text = path.read_text(encoding="utf-8", errors="replace")
        for reference in markdown_references(text):
            if Path(reference).name not in CHECKPOINT_FILES and not resolves(reference, path):
                found.append(f"{path.relative_to(REPO)}: {reference}")
    return found


def test_every_cited_markdown_file_is_in_the_repo():
    if not (REPO / ".git").exists():
        pytest.skip("needs the git checkout (git ls-files)")
    dangling = dangling_references()
    assert not dangling, f"references to Markdown files this repo does not hold: {dangling}"


@pytest.mark.parametrize("text, expected", [
    ("the placement (FACTS.md section 4)", ["FACTS.md"]),
    ("see docs/DESIGN.md section 4 and [CLI](CLI.md)", ["docs/DESIGN.md", "CLI.md"]),
    ("https://github.com/ggml-org/llama.cpp/blob/master/docs/build.md only", []),
    ("--markdown /tmp/b.md", []),
    ("README.md, `../shared/STYLE.md`.", ["README.md", "../shared/STYLE.md"]),
])
def test_references_are_found_where_they_are_written(text, expected):
    assert markdown_references(text) == expected


def test_a_missing_page_is_caught(tmp_path):
    cited_in = REPO / "converter" / "transforms.py"
    assert resolves("docs/DESIGN.md", cited_in) and resolves("CLI.md", REPO / "docs" / "HUB.md")
    assert not resolves("FACTS.md", cited_in) and not resolves("docs/STYLE.md", cited_in)


# docs/DESIGN.md "The pad-global transform: placement math", or docs/CLI.md, "inspect SRC": a page and a heading
HEADING_CITATION = re.compile(r"((?:[\w.-]+/)*[\w-]+\.md),? \"([^\"\n]+)\"")
HEADING_LINE = re.compile(r"^#+\s+(?:\d+\.\s+)?(.+)$", re.M)


def headings_of(page: Path) -> list[str]:
    return [h.replace("`", "") for h in HEADING_LINE.findall(page.read_text(encoding="utf-8"))]


def cited_headings_missing() -> list[str]:
    """Each `PAGE.md "Heading"` in the code's comments names a heading of that page (the cited text is the heading or
    its start, backticks aside): a renamed heading takes the comments that cite it along."""
    missing = []
    for path in tracked_text_files():
        if path.suffix != ".py" or path == Path(__file__).resolve():
            continue
        for page, heading in HEADING_CITATION.findall(path.read_text(encoding="utf-8", errors="replace")):
            found = next((base / page for base in (path.parent, REPO, REPO / "docs") if (base / page).is_file()), None)
            wanted = heading.replace("`", "")
            if found is not None and not any(h.startswith(wanted) for h in headings_of(found)):
                missing.append(f"{path.relative_to(REPO)}: {page} \"{heading}\"")
    return missing


def test_every_cited_heading_is_a_heading_of_its_page():
    if not (REPO / ".git").exists():
        pytest.skip("needs the git checkout (git ls-files)")
    missing = cited_headings_missing()
    assert not missing, f"citations of headings their page does not have: {missing}"


def test_a_heading_citation_is_found_and_a_missing_one_reported(tmp_path):
    assert HEADING_CITATION.findall('(docs/DESIGN.md "Checkpoints") and docs/CLI.md, "inspect SRC"') == [
        ("docs/DESIGN.md", "Checkpoints"), ("docs/CLI.md", "inspect SRC")]
    page = tmp_path / "P.md"
    page.write_text("# Title\n## 3. The `pad-global` transform\n")
    assert headings_of(page) == ["Title", "The pad-global transform"]

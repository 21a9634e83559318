"""Comments, docs and errors cite files in the repository (docs/algorithm.md, docs/architecture.md),
never documents outside it; and the cited docs exist."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"sao-spec|design\.md|field-notes|style\.md|shared/docs|\bspec §")
TRACKER = re.compile(r"\bissue[ -]?#?\d+|\bissue\d+|\bissue's\b|--issue-", re.I)  # an outside issue tracker
DOCS = ["README.md", "benchmarks/README.md", *(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]


def test_no_citation_of_documents_outside_the_repository():
    files = [p for d in ("sao", "tests", "benchmarks", "examples", "scripts", "docs") for p in (ROOT / d).rglob("*")
             if p.suffix in (".py", ".md", ".sh", ".yaml") and p.name != Path(__file__).name]
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in files + [ROOT / "README.md"]
           for i, line in enumerate(p.read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert not bad, bad


def test_no_reference_to_an_issue_tracker():
    """Docs, comments and result labels say what a change was, not which tracker entry asked for it."""
    files = [p for d in ("sao", "tests", "benchmarks", "examples", "scripts", "docs") for p in (ROOT / d).rglob("*")
             if p.suffix in (".py", ".md", ".sh", ".yaml", ".json") and p.name != Path(__file__).name]
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in files + [ROOT / "README.md"]
           for i, line in enumerate(p.read_text().splitlines(), 1) if TRACKER.search(line)]
    assert not bad, bad


def test_files_the_docs_name_exist():
    """Every repository path a doc names (`sao/...`, `benchmarks/...`) is there; NAME-style parts are placeholders."""
    path = re.compile(r"(?<![\w/.-])((?:sao|benchmarks|docs|tests|examples|scripts)/[\w./-]*\w)(?![\w{*])")
    missing = [f"{doc}:{i}: {m}" for doc in DOCS for i, line in enumerate((ROOT / doc).read_text().splitlines(), 1)
               for m in path.findall(line) if not re.search(r"\b[A-Z]{3,}\b", m) and not (ROOT / m).exists()]
    assert not missing, missing


def test_cited_sections_exist():
    for doc in ("algorithm", "architecture"):
        text = (ROOT / "docs" / f"{doc}.md").read_text()
        sections = {int(n) for n in re.findall(r"^## (\d+)\.", text, re.M)}
        cited = {int(n) for p in (ROOT / "sao").rglob("*.py") for n in re.findall(rf"docs/{doc}\.md §(\d+)", p.read_text())}
        assert cited <= sections, (doc, cited - sections)

"""Comments, docs and errors cite files in the repository (docs/algorithm.md, docs/architecture.md),
never documents outside it; and the cited docs exist."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"sao-spec|design\.md|field-notes|style\.md|shared/docs|\bspec §")


def test_no_citation_of_documents_outside_the_repository():
    files = [p for d in ("sao", "tests", "benchmarks", "examples", "scripts", "docs") for p in (ROOT / d).rglob("*")
             if p.suffix in (".py", ".md", ".sh", ".yaml") and p.name != Path(__file__).name]
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in files + [ROOT / "README.md"]
           for i, line in enumerate(p.read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert not bad, bad


def test_cited_sections_exist():
    for doc in ("algorithm", "architecture"):
        text = (ROOT / "docs" / f"{doc}.md").read_text()
        sections = {int(n) for n in re.findall(r"^## (\d+)\.", text, re.M)}
        cited = {int(n) for p in (ROOT / "sao").rglob("*.py") for n in re.findall(rf"docs/{doc}\.md §(\d+)", p.read_text())}
        assert cited <= sections, (doc, cited - sections)

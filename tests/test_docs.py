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
    for doc in ("algorithm", "architecture", "ranks"):
        text = (ROOT / "docs" / f"{doc}.md").read_text()
        sections = {int(n) for n in re.findall(r"^## (\d+)\.", text, re.M)}
        cited = {int(n) for p in (ROOT / "sao").rglob("*.py") for n in re.findall(rf"docs/{doc}\.md §(\d+)", p.read_text())}
        assert cited <= sections, (doc, cited - sections)


def test_settings_the_docs_name_exist():
    """Every setting a doc names (`runtime.max_lag`, `model.lora.r`, ...) is a field of sao.config.Config;
    keys under a dict-valued setting (env.options.*) are the environment's own."""
    from pydantic import BaseModel

    from sao.config import Config

    sections = "|".join(sorted(Config.model_fields))
    setting = re.compile(rf"(?<![\w./-])({sections})\.([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)(?![\w*(-]|\.\w)")
    not_settings = {"env.step"}  # an environment's method, named in a timing table

    def exists(section: str, rest: str) -> bool:
        model = Config.model_fields[section].annotation
        for part in rest.split("."):
            if not (isinstance(model, type) and issubclass(model, BaseModel)):
                return True
            if part not in model.model_fields:
                return False
            model = model.model_fields[part].annotation
        return True

    named = [(doc, i, s, r) for doc in DOCS for i, line in enumerate((ROOT / doc).read_text().splitlines(), 1)
             for s, r in setting.findall(line) if not r.endswith(("py", "md", "json", "yaml")) or "." in r]
    assert len(named) > 100  # the docs name many settings: the pattern finds them
    bad = [f"{doc}:{i}: {s}.{r}" for doc, i, s, r in named if f"{s}.{r}" not in not_settings and not exists(s, r)]
    assert not bad, bad


def test_the_package_map_names_every_file_and_the_real_import_boundaries():
    """docs/architecture.md §2/§4: every module of every package is in the map, and the table's
    "must not import" column is what tests/test_import_boundaries.py enforces."""
    from test_import_boundaries import FORBIDDEN

    text = (ROOT / "docs" / "architecture.md").read_text()
    unmapped = [str(p.relative_to(ROOT)) for p in (ROOT / "sao").rglob("*.py")
                if p.name != "__init__.py" and not re.search(rf"(?<!\w){re.escape(p.name)}\b", text)]
    assert not unmapped, unmapped
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `sao/(\w+)/?(?:\.py)?`[^|]*\|[^|]*\| ([^|]*) \|$", text, re.M)}
    for owner, bad_prefixes in FORBIDDEN.items():
        name = owner.split(".")[1]
        if bad_prefixes == ["sao."]:
            assert "anything" in rows[name], owner
            continue
        listed = set(re.findall(r"\b(\w+)\b", rows[name].split("(")[0]))
        assert listed == {p.split(".")[1] for p in bad_prefixes}, (owner, listed)

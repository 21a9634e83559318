"""docs/architecture.md §2: who may import whom. Checked on the source, so a lazy import counts too."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "sao"
FORBIDDEN = {
    "sao.types": ["sao."],
    "sao.config": ["sao.runtime", "sao.engine", "sao.rollout", "sao.trainer", "sao.models", "sao.envs", "sao.algo"],
    "sao.algo": ["sao.models", "sao.engine", "sao.runtime", "sao.rollout", "sao.trainer", "sao.envs", "sao.config"],
    "sao.models": ["sao.runtime", "sao.engine", "sao.rollout", "sao.trainer", "sao.envs"],
    "sao.engine": ["sao.trainer", "sao.runtime", "sao.rollout", "sao.envs"],
    "sao.envs": ["sao.engine", "sao.trainer", "sao.runtime", "sao.rollout"],
    "sao.rollout": ["sao.trainer", "sao.runtime"],
    "sao.trainer": ["sao.rollout", "sao.engine", "sao.runtime", "sao.envs"],
    "sao.sandbox": ["sao."],  # and stdlib only: test_the_sandbox_imports_only_the_standard_library
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


FILES = sorted(ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_respects_its_boundaries(path):
    name = _module_name(path)
    for owner, bad_prefixes in FORBIDDEN.items():
        if name != owner and not name.startswith(owner + "."):
            continue
        for imported in _imports(path):
            if imported == owner or imported.startswith(owner + "."):
                continue  # inside its own package
            assert not any(imported == b.rstrip(".") or imported.startswith(b) for b in bad_prefixes), \
                f"{name} imports {imported}"


def test_the_sandbox_imports_only_the_standard_library():
    """docs/architecture.md §2: sao/sandbox is stdlib only (it runs where the trainer's packages may not exist)."""
    import sys

    files = sorted((ROOT / "sandbox").glob("*.py"))
    assert files
    for path in files:
        outside = {i for i in _imports(path) if i.split(".")[0] not in sys.stdlib_module_names
                   and i != "sao.sandbox" and not i.startswith("sao.sandbox.")}
        assert not outside, f"{path.name} imports {sorted(outside)}"


def test_boundary_checker_sees_violations(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("from sao.runtime.train import train\nimport sao.engine\n")
    assert {"sao.runtime.train", "sao.engine"} <= _imports(bad)

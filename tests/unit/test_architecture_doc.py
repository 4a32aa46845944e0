"""docs/architecture.md names every module of the package, so the map never falls behind the code."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rlink_ucx"


def test_every_module_and_package_is_named_in_the_architecture_doc():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.name == "__init__.py":
            name = f"{rel.parent.as_posix()}/" if rel.parent != Path(".") else "__init__.py"
        else:
            name = rel.as_posix()
        if f"`{name}`" not in doc and f"`rlink_ucx/{name}`" not in doc:
            missing.append(name)
    assert not missing, f"docs/architecture.md does not name: {missing}"

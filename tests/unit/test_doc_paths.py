"""Every repository path the docs name exists: README.md, SECURITY.md, docs/**/*.md, and the
package's docstrings and comments. The rules are the architecture check's (a relative link; a
path under one of the repository's or the package's folders ending in a file type), kept here
so the test needs nothing beside the clone."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rlink_ucx"

# A markdown link's target, without its #anchor.
LINKED = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# A path in prose: a top folder of the repository (or of the package, read from rlink_ucx/),
# then anything up to a file type. Not preceded by a path character, so the tail of a longer
# path or a URL is not read as a path of its own.
NAMED = re.compile(
    r"(?<![\w/.-])((?:rlink_ucx|docs|bench|tests|examples|ci|docker|store|session|transport|weights|wire|observe"
    r"|doctor|demo)/[\w/.-]*\w\.(?:py|md|sh|ya?ml|toml|png|txt))\b"
)


def _exists(target: str, base: Path) -> bool:
    return any((where / target).exists() for where in (ROOT, PACKAGE, base))


def missing_in_markdown(path: Path, text: str) -> Iterator[str]:
    """What ``text`` (a markdown file at ``path``) links to or names that does not exist."""
    for i, line in enumerate(text.splitlines(), 1):
        for target in LINKED.findall(line):
            if re.match(r"[a-z]+:", target) or target.startswith("/"):
                continue  # a URL, a mailto:, an absolute path on the reader's machine
            if not _exists(target, path.parent):
                yield f"{path.relative_to(ROOT)}:{i} links to {target}"
        for target in NAMED.findall(line):
            if "*" not in target and not _exists(target, path.parent):
                yield f"{path.relative_to(ROOT)}:{i} names {target}"


def _prose(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment and docstring of a module."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                first = node.body[0].lineno
                for offset, line in enumerate(doc.splitlines()):
                    yield first + offset, line


def missing_in_module(path: Path, source: str) -> Iterator[str]:
    """What the comments and docstrings of ``source`` (the module at ``path``) name that does not exist."""
    for line_no, text in _prose(source):
        for target in NAMED.findall(text):
            if "*" not in target and not _exists(target, path.parent):
                yield f"{path.relative_to(ROOT)}:{line_no} names {target}"


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "SECURITY.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_the_documents_name_only_paths_that_exist() -> None:
    missing = [m for p in markdown_files() for m in missing_in_markdown(p, p.read_text(encoding="utf-8"))]
    assert missing == []


def test_the_package_docstrings_and_comments_name_only_paths_that_exist() -> None:
    missing = [m for p in sorted(PACKAGE.rglob("*.py")) for m in missing_in_module(p, p.read_text(encoding="utf-8"))]
    assert missing == []


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("the ring (`store/ring.py`)", []),
        ("the ring (`store/no_such_ring.py`)", ["docs/weights.md:1 names store/no_such_ring.py"]),
        ("see [the tuning](ucx-tuning.md)", ["docs/weights.md:1 links to ucx-tuning.md"]),
        ("see [transports](transports.md#ucx) and [home](https://example.org/a/b.md)", []),
        ("in docs/no-such-doc.md", ["docs/weights.md:1 names docs/no-such-doc.md"]),
        ("a glob: tests/unit/test_*.py", []),
    ],
)
def test_a_bogus_path_in_a_document_is_found(text: str, found: list[str]) -> None:
    assert list(missing_in_markdown(ROOT / "docs" / "weights.md", text)) == found


def test_a_bogus_path_in_a_comment_or_docstring_is_found() -> None:
    source = '"""Reads `store/ring.py`."""\n\n\ndef f():\n    """Then store/gone.py."""\n    return 1  # see docs/gone.md\n'
    found = sorted(missing_in_module(PACKAGE / "store" / "x.py", source))
    assert found == ["rlink_ucx/store/x.py:5 names store/gone.py", "rlink_ucx/store/x.py:6 names docs/gone.md"]

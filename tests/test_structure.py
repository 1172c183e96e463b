"""The package keeps the shape CONTRIBUTING.md describes: limits a reader can rely on.

Read from the sources (no import): no file in ``liger_losses/`` over 600 lines, no function over 120 lines, no
module importing another module's ``_private`` name (a helper two modules share is public within the package),
and no comment or docstring citing a work session instead of a result file. Exact checks, no tolerance.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "liger_losses"
SOURCES = sorted(PACKAGE.rglob("*.py"))
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 120


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", SOURCES, ids=_rel)
def test_file_and_function_sizes(path):
    text = path.read_text()
    assert text.count("\n") <= MAX_FILE_LINES, f"{_rel(path)}: {text.count(chr(10))} lines"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            assert length <= MAX_FUNCTION_LINES, f"{_rel(path)}:{node.lineno} {node.name}: {length} lines"


def private_imports(text: str) -> list[tuple[int, list[str]]]:
    """``(line, names)`` of each ``from <liger_losses module> import _private`` in ``text``."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.ImportFrom) or node.module == "__future__":
            continue
        ours = node.level > 0 or (node.module or "").startswith("liger_losses")
        private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
        if ours and private:
            found.append((node.lineno, private))
    return found


SESSION = re.compile(r"\bsession ?\d+\b", re.IGNORECASE)


@pytest.mark.parametrize("path", SOURCES, ids=_rel)
def test_no_private_names_imported_from_other_modules(path):
    assert private_imports(path.read_text()) == [], _rel(path)


def test_no_session_references():
    for path in [*SOURCES, *sorted((ROOT / "tests").rglob("*.py"))]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not SESSION.search(line), f"{_rel(path)}:{number}: {line.strip()}"


def test_the_checks_catch_violations():
    """The checks are not vacuous: each flags a violating snippet and passes a clean one."""
    assert private_imports("from .engine import _scaled_grads\n") == [(1, ["_scaled_grads"])]
    assert private_imports("from liger_losses.chunked.tokens import _x, y\n") == [(1, ["_x"])]
    assert private_imports("from torch import _C\nfrom .tokens import scan_labels\n") == []
    assert SESSION.search("measured in Sess" + "ion 8") and not SESSION.search("sessions of training")

"""The import structure of the kernel and patching layers (DESIGN.md, "imports only go downward"):
no import cycle among the modules of ``liger_losses/kernels`` and ``liger_losses/patching``
(function-level imports included, where a cycle would hide), and ``kernels/`` imports nothing of
``liger_losses`` above it. Read from the source (AST), so nothing is imported; exact.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "liger_losses"
PACKAGES = ("liger_losses", "liger_losses.kernels", "liger_losses.patching")


def _modules():
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = p
    return mods


def _imports(name, path, mods):
    """The liger_losses modules ``name`` imports anywhere in its source."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        found |= {c for c in candidates if c in mods and c != name}
    return found


def test_no_import_cycle_in_kernels_and_patching():
    mods = _modules()
    graph = {m: _imports(m, p, mods) - set(PACKAGES) for m, p in mods.items()}
    layer = [m for m in mods if m.startswith(("liger_losses.kernels.", "liger_losses.patching."))]

    def reaches(start, goal):
        stack, seen = list(graph[start]), set()
        while stack:
            n = stack.pop()
            if n == goal:
                return True
            if n not in seen:
                seen.add(n)
                stack.extend(graph.get(n, ()))
        return False

    assert [m for m in layer if reaches(m, m)] == []


def test_kernels_import_nothing_above_them():
    mods = _modules()
    for m, p in mods.items():
        if m.startswith("liger_losses.kernels"):
            above = {i for i in _imports(m, p, mods) if not i.startswith("liger_losses.kernels")}
            assert not above, f"{m} imports {sorted(above)}"

"""The package's imports only go down: leaf (core) < rooms < entry points, with no cycle anywhere.

Function-level imports count too: a lazy import upwards is still a cycle, only a hidden one.
"""

from __future__ import annotations

import ast
import subprocess
import sys

from mlproject.core.constants import PROJECT_ROOT

PACKAGE = PROJECT_ROOT / "src" / "mlproject"
# Lowest first; a module may import its own room and the rooms before it. Modules directly in the package
# (train, eval, export, preflight, cli, build, ...) are the top.
ROOMS = ["core", "utils", "loggers", "checkpoint", "distributed", "training", "data", "models", "callbacks", "cluster"]
TOP = len(ROOMS)


def module_name(path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Every module of the package -> the package modules it imports, wherever in the file."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
        # `from mlproject.x import y` names a module (mlproject.x.y) or a name in mlproject.x
        graph[name] = {m for m in found if m in modules and m != name and m != "mlproject"}
    return graph


def layer(module: str) -> int:
    parts = module.split(".")
    return ROOMS.index(parts[1]) if len(parts) >= 2 and parts[1] in ROOMS else TOP


def test_imports_only_go_down():
    upward = [f"{a} imports {b}" for a, targets in imports().items() for b in sorted(targets) if layer(b) > layer(a)]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    graph, state, cycles = imports(), {}, []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)


def test_leaf_imports_no_torch():
    """The leaf is what every config-only tool (preflight's first checks, plan) loads: it stays light."""
    leaf = [m for m in imports() if layer(m) == 0]
    code = f"import sys; import {', '.join(leaf)}; print(sorted({{'torch', 'lightning'}} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

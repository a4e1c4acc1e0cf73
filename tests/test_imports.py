"""kda_cute's import graph has no circle: no module imports (at its top or inside a function) a
module that imports it back, directly or through others."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "kda_cute"


def _modules() -> dict[str, Path]:
    mods = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(PKG.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def _imports(name: str, path: Path, mods) -> set[str]:
    """The kda_cute modules `name` imports, a package's names resolved to its submodules."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in mods}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target not in mods:
                continue
            subs = {f"{target}.{a.name}" for a in node.names} & mods.keys()
            # `from pkg import submodule` imports the submodule; any other name, the package
            found |= subs if len(subs) == len(node.names) else subs | {target}
    found.discard(name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, state, stack = [], {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == "open":
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n)
    return cycles


def test_graph_reader_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_kda_cute_imports_no_module_that_imports_it_back():
    mods = _modules()
    graph = {n: _imports(n, p, mods) for n, p in mods.items()}
    assert graph["kda_cute.api"], "the reader found no imports: it is broken"
    assert "kda_cute.checks" in graph["kda_cute.api"]
    assert _cycles(graph) == []

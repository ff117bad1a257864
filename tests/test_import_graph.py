"""The package's module graph has no cycle, counting imports inside functions too (a lazy
import hides a cycle from the interpreter, not from a reader)."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "megalite")


def module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def modules() -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                out[module_name(path)] = path
    return out


def imports_of(name: str, path: str, known: set[str]) -> set[str]:
    """Modules of the package that `name` imports, resolved to the most specific module."""
    is_package = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from pkg import mod` names a module; `from mod import func` names the module
            targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n):
        state[n] = 1
        path.append(n)
        for m in sorted(g[n]):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state:
                cycle = visit(m)
                if cycle:
                    return cycle
        path.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state:
            cycle = visit(n)
            if cycle:
                return cycle
    return None


def test_no_import_cycle():
    g = graph()
    assert len(g) > 30 and "megalite.training" in g
    cycle = find_cycle(g)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("edges,expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": set(), "c": {"b"}}, None),
])
def test_cycle_finder_finds_cycles(edges, expected):
    assert find_cycle(edges) == expected


def test_lazy_imports_are_edges():
    g = graph()
    # checkpoints read the layer arithmetic from the rank grid, never from the loop
    assert "megalite.parallel_state" in g["megalite.checkpoint.offline"]
    assert not any("megalite.training" in g[m] for m in g if m.startswith("megalite.checkpoint"))
    # a function-level import counts (validation probes the attention kernel lazily)
    assert "megalite.model.attention" in g["megalite.arguments.model"]

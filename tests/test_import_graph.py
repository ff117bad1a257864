"""The package's module graph has no cycle and runs one way, down the floors of FLOORS, counting
imports inside functions too (a lazy import hides a cycle from the interpreter, not from a reader)."""
import ast
import os
import subprocess
import sys

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


# The house's floors, lowest first (docs/architecture.md draws them): a unit imports only units on
# floors below its own, never one beside it. A unit is a top-level module or package of megalite/,
# and inside checkpoint/ each child: the formats' families, and the modules that open any format
# (files, load, offline), which stand above the families. A package that gains a face (an
# __init__.py importing its modules) must keep to this too: importing any of its modules runs the
# face, so an upward import would run a whole family before the one importing it has finished.
FLOORS = [
    ["megalite", "checkpoint", "rendezvous", "recompute", "num_microbatches_calculator"],  # import nothing
    ["errors"],
    ["config", "comm"],
    ["fp8"],  # FP8 casts and scales (torchao): read by tensor_parallel's and model's FP8 linears
    ["parallel_state", "runtime", "tensor_parallel", "context_parallel", "pipeline_parallel"],
    ["model", "data"],
    ["distributed", "optimizer"],
    ["checkpoint.paths"],  # names on disk, torch-free
    ["checkpoint.native"],  # megalite's own format, and the one reader of saved pieces
    ["checkpoint.hf"],
    ["checkpoint.megatron"],  # reads through native's pieces; streams to hf
    ["checkpoint.files"],  # the up-front checks of any format (torch-free until a format needs it)
    ["checkpoint.load"],  # opens any format
    ["checkpoint.offline", "checkpoint.upcycling", "checkpoint.non_persistent"],
    ["planning", "arguments", "generation"],
    ["initialize", "launch"],
    ["dry_run", "train_report"],
    ["training"],
    ["inprocess"],  # in-process restart: pretrain in a loop, and its launcher
]


def unit(module: str) -> str:
    """The floor-plan unit of a module: `megalite.model.gpt` -> "model", `megalite.checkpoint.hf.moe`
    -> "checkpoint.hf", `megalite.checkpoint.load` -> "checkpoint.load"."""
    parts = module.split(".")[1:]
    if not parts:
        return "megalite"
    return "checkpoint." + parts[1] if parts[0] == "checkpoint" and len(parts) > 1 else parts[0]


def upward_imports(g: dict[str, set[str]], floors: list[list[str]]) -> list[str]:
    """Each import from a unit to one on its own floor or above, as "a -> b (floor i -> floor j)"."""
    floor = {u: i for i, units in enumerate(floors) for u in units}
    return [f"{a} -> {b} (floor {floor[unit(a)]} -> floor {floor[unit(b)]})"
            for a in sorted(g) for b in sorted(g[a])
            if unit(a) != unit(b) and floor[unit(b)] >= floor[unit(a)]]


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


def test_every_unit_stands_on_one_floor():
    placed = [u for units in FLOORS for u in units]
    assert len(placed) == len(set(placed)), "a unit on two floors"
    units = {unit(m) for m in graph()}
    assert units - set(placed) == set(), "add the new unit to FLOORS (and to docs/architecture.md's floors)"
    assert set(placed) - units == set(), "FLOORS names a unit that is gone"


def test_imports_run_down_the_floors():
    up = upward_imports(graph(), FLOORS)
    assert not up, "imports from a floor to one above it (or beside it):\n" + "\n".join(up)


def test_floor_check_finds_upward_and_sideways_imports():
    floors = [["comm"], ["model", "data"], ["training"]]
    g = {"megalite.comm": {"megalite.model.gpt"}, "megalite.model.gpt": {"megalite.data.batch", "megalite.comm"},
         "megalite.data.batch": set(), "megalite.training": {"megalite.model.gpt"}}
    assert upward_imports(g, floors) == ["megalite.comm -> megalite.model.gpt (floor 0 -> floor 1)",
                                         "megalite.model.gpt -> megalite.data.batch (floor 1 -> floor 1)"]


def test_argument_layer_imports_no_torch():
    """Flags are parsed and checked (--load's files included) before torch is imported: the
    argument layer reaches only checkpoint/'s torch-free modules (paths, files, the upcycling plan)."""
    code = ("import sys, megalite.arguments, megalite.checkpoint.files, megalite.checkpoint.upcycling.plan; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('megalite.checkpoint.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(sorted(["megalite.checkpoint.files", "megalite.checkpoint.paths",
                                      "megalite.checkpoint.upcycling", "megalite.checkpoint.upcycling.plan"]))

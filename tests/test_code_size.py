"""Small modules, one concept each: no module of megalite/ over 500 lines, no function over 80
(the parser generator and the checks included). A module that outgrows this splits by concern."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 80


def sizes(path: str):
    src = open(path).read()
    yield None, len(src.splitlines())
    for node in ast.walk(ast.parse(src, path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.end_lineno - node.lineno + 1


def oversized(root: str) -> list[str]:
    out = []
    for dirpath, _, files in os.walk(root):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT)
                for name, n in sizes(path):
                    limit = MAX_MODULE_LINES if name is None else MAX_FUNCTION_LINES
                    if n > limit:
                        out.append(f"{rel}{'' if name is None else ':' + name}: {n} lines (at most {limit})")
    return out


def test_modules_and_functions_stay_small():
    assert not oversized(os.path.join(ROOT, "megalite")), oversized(os.path.join(ROOT, "megalite"))


def test_the_size_check_can_fail(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    (tmp_path / "big.py").write_text("def f():\n" + body + "\n")
    assert oversized(str(tmp_path)) == [f"{os.path.relpath(tmp_path / 'big.py', ROOT)}:f: 82 lines (at most 80)"]

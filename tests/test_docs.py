"""The documentation cannot drift from the code: README.md stays a short front page that links
every docs/ page, every relative link resolves, every `megalite/...` path the docs name exists,
and docs/architecture.md's code map lists exactly the modules of megalite/.

The code map is the table rows of docs/architecture.md whose first cell is a module path in
backticks, e.g. "| `megalite/checkpoint/native/index.py` | the global index ... |". After adding,
splitting, renaming or removing a module, add, split, rename or remove its row."""
import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
ARCHITECTURE = os.path.join(DOCS, "architecture.md")
README_LIMIT = 12 * 1024

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")          # [text](target)
MAP_ROW = re.compile(r"^\|\s*`(megalite/[^`]+\.py)`\s*\|", re.M)
PACKAGE_PATH = re.compile(r"(?<![\w/.-])(megalite/[\w/]*\w(?:\.py)?/?)")


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def doc_pages() -> list[str]:
    return sorted(os.path.join(DOCS, f) for f in os.listdir(DOCS) if f.endswith(".md"))


def rel(path: str) -> str:
    return os.path.relpath(path, ROOT).replace(os.sep, "/")


def strip_code_blocks(text: str) -> str:
    """Fenced code blocks hold commands and output, not links."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def relative_links(path: str) -> list[str]:
    return [t for t in LINK.findall(strip_code_blocks(read(path)))
            if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def is_trivial_init(path: str) -> bool:
    """An __init__.py with nothing but (at most) a docstring: no row needed in the map."""
    if os.path.basename(path) != "__init__.py":
        return False
    body = ast.parse(read(path), path).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return not body


def package_modules() -> tuple[set[str], set[str]]:
    """(modules the map must list, modules it may list): every .py file under megalite/, the
    first set without the __init__.py files that hold only a docstring."""
    required, allowed = set(), set()
    for dirpath, dirnames, files in os.walk(os.path.join(ROOT, "megalite")):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                allowed.add(rel(path))
                if not is_trivial_init(path):
                    required.add(rel(path))
    return required, allowed


def test_readme_is_short():
    size = os.path.getsize(README)
    assert size <= README_LIMIT, (
        f"README.md is {size} bytes, over {README_LIMIT}: move the detail into a docs/ page and link it")


def test_readme_starts_with_the_two_commands():
    text = read(README)
    first_block = text.split("```", 2)[1]
    assert "make demo" in first_block and "make test" in first_block, \
        "README.md must start with the `make demo` / `make test` block"


def test_readme_links_every_docs_page():
    linked = {os.path.normpath(os.path.join(ROOT, t.split("#")[0])) for t in relative_links(README)}
    unlinked = [rel(p) for p in doc_pages() if os.path.normpath(p) not in linked]
    assert not unlinked, f"README.md does not link these docs pages (add them to its feature list): {unlinked}"


def test_relative_links_resolve():
    broken = []
    for page in [README] + doc_pages():
        for target in relative_links(page):
            path = target.split("#")[0]
            if path and not os.path.exists(os.path.join(os.path.dirname(page), path)):
                broken.append(f"{rel(page)}: ({target})")
    assert not broken, "links to files that do not exist:\n  " + "\n  ".join(broken)


def test_package_paths_named_in_docs_exist():
    """A module renamed or split leaves no stale `megalite/...` path in README.md or docs/."""
    stale = []
    for page in [README] + doc_pages():
        for path in sorted(set(PACKAGE_PATH.findall(read(page)))):
            if not os.path.exists(os.path.join(ROOT, path)):
                stale.append(f"{rel(page)}: {path}")
    assert not stale, "paths under megalite/ that do not exist (renamed or split?):\n  " + "\n  ".join(stale)


def test_architecture_code_map_lists_every_module():
    listed = MAP_ROW.findall(read(ARCHITECTURE))
    required, allowed = package_modules()
    duplicated = sorted({m for m in listed if listed.count(m) > 1})
    missing = sorted(required - set(listed))
    extra = sorted(set(listed) - allowed)
    problems = []
    if missing:
        problems.append("modules missing from docs/architecture.md's code map (add a row "
                        "'| `PATH` | what it holds |' to its package's table):\n  " + "\n  ".join(missing))
    if extra:
        problems.append("docs/architecture.md's code map lists modules that do not exist "
                        "(remove or rename the row):\n  " + "\n  ".join(extra))
    if duplicated:
        problems.append("docs/architecture.md's code map lists these more than once:\n  " + "\n  ".join(duplicated))
    assert not problems, "\n".join(problems)


def test_code_map_rows_say_something():
    rows = re.findall(r"^\|\s*`(megalite/[^`]+\.py)`\s*\|([^|\n]*)\|", read(ARCHITECTURE), re.M)
    empty = [m for m, what in rows if not what.strip()]
    assert not empty, f"code map rows with no description: {empty}"

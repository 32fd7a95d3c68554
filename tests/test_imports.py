"""The package's modules import each other without a circle, counting imports inside functions.

Why: a circle, even one hidden in a function-level import, means two modules each need the
other, so one of them lives on the wrong floor (docs/architecture.md); Python would also run one
of them half-initialised the day the import moves to the top. Imports under ``if TYPE_CHECKING:``
count too: a type hint that points back up is the same dependency, only deferred (type against a
protocol of the lower floor instead, as ``metrics.guard.Watched`` does).
"""

from __future__ import annotations

import ast
from pathlib import Path

import spotguard

ROOT = Path(spotguard.__file__).parent


def module_names() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports anywhere in its code (a package's own name for its ``__init__``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    # Importing pkg.sub runs pkg/__init__.py first: an edge to every package on the way, except the
    # importer's own packages (they are initialising already when it runs).
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    for m in list(found):
        parts = m.split(".")
        found.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p not in own)
    return {m for m in found if m in modules and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (module -> modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def package_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_the_checker_sees_function_level_and_relative_imports(tmp_path):
    (tmp_path / "sub").mkdir()
    modules = {
        "pkg": tmp_path / "__init__.py",
        "pkg.a": tmp_path / "a.py",
        "pkg.b": tmp_path / "b.py",
        "pkg.sub": tmp_path / "sub" / "__init__.py",
        "pkg.sub.c": tmp_path / "sub" / "c.py",
    }
    modules["pkg"].write_text("")
    modules["pkg.a"].write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import b\n")
    modules["pkg.b"].write_text("def f():\n    from . import a\n    from .a import x\n    import pkg.sub.c\n")
    modules["pkg.sub"].write_text("from .c import y\n")
    modules["pkg.sub.c"].write_text("from .. import a\n")
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    # pkg.b runs pkg/sub/__init__.py on its way to pkg.sub.c.
    assert graph == {
        "pkg": set(),
        "pkg.a": {"pkg.b"},  # a type hint's import counts
        "pkg.b": {"pkg.a", "pkg.sub", "pkg.sub.c"},
        "pkg.sub": {"pkg.sub.c"},
        "pkg.sub.c": {"pkg.a"},
    }
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]


def test_the_package_has_no_import_circle():
    graph = package_graph()
    assert len(graph) > 50 and "spotguard.checkpoint.folders.layout" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_integrations_import_nothing_of_the_guard_but_guard():
    """What the integrations share with the Guard lives in ``spotguard.coordination``: an integration
    that reaches into ``spotguard.guard.<module>`` depends on the Guard's internals, the floor beside it."""
    graph = package_graph()
    allowed = {"spotguard.guard"}  # the public ``Guard`` (ray.py, lazily)
    reached = {
        (name, dep)
        for name, deps in graph.items()
        if name.startswith("spotguard.integrations")
        for dep in deps
        if (dep == "spotguard.guard" or dep.startswith("spotguard.guard.")) and dep not in allowed
    }
    assert not reached, "integrations import guard internals: " + ", ".join(f"{a} -> {b}" for a, b in sorted(reached))


def test_coordination_imports_neither_the_guard_nor_the_integrations():
    graph = package_graph()
    up = {
        (name, dep)
        for name, deps in graph.items()
        if name.startswith("spotguard.coordination")
        for dep in deps
        if dep.split(".")[:2] in (["spotguard", "guard"], ["spotguard", "integrations"])
    }
    assert not up, "coordination imports a floor above it: " + ", ".join(f"{a} -> {b}" for a, b in sorted(up))


# -- the drawing of docs/architecture.md ------------------------------------------------------------
DOC = ROOT.parent / "docs" / "architecture.md"
BEGIN, END = (
    "<!-- floors: made by tests/test_imports.py (floors_drawing); edit the code, not this -->",
    "<!-- /floors -->",
)


def floor_graph() -> dict[str, set[str]]:
    """The package's top-level parts (``guard``, ``checkpoint``, ``watcher`` ...) and the parts each imports."""
    floors: dict[str, set[str]] = {}
    for name, deps in package_graph().items():
        own = name.split(".")[1] if "." in name else "__init__"
        floors.setdefault(own, set()).update(d.split(".")[1] if "." in d else "__init__" for d in deps)
    return {f: deps - {f} for f, deps in floors.items()}


def floors_drawing(graph: dict[str, set[str]]) -> str:
    """Each part on the floor above everything it imports (floor 0 imports no other part), with its arrows."""
    level: dict[str, int] = {}

    def floor(node: str) -> int:
        if node not in level:
            level[node] = 1 + max((floor(d) for d in graph[node]), default=-1)
        return level[node]

    lines = []
    for n in sorted(graph, key=lambda f: (-floor(f), f)):
        shown = "spotguard (__init__: the public face)" if n == "__init__" else n
        arrows = " ".join(sorted(graph[n]))
        lines.append(f"{floor(n):>2}  {shown:<38} -> {arrows}" if arrows else f"{floor(n):>2}  {shown}")
    return "\n".join(["```", *lines, "```"])


def test_the_package_parts_form_floors_with_no_circle_as_the_drawing_shows():
    graph = floor_graph()
    assert {"guard", "checkpoint", "storage", "coordination", "integrations", "ops"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "parts import each other in a circle: " + " -> ".join(cycle or [])
    text = DOC.read_text()
    assert BEGIN in text and END in text, f"docs/architecture.md lost its {BEGIN} ... {END} block"
    drawn = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    expected = floors_drawing(graph)
    assert drawn == expected, (
        "docs/architecture.md's floors are out of date; put this between its markers:\n" + expected
    )


def test_the_drawing_puts_each_part_above_what_it_imports():
    drawing = floors_drawing({"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": set()})
    rows = [line.split() for line in drawing.splitlines()[1:-1]]
    assert rows == [["2", "a", "->", "b", "c"], ["1", "b", "->", "c"], ["0", "c"], ["0", "d"]]

"""Imports run downward only: no cycle among the project's modules (imports inside functions
count as much as those at the top), and the runtime package never imports the training one.

The graph is read from the source (ast), nothing is imported: an edge A -> B for every
`import B`, `from B import name` and `from . import B` in A, relative or absolute, at any
depth of A's code. `from P import name` where P is a package and `name` not a submodule
is an edge to P's `__init__`; the packages an import passes through are not edges (every
submodule would otherwise import its package's `__init__`).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("mtp_jax", "mtp_train", "pallas_kernels")
RUNTIME, TRAINING = "mtp_jax", "mtp_train"


def find_modules(root: Path, packages=PACKAGES) -> dict:
    """{dotted name: path} of every module of `packages` under `root`, subpackages included."""
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _project_module(name: str, modules: dict):
    """The longest leading part of dotted `name` that is a project module, or None."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def imports_of(name: str, path: Path, modules: dict) -> list:
    """[(imported project module, line)] of every import statement anywhere in the module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module
            # `from base import x`: the submodule base.x where there is one, else base
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            mod = _project_module(target, modules)
            if mod is not None and mod != name:
                out.append((mod, node.lineno))
    return out


def import_graph(root: Path = ROOT, packages=PACKAGES) -> dict:
    """{module: {imported module: first line that imports it}}."""
    modules = find_modules(root, packages)
    graph = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for target, line in imports_of(name, path, modules):
            edges.setdefault(target, line)
    return graph


def find_cycles(graph: dict) -> list:
    """One cycle [a, b, ..., a] per strongly connected component of two or more modules."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v):  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in components:  # a shortest way round from the component's first module
        start = min(comp)
        paths, frontier, cycle = {start: [start]}, [start], None
        while cycle is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w == start and cycle is None:
                        cycle = paths[v] + [start]
                    elif w in comp and w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
            frontier = nxt
        cycles.append(cycle)
    return sorted(cycles)


def describe(cycle: list, graph: dict) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + \
        f" -> {cycle[-1]}"


def test_no_import_cycle():
    graph = import_graph()
    assert {"mtp_jax.model", "pallas_kernels.common"} <= set(graph)  # the walk found them
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (each module imports the next, at the line given):\n" + \
        "\n".join(describe(c, graph) for c in cycles)


def test_runtime_does_not_import_training():
    graph = import_graph()
    bad = [f"{a} (line {line}) imports {b}" for a, edges in sorted(graph.items())
           if a.split(".")[0] == RUNTIME for b, line in sorted(edges.items())
           if b.split(".")[0] == TRAINING]
    assert not bad, "\n".join(bad)


def test_finds_cycles_hidden_in_functions(tmp_path):
    """The walk sees every import form, at module level and inside functions."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "def helper():\n    pass\n",
        "a.py": "from . import b\n",
        "b.py": "def f():\n    from .sub.c import g\n    return g\n",
        "sub/__init__.py": "",
        "sub/c.py": "import pkg.d\n",
        "d.py": "class K:\n    def m(self):\n        from . import a\n",
        "e.py": "from pkg import helper\nfrom pkg.sub import c\nimport os\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.e"] == {"pkg": 1, "pkg.sub.c": 2}
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.d", "pkg.a"]]
    assert describe(find_cycles(graph)[0], graph).startswith("pkg.a (line 1) -> pkg.b (line 2)")

"""The package's shape, checked from its source: imports only point down the floors and never form a cycle, no class
grows past 20 methods, and no function outside ``kernels/`` takes more than 10 parameters.

Floors, lowest first (a module may import its own floor and those below it)::

    kv < kernels < model < engine < server, bench < commands < cli (and the top-level package)

Imports inside functions count too: a lazy import still ties the two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "hybridkv"
FLOORS = {"kv": 0, "kernels": 1, "model": 2, "engine": 3, "server": 4, "bench": 4, "commands": 5}
TOP_FLOOR = 6  # hybridkv/__init__.py, cli.py
MAX_METHODS = 20
MAX_PARAMS = 10


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _imported(name: str, node: ast.AST) -> list[str]:
    """The package modules an import statement of module ``name`` names (``from a import b`` may name a.b)."""
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            is_package = MODULES[name].name == "__init__.py"
            base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        targets = [module] + [f"{module}.{a.name}" for a in node.names]
    else:
        return []
    return [t for t in targets if t in MODULES and t != name]


def _edges() -> dict[str, set[str]]:
    return {name: {t for node in ast.walk(tree) for t in _imported(name, node)} for name, tree in TREES.items()}


def _floor(module: str) -> int:
    parts = module.split(".")
    return FLOORS.get(parts[1], TOP_FLOOR) if len(parts) > 1 else TOP_FLOOR


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_imports_never_point_up_a_floor():
    up = sorted(f"{a} -> {b}" for a, targets in _edges().items() for b in targets if _floor(b) > _floor(a))
    assert up == []


def test_no_import_cycles():
    assert _cycles(_edges()) == []


def test_cycle_finder_finds_a_planted_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_class_over_twenty_methods():
    crowded = []
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                n = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                if n > MAX_METHODS:
                    crowded.append(f"{name}.{node.name}: {n} methods")
    assert crowded == []


def _num_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
    first = (a.posonlyargs + a.args)[:1]
    return n - 1 if first and first[0].arg in ("self", "cls") else n


@pytest.mark.parametrize("package", sorted(set(FLOORS) - {"kernels"}))
def test_no_function_over_ten_parameters(package):
    long = []
    for name, tree in TREES.items():
        if name.split(".")[1:2] != [package]:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _num_params(node) > MAX_PARAMS:
                long.append(f"{name}.{node.name}: {_num_params(node)} parameters")
    assert long == []


def test_the_readme_layout_names_every_module():
    """README.md's "Layout of the code" lists every module of the package by its file name."""
    readme = (ROOT.parent / "README.md").read_text()
    layout = readme[readme.index("## Layout of the code"):]
    missing = sorted(str(p.relative_to(ROOT.parent)) for p in ROOT.rglob("*.py")
                     if p.name != "__init__.py" and p.name not in layout)
    assert missing == []

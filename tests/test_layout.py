"""The floor plan as a checked property (docs/contributing/layout.md): an AST walk over dantinox/, imports inside
functions included, so a circle cannot hide behind a function-level import.

Packages sit in layers; an import may point to its own package or to a lower layer, never up. Importing
``dantinox.a.b`` also runs ``dantinox/a/__init__.py`` (the face), so that counts as an edge too.
"""

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "dantinox"

# Highest first: a package imports only packages of a lower number (or its own).
LAYERS = {
    "cli": 11,
    "plan": 10,
    "serving": 9,
    "quality": 8, "budget": 8, "checkpoints": 8,
    "generation": 7, "train": 7,
    "runs": 6,
    "model": 5,
    "kv": 4,
    "quant": 3, "parallel": 3,
    "programs": 2,
    "config": 1, "xla": 1, "_version": 1, "_launch": 1,
}
ROOT_FILES = ["__init__.py", "_launch.py", "_version.py", "config.py", "xla.py"]
INFERENCE = ("generation", "serving", "plan", "quality", "checkpoints", "runs", "model", "kv", "quant",
             "parallel", "budget")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _imported(module: str, tree: ast.Module) -> set[str]:
    """dantinox modules ``module`` imports anywhere in its file (package faces on the way included)."""
    is_package = MODULES[module].name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in MODULES else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    edges = set()
    for target in found:
        if target not in MODULES or target == module:
            continue
        edges.add(target)
        parts = target.split(".")
        for i in range(2, len(parts)):
            face = ".".join(parts[:i])
            if face in MODULES and not (module + ".").startswith(face + "."):
                edges.add(face)
    return edges


GRAPH = {name: _imported(name, tree) for name, tree in TREES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_imports_point_down_the_layers():
    upward = []
    for module, targets in GRAPH.items():
        own = _package(module)
        if own is None:
            continue
        for target in targets:
            other = _package(target)
            if other is None or other == own:
                continue
            assert own in LAYERS and other in LAYERS, f"{own} or {other} has no layer in LAYERS"
            if LAYERS[other] >= LAYERS[own]:
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_every_package_has_a_layer():
    assert {_package(m) for m in MODULES if _package(m)} - {"bundled"} <= set(LAYERS)


def test_argparse_and_printing_only_in_cli():
    offenders = []
    for module, tree in TREES.items():
        if module.startswith("dantinox.cli"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names):
                offenders.append(f"{module}: import argparse")
            elif isinstance(node, ast.ImportFrom) and node.module == "argparse":
                offenders.append(f"{module}: from argparse")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                offenders.append(f"{module}:{node.lineno}: print()")
    assert offenders == []


@pytest.mark.parametrize("package", INFERENCE)
def test_inference_does_not_import_train(package):
    bad = [f"{m} -> {t}" for m, targets in GRAPH.items() if _package(m) == package
           for t in targets if _package(t) == "train"]
    assert bad == []


def test_root_holds_only():
    assert sorted(p.name for p in PKG.glob("*.py")) == ROOT_FILES


def test_faces_only_reexport():
    """A package's __init__.py holds its docstring, imports and __all__: no code of its own (cli/ has
    ``__main__.py`` for ``python -m dantinox.cli``)."""
    for module, tree in TREES.items():
        if MODULES[module].name != "__init__.py" or module == "dantinox":
            continue
        for node in tree.body:
            is_doc = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            is_all = isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]
            assert is_doc or is_all or isinstance(node, (ast.Import, ast.ImportFrom)), \
                f"{module}:{node.lineno} is code in a face"

"""Layers point one way (shared/DESIGN.md): data/models -> parallel -> train -> bench/serve/report -> cli, with
no import cycle, not even through a function-level import, and no private name imported across modules.
Read from the source with `ast`, so an import counts wherever it is written (module level, in a function,
under TYPE_CHECKING)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A module may import from its own layer and the layers below; the rest of the package (errors, config,
# fileio, lifecycle) is layer 0.
LAYERS = {"data": 1, "models": 1, "testing": 1, "parallel": 2, "train": 3, "inference": 3, "bench": 4, "serve": 4,
          "report": 4, "cli": 5, "__main__": 6}


def find_modules(src: Path, package: str) -> dict[str, Path]:
    """{dotted module name: file} of `package` under `src` (a package by its own name, not `.__init__`)."""
    modules = {}
    for file in sorted((src / package).rglob("*.py")):
        name = ".".join(file.relative_to(src).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = file
    return modules


def imports_of(name: str, file: Path, modules: dict[str, Path]) -> list[tuple[str, int, str | None]]:
    """(imported module of `modules`, line, name taken from it or None) for every import in `file`.
    `from a import b` where a.b is a module imports a.b; relative imports are resolved against `name`."""
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"), str(file))):
        if isinstance(node, ast.Import):
            targets = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            targets = [(f"{base}.{a.name}", None) if f"{base}.{a.name}" in modules else (base, a.name)
                       for a in node.names]
        else:
            continue
        for target, taken in targets:
            while target and target not in modules:  # `import a.b.c` of a non-module c: the module a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                found.append((target, node.lineno, taken))
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def graph(src: Path, package: str) -> tuple[dict[str, Path], dict[tuple[str, str], tuple[Path, int]]]:
    """The modules and {(importer, imported): (file, first line)}."""
    modules = find_modules(src, package)
    where: dict[tuple[str, str], tuple[Path, int]] = {}
    for name, file in modules.items():
        for target, line, _ in imports_of(name, file, modules):
            where.setdefault((name, target), (file, line))
    return modules, where


def describe(where: dict[tuple[str, str], tuple[Path, int]], importer: str, imported: str) -> str:
    file, line = where[(importer, imported)]
    return f"{importer} -> {imported} ({file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}:{line})"


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.get(parts[1], 0) if len(parts) > 1 else 0


def test_the_checker_follows_relative_function_level_and_submodule_imports(tmp_path):
    """A cycle closed only by a relative import of a submodule inside a function is still a cycle."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from pkg.b import thing\n")
    (pkg / "b.py").write_text("def thing():\n    from .sub import a\n")
    (pkg / "c.py").write_text("import pkg.b\n")
    modules, where = graph(tmp_path, "pkg")
    edges = {m: {t for (s, t) in where if s == m} for m in modules}
    assert edges["pkg.b"] == {"pkg.sub.a"} and edges["pkg.c"] == {"pkg.b"}
    assert cycles(edges) == [["pkg.b", "pkg.sub.a"]]


def test_no_import_cycle_in_t5forge():
    modules, where = graph(ROOT / "src", "t5forge")
    edges = {m: {t for (s, t) in where if s == m} for m in modules}
    found = cycles(edges)
    report = [" <-> ".join(c) + ":\n    " + "\n    ".join(describe(where, s, t) for s in c for t in sorted(edges[s])
                                                          if t in c) for c in found]
    assert not found, "import cycles (remove one import of each):\n" + "\n".join(report)


def test_imports_point_down_the_layers():
    modules, where = graph(ROOT / "src", "t5forge")
    upward = [describe(where, s, t) for (s, t) in sorted(where) if layer(t) > layer(s)]
    assert not upward, "imports from a higher layer (move the code down, or pass it in):\n" + "\n".join(upward)


def test_no_private_name_imported_from_another_module():
    """`from t5forge.x import _name` anywhere (package, tests, scripts): a name used elsewhere is public."""
    modules = find_modules(ROOT / "src", "t5forge")
    files = [(name, file) for name, file in modules.items()]
    files += [(".".join(f.relative_to(ROOT).with_suffix("").parts), f)
              for folder in ("tests", "scripts") for f in sorted((ROOT / folder).rglob("*.py"))]
    private = [f"{file.relative_to(ROOT)}:{line}: from {target} import {taken}"
               for name, file in files for target, line, taken in imports_of(name, file, modules)
               if taken and taken.startswith("_") and not taken.startswith("__")]
    assert not private, "private names imported across modules (make them public):\n" + "\n".join(private)

"""The packages' one direction of dependencies, read from the source (every import statement,
at module level or inside a function):

    graph      <- imports no other package of dsv41
    schedules  <- graph
    runtime    <- graph (a deployment runs an artifact with TVM's runtime alone: no compiler)
    compiler   <- graph, schedules, runtime (the compiler proper, and on top of it the tools:
                  compiler.tools, the CLI and the benchmarks)

and inside the packages, between their rooms (subpackages):

    compiler (proper)   imports nothing of compiler.tools
    runtime.tiers       imports no runtime.engine, runtime.serving or runtime.backends
    runtime.serving     imports no backend internals (runtime.backends: only the public
                        faces named in SERVING_MAY_USE)
    runtime.backends    imports no runtime.engine or runtime.serving

and no module imports a private name (`_x`) of another module, and the module import graph has
no cycle (function-level imports included: they hide cycles, they do not remove them).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {
    "graph": frozenset(),
    "schedules": frozenset({"graph"}),
    "runtime": frozenset({"graph"}),
    "compiler": frozenset({"graph", "schedules", "runtime"}),
}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. runtime.compiled
    target: str  # the imported module, e.g. graph.phases
    names: tuple[str, ...]  # names taken from it (from-imports)
    line: int


def modules() -> dict[str, Path]:
    out = {}
    for pkg in ALLOWED:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            out[".".join(path.relative_to(ROOT).with_suffix("").parts)] = path
    return out


def imports(module: str, path: Path) -> Iterator[Import]:
    is_pkg = path.name == "__init__.py"
    parts = module.split(".")
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level + (1 if is_pkg else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("dsv41."):
                target = node.module.removeprefix("dsv41.")
            else:
                continue
            yield Import(module, target, tuple(a.name for a in node.names), node.lineno)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("dsv41."):
                    yield Import(module, a.name.removeprefix("dsv41."), (), node.lineno)


def all_imports() -> list[Import]:
    return [i for m, p in modules().items() for i in imports(m, p)]


def test_the_scan_sees_every_package_and_both_kinds_of_import():
    """A guard for the checks below: the scan finds the modules and resolves relative,
    absolute and function-level imports (runtime.backends.compiled imports
    graph.phases at top level, compiler.tools.assets imports compiler.build inside a function)."""
    found = {(i.module, i.target) for i in all_imports()}
    assert {p.split(".")[0] for p in modules()} == set(ALLOWED)
    assert ("runtime.backends.compiled", "graph.phases") in found
    assert ("runtime.backends.compiled", "runtime.backends.artifact") in found
    assert ("compiler.tools.assets", "compiler.build") in found  # inside a function


def test_imports_follow_the_package_order():
    bad = [f"{i.module}:{i.line} imports {i.target}" for i in all_imports()
           if (pkg := i.target.split(".")[0]) in ALLOWED and pkg != i.module.split(".")[0]
           and pkg not in ALLOWED[i.module.split(".")[0]]]
    assert not bad, "imports against graph <- schedules <- compiler, graph <- runtime:\n" + \
        "\n".join(bad)


def test_no_private_name_is_imported_from_another_module():
    bad = [f"{i.module}:{i.line} imports {n} from {i.target}" for i in all_imports()
           if i.target != i.module for n in i.names
           if n.startswith("_") and not n.startswith("__")]
    assert not bad, "\n".join(bad)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def module_graph() -> dict[str, set[str]]:
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for i in all_imports():
        # `from pkg import mod` names a module too
        for t in (i.target, *(f"{i.target}.{n}" for n in i.names)):
            if t in mods and t != i.module:
                edges[i.module].add(t)
    return edges


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_module_import_graph_has_no_cycle():
    assert cycles(module_graph()) == []


# room -> the rooms (module prefixes) of its own package it must not import
ROOM_RULES = {
    "compiler": ("compiler.tools",),  # the compiler proper (compiler.tools is exempt below)
    "runtime.tiers": ("runtime.engine", "runtime.serving", "runtime.backends"),
    "runtime.backends": ("runtime.engine", "runtime.serving"),
    "runtime.serving": ("runtime.backends",),
}
# what serving may take from the backends: nothing (the engine room builds an engine; the entry
# sets the serving assembly asks for are graph.entries' contract)
SERVING_MAY_USE = frozenset()


def room_of(module: str) -> str | None:
    if module.startswith("compiler.tools"):
        return None  # the tools may import anything below them
    return max((r for r in ROOM_RULES if module == r or module.startswith(r + ".")),
               key=len, default=None)


def test_the_rooms_import_only_what_their_rules_allow():
    bad = []
    for i in all_imports():
        room = room_of(i.module)
        if room is None:
            continue
        for t in (i.target, *(f"{i.target}.{n}" for n in i.names)):
            if t in SERVING_MAY_USE:
                continue
            if any(t == f or t.startswith(f + ".") for f in ROOM_RULES[room]):
                bad.append(f"{i.module}:{i.line} ({room}) imports {t}")
                break
    assert not bad, "imports across the rooms against their rules:\n" + "\n".join(bad)


def test_the_room_rules_catch_an_import_against_them():
    assert room_of("compiler.build") == "compiler"
    assert room_of("compiler.tools.cli.main") is None
    assert room_of("runtime.tiers.ssd_store") == "runtime.tiers"
    assert room_of("runtime.serving.app") == "runtime.serving"


def test_every_package_folder_is_installed():
    """pyproject.toml lists every folder with an __init__.py (setuptools installs only those)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {"dsv41." + ".".join(p.parent.relative_to(ROOT).parts)
             for pkg in ALLOWED for p in (ROOT / pkg).rglob("__init__.py")}
    assert found == listed, (sorted(found - listed), sorted(listed - found))

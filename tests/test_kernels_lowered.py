"""Every kernel factory in `schedules/` is reachable from the compile pipeline.

A kernel factory is a top-level function of a `schedules/` module named `make_*`, `build_*` or
`schedule_*`. The roots are the names `compiler/kernels.py` (the kernel registry: the dsv41
ops' converters), `compiler/lower.py` (the aten overrides) and `compiler/build.py` (the default
schedules, the CUDA build) reference in a `schedules/` module; from them the scan follows,
through the source, every name a reachable function references: a top-level name of its own
module, `module.name` of an imported `schedules/` module, or a name from-imported from one.
A factory no root reaches is code no
compiled entry runs: wire it into the lowering or delete it (a kernel only a test needs lives in
that test).

Static on purpose: a lowering that picks its builder through `getattr(module, f"build_{op}")`
is invisible here, so the registry names its builders explicitly (one table per op family).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROOTS = ("compiler/lower.py", "compiler/kernels.py", "compiler/build.py")
FACTORY_PREFIXES = ("make_", "build_", "schedule_")


@dataclass(frozen=True)
class Source:
    """One module's top-level functions, classes and assigned names (name -> node) and how it
    names `schedules/` modules:
    `aliases` (local name -> schedules module) and `imported` (local name -> (module, name))."""

    module: str
    functions: dict[str, ast.AST]
    aliases: dict[str, str]
    imported: dict[str, tuple[str, str]]


def _schedules_module(node: ast.ImportFrom, module: str) -> str | None:
    """The schedules module a from-import reads (`from .gemm import x`, `from dsv41.schedules
    import gemm` -> None: that form imports modules, see `_read`); a module of a family package
    is named by its dotted path below schedules (`indexer.sweep`)."""
    if node.level:
        return node.module if module.startswith("schedules.") and node.module else None
    name = node.module or ""
    return name.removeprefix("dsv41.schedules.") if name.startswith("dsv41.schedules.") else None


def _read(rel: str) -> Source:
    path = ROOT / rel
    parts = Path(rel).with_suffix("").parts
    module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    tree = ast.parse(path.read_text(), str(path))
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
    for n in tree.body:  # module-level tables (`_MAKERS = {...}`) are followed like functions
        if isinstance(n, ast.Assign | ast.AnnAssign):
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                if isinstance(t, ast.Name):
                    functions[t.id] = n
    aliases, imported = {}, {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        from_pkg = (node.level == 1 and node.module is None and module.startswith("schedules."))\
            or node.module == "dsv41.schedules"
        if from_pkg:
            for a in node.names:
                aliases[a.asname or a.name] = a.name
            continue
        target = _schedules_module(node, module)
        if target:
            for a in node.names:
                imported[a.asname or a.name] = (target, a.name)
    return Source(module, functions, aliases, imported)


def _references(src: Source, node: ast.AST) -> set[tuple[str, str]]:
    """(schedules module, name) pairs a function body (or a whole root module) refers to."""
    own = src.module.removeprefix("schedules.") if src.module.startswith("schedules.") else None
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) \
                and n.value.id in src.aliases:
            out.add((src.aliases[n.value.id], n.attr))
        elif isinstance(n, ast.Name):
            if n.id in src.imported:
                out.add(src.imported[n.id])
            elif own and n.id in src.functions:
                out.add((own, n.id))
    return out


def schedules_sources() -> dict[str, Source]:
    """Every module below schedules/ by its dotted name there (`gemm`, `indexer.sweep`): a
    family package's `__init__` is the package's own name."""
    out = {}
    for p in sorted((ROOT / "schedules").rglob("*.py")):
        rel = p.relative_to(ROOT / "schedules").with_suffix("").parts
        if rel == ("__init__",):
            continue
        name = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
        out[name] = _read(str(p.relative_to(ROOT)))
    return out


def reachable() -> set[tuple[str, str]]:
    sources = schedules_sources()
    todo = set()
    for rel in ROOTS:
        src = _read(rel)
        todo |= _references(src, ast.parse((ROOT / rel).read_text()))
    seen = set()
    while todo:
        mod, name = todo.pop()
        if (mod, name) in seen or mod not in sources:
            continue
        seen.add((mod, name))
        node = sources[mod].functions.get(name)
        if node is not None:
            todo |= _references(sources[mod], node) - seen
        elif name in sources[mod].imported:  # a package's re-export: follow it to its module
            todo.add(sources[mod].imported[name])
    return seen


def factories() -> set[tuple[str, str]]:
    return {(mod, name) for mod, src in schedules_sources().items() for name in src.functions
            if name.startswith(FACTORY_PREFIXES)}


def test_the_scan_follows_calls_across_modules():
    """A guard for the check below: kernels.py names gemm.build_fp8_linear, a re-export of
    gemm.linear's, which calls make_fp8_linear (same module); moe's chain reaches gemm's
    helpers through `gemm.x`; build.py reaches cpu_rules through a function-level from-import."""
    seen = reachable()
    assert ("gemm", "build_fp8_linear") in seen
    assert ("gemm.linear", "make_fp8_linear") in seen
    assert ("indexer.x86_sweep", "make_index_scores_avx512") in seen  # via indexer.build
    assert ("moe", "emit_moe_experts") in seen
    assert ("gemm", "pow2_scale_byte") in seen  # moe.make_moe_qdq -> gemm.pow2_scale_byte
    assert ("cpu_rules", "schedule_prim_func") in seen  # build.py -> apply_cpu_schedules -> ...
    assert len(factories()) > 20


def test_every_kernel_factory_is_reachable_from_the_lowering():
    unreached = sorted(f"schedules/{m.replace('.', '/')}.py: {n}"
                       for m, n in factories() - reachable())
    assert not unreached, ("kernel factories no compiled entry reaches (wire them into "
                           "compiler/kernels.py or delete them):\n  " + "\n  ".join(unreached))

"""The tree in numbers (what the structural step's closing note reports): lines per package and
subpackage, the largest modules, and the imports inside functions (with the reason comment each
one carries, if any).

    python scripts/tree_stats.py [--root DIR] [--largest 10] [--imports]
"""

from __future__ import annotations

import argparse
import ast
from collections import Counter
from pathlib import Path

PACKAGES = ("graph", "schedules", "runtime", "compiler")


def modules(root: Path) -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")
                  if "__pycache__" not in p.parts)


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def reason_above(text: list[str], line: int) -> str:
    """The comment above an import (`# why`), over the imports of its group; '' if none."""
    i = line - 2
    while i >= 0 and text[i].strip().startswith(("import ", "from ")):
        i -= 1
    above = text[i].strip() if i >= 0 else ""
    return above if above.startswith("#") else ""


def function_imports(path: Path) -> list[tuple[int, str]]:
    """(line, source) of every import statement inside a function body; the source with its
    reason when the comment is on the line above (or above its group of imports)."""
    src = path.read_text()
    text = src.splitlines()
    out = []
    for fn in ast.walk(ast.parse(src)):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    line = text[node.lineno - 1].strip()
                    if why := reason_above(text, node.lineno):
                        line = f"{line}  {why}"
                    out.append((node.lineno, line))
    return sorted(set(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--largest", type=int, default=10)
    ap.add_argument("--imports", action="store_true", help="list every function-level import")
    a = ap.parse_args()
    mods = modules(a.root)
    per = Counter()
    for m in mods:
        rel = m.relative_to(a.root)
        per[rel.parts[0]] += lines(m)  # the package, subpackages included
        for depth in range(2, len(rel.parts)):  # each subpackage, its own subpackages included
            per["/".join(rel.parts[:depth])] += lines(m)
        if len(rel.parts) == 2:
            per[f"{rel.parts[0]}/*.py"] += lines(m)  # the package's own modules
    print("lines per package and subpackage:")
    for k in sorted(per):
        print(f"  {k if k.endswith('.py') else k + '/':32s} {per[k]:6d}")
    print(f"  {'total':32s} {sum(per[p] for p in PACKAGES):6d}  ({len(mods)} modules)")
    print(f"the {a.largest} largest modules:")
    for m in sorted(mods, key=lines, reverse=True)[: a.largest]:
        print(f"  {str(m.relative_to(a.root)):44s} {lines(m):5d}")
    fi = {m: function_imports(m) for m in mods}
    total = sum(len(v) for v in fi.values())
    by_pkg = Counter()
    for m, v in fi.items():
        by_pkg["/".join(m.relative_to(a.root).parts[:-1])] += len(v)
    print(f"function-level imports: {total}")
    for k, n in sorted(by_pkg.items(), key=lambda kv: -kv[1]):
        if n:
            print(f"  {k + '/':32s} {n:4d}")
    if a.imports:
        for m, v in fi.items():
            for line, text in v:
                print(f"  {m.relative_to(a.root)}:{line}: {text}")


if __name__ == "__main__":
    main()

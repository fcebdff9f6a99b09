#!/usr/bin/env python3
"""Check that kvcache_ggml/ has no import circles.

Every ``import``/``from ... import`` statement of every module counts, wherever it stands: at the top, under
``if TYPE_CHECKING:``, inside a function.  Relative imports are resolved.  An import counts as an edge to the module
it names: ``from P.m import x`` and ``import P.m`` to ``P.m``; ``from P import x`` to the submodule ``P.x`` when there
is one, else to ``P`` (a package is its ``__init__``).  The packages above a named module, which Python runs first,
are not counted (or every package ``__init__`` that re-exports would circle with each of its submodules).  So a
package's ``__init__`` that re-exports from its submodules is fine, but a submodule that imports a name from its own
package (``from . import name``, ``from ..cache import KVCache`` inside ``cache/``) makes a circle: it imports the
defining submodule directly instead.  Imports of modules outside the package are ignored.

    python3 scripts/check_imports.py [PACKAGE_DIR]    # default: kvcache_ggml/ next to this script's folder

Prints one line per circle (a strongly connected component of more than one module, its modules sorted) and
exits 1 if there is any, 0 otherwise.  ``--edges`` prints the whole graph instead.  Standard library only.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the package folder `root` (a package is its
    ``__init__``)."""
    root = root.resolve()
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of ``from <level dots><name>`` written in `module`."""
    if level == 0:
        return name or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules that `module` (at `path`) imports, anywhere in its source."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node.level, node.module)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:
                    out.add(sub)
                elif target in modules:
                    out.add(target)
    out.discard(module)
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the package modules it imports, for the package folder `root`."""
    modules = module_names(root)
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def _strong_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of `graph` (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    out.append(sorted(comp))
    return out


def circles(root: Path) -> list[list[str]]:
    """The import circles of the package folder `root`: each strongly connected component of more than one module,
    sorted, the components in order of their first module."""
    return sorted(c for c in _strong_components(import_graph(root)) if len(c) > 1)


def main(argv: list[str]) -> int:
    args = [a for a in argv[1:] if a != "--edges"]
    root = Path(args[0]) if args else Path(__file__).resolve().parent.parent / "kvcache_ggml"
    if not root.is_dir():
        print(f"check_imports: {root} is not a folder", file=sys.stderr)
        return 2
    if "--edges" in argv:
        for m, deps in sorted(import_graph(root).items()):
            print(f"{m}: {' '.join(sorted(deps))}")
        return 0
    found = circles(root)
    for comp in found:
        print("circle: " + " <-> ".join(comp))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

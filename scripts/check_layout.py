#!/usr/bin/env python3
"""Check the size limits of kvcache_ggml/: no file over 600 lines, no function or method over 80 lines.

A function's length runs from its ``def`` line to the last line of its body (decorators excluded, its docstring
and comments inside it included).  Nested functions are checked on their own and also count toward their parent.

    python3 scripts/check_layout.py [PACKAGE_DIR]     # default: kvcache_ggml/ next to this script's folder

Prints one line per breach (``path: N lines (limit 600)`` or ``path:LINE qualname: N lines (limit 80)``) and exits 1
if there is any, 0 otherwise.  Standard library only.
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


@dataclass(frozen=True, slots=True)
class Breach:
    path: Path  # the offending file
    line: int  # 0 for a whole file, else the def line of the function
    name: str  # "" for a whole file, else the function's qualified name (Class.method, outer.inner)
    lines: int  # its length in lines
    limit: int  # the limit it exceeds

    def __str__(self) -> str:
        if not self.name:
            return f"{self.path}: {self.lines} lines (limit {self.limit})"
        return f"{self.path}:{self.line} {self.name}: {self.lines} lines (limit {self.limit})"


def _functions(tree: ast.AST):
    """Yield (qualname, node) for every function and method in `tree`, nested ones included."""
    stack = [("", tree)]
    while stack:
        prefix, node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    yield name, child
                stack.append((name + ".", child))
            else:
                stack.append((prefix, child))


def check_file(path: Path) -> list[Breach]:
    """The breaches in one Python source file."""
    source = path.read_text(encoding="utf-8")
    out = []
    n_lines = len(source.splitlines())
    if n_lines > MAX_FILE_LINES:
        out.append(Breach(path, 0, "", n_lines, MAX_FILE_LINES))
    for name, fn in _functions(ast.parse(source, filename=str(path))):
        length = fn.end_lineno - fn.lineno + 1
        if length > MAX_FUNCTION_LINES:
            out.append(Breach(path, fn.lineno, name, length, MAX_FUNCTION_LINES))
    return sorted(out, key=lambda b: b.line)


def check_tree(root: Path) -> list[Breach]:
    """The breaches in every .py file under `root`, in path order (paths relative to root's parent)."""
    base = root.resolve().parent
    out = []
    for path in sorted(root.resolve().rglob("*.py")):
        out += [Breach(b.path.relative_to(base), b.line, b.name, b.lines, b.limit) for b in check_file(path)]
    return out


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent / "kvcache_ggml"
    if not root.is_dir():
        print(f"check_layout: {root} is not a folder", file=sys.stderr)
        return 2
    breaches = check_tree(root)
    for b in breaches:
        print(b)
    return 1 if breaches else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

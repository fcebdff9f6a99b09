#!/usr/bin/env python3
"""Check the shape of kvcache_ggml/: size limits, and no object reaching into another's private names.

Size limits: no file over 600 lines (except the files of ``FILE_LINE_CAPS``, each with its own cap and reason), no
function or method over 80 lines.  A function's length runs from its ``def`` line to the last line of its body
(decorators excluded, its docstring and comments inside it included).  Nested functions are checked on their own and
also count toward their parent.

Private reaches: an attribute access ``x._name`` where ``x`` is not ``self``/``cls`` (nor ``super()``) and
``_name`` is neither a dunder nor a sunder (``_type_``: ctypes' and enum's protocol) -- one object reading or
writing another's private state -- and, in a class, a read of ``self._name``/``cls._name`` that the class does not
define: not assigned as ``self._name = ...`` in it, not a method or class attribute of it or of its bases within
the package (a mixin reading its host's private names; a ``__slots__`` entry alone does not define a name).
Module-level private names imported from sibling modules (``from ._x import _f``) are not reaches.
At most 10 reaches may be allowed (``ALLOWED_REACHES``), each with its reason.

    python3 scripts/check_layout.py [PACKAGE_DIR]     # default: kvcache_ggml/ next to this script's folder

Prints one line per breach (``path: N lines (limit 600)`` or ``path:LINE qualname: N lines (limit 80)``), then one
per private reach that is not allowed (``path:LINE: expr``), a count per file on stderr, and exits 1 if there is
any, 0 otherwise.  Standard library only.
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80

# files allowed over MAX_FILE_LINES: path (from the package's parent folder) -> (their own cap, why)
FILE_LINE_CAPS: dict[str, tuple[int, str]] = {
    "kvcache_ggml/batch/_allocator.py": (1100, "BatchAllocator is one class, as llama_batch_allocr: init's sections, "
                                               "its decode fast path and the splits share the one committed batch"),
    "kvcache_ggml/cache/cells/kvcells.py": (800, "KVCells is one class, as llama_kv_cells: the parallel arrays "
                                                 "and their derived indices, kept in sync by its private helpers"),
}

# private reaches allowed: (path from the package's parent folder, the expression as printed) -> why
ALLOWED_REACHES: dict[tuple[str, str], str] = {
    ("kvcache_ggml/ggml/_lib.py", "ctypes._SimpleCData"): "ctypes' base of the scalar types: no public name for it",
    ("kvcache_ggml/ggml/_lib.py", "ctypes._Pointer"): "ctypes' base of the pointer types: no public name for it",
    ("kvcache_ggml/ggml/_lib.py", "ctypes._CFuncPtr"): "ctypes' base of the C function types: no public name for it",
    ("kvcache_ggml/ggml/_fastcalls.py", "ctypes._SimpleCData"): "ctypes' base of the scalar types: no public name",
}
MAX_ALLOWED_REACHES = 10


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


def check_file(path: Path, max_lines: int = MAX_FILE_LINES) -> list[Breach]:
    """The breaches in one Python source file (``max_lines``: its line cap)."""
    source = path.read_text(encoding="utf-8")
    out = []
    n_lines = len(source.splitlines())
    if n_lines > max_lines:
        out.append(Breach(path, 0, "", n_lines, max_lines))
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
        rel = path.relative_to(base)
        cap = FILE_LINE_CAPS.get(rel.as_posix(), (MAX_FILE_LINES, ""))[0]
        out += [Breach(rel, b.line, b.name, b.lines, b.limit) for b in check_file(path, cap)]
    return out


@dataclass(frozen=True, slots=True)
class Reach:
    path: Path  # the file, relative to the package's parent folder
    line: int  # the line of the access
    expr: str  # the access as written (``other._pos``, ``self._used`` in a class that does not define ``_used``)

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.expr}"


_SELF = ("self", "cls")


def _is_private(name: str) -> bool:
    """``_name`` or ``__name``; not a dunder (``__len__``) nor a sunder (``_type_``, ``_fields_``: the names that
    ctypes and enum reserve for their protocol, public by design)."""
    if not name.startswith("_") or (name.startswith("__") and name.endswith("__")):
        return False
    return not (name.endswith("_") and len(name) > 2 and name[1] != "_")


def _own_nodes(cls: ast.ClassDef):
    """Every node inside ``cls``, its methods' bodies included, but not the insides of nested classes (whose
    ``self`` is another object)."""
    stack = list(cls.body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, ast.ClassDef):
            stack.extend(ast.iter_child_nodes(node))


def _class_defines(cls: ast.ClassDef) -> set[str]:
    """The names ``cls`` itself defines: methods, class attributes, ``self.x = ...`` (a ``__slots__`` entry only
    declares room for a name: whoever assigns it defines it)."""
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    names.add(n.id)
    for node in _own_nodes(cls):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
                and node.value.id in _SELF):
            names.add(node.attr)
    return names


def _base_names(cls: ast.ClassDef) -> list[str]:
    """The names of ``cls``'s bases (``a.B`` -> ``B``), matched against the package's classes by name."""
    return [b.id if isinstance(b, ast.Name) else b.attr for b in cls.bases
            if isinstance(b, (ast.Name, ast.Attribute))]


def private_reaches(root: Path) -> list[Reach]:
    """Every private reach in the .py files under ``root``, in path and line order (paths relative to root's
    parent)."""
    base = root.resolve().parent
    trees = {path.relative_to(base): ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
             for path in sorted(root.resolve().rglob("*.py"))}
    classes: dict[str, list[ast.ClassDef]] = {}  # class name -> its definitions in the package (names may repeat)
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(node)
    own = {id(c): _class_defines(c) for defs in classes.values() for c in defs}

    def defined(cls: ast.ClassDef, seen: set[int]) -> set[str]:
        names = set(own[id(cls)])
        for b in _base_names(cls):
            for bc in classes.get(b, []):
                if id(bc) not in seen:
                    seen.add(id(bc))
                    names |= defined(bc, seen)
        return names

    out = []
    for rel, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                v = node.value
                is_self = isinstance(v, ast.Name) and v.id in _SELF
                is_super = isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super"
                if not (is_self or is_super):
                    out.append(Reach(rel, node.lineno, ast.unparse(node)))
            elif isinstance(node, ast.ClassDef):
                names = defined(node, {id(node)})
                out += [Reach(rel, n.lineno, ast.unparse(n)) for n in _own_nodes(node)
                        if isinstance(n, ast.Attribute) and not isinstance(n.ctx, ast.Store)
                        and isinstance(n.value, ast.Name) and n.value.id in _SELF
                        and _is_private(n.attr) and n.attr not in names]
    return sorted(set(out), key=lambda r: (str(r.path), r.line, r.expr))


def not_allowed(reaches: list[Reach], allowed: dict[tuple[str, str], str]) -> list[Reach]:
    """The reaches that ``allowed`` ((path, expr) -> reason) does not name."""
    return [r for r in reaches if (r.path.as_posix(), r.expr) not in allowed]


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent / "kvcache_ggml"
    if not root.is_dir():
        print(f"check_layout: {root} is not a folder", file=sys.stderr)
        return 2
    if len(ALLOWED_REACHES) > MAX_ALLOWED_REACHES:
        print(f"check_layout: {len(ALLOWED_REACHES)} allowed reaches, at most {MAX_ALLOWED_REACHES}", file=sys.stderr)
        return 2
    breaches = check_tree(root)
    for b in breaches:
        print(b)
    reaches = not_allowed(private_reaches(root), ALLOWED_REACHES)
    for r in reaches:
        print(r)
    if reaches:
        per_file: dict[str, int] = {}
        for r in reaches:
            per_file[str(r.path)] = per_file.get(str(r.path), 0) + 1
        print(f"check_layout: {len(reaches)} private reaches not allowed: "
              + ", ".join(f"{p} {n}" for p, n in per_file.items()), file=sys.stderr)
    return 1 if breaches or reaches else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

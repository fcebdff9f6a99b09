"""The package's shape: size limits and private reaches (scripts/check_layout.py), no import circles
(scripts/check_imports.py) and the layers that must load no ggml."""
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKER = ROOT / "scripts" / "check_layout.py"
IMPORTS_CHECKER = ROOT / "scripts" / "check_imports.py"


def load_checker(path=CHECKER):
    name = path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[name]
    return mod


def test_no_file_over_its_cap_and_no_function_over_80():
    """Files over 600 lines only where FILE_LINE_CAPS allows it (each with its reason), under their own cap."""
    mod = load_checker()
    assert mod.check_tree(ROOT / "kvcache_ggml") == []
    assert all(reason and 600 < cap for cap, reason in mod.FILE_LINE_CAPS.values())
    assert all((ROOT / path).is_file() for path in mod.FILE_LINE_CAPS), "a cap for a file that is gone"


def test_no_private_reach_in_the_package():
    mod = load_checker()
    assert len(mod.ALLOWED_REACHES) <= mod.MAX_ALLOWED_REACHES
    assert all(reason.strip() for reason in mod.ALLOWED_REACHES.values())
    reaches = mod.not_allowed(mod.private_reaches(ROOT / "kvcache_ggml"), mod.ALLOWED_REACHES)
    bad = [str(r) for r in reaches]
    assert bad == [], "private reaches:\n" + "\n".join(bad)


def test_reach_checker_counts_cross_object_and_mixin_reads_and_honours_the_allowlist(tmp_path, capsys):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "_helpers.py").write_text("_TABLE = {}\n\n\ndef _f():\n    return 1\n")
    (pkg / "a.py").write_text(textwrap.dedent('''\
        from ._helpers import _TABLE, _f                # module-level private names of a sibling: not reaches


        class Mixin:
            def helper(self):
                return self._data + self._own          # _data: the host's (a reach); _own: its own
                                                       # (assigned below)
            def set_own(self):
                self._own = _f()


        class Base:
            _limit = 3                                 # a class attribute: defined

            def _check(self):
                return self._limit


        class Host(Mixin, Base):
            __slots__ = ("_data", "_spare")            # a slot alone defines nothing

            def __init__(self, other):
                self._data = []
                super()._check()                       # super(): the same object
                self.__len__()                         # a dunder
                other._data.append(1)                  # another object's private state
                self._spare                            # declared in __slots__, assigned nowhere

            def peek(self, other):
                return other._data, _TABLE, other.__class__, other._type_   # one reach; a sunder is public
        '''))
    mod = load_checker()
    reaches = mod.private_reaches(pkg)
    assert [str(r) for r in reaches] == [
        "pkg/a.py:6: self._data",      # Mixin reads a name it does not define
        "pkg/a.py:26: other._data",
        "pkg/a.py:27: self._spare",
        "pkg/a.py:30: other._data",
    ]
    assert mod.main(["check_layout.py", str(pkg)]) == 1
    out = capsys.readouterr()
    assert out.out.splitlines() == [str(r) for r in reaches]
    assert "4 private reaches not allowed: pkg/a.py 4" in out.err
    # an allowlist entry names (path, expression) and covers each line where it is written
    mod.ALLOWED_REACHES = {("pkg/a.py", "other._data"): "why", ("pkg/a.py", "self._data"): "why",
                           ("pkg/a.py", "self._spare"): "why"}
    assert mod.main(["check_layout.py", str(pkg)]) == 0
    assert capsys.readouterr().out == ""
    mod.ALLOWED_REACHES = {("pkg/a.py", "other._data"): "why"}
    assert mod.main(["check_layout.py", str(pkg)]) == 1
    assert capsys.readouterr().out.splitlines() == ["pkg/a.py:6: self._data", "pkg/a.py:27: self._spare"]
    mod.ALLOWED_REACHES = {("pkg/a.py", f"x._{i}"): "why" for i in range(mod.MAX_ALLOWED_REACHES + 1)}
    assert mod.main(["check_layout.py", str(pkg)]) == 2  # more than 10 allowed: refused
    p = subprocess.run([sys.executable, str(CHECKER), str(pkg)], capture_output=True, text=True)
    assert p.returncode == 1 and p.stdout.splitlines() == [str(r) for r in reaches]


def test_checker_counts_from_def_to_body_end(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(78))  # def line + 78 + return = 80 lines: at the limit
    (pkg / "ok.py").write_text(f"@staticmethod\n@property\ndef at_limit():\n{body}\n    return 0\n")
    (pkg / "long.py").write_text(textwrap.dedent('''\
        class A:
            def method(self):
        ''') + "\n".join(f"        y{i} = {i}" for i in range(80)) + "\n" + "x = 1\n" * 600)
    breaches = load_checker().check_tree(pkg)
    assert [(str(b.path), b.line, b.name, b.lines, b.limit) for b in breaches] == [
        ("pkg/long.py", 0, "", 682, 600),            # class and def lines + 80 body lines + 600 lines
        ("pkg/long.py", 2, "A.method", 81, 80),      # def line + 80 body lines (ok.py's decorators do not count)
    ]
    p = subprocess.run([sys.executable, str(CHECKER), str(pkg)], capture_output=True, text=True)
    assert p.returncode == 1 and p.stdout.splitlines() == ["pkg/long.py: 682 lines (limit 600)",
                                                          "pkg/long.py:2 A.method: 81 lines (limit 80)"]


@pytest.mark.parametrize("module", ["kvcache_ggml.cache.cells", "kvcache_ggml.batch"])
def test_bookkeeping_layers_load_no_ggml(module):
    code = (f"import sys, {module}\n"
            "bad = sorted(m for m in sys.modules if m == 'ggml' or m.startswith(('ggml.', 'kvcache_ggml.ggml')))\n"
            "print(' '.join(bad))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "", f"importing {module} loaded {p.stdout.strip()}"


def test_no_import_circles_in_the_package():
    """Counting every import: under TYPE_CHECKING and inside functions too."""
    assert load_checker(IMPORTS_CHECKER).circles(ROOT / "kvcache_ggml") == []
    p = subprocess.run([sys.executable, str(IMPORTS_CHECKER), str(ROOT / "kvcache_ggml")], capture_output=True,
                       text=True)
    assert p.returncode == 0 and p.stdout == "", p.stdout + p.stderr


def test_import_checker_counts_every_kind_of_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .a import A\nfrom .sub import S\n",         # re-exports: fine
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\nA = 1\n",
        "b.py": "def f():\n    from . import a\n",                      # a <-> b, through TYPE_CHECKING and a def
        "c.py": "import pkg.d\n",
        "d.py": "from .sub.inner import x\n",
        "sub/__init__.py": "from .inner import S\n",
        "sub/inner.py": "from .. import c\nS = x = 1\n",               # c -> d -> sub.inner -> c
        "e.py": "import os\nfrom pkg import a\n",                       # outside imports ignored; no circle
        "f.py": "from . import g\n",
        "g.py": "from .sub import S\nfrom . import f as _\n",         # f <-> g; sub's __init__ is not in it
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    mod = load_checker(IMPORTS_CHECKER)
    assert mod.import_graph(pkg)["pkg.g"] == {"pkg.sub", "pkg.f"}
    assert mod.circles(pkg) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d", "pkg.sub.inner"], ["pkg.f", "pkg.g"]]
    (pkg / "sub" / "inner.py").write_text("from . import S\n")  # a submodule importing its own package's name
    assert ["pkg.sub", "pkg.sub.inner"] in mod.circles(pkg)
    p = subprocess.run([sys.executable, str(IMPORTS_CHECKER), str(pkg)], capture_output=True, text=True)
    assert p.returncode == 1 and "circle: pkg.a <-> pkg.b" in p.stdout.splitlines()

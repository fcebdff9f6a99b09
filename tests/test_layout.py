"""The package's shape: size limits (scripts/check_layout.py), no import circles (scripts/check_imports.py) and the
layers that must load no ggml."""
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


def test_no_file_over_600_lines_and_no_function_over_80():
    p = subprocess.run([sys.executable, str(CHECKER), str(ROOT / "kvcache_ggml")], capture_output=True, text=True)
    assert p.returncode == 0, "limits exceeded:\n" + p.stdout + p.stderr
    assert p.stdout == ""


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

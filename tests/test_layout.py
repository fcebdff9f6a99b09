"""The package's shape: size limits (scripts/check_layout.py) and the layers that must load no ggml."""
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKER = ROOT / "scripts" / "check_layout.py"


def load_checker():
    spec = importlib.util.spec_from_file_location("check_layout", CHECKER)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["check_layout"] = mod  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules["check_layout"]
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


@pytest.mark.parametrize("module", ["kvcache_ggml.cache.cells", "kvcache_ggml.cells", "kvcache_ggml.batch"])
def test_bookkeeping_layers_load_no_ggml(module):
    code = (f"import sys, {module}\n"
            "bad = sorted(m for m in sys.modules if m == 'ggml' or m.startswith(('ggml.', 'kvcache_ggml._ggml')))\n"
            "print(' '.join(bad))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "", f"importing {module} loaded {p.stdout.strip()}"

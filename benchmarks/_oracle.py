"""Run timing code on llama.cpp's own cache (../shared/oracle) in its interpreter, side by side with ours.

``oracle_timings(script)`` runs ``script`` under the oracle's Python with ``kvoracle`` importable and returns what
it printed as JSON, or None when the oracle is not built.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ORACLE_DIR = Path(os.environ.get("ORACLE_DIR", "/tmp/kvoracle"))
ORACLE_SRC = Path(os.environ.get("KVORACLE_SRC", Path(__file__).resolve().parents[2] / "shared" / "oracle"))
ORACLE_PY = ORACLE_DIR / "venv" / "bin" / "python"


def oracle_available() -> bool:
    return all(p.exists() for p in (ORACLE_PY, ORACLE_DIR / "libkvoracle.so", ORACLE_DIR / "tiny.gguf",
                                     ORACLE_SRC / "kvoracle.py"))


def oracle_timings(script: str, timeout: int = 900):
    if not oracle_available():
        return None
    prelude = (f"import sys, json, time\nsys.path.insert(0, {str(ORACLE_SRC)!r})\nimport kvoracle\n"
               f"MODEL = {str(ORACLE_DIR / 'tiny.gguf')!r}\n")
    env = dict(os.environ, ORACLE_DIR=str(ORACLE_DIR))
    p = subprocess.run([str(ORACLE_PY), "-c", prelude + script], capture_output=True, text=True, timeout=timeout,
                       env=env)
    if p.returncode != 0:
        raise RuntimeError(f"oracle timing failed ({p.returncode}): {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])

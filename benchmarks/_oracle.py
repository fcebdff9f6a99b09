"""Run timing code on llama.cpp's own cache (built by scripts/build_reference.sh) in its interpreter, side by side with ours.

``pin()`` puts this process (and the oracle's interpreter it starts) on the same CPUs.  ``oracle_timings(script)`` runs ``script`` under the oracle's Python with ``kvoracle`` importable and returns what
it printed as JSON, or None when the oracle is not built.  ``step_lib()`` builds ``_oracle_step.cpp`` (timing
anchors the oracle's shim lacks) against the oracle's llama.cpp.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "oracle"))
from llama_runner import ORACLE_DIR, ORACLE_PY, ORACLE_SRC  # noqa: E402  (the one place naming the reference)


_ALL_CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def pin(threads: int, off: bool = False) -> None:
    """Run this process -- and llama.cpp's side, which inherits it when it starts -- on the same first ``threads``
    CPUs.  On a shared machine one CPU can run at half the speed of another for seconds (a busy neighbour on its
    core); unpinned, the two sides may sit on different CPUs and a single-thread ratio then swings by 2x."""
    if off or not _ALL_CPUS:
        return
    os.sched_setaffinity(0, _ALL_CPUS[:max(1, threads)])


def oracle_available() -> bool:
    return all(p.exists() for p in (ORACLE_PY, ORACLE_DIR / "libkvoracle.so", ORACLE_DIR / "tiny.gguf",
                                     ORACLE_SRC / "kvoracle.py"))


STEP_SRC = Path(__file__).resolve().with_name("_oracle_step.cpp")


def step_lib() -> Path | None:
    """``_oracle_step.cpp`` built against the oracle's llama.cpp (once per source version, in a temporary folder),
    or None when the oracle or a C++ compiler is missing or the build fails."""
    if not oracle_available():
        return None
    src = STEP_SRC.read_bytes()
    out = Path(tempfile.gettempdir()) / f"kvcache_ggml_oracle_step_{hashlib.sha1(src).hexdigest()[:12]}.so"
    if out.exists():
        return out
    llama = ORACLE_DIR / "src" / "llama_cpp_python-0.3.17" / "vendor" / "llama.cpp"
    libs = sorted((ORACLE_DIR / "venv").glob("lib/python3*/site-packages/llama_cpp/lib"))
    if not libs or not shutil.which("g++"):
        return None
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = ["g++", "-O2", "-std=c++17", "-shared", "-fPIC", "-o", str(tmp), str(STEP_SRC),
           f'-DKV_ORACLE_CPP="{ORACLE_SRC / "kv_oracle.cpp"}"', f"-I{llama / 'src'}", f"-I{llama / 'include'}",
           f"-I{llama / 'ggml' / 'include'}", f"-L{libs[0]}", "-lllama", "-lggml", "-lggml-base",
           f"-Wl,-rpath,{libs[0]}"]
    if subprocess.run(cmd, capture_output=True).returncode != 0:
        return None
    tmp.replace(out)
    return out


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

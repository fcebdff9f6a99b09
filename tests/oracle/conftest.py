"""The oracle suite: llama.cpp's own KV cache and runtime, built by scripts/build_reference.sh.

Run with ``python3 build.py test -m oracle``.  Every test here is skipped when the oracle is not built.
"""
import json
import os
import subprocess
from pathlib import Path

import pytest

from llama_runner import BUILD_REFERENCE, ORACLE_DIR, ORACLE_PY, ORACLE_SRC  # the one place naming the oracle  # noqa: E402
REPLAY = Path(__file__).with_name("replay_oracle.py")


def oracle_missing() -> str | None:
    for p in (ORACLE_DIR / "libkvoracle.so", ORACLE_PY, ORACLE_DIR / "tiny.gguf", ORACLE_SRC / "kvoracle.py"):
        if not p.exists():
            return f"oracle not built ({p} missing): run bash {BUILD_REFERENCE}"
    return None


def pytest_collection_modifyitems(config, items):
    why = oracle_missing()
    for item in items:
        if "oracle" in str(item.fspath) or item.get_closest_marker("oracle"):
            item.add_marker(pytest.mark.oracle)
            if why:
                item.add_marker(pytest.mark.skip(reason=why))


def run_oracle(spec: dict) -> list[dict]:
    """Replay ``spec`` on llama.cpp's cache in a subprocess; one dict per op (an abort ends the list early)."""
    spec = dict(spec, model=str(spec.get("model", ORACLE_DIR / "tiny.gguf")))
    env = dict(os.environ, ORACLE_DIR=str(ORACLE_DIR), KVORACLE_SRC=str(ORACLE_SRC))
    p = subprocess.run([str(ORACLE_PY), str(REPLAY)], input=json.dumps(spec), capture_output=True, text=True,
                       env=env, timeout=600)
    out = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 and len(out) < len(spec["ops"]):
        out.append({"abort": p.returncode, "stderr": p.stderr[-2000:]})
    return out

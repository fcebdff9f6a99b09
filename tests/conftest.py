"""Test-wide settings: under CI (CI=true) hypothesis replays a fixed set of examples, so a run is reproducible.

ggml lists no CPU-type Vulkan device (Mesa's lavapipe, the software device the Vulkan tests run on without a GPU)
unless GGML_VK_VISIBLE_DEVICES names it; it must be set before ggml enumerates its devices, so here, before any test
module imports ggml.  A value already set (a real GPU's index) is kept.

benchmarks/ is put on ``sys.path`` for its workload helpers (``_workload``: the chat workload and its replay through
the serving engine), which the prefix-cache tests replay as the benchmark does.
"""
import os
import sys
from pathlib import Path

os.environ.setdefault("GGML_VK_VISIBLE_DEVICES", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

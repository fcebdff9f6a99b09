"""The ASan flavour is really checked: a deliberate out-of-bounds write through the binding layer is reported.

Runs only under the ASan flavour (``python3 build.py --asan test``, which preloads the sanitizer runtimes); in
every other run it skips with the reason.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from helpers import UNDER_ASAN

pytestmark = pytest.mark.skipif(not UNDER_ASAN, reason="not the ASan flavour (python3 build.py --asan test)")

# a 64-byte CPU buffer and a 256-byte F32 tensor placed at its base by hand (ggml_backend_tensor_alloc would refuse):
# ggml_backend_tensor_set checks the size against the tensor (256 <= 256) and the CPU buffer's memcpy writes 192
# bytes past the buffer's end
_OVERFLOW = textwrap.dedent("""
    import ctypes
    import numpy as np
    from kvcache_ggml import ggml as G
    buf = G.BackendBuffer.alloc(G.cpu_buffer_type(), 64)
    with G.Context.for_tensors(1) as ctx:
        t = ctx.new_tensor("f32", (64,), "t")
        G.ggml_tensor.from_address(t).data = buf.base
        G.set_buffer(t, buf.ptr)
        src = np.ones(64, np.float32)
        G.ggml_backend_tensor_set(t, src.ctypes.data, 0, src.nbytes)
    print("not caught")
""")


def test_an_out_of_bounds_write_is_reported(tmp_path):
    env = dict(os.environ, ASAN_OPTIONS=f"detect_leaks=0:log_path={tmp_path / 'asan'}")
    proc = subprocess.run([sys.executable, "-c", _OVERFLOW], env=env, capture_output=True, text=True, timeout=120)
    reports = [p.read_text() for p in tmp_path.iterdir() if p.name.startswith("asan")]
    assert proc.returncode != 0 and "not caught" not in proc.stdout, proc.stdout + proc.stderr
    assert len(reports) == 1 and "heap-buffer-overflow" in reports[0] and "WRITE of size 256" in reports[0], reports

"""Bit-exactness with llama.cpp, node by node (docs/exactness.md).

1. The attention's two matrix products alone (``kernel_probe.py``), run on llama.cpp's libggml and on ours with the
   same inputs: the same bits when both CPU backends are built with llamafile's sgemm, as llama.cpp builds its own.
2. Plain attention (mul_mat + soft_max over a transposed V cache) on a model with SmolLM-135M's head layout (9/3
   heads of 64): every named node of every decode (llama.cpp's ``cb_eval`` against our scheduler's eval callback)
   and the logits, bit for bit, for a prompt, decode steps and four forked sequences, with F16 and F32 caches.
"""
from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvcache_ggml import ggml as G
from kvcache_ggml.ggml._lib import LIB_DIR
from kvcache_ggml.batch import Batch
from kvcache_ggml.runtime import Context, Model, make_model
from llama_runner import ORACLE_PY, b64_floats, llama_available, run_llama, trace_nodes
from kvcache_ggml.runtime.modelmaker import ModelSpec
from kvcache_ggml.runtime.trace import NodeTrace, first_difference

pytestmark = [pytest.mark.oracle,
              pytest.mark.skipif(llama_available() is not None, reason=str(llama_available()))]

PROBE = Path(__file__).with_name("kernel_probe.py")
VOCAB = 256


def _probe(python: str, libdir: Path, kv: str) -> dict:
    args = [python, str(PROBE), str(libdir)] + (["--f32"] if kv == "f32" else [])
    return json.loads(subprocess.run(args, capture_output=True, text=True, check=True, timeout=300).stdout)


def _llama_libdir() -> Path:
    out = subprocess.run([str(ORACLE_PY), "-c", "import llama_cpp, os; print(os.path.dirname(llama_cpp.__file__))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return Path(out) / "lib"


@pytest.mark.parametrize("kv", ["f16", "f32"])
def test_attention_matmuls_alone(kv):
    """kq and kqv on both libraries, same inputs: bit-identical iff both have llamafile's sgemm."""
    theirs = _probe(str(ORACLE_PY), _llama_libdir(), kv)
    ours = _probe(sys.executable, LIB_DIR, kv)
    assert theirs["has_llamafile"] == 1
    assert ours["has_llamafile"] == 1, "our ggml-cpu lacks llamafile's sgemm: rebuild with build.py (GGML_LLAMAFILE=ON)"
    for name in ("kq", "kqv"):
        a = np.frombuffer(base64.b64decode(ours[name]["data"]), np.float32)
        b = np.frombuffer(base64.b64decode(theirs[name]["data"]), np.float32)
        assert np.array_equal(a, b), f"{name}: {np.count_nonzero(a != b)} of {a.size} values differ"


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("exact") / "smol.gguf",
                      ModelSpec(layers=3, embd=576, heads=9, heads_kv=3, ff=1536, vocab=VOCAB, seed=7, type="q8_0",
                                tied=True))


def _ops():
    toks = np.random.default_rng(3).integers(3, VOCAB, 40).tolist()
    ops = [{"op": "decode", "tokens": toks[:30], "pos": list(range(30)), "seq": [[0]] * 30, "logits": [1] * 30}]
    ops += [{"op": "decode", "tokens": [t], "pos": [30 + i], "seq": [[0]], "logits": [1]}
            for i, t in enumerate(toks[30:34])]
    ops += [{"op": "seq_cp", "args": [0, s, -1, -1]} for s in (1, 2, 3)]
    ops += [{"op": "decode", "tokens": toks[34 + k:38 + k], "pos": [34 + k] * 4, "seq": [[0], [1], [2], [3]],
             "logits": [1] * 4} for k in range(2)]
    return ops


@pytest.mark.parametrize("kv", ["f16", "f32"])
@pytest.mark.parametrize("unified", [True, False], ids=["unified", "streams"])
def test_plain_attention_node_by_node(smol, kv, unified):
    pr = {"n_ctx": 512, "n_batch": 512, "n_ubatch": 512, "n_seq_max": 4, "kv_unified": unified,
          "flash_attn": False, "type_k": kv, "type_v": kv, "n_threads": 1}
    ops = _ops()
    theirs = run_llama({"model": str(smol), "params": dict(pr, trace=True), "ops": ops})
    assert "abort" not in theirs[-1], theirs[-1]
    with Model(smol) as m, Context(m, n_threads=1, n_threads_batch=1,
                                   **{k: v for k, v in pr.items() if k != "n_threads"}) as ctx:
        for k, (op, th) in enumerate(zip(ops, theirs)):
            if op["op"] == "seq_cp":
                ctx.memory_seq_cp(*op["args"])
                continue
            seq = np.array([s[0] for s in op["seq"]], np.int32)
            with NodeTrace(ctx) as tr:
                got = ctx.decode(Batch(token=np.array(op["tokens"], np.int32), pos=np.array(op["pos"], np.int32),
                                       seq_id=seq, logits=np.array(op["logits"], np.int8)))
            ref = trace_nodes(th)
            diff, compared = first_difference(tr.nodes, ref)
            assert diff is None, f"op {k}: first differing node {diff}"
            assert compared == len(ref), f"op {k}: only {compared} of {len(ref)} nodes matched by name"
            assert np.array_equal(got, b64_floats(th["logits"], th["n_vocab"])), f"op {k}: logits differ"


@pytest.mark.skipif(not G.ggml_cpu_has_avx2(), reason="the AVX2 kernels are the ones compared")
def test_q6_K_dot_product_changed_between_ggml_versions():
    """The one kernel that differs (docs/exactness.md): ggml 0.15's AVX2 ggml_vec_dot_q6_K_q8_K takes the -32
    offset of Q6_K out after the products (through the Q8_K block sums) where ggml 0.9.8 subtracts it per pair, so
    the integer partial sums land in other lanes and the float sum rounds differently.  Same weight bytes (each
    library quantizes with its own ggml_quantize_chunk), same activations: products equal to ~1e-7, not bit for
    bit, for one token (vec_dot) and four."""
    theirs = json.loads(subprocess.run([str(ORACLE_PY), str(PROBE), str(_llama_libdir()), "--q6k"], capture_output=True,
                                       text=True, check=True, timeout=300).stdout)
    ours = json.loads(subprocess.run([sys.executable, str(PROBE), str(LIB_DIR), "--q6k"], capture_output=True,
                                     text=True, check=True, timeout=300).stdout)
    assert ours["weight_sha256"] == theirs["weight_sha256"]
    for n in ("n1", "n4"):
        a = np.frombuffer(base64.b64decode(ours[n]["data"]), np.float32).astype(np.float64)
        b = np.frombuffer(base64.b64decode(theirs[n]["data"]), np.float32).astype(np.float64)
        rel = np.abs(a - b).max() / np.abs(b).max()
        assert 0 < rel < 1e-6, f"{n}: max rel diff {rel:.2e}"

"""Run the attention's two matrix products (kq and kqv of a plain-attention prompt) on one ggml build, alone.

    python kernel_probe.py LIBDIR [--f32]      # LIBDIR holds libggml-base.so and libggml-cpu.so
    python kernel_probe.py LIBDIR --q6k        # a Q6_K weight times F32 activations instead

Standalone on purpose: it imports neither kvcache_ggml nor ggml-python, only ctypes and numpy, and calls the part of
ggml's C API that has not changed between ggml 0.9 and 0.15 (ggml_init, ggml_new_tensor_*, ggml_view_*,
ggml_mul_mat, ggml_graph_compute_with_ctx), so the same file runs under llama-cpp-python's interpreter against its
own libggml and under ours against ggml-python's.  The inputs come from a seeded numpy generator and are laid out
as the KV cache lays them out: an F16 K cache [d, n_head_kv, n_kv] read as the permuted view [d, n_kv, n_head_kv],
Q permuted the same way, a transposed V cache read as [n_kv, d, n_head_kv] and a contiguous soft_max output.  It
prints one JSON line: the build's ``ggml_cpu_has_llamafile()`` and, per product, the sha256 of the result bytes and
the result itself (base64 float32), so two builds can be compared bit for bit.  ``--q6k`` runs one
``mul_mat(Q6_K weight [256, 64], F32 activations [256, n])`` for n = 1 and 4 instead (the weight quantized by the
library's own ``ggml_quantize_chunk``; its sha256 is printed too, to show both libraries multiply the same bytes).
"""
from __future__ import annotations

import base64
import ctypes
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

F32, F16 = 0, 1
_vp = ctypes.c_void_p
_i64 = ctypes.c_int64


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", _vp), ("no_alloc", ctypes.c_bool)]


def _load(libdir: Path):
    base = ctypes.CDLL(str(libdir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(libdir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    sig = {
        "ggml_init": (_vp, [_InitParams]), "ggml_free": (None, [_vp]),
        "ggml_new_tensor_2d": (_vp, [_vp, ctypes.c_int, _i64, _i64]),
        "ggml_new_tensor_3d": (_vp, [_vp, ctypes.c_int, _i64, _i64, _i64]),
        "ggml_view_3d": (_vp, [_vp, _vp, _i64, _i64, _i64, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t]),
        "ggml_permute": (_vp, [_vp, _vp, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]),
        "ggml_mul_mat": (_vp, [_vp, _vp, _vp]), "ggml_mul_mat_set_prec": (None, [_vp, ctypes.c_int]),
        "ggml_get_data": (_vp, [_vp]), "ggml_nbytes": (ctypes.c_size_t, [_vp]),
        "ggml_new_graph": (_vp, [_vp]), "ggml_build_forward_expand": (None, [_vp, _vp]),
    }
    fns = {}
    for name, (res, args) in sig.items():
        f = base[name]
        f.restype, f.argtypes = res, args
        fns[name] = f
    q = base["ggml_quantize_chunk"]
    q.restype = ctypes.c_size_t
    q.argtypes = [ctypes.c_int, _vp, _vp, _i64, _i64, _i64, _vp]
    fns["quantize"] = q
    g = cpu["ggml_graph_compute_with_ctx"]
    g.restype, g.argtypes = ctypes.c_int, [_vp, _vp, ctypes.c_int]
    fns["compute"] = g
    fns["has_llamafile"] = cpu["ggml_cpu_has_llamafile"]
    return fns


def _fill(f, t, arr: np.ndarray) -> None:
    n = f["ggml_nbytes"](t)
    assert arr.nbytes == n, (arr.nbytes, n)
    ctypes.memmove(f["ggml_get_data"](t), arr.ctypes.data, n)


def probe(libdir: Path, d: int = 64, n_head: int = 9, n_head_kv: int = 3, n_kv: int = 256, n_tps: int = 30,
          kv_type: int = F16, n_threads: int = 1, seed: int = 0) -> dict:
    f = _load(libdir)
    rng = np.random.default_rng(seed)
    kv_dt = np.float16 if kv_type == F16 else np.float32
    esz = np.dtype(kv_dt).itemsize
    ctx = f["ggml_init"](_InitParams(256 << 20, None, False))
    try:
        # K cache: [d, n_head_kv, n_kv] contiguous; the attention reads [d, n_kv, n_head_kv] through a permute
        k_cache = f["ggml_new_tensor_3d"](ctx, kv_type, d, n_head_kv, n_kv)
        _fill(f, k_cache, rng.standard_normal((n_kv, n_head_kv, d)).astype(kv_dt))
        k = f["ggml_permute"](ctx, k_cache, 0, 2, 1, 3)                     # [d, n_kv, n_head_kv]
        q_raw = f["ggml_new_tensor_3d"](ctx, F32, d, n_head, n_tps)
        _fill(f, q_raw, rng.standard_normal((n_tps, n_head, d)).astype(np.float32))
        q = f["ggml_permute"](ctx, q_raw, 0, 2, 1, 3)                       # [d, n_tps, n_head]
        kq = f["ggml_mul_mat"](ctx, k, q)                                   # [n_kv, n_tps, n_head]
        f["ggml_mul_mat_set_prec"](kq, 10)                                  # GGML_PREC_F32, as llama.cpp
        # transposed V cache: [n_kv, d*n_head_kv] (one row per embedding dim), read as [n_kv, d, n_head_kv]
        v_cache = f["ggml_new_tensor_2d"](ctx, kv_type, n_kv, d * n_head_kv)
        _fill(f, v_cache, rng.standard_normal((d * n_head_kv, n_kv)).astype(kv_dt))
        v = f["ggml_view_3d"](ctx, v_cache, n_kv, d, n_head_kv, n_kv * esz, n_kv * esz * d, 0)
        # a soft_max output: non-negative rows summing to 1, contiguous [n_kv, n_tps, n_head]
        p = rng.random((n_head, n_tps, n_kv)).astype(np.float32)
        p /= p.sum(axis=-1, keepdims=True)
        sm = f["ggml_new_tensor_3d"](ctx, F32, n_kv, n_tps, n_head)
        _fill(f, sm, p)
        kqv = f["ggml_mul_mat"](ctx, v, sm)                                 # [d, n_tps, n_head]
        out = {"has_llamafile": int(f["has_llamafile"]())}
        for name, t in (("kq", kq), ("kqv", kqv)):
            out[name] = _compute(f, ctx, t, n_threads)
        return out
    finally:
        f["ggml_free"](ctx)


def _compute(f, ctx, t, n_threads: int) -> dict:
    gf = f["ggml_new_graph"](ctx)
    f["ggml_build_forward_expand"](gf, t)
    rc = f["compute"](ctx, gf, n_threads)
    if rc != 0:
        raise RuntimeError(f"ggml_graph_compute_with_ctx returned {rc}")
    raw = ctypes.string_at(f["ggml_get_data"](t), f["ggml_nbytes"](t))
    return {"sha256": hashlib.sha256(raw).hexdigest(), "data": base64.b64encode(raw).decode()}


def probe_q6k(libdir: Path, k: int = 256, m: int = 64, seed: int = 0) -> dict:
    """mul_mat of a Q6_K weight [k, m] and F32 activations [k, n] for n = 1 (vec_dot) and 4."""
    Q6_K = 14
    f = _load(libdir)
    rng = np.random.default_rng(seed)
    w32 = rng.standard_normal((m, k)).astype(np.float32)
    ctx = f["ggml_init"](_InitParams(64 << 20, None, False))
    try:
        w = f["ggml_new_tensor_2d"](ctx, Q6_K, k, m)
        nb = f["quantize"](Q6_K, w32.ctypes.data, f["ggml_get_data"](w), 0, m, k, None)
        assert nb == f["ggml_nbytes"](w), (nb, f["ggml_nbytes"](w))
        wraw = ctypes.string_at(f["ggml_get_data"](w), nb)
        out = {"has_llamafile": int(f["has_llamafile"]()), "weight_sha256": hashlib.sha256(wraw).hexdigest()}
        for n in (1, 4):
            x = f["ggml_new_tensor_2d"](ctx, F32, k, n)
            _fill(f, x, rng.standard_normal((n, k)).astype(np.float32))
            out[f"n{n}"] = _compute(f, ctx, f["ggml_mul_mat"](ctx, w, x), 1)
        return out
    finally:
        f["ggml_free"](ctx)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    if "--q6k" in argv:
        print(json.dumps(probe_q6k(Path(argv[0]))))
        return 0
    kv_type = F32 if "--f32" in argv else F16
    print(json.dumps(probe(Path(argv[0]), kv_type=kv_type)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

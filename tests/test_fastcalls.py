"""The compiled calls (kvcache_ggml/ggml/_fastcalls.py) against the ctypes table they are generated from."""
from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kvcache_ggml import ggml as G
from kvcache_ggml.ggml import _fastcalls

F32, F16, I32, I64 = (int(G.GGMLType[n]) for n in ("F32", "F16", "I32", "I64"))
ROOT = Path(__file__).resolve().parents[1]
COMPILED = pytest.mark.skipif(not G.FAST, reason=f"no compiled calls: {G.WHY_NO_FAST}")


def test_the_set_up_builds_the_compiled_calls():
    """Where build.py compiled them (its stamp says so), the package calls them: a set-up or an import that lost
    them would silently make every graph build pay ctypes' per-argument cost again."""
    stamp = Path(sys.prefix) / ".kvcache_build.json"  # the flavour's venv this interpreter runs in (build.py)
    done = json.loads(stamp.read_text()).get("fastcalls") if stamp.exists() else None
    if not done or done.get("failed") or Path(sys.prefix).resolve().parent != ROOT:
        pytest.skip("not a build.py set-up that compiled the calls (another interpreter, or no cffi there)")
    assert G.WHY_NO_FAST == ""
    assert set(G.FAST) == {n for n in _fastcalls.NAMES if n in G.FUNCTIONS}
    assert G.ggml_view_4d is G.FAST["ggml_view_4d"] and G.CALLS["ggml_add"] is G.FAST["ggml_add"]


def test_generated_wrappers_by_hand():
    """The C of three functions, against their prototypes in ggml.h, written out by hand."""
    table = {n: G.FUNCTIONS[n] for n in ("ggml_view_2d", "ggml_set_name", "ggml_set_output")}
    cdef, src = _fastcalls.c_source(table)
    # struct ggml_tensor * ggml_view_2d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0,
    #                                   int64_t ne1, size_t nb1, size_t offset)
    assert ("intptr_t kv_ggml_view_2d(intptr_t a0, intptr_t a1, int64_t a2, int64_t a3, uint64_t a4, uint64_t a5);"
            in cdef.splitlines())
    assert ("static intptr_t kv_ggml_view_2d(intptr_t a0, intptr_t a1, int64_t a2, int64_t a3, uint64_t a4, "
            "uint64_t a5) { return (intptr_t) ggml_view_2d((void *) a0, (void *) a1, a2, a3, a4, a5); }"
            in src.splitlines())
    # struct ggml_tensor * ggml_set_name(struct ggml_tensor * tensor, const char * name)
    assert "intptr_t kv_ggml_set_name(intptr_t a0, const char * a1);" in cdef.splitlines()
    # void ggml_set_output(struct ggml_tensor * tensor)
    assert ("static void kv_ggml_set_output(intptr_t a0) { ggml_set_output((void *) a0); }" in src.splitlines())
    assert "const char * kv_signature(void);" in cdef.splitlines()
    assert cdef.count("kv_") == 4 and f'return "{_fastcalls.signature(table)}"' in src


def test_unsupported_declarations_are_refused():
    with pytest.raises(ValueError, match="c_char_p"):
        _fastcalls._c_type(ctypes.c_char_p, result=True)  # ctypes returns bytes there, cffi a pointer
    with pytest.raises(ValueError, match="ggml_tensor"):
        _fastcalls._c_type(G.ggml_tensor)
    with pytest.raises(ValueError, match="LP_c_long"):
        _fastcalls._c_type(ctypes.POINTER(ctypes.c_int64))
    assert [_fastcalls._c_type(t) for t in (ctypes.c_int, ctypes.c_size_t, ctypes.c_float, ctypes.c_bool, None)] \
        == ["int32_t", "uint64_t", "float", "bool", "void"]


@COMPILED
def test_a_module_built_from_other_declarations_is_not_used():
    table = dict(G.FUNCTIONS)
    table["ggml_add"] = SimpleNamespace(restype=ctypes.c_void_p, argtypes=[ctypes.c_void_p] * 2)  # one less
    fast, why = _fastcalls.load(table)
    assert fast == {} and "other declarations" in why
    fast, why = _fastcalls.load(G.FUNCTIONS)
    assert why == "" and fast.keys() == G.FAST.keys()


def _build(F: dict, ctx: G.Context) -> None:
    """A graph through every tensor-making function of NAMES, called through ``F`` (a name -> function table)."""
    c = ctx.ptr
    x = F["ggml_new_tensor_3d"](c, F32, 8, 4, 3)                     # [8, 4, 3]
    w = F["ggml_new_tensor_2d"](c, F16, 8, 16)                       # [8, 16]
    pos = F["ggml_new_tensor_1d"](c, I32, 3)
    idx = F["ggml_new_tensor_1d"](c, I64, 2)
    freq = F["ggml_new_tensor_1d"](c, F32, 4)
    cache = F["ggml_new_tensor_4d"](c, F16, 8, 4, 32, 1)
    mask = F["ggml_new_tensor_2d"](c, F32, 32, 3)
    for t in (pos, idx, mask):
        F["ggml_set_input"](t)
    F["ggml_set_name"](x, b"x")
    F["ggml_dup_tensor"](c, x)
    F["ggml_view_tensor"](c, x)
    F["ggml_view_1d"](c, x, 8, 4)
    F["ggml_view_2d"](c, x, 8, 4, 32, 128)
    F["ggml_view_3d"](c, x, 4, 4, 3, 32, 128, 16)
    v4 = F["ggml_view_4d"](c, cache, 8, 4, 16, 1, 16, 64, 2048, 1024)
    r1 = F["ggml_reshape_1d"](c, x, 96)
    r2 = F["ggml_reshape_2d"](c, r1, 32, 3)
    F["ggml_reshape_3d"](c, r2, 8, 4, 3)
    F["ggml_reshape_4d"](c, r2, 8, 4, 3, 1)
    p = F["ggml_permute"](c, x, 0, 2, 1, 3)
    tr = F["ggml_transpose"](c, r2)
    F["ggml_cont"](c, p)
    F["ggml_cont_2d"](c, tr, 3, 32)
    F["ggml_cont_3d"](c, p, 8, 3, 4)
    F["ggml_set_rows"](c, F["ggml_reshape_2d"](c, cache, 32, 32), F["ggml_view_2d"](c, r2, 32, 2, 128, 0), idx)
    F["ggml_get_rows"](c, w, pos)
    F["ggml_pad"](c, x, 8, 0, 1, 0)
    F["ggml_cpy"](c, x, F["ggml_cast"](c, x, F16))
    q = F["ggml_rope_ext"](c, x, pos, 0, 8, 0, 4096, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)  # no frequency factors
    F["ggml_rope_ext"](c, x, pos, freq, 8, 2, 4096, 500000.0, 0.5, 1.0, 1.0, 32.0, 1.0)
    F["ggml_rope_ext_inplace"](c, v4, F["ggml_new_tensor_1d"](c, I32, 16), 0, 8, 0, 0, 10000.0, 1.0, 0.0, 1.0,
                               32.0, 1.0)
    s = F["ggml_add"](c, x, q)
    s = F["ggml_mul"](c, s, F["ggml_rms_norm"](c, s, 1e-6))
    s = F["ggml_scale"](c, s, 0.125)
    kq = F["ggml_mul_mat"](c, F["ggml_view_2d"](c, cache, 32, 32, 64, 0), F["ggml_reshape_2d"](c, s, 32, 3))
    F["ggml_mul_mat_set_prec"](kq, 10)
    F["ggml_soft_max_ext"](c, kq, mask, 0.5, 0.0)
    F["ggml_tanh"](c, kq)
    F["ggml_swiglu_split"](c, kq, kq)
    F["ggml_geglu_split"](c, kq, kq)
    kv = F["ggml_permute"](c, v4, 0, 2, 1, 3)                        # [8, 16 cells, 4 heads, 1]
    fa = F["ggml_flash_attn_ext"](c, F["ggml_permute"](c, x, 0, 2, 1, 3), kv, kv, 0, 0.35, 0.0, 0.0)  # no mask
    F["ggml_flash_attn_ext_set_prec"](fa, 10)
    F["ggml_set_output"](fa)


def _describe(ctx: G.Context) -> list[tuple]:
    """Every tensor of ctx as context-independent values: sources and views as indices in creation order."""
    ts = list(ctx.tensors())
    at = {t: i for i, t in enumerate(ts)}
    out = []
    for t in ts:
        cs = G._tensor._c(t)
        out.append((G.op(t), G.ttype(t), G.ne(t), G.nb(t), bytes(cs.op_params), cs.flags, G.name(t),
                    tuple(at.get(G.src(t, i), -1) for i in range(G.GGML_MAX_SRC)), at.get(G.view_src(t), -1),
                    G.view_offs(t)))
    return out


@COMPILED
def test_compiled_calls_build_what_ctypes_builds():
    with G.Context.for_tensors(256) as a, G.Context.for_tensors(256) as b:
        _build(G.FUNCTIONS, a)
        _build(G.CALLS, b)
        da, db = _describe(a), _describe(b)
    assert len(da) > 40 and da == db
    ops = {d[0].name for d in da}
    assert {"ROPE", "FLASH_ATTN_EXT", "SET_ROWS", "SOFT_MAX", "GLU", "VIEW", "PERMUTE", "CPY"} <= ops
    # the NULL frequency factors (0 through the compiled call, None through ctypes) are no source
    ropes = [d for d in db if d[0].name == "ROPE"]
    assert [r[7][2] for r in ropes] == [-1, 4, -1]


@COMPILED
def test_compiled_graph_calls_compute_what_ctypes_computes():
    """A graph made, sized and computed through the compiled calls gives numpy's values."""
    rng = np.random.default_rng(3)
    xa, ya = rng.standard_normal((3, 8)).astype(np.float32), rng.standard_normal((3, 8)).astype(np.float32)
    with G.Context.for_tensors(8, graph_size=16) as ctx, G.Backend.cpu() as be:
        c = ctx.ptr
        x, y = ctx.new_tensor("f32", (8, 3)), ctx.new_tensor("f32", (8, 3))
        out = G.ggml_scale(c, G.ggml_add(c, x, y), 0.5)
        G.ggml_set_output(out)
        graph = G.Graph(ctx, 16)
        graph.expand(out)
        assert G.ggml_graph_n_nodes(graph.ptr) == 2
        with G.BackendBuffer.for_context(ctx, G.cpu_buffer_type()):
            G.set_tensor(x, xa)
            G.set_tensor(y, ya)
            with G.Sched([be], 16) as sched:
                sched.alloc_graph(graph)
                assert G.ggml_backend_sched_graph_compute(sched.ptr, graph.ptr) == int(G.Status.SUCCESS)
                np.testing.assert_array_equal(G.to_numpy(out), (xa + ya) * np.float32(0.5))

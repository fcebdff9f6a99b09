"""K-shift, stream copies and update() on the CPU backend, against a numpy RoPE written from ggml's CPU kernel.

The numpy rope follows ggml-cpu's rope (theta cache by repeated multiplication in float32, YaRN ramp and magnitude
scale, NORM pairs (i, i+1), NEOX pairs (i, i + n_dims/2), dims past n_dims untouched).  Quantized caches are
checked against the rope of their dequantized rows, within one quantization step of the re-quantized block.
"""
import math
from functools import partial

import numpy as np
import pytest

from kvcache_ggml import ggml as G
from kvcache_ggml.cache import StreamCopyInfo, UpdateContext
from kvcache_ggml.cparams import CParams, ContextParams, RopeScalingType
from kvcache_ggml.hparams import HParams, RopeType

from helpers import ToyModel, decode, make_cache

Op = G.GGMLOp
E_HEAD = 32


# the model of these tests: 2 layers of 4 heads of 32 dims (2 and 1 KV heads), NEOX RoPE over every dim
KSHIFT_HP = dict(n_embd_head=E_HEAD, n_head=4, n_head_kv=(2, 1), n_rot=E_HEAD, rope_type=RopeType.NEOX)
TinyModel = partial(ToyModel, **KSHIFT_HP)


class RopeModel(ToyModel):
    """A model with its own per-layer RoPE parameters and frequency factors (the seed's model.get_rope_*)."""

    def __init__(self, factors, **kw):
        super().__init__(**{**KSHIFT_HP, **kw})
        self.factors = factors

    def get_rope_freq_base(self, cparams, il):
        return 500.0 if il == 1 else cparams.rope_freq_base

    def get_rope_freq_scale(self, cparams, il):
        return 0.5 if il == 1 else cparams.rope_freq_scale

    def get_rope_factors(self, cparams, il):
        return self.factors if il == 0 else None


# ---------------------------------------------------------------------------------------------- numpy rope

def corr_dims(n_dims, n_ctx_orig, base, beta_fast, beta_slow):
    def dim(n_rot):
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))
    return max(0.0, math.floor(dim(beta_fast))), min(n_dims - 1.0, math.ceil(dim(beta_slow)))


def rope_np(x, pos, n_dims, mode, base, scale, cp: CParams, factors=None):
    """x float64 [rows, heads, n_embd_head] rotated by pos [rows]; ggml-cpu's forward rope."""
    f32 = np.float32
    half = n_dims // 2
    theta_scale = f32(base) ** f32(-2.0 / n_dims)
    steps = np.full((len(pos), half), theta_scale, f32)
    steps[:, 0] = np.asarray(pos, f32)
    theta_extrap = np.cumprod(steps, axis=1, dtype=f32)            # theta *= theta_scale, as the C loop
    if factors is not None:
        theta_extrap = (theta_extrap / factors[:half].astype(f32)).astype(f32)
    theta = (f32(scale) * theta_extrap).astype(np.float64)
    mscale = cp.yarn_attn_factor
    if cp.yarn_ext_factor != 0:
        low, high = corr_dims(n_dims, cp.n_ctx_orig_yarn, base, cp.yarn_beta_fast, cp.yarn_beta_slow)
        y = (np.arange(half) - low) / max(0.001, high - low)        # i0/2 for i0 = 0, 2, ...
        mix = (1 - np.clip(y, 0, 1)) * cp.yarn_ext_factor
        theta = theta * (1 - mix) + theta_extrap.astype(np.float64) * mix
        mscale *= 1.0 + 0.1 * math.log(1.0 / scale)
    cos, sin = (np.cos(theta) * mscale)[:, None, :], (np.sin(theta) * mscale)[:, None, :]
    out = x.copy()
    if mode == RopeType.NORM:
        i0, i1 = np.arange(0, n_dims, 2), np.arange(1, n_dims, 2)
    else:
        i0, i1 = np.arange(half), np.arange(half) + half
    x0, x1 = x[..., i0], x[..., i1]
    out[..., i0] = x0 * cos - x1 * sin
    out[..., i1] = x0 * sin + x1 * cos
    return out


# ---------------------------------------------------------------------------------------------- quantized rows

def q8_0_dequant(raw):
    b = raw.reshape(-1, 34)
    d = b[:, :2].copy().view(np.float16).astype(np.float64)
    return (d * b[:, 2:].view(np.int8)).reshape(-1), np.repeat(np.abs(d[:, 0]), 32)


def q8_0_quant(x):
    b = x.reshape(-1, 32).astype(np.float32)
    d = np.abs(b).max(axis=1) / 127
    q = np.round(b / np.where(d == 0, 1, d)[:, None]).astype(np.int8)
    return np.concatenate([d.astype(np.float16)[:, None].view(np.uint8), q.view(np.uint8)], axis=1).reshape(-1)


def q4_0_dequant(raw):
    b = raw.reshape(-1, 18)
    d = b[:, :2].copy().view(np.float16).astype(np.float64)
    qs = b[:, 2:]
    q = np.concatenate([(qs & 0xF).astype(np.int64), (qs >> 4).astype(np.int64)], axis=1) - 8
    return (d * q).reshape(-1), np.repeat(np.abs(d[:, 0]), 32)


def q4_0_quant(x):
    b = x.reshape(-1, 32).astype(np.float32)
    mx = b[np.arange(len(b)), np.abs(b).argmax(axis=1)]
    d = mx / -8
    q = np.clip((b / np.where(d == 0, 1, d)[:, None] + 8.5).astype(np.int64), 0, 15).astype(np.uint8)
    qs = q[:, :16] | (q[:, 16:] << 4)
    return np.concatenate([d.astype(np.float16)[:, None].view(np.uint8), qs], axis=1).reshape(-1)


QUANT = {"q8_0": (q8_0_quant, q8_0_dequant, 1.0), "q4_0": (q4_0_quant, q4_0_dequant, 1.5)}


def fill_k(kv, rng):
    """Random K (valid blocks for quantized caches) and V; returns the K rows as float64 [stream, cell, head, dim]."""
    rows = []
    for layer in kv.layers:
        a = G.to_numpy(layer.k, ndim=3)
        h = kv.hparams.n_head_kv(layer.il)
        x = rng.standard_normal((kv.n_stream, kv.get_size(), h, E_HEAD)).astype(np.float32)
        tk = G.type_name(G.ttype(layer.k))
        if tk in QUANT:
            quant, dequant, _ = QUANT[tk]
            a[...] = quant(x).reshape(a.shape)
            rows.append(dequant(a.reshape(-1))[0].reshape(x.shape))
        else:
            a[...] = x.reshape(a.shape).astype(a.dtype)
            rows.append(a.astype(np.float64).reshape(x.shape))
        v = G.to_numpy(layer.v)
        v[...] = rng.standard_normal(v.shape).astype(v.dtype)
    return rows


def place(kv, strm, n, seq=0):
    cells = kv.v_cells[strm]
    cells.place(np.arange(n), np.arange(n), np.full((n, 1), seq, np.int32))


def shifts(kv):
    return [np.where(c.pos_array >= 0, c.shift_array, 0).copy() for c in kv.v_cells]


def check_rotated(kv, before, pending, cp, model=None, v_before=None):
    hp = kv.hparams
    mode = RopeType.NEOX if hp.rope_type in (RopeType.MROPE, RopeType.IMROPE) else hp.rope_type
    for layer, old in zip(kv.layers, before):
        il = layer.il
        base, scale, factors = cp.rope_freq_base, cp.rope_freq_scale, None
        if model is not None and hasattr(model, "get_rope_freq_base"):
            base, scale = model.get_rope_freq_base(cp, il), model.get_rope_freq_scale(cp, il)
            f = model.get_rope_factors(cp, il)
            factors = None if f is None else G.to_numpy(f, copy=True)
        tk = G.type_name(G.ttype(layer.k))
        got_raw = G.to_numpy(layer.k, copy=True, ndim=3)
        for s in range(kv.n_stream):
            exp = rope_np(old[s], pending[s], hp.n_rot, mode, base, scale, cp, factors)
            if tk in QUANT:
                _, dequant, steps = QUANT[tk]
                got, step = dequant(got_raw[s].reshape(-1))
                err = np.abs(got - exp.reshape(-1))
                assert (err <= steps * step + 1e-6).all(), f"layer {il} stream {s}: {err.max()} > step"
            elif tk == "f16":
                got = got_raw[s].astype(np.float64).reshape(exp.shape)
                ref16 = exp.astype(np.float16)
                tol = 2 * np.spacing(np.abs(ref16)).astype(np.float64) + 1e-6
                assert (np.abs(got - ref16.astype(np.float64)) <= tol).all(), f"layer {il} stream {s}"
            else:
                got = got_raw[s].astype(np.float64).reshape(exp.shape)
                np.testing.assert_allclose(got, exp, rtol=2e-5, atol=2e-5, err_msg=f"layer {il} stream {s}")
    if v_before is not None:
        for layer, v0 in zip(kv.layers, v_before):
            np.testing.assert_array_equal(G.to_numpy(layer.v, copy=True), v0)


# ---------------------------------------------------------------------------------------------- K-shift numerics

@pytest.mark.parametrize("type_k", ["f32", "f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("rope_type", [RopeType.NORM, RopeType.NEOX])
def test_seq_add_then_update_rotates_k(type_k, rope_type):
    rng = np.random.default_rng(1)
    model = TinyModel(rope_type=rope_type, n_rot=16)
    kv = make_cache(model=model, type_k=type_k)
    place(kv, 0, 12)
    before = fill_k(kv, rng)
    v_before = [G.to_numpy(layer.v, copy=True) for layer in kv.layers]
    kv.seq_add(0, 0, 4, 20)
    kv.seq_add(0, 4, 8, -2)
    kv.seq_add(0, 8, 10, -9)   # cell 8 falls below 0 and is freed
    pending = shifts(kv)
    assert pending[0][:12].tolist() == [20] * 4 + [-2] * 4 + [0, -9, 0, 0]
    kctx = kv.init_update(None)
    assert kctx.apply()
    assert not kv.get_has_shift() and not kv.v_cells[0].shift_array.any()
    check_rotated(kv, before, pending, CParams.from_hparams(model.hparams), v_before=v_before)
    kv.close()


@pytest.mark.parametrize("type_k", ["f32", "q8_0"])
def test_yarn_and_model_rope_parameters(type_k):
    rng = np.random.default_rng(2)
    with G.Context(4096) as wctx:
        factors = G.from_numpy(wctx, np.linspace(1.0, 4.0, E_HEAD // 2).astype(np.float32), "rope_freqs")
        model = RopeModel(factors, rope_type=RopeType.NEOX, n_rot=E_HEAD, rope_freq_scale_train=0.25,
                          n_ctx_train=2048)
        cp = CParams.from_hparams(model.hparams, ContextParams(rope_scaling_type=RopeScalingType.YARN, n_ctx=1024))
        assert cp.yarn_ext_factor == 1.0 and cp.rope_freq_scale == 0.25 and cp.n_ctx_orig_yarn == 2048
        cp.yarn_attn_factor = 1.25  # a magnitude scale != 1 makes unshifted rows change too
        kv = make_cache(model=model, type_k=type_k, n_stream=2)
        place(kv, 0, 10)
        place(kv, 1, 6, seq=1)
        before = fill_k(kv, rng)
        kv.seq_add(0, 2, 10, 5)
        kv.seq_add(1, 0, 3, 11)
        pending = shifts(kv)
        with UpdateContext.for_cache(kv, cp) as lctx:
            assert kv.update(lctx, True, StreamCopyInfo())
        check_rotated(kv, before, pending, cp, model=model)
        kv.close()


def test_swa_layers_use_the_swa_rope_base_when_hparams_has_it():
    rng = np.random.default_rng(4)
    model = TinyModel(rope_type=RopeType.NORM, swa_layers=(False, True))
    hp = model.hparams  # HParams has no SWA RoPE fields: add them in a subclass, as a model loader would


    class SwaHParams(type(hp)):
        __slots__ = ("rope_freq_base_train_swa", "rope_freq_scale_train_swa")

    model.hparams = SwaHParams(**{f: getattr(hp, f) for f in type(hp).__dataclass_fields__})
    model.hparams.rope_freq_base_train_swa, model.hparams.rope_freq_scale_train_swa = 100.0, 0.5
    kv = make_cache(model=model, type_k="f32")
    place(kv, 0, 8)
    before = fill_k(kv, rng)
    kv.seq_add(0, 0, 8, 3)
    pending = shifts(kv)
    cp = CParams.from_hparams(model.hparams)
    assert kv.kshift.rope_params(cp, 1) == (100.0, 0.5, None) and kv.kshift.rope_params(cp, 0) == (10000.0, 1.0, None)
    assert kv.update(None, True, StreamCopyInfo())

    class Swa:  # the rule written out for check_rotated
        def get_rope_freq_base(self, c, il):
            return 100.0 if il == 1 else c.rope_freq_base

        def get_rope_freq_scale(self, c, il):
            return 0.5 if il == 1 else c.rope_freq_scale

        def get_rope_factors(self, c, il):
            return None
    check_rotated(kv, before, pending, cp, model=Swa())
    kv.close()


@pytest.mark.parametrize("rope_type", [RopeType.MROPE, RopeType.IMROPE])
def test_mrope_is_shifted_as_neox(rope_type):
    rng = np.random.default_rng(5)
    model = TinyModel(rope_type=rope_type)
    kv = make_cache(model=model, type_k="f32")
    place(kv, 0, 6)
    before = fill_k(kv, rng)
    kv.v_cells[0].pos_add_many(np.arange(2, 6), 4)  # seq_add refuses M-RoPE models; shift the cells directly
    pending = shifts(kv)
    assert kv.update(None, True, StreamCopyInfo())
    check_rotated(kv, before, pending, CParams.from_hparams(model.hparams))
    kv.close()


def test_no_rope_model_only_clears_the_shift():
    rng = np.random.default_rng(6)
    kv = make_cache(model=TinyModel(rope_type=RopeType.NONE))
    place(kv, 0, 4)
    fill_k(kv, rng)
    k0 = [G.to_numpy(layer.k, copy=True) for layer in kv.layers]
    kv.seq_add(0, 0, 4, 2)
    assert kv.update(None, True, StreamCopyInfo()) is False
    assert not kv.get_has_shift()
    for layer, k in zip(kv.layers, k0):
        np.testing.assert_array_equal(G.to_numpy(layer.k, copy=True), k)
    kv.close()


# ---------------------------------------------------------------------------------------------- graph structure

def op_params(t):
    p = list(G.ggml_tensor.from_address(t).op_params[:11])
    floats = np.array(p[5:11], np.int32).view(np.float32).tolist()
    return p[1], p[2], p[4], floats  # n_dims, mode, n_ctx_orig, (base, scale, ext, attn, beta_fast, beta_slow)


@pytest.mark.parametrize("type_k", ["f16", "q8_0"])
def test_shift_graph_ops(type_k):
    model = TinyModel(rope_type=RopeType.MROPE, n_rot=16)
    kv = make_cache(model=model, type_k=type_k, n_stream=2)
    cp = CParams(n_ctx_orig_yarn=333, yarn_ext_factor=0.5, yarn_attn_factor=0.75, yarn_beta_fast=16.0,
                 yarn_beta_slow=2.0, rope_freq_base=5000.0, rope_freq_scale=0.5)
    with kv.shift_context() as ctx, UpdateContext.for_cache(kv, cp) as lctx:
        sg = kv.build_graph_shift(ctx, lctx)
        assert G.ttype(sg.k_shift) == G.GGMLType.I32 and G.ne(sg.k_shift) == (32, 1, 1, 1)
        nodes = sg.graph.nodes()
        roots = [n for n in nodes if G.op(n) in (Op.CPY, Op.ROPE) and G.ttype(n) == G.parse_type(type_k)]
        assert len(roots) == 2
        for layer, root in zip(kv.layers, roots):
            h = kv.hparams.n_head_kv(layer.il)
            if type_k == "q8_0":
                rope, dst = G.src(root, 0), G.src(root, 1)
                assert G.op(rope) == Op.ROPE and G.ttype(rope) == G.GGMLType.F32
                cast = G.src(rope, 0)
                assert G.op(cast) == Op.CPY and G.src(cast, 0) is not None
                view = G.src(cast, 0)
                assert G.addr(view) == G.addr(dst)
            else:
                rope, view = root, G.src(root, 0)
                assert G.addr(G.view_src(rope)) == G.addr(layer.k)  # in place
            assert G.op(view) == Op.VIEW and G.addr(G.view_src(view)) == G.addr(layer.k)
            def rsz(n):
                return G.type_size(type_k) * n // G.blck_size(type_k)
            assert G.ne(view) == (E_HEAD, h, 32, 1) and G.view_offs(view) == 0
            assert G.nb(view)[1:3] == (rsz(E_HEAD), rsz(E_HEAD * h))
            assert G.addr(G.src(rope, 1)) == G.addr(sg.k_shift) and G.src(rope, 2) is None
            n_dims, mode, n_ctx_orig, fl = op_params(rope)
            assert (n_dims, mode, n_ctx_orig) == (16, int(RopeType.NEOX), 333)
            assert fl == [5000.0, 0.5, 0.5, 0.75, 16.0, 2.0]
    kv.close()


def test_graph_too_small_for_the_scheduler_is_an_error():
    kv = make_cache(model=TinyModel())
    place(kv, 0, 2)
    kv.seq_add(0, 0, 2, 1)
    with UpdateContext.for_cache(kv) as lctx:
        lctx.graph_size = 4
        with pytest.raises(RuntimeError, match="needs 16 nodes; the scheduler was created for 4"):
            kv.update(lctx, True, StreamCopyInfo())
    assert kv.get_has_shift()  # nothing was applied
    kv.close()


def test_vision_rope_is_refused():
    kv = make_cache(model=TinyModel(rope_type=RopeType.VISION))
    place(kv, 0, 2)
    kv.seq_add(0, 0, 2, 1)
    with pytest.raises(ValueError, match="not VISION"):
        kv.update(None, True, StreamCopyInfo())
    kv.close()


# ---------------------------------------------------------------------------------------------- stream copies

def raw_streams(kv):
    return [[(G.to_numpy(ly.k_stream[s], copy=True).view(np.uint8), G.to_numpy(ly.v_stream[s], copy=True).view(
        np.uint8)) for s in range(kv.n_stream)] for ly in kv.layers]


@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("type_k", ["f16", "q8_0"])
def test_seq_cp_across_streams_copies_the_bytes(v_trans, type_k):
    rng = np.random.default_rng(8)
    kv = make_cache(model=TinyModel(), type_k=type_k, n_stream=3, v_trans=v_trans)
    place(kv, 0, 5, seq=0)
    fill_k(kv, rng)
    old = raw_streams(kv)
    kv.seq_cp(0, 2)
    kctx = kv.init_update(None)
    assert kctx.get_status().name == "SUCCESS" and kctx.apply()
    new = raw_streams(kv)
    for lo, ln in zip(old, new):
        for part in (0, 1):
            np.testing.assert_array_equal(ln[2][part], lo[0][part])  # destination = source bytes
            np.testing.assert_array_equal(ln[0][part], lo[0][part])  # source untouched
            np.testing.assert_array_equal(ln[1][part], lo[1][part])  # other stream untouched
    assert kv.seq_pos_max(2) == 4
    kv.close()


def test_copy_then_shift_rotates_both_streams():
    rng = np.random.default_rng(9)
    model = TinyModel(rope_type=RopeType.NORM)
    kv = make_cache(model=model, type_k="f32", n_stream=2)
    place(kv, 0, 8, seq=0)
    before = fill_k(kv, rng)
    kv.seq_add(0, 3, 8, 6)
    kv.seq_cp(0, 1)          # the destination inherits the source's cells and pending shift
    pending = shifts(kv)
    np.testing.assert_array_equal(pending[0], pending[1])
    assert kv.init_update(None).apply()
    same = [b.copy() for b in before]
    for b in same:
        b[1] = b[0]  # stream 1 holds stream 0's rows once copied, then both are rotated
    check_rotated(kv, same, pending, CParams.from_hparams(model.hparams))
    kv.close()


def test_has_pending_update_is_what_init_update_finds():
    """has_pending_update() answers without taking anything: a K-shift or a stream copy pending, or neither."""
    kv = make_cache(model=TinyModel(rope_type=RopeType.NORM), type_k="f32", n_stream=2)
    place(kv, 0, 6, seq=0)
    steps = [lambda: None, lambda: kv.seq_add(0, 2, 6, 3), lambda: kv.seq_cp(0, 1),
             lambda: kv.seq_add(1, 0, -1, 0), lambda: kv.seq_div(0, 0, -1, 2)]
    for change in steps:
        change()
        pending = kv.has_pending_update()
        assert pending == kv.has_pending_update()    # asking takes nothing
        kctx = kv.init_update(None)
        assert pending == (kctx.get_status().name == "SUCCESS")
        kctx.apply()
        assert not kv.has_pending_update()
    kv.close()


def test_cparams_from_hparams_follows_llama_context():
    hp = HParams.simple(n_layer=1, n_embd_head=8, n_head=1, n_head_kv=1, n_ctx_train=8192,
                        rope_freq_base_train=500000.0)
    c = CParams.from_hparams(hp, ContextParams(n_ctx=0, n_seq_max=3, n_batch=4096, n_ubatch=0))
    assert c.n_ctx == 3 * 2816 and c.n_ctx_seq == 2816  # 8192/3 = 2730 padded to 256, times 3
    assert c.n_batch == 4096 and c.n_ubatch == 4096 and c.rope_freq_base == 500000.0
    assert c.n_ctx_orig_yarn == 8192 and c.yarn_ext_factor == 0.0 and c.yarn_attn_factor == 1.0
    c = CParams.from_hparams(hp, ContextParams(rope_scaling_type=RopeScalingType.NONE, rope_freq_scale=0.5,
                                               kv_unified=True, n_ctx=1000))
    assert c.rope_freq_scale == 1.0 and c.n_ctx == c.n_ctx_seq == 1024
    with pytest.raises(ValueError, match="n_seq_max must be <= 256"):
        CParams.from_hparams(hp, ContextParams(n_seq_max=300))


def test_callers_scheduler_is_used_and_left_open():
    rng = np.random.default_rng(10)
    model = TinyModel(rope_type=RopeType.NEOX)
    kv = make_cache(model=model, type_k="f32")
    place(kv, 0, 4)
    before = fill_k(kv, rng)
    kv.seq_add(0, 0, 4, 9)
    pending = shifts(kv)
    cp = CParams.from_hparams(model.hparams, ContextParams(n_threads=1))
    with G.Backend.cpu() as cpu, G.Sched([cpu]) as sched:
        lctx = UpdateContext(sched, cp)
        assert kv.init_update(lctx).apply() and not kv.get_has_shift()
        lctx.close()
        assert not sched.closed and not cpu.closed
    check_rotated(kv, before, pending, cp)
    kv.close()


def test_bad_stream_copy_changes_nothing():
    rng = np.random.default_rng(11)
    kv = make_cache(model=TinyModel(), n_stream=2)
    fill_k(kv, rng)
    old = raw_streams(kv)
    with pytest.raises(ValueError, match=r"stream copy 1 -> 5: need two different streams in \[0, 2\)"):
        kv.update(None, False, StreamCopyInfo([0, 1], [1, 5]))
    for lo, ln in zip(old, raw_streams(kv)):
        for s in range(2):
            np.testing.assert_array_equal(ln[s][0], lo[s][0])
    kv.close()


def test_refused_k_shift_does_not_perform_the_queued_stream_copies():
    model = ToyModel(n_layer=1, n_embd_head=8, n_head=2, n_head_kv=1, n_rot=3)  # odd n_rot: no K-shift graph
    kv = make_cache(8, model=model, n_stream=2, type_k="f32", type_v="f32")
    decode(kv, [0, 1], [0, 0])
    kv.seq_add(0, -1, -1, 1)
    kv.seq_cp(0, 1, -1, -1)
    G.ggml_backend_tensor_memset(kv.layers[0].k, 7, 0, G.nbytes(kv.layers[0].k) // 2)  # stream 0 differs
    before = G.to_numpy(kv.layers[0].k, copy=True)
    with pytest.raises(ValueError, match="n_rot"):
        kv.init_update().apply()
    np.testing.assert_array_equal(G.to_numpy(kv.layers[0].k, copy=True), before)  # stream 1 not overwritten
    assert kv.get_has_shift()
    assert kv.sc_info.ssrc == [0] and kv.sc_info.sdst == [1]  # the copy stays queued for the next update
    kv.close()


def test_no_alloc_cache_refuses_data_moves():
    kv = make_cache(model=TinyModel(no_alloc=True), n_stream=2)
    place(kv, 0, 2)
    kv.seq_add(0, 0, 2, 1)
    with pytest.raises(RuntimeError, match="no_alloc"):
        kv.update(None, True, StreamCopyInfo())
    assert kv.get_has_shift()
    kv.close()

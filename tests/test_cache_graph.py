"""KVCache graph API (get_k, get_v, cpy_k, cpy_v, index inputs) on the CPU backend, checked against numpy.

Every expected shape, stride and offset below is computed here from the seed's formulas; the stores are checked by
writing random rows into random cells and comparing the whole cache with a numpy copy updated by hand.
"""
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest

from kvcache_ggml import ggml as G
from kvcache_ggml.cache import KVCache, KVCacheContext, SlotInfo

from helpers import ToyModel, make_cache

Op = G.GGMLOp
E_HEAD = 8          # n_embd_head_k
E_HEAD_V = 4        # n_embd_head_v (different from K on purpose)


# 3 layers of 4 heads, K heads of E_HEAD and V heads of E_HEAD_V dims, 2/1/2 KV heads; n_stream streams
make = partial(make_cache, n_stream=1, n_head=4, n_head_kv=(2, 1, 2), n_embd_head=E_HEAD, n_embd_head_v=E_HEAD_V)


def rs(t, n):
    """ggml_row_size, computed here."""
    return G.type_size(t) * n // G.blck_size(t)


def same(a, b):
    return G.addr(a) == G.addr(b)


class Runner:
    """One CPU backend and scheduler; computes a graph after filling its inputs."""

    def __init__(self):
        self.backend = G.Backend.cpu(2)
        self.sched = G.Sched([self.backend])

    def compute(self, graph, inputs):
        self.sched.reset()
        self.sched.alloc_graph(graph)
        for t, a in inputs:
            G.set_tensor(t, a)
        self.sched.compute(graph)
        self.sched.reset()

    def close(self):
        self.sched.close()
        self.backend.close()


@pytest.fixture(scope="module")
def runner():
    r = Runner()
    yield r
    r.close()


@pytest.fixture
def ctx():
    with G.Context.for_tensors(256, 256) as c:
        yield c


def slot(kv, per_stream, rng, streams=None):
    """A SlotInfo over the given streams with distinct random cells in each."""
    streams = list(range(kv.n_stream)) if streams is None else streams
    idxs = [np.sort(rng.choice(kv.get_size(), per_stream, replace=False)).astype(np.int64) for _ in streams]
    return SlotInfo(s0=min(streams), s1=max(streams), strm=streams, idxs=idxs)


# ---------------------------------------------------------------------------------------------- graph structure

@pytest.mark.parametrize("type_k", ["f16", "f32", "q8_0"])
@pytest.mark.parametrize("n_stream,s0,s1", [(1, 0, 0), (3, 0, 2), (3, 1, 2)])
def test_get_k_view(ctx, type_k, n_stream, s0, s1):
    kv = make(n_stream=n_stream, type_k=type_k, n_embd_head=32)
    for il in range(3):
        k = kv.tensors.layer(il).k
        n_kv, h = 12, kv.hparams.n_head_kv(il)
        t = kv.get_k(ctx, il, n_kv, SlotInfo(s0=s0, s1=s1, strm=list(range(s0, s1 + 1))))
        gqa = 32 * h
        assert G.op(t) == Op.VIEW and same(G.src(t, 0), k) and same(G.view_src(t), k)
        assert G.ne(t) == (32, h, n_kv, s1 - s0 + 1)
        assert G.nb(t) == (G.type_size(type_k), rs(type_k, 32), rs(type_k, gqa), rs(type_k, gqa * 16))
        assert G.view_offs(t) == rs(type_k, gqa * 16) * s0
    kv.close()


@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("n_stream,s0,s1", [(1, 0, 0), (2, 1, 1), (3, 0, 2)])
def test_get_v_view(ctx, v_trans, n_stream, s0, s1):
    kv = make(v_trans=v_trans, n_stream=n_stream)
    hp, n_kv = kv.hparams, 16
    for il in range(3):
        v = kv.tensors.layer(il).v
        h = hp.n_head_kv(il)
        width = hp.n_embd_v_gqa_max() if v_trans else E_HEAD_V * h  # [TAG_V_CACHE_VARIABLE]
        assert G.ne(v)[0] == width
        t = kv.get_v(ctx, il, n_kv, SlotInfo(s0=s0, s1=s1, strm=list(range(s0, s1 + 1))))
        assert G.op(t) == Op.VIEW and same(G.view_src(t), v)
        ns, ts = s1 - s0 + 1, 2
        if v_trans:
            assert G.ne(t) == (n_kv, h, E_HEAD_V, ns)
            assert G.nb(t) == (ts, ts * 16 * E_HEAD_V, ts * 16, ts * 16 * width)
        else:
            assert G.ne(t) == (E_HEAD_V, h, n_kv, ns)
            assert G.nb(t) == (ts, ts * E_HEAD_V, ts * width, ts * width * 16)
        assert G.view_offs(t) == ts * width * 16 * s0
    kv.close()


@pytest.mark.parametrize("n_stream", [1, 2])
def test_cpy_k_ops(ctx, n_stream):
    kv = make(n_stream=n_stream)
    n_tokens = 3 * n_stream
    for il in range(3):
        h = kv.hparams.n_head_kv(il)
        k_cur = G.new_tensor(ctx, "f32", (E_HEAD, h, n_tokens))
        k_idxs = kv.build_input_k_idxs(ctx, SimpleNamespace(n_tokens=n_tokens))
        assert G.ttype(k_idxs) == G.GGMLType.I64 and G.ne(k_idxs) == (n_tokens, 1, 1, 1)
        assert G.ggml_tensor.from_address(k_idxs).flags & 1  # GGML_TENSOR_FLAG_INPUT
        t = kv.cpy_k(ctx, k_cur, k_idxs, il, None)
        k = kv.tensors.layer(il).k
        assert G.op(t) == Op.SET_ROWS
        src0, src1, src2 = G.src(t, 0), G.src(t, 1), G.src(t, 2)
        assert G.op(src0) == Op.VIEW and same(G.view_src(src0), k_cur)
        assert G.ne(src0) == (E_HEAD * h, n_tokens, 1, 1) and G.nb(src0)[1] == G.nb(k_cur)[2]
        assert same(src1, k_idxs)
        if n_stream == 1:
            assert same(src2, k) and G.ne(t) == (E_HEAD * h, 16, 1, 1)
        else:
            assert G.op(src2) == Op.RESHAPE and same(G.view_src(src2), k)
            assert G.ne(src2) == (E_HEAD * h, 16 * n_stream, 1, 1)
        assert same(G.view_src(t), k)  # set_rows returns a view of the cache (ggml follows views to the root)
    kv.close()


def test_cpy_v_of_a_transposed_quantized_v_raises(ctx):
    """A transposed V cache of a block type is made, as the seed's constructor makes it, but writing it is refused:
    its values go one at a time, which a block cannot hold (the seed's ggml_row_size asserts in debug builds and
    writes nothing in release ones: the logits were silently wrong)."""
    kv = KVCache(ToyModel(n_embd_head=32), kv_size=8, v_trans=True, type_v="q8_0")
    v_idxs = kv.build_input_v_idxs(ctx, SimpleNamespace(n_tokens=2))
    v_cur = G.new_tensor(ctx, "f32", (32, kv.hparams.n_head_kv(0), 2))
    with pytest.raises(ValueError, match=r"transposed V cache of block type q8_0 cannot be written"):
        kv.cpy_v(ctx, v_cur, v_idxs, 0, None)
    kv.close()


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("v_trans", [False, True])
def test_cpy_v_ops(ctx, v_trans, strided):
    kv = make(v_trans=v_trans, n_stream=2)
    hp, n_tokens = kv.hparams, 4
    v_idxs = kv.build_input_v_idxs(ctx, SimpleNamespace(n_tokens=n_tokens))
    assert G.ne(v_idxs)[0] == n_tokens * (hp.n_embd_v_gqa_max() if v_trans else 1)
    for il in range(3):
        h = hp.n_head_kv(il)
        gqa = E_HEAD_V * h
        if strided:  # v_cur is a view of a wider row (dims 0..2 cannot merge)
            parent = G.new_tensor(ctx, "f32", (gqa + 4, n_tokens))
            v_cur = G.ggml_view_3d(ctx.ptr, parent, E_HEAD_V, h, n_tokens, 4 * E_HEAD_V, G.nb(parent)[1], 0)
        else:
            v_cur = G.new_tensor(ctx, "f32", (E_HEAD_V, h, n_tokens))
        t = kv.cpy_v(ctx, v_cur, v_idxs, il, None)
        v = kv.tensors.layer(il).v
        assert G.op(t) == Op.SET_ROWS and same(G.src(t, 1), v_idxs)
        src0, src2 = G.src(t, 0), G.src(t, 2)
        if not v_trans:
            assert G.op(src0) == Op.VIEW and G.ne(src0) == (gqa, n_tokens, 1, 1)
            assert G.op(src2) == Op.RESHAPE and G.ne(src2) == (gqa, 32, 1, 1)
            continue
        width = hp.n_embd_v_gqa_max()
        assert G.op(src2) == Op.RESHAPE and same(G.view_src(src2), v) and G.ne(src2) == (1, width * 32, 1, 1)
        assert G.op(src0) == Op.RESHAPE and G.ne(src0) == (1, width * n_tokens, 1, 1)
        inner = G.src(src0, 0)
        if gqa < width:
            assert G.op(inner) == Op.PAD and G.ne(inner) == (width, n_tokens, 1, 1)
            inner = G.src(inner, 0)
        assert G.op(inner) == (Op.CONT if strided else Op.RESHAPE) and G.ne(inner) == (gqa, n_tokens, 1, 1)
        assert same(G.src(inner, 0), v_cur)
    kv.close()


def test_context_delegates(ctx):
    kv = make(n_stream=2)
    kctx = KVCacheContext.full(kv)
    kctx.n_kv = 16
    assert G.ne(kctx.get_k(ctx, 0)) == (E_HEAD, 2, 16, 2)
    assert G.ne(kctx.get_v(ctx, 2)) == (16, 2, E_HEAD_V, 2)
    assert G.ne(kctx.build_input_v_idxs(ctx, SimpleNamespace(n_tokens=5)))[0] == 5 * 8
    kv.close()


def test_errors_name_values(ctx):
    kv = make()
    with pytest.raises(ValueError, match="layer 7 has no KV tensors"):
        kv.get_k(ctx, 7, 16, SlotInfo(0, 0, [0]))
    with pytest.raises(ValueError, match=r"slot streams \[0, 1\]"):
        kv.get_k(ctx, 0, 16, SlotInfo(0, 1, [0, 1]))
    with pytest.raises(ValueError, match="n_kv=17"):
        kv.get_v(ctx, 0, 17, SlotInfo(0, 0, [0]))
    idx = kv.build_input_k_idxs(ctx, SimpleNamespace(n_tokens=2))
    with pytest.raises(ValueError, match="must be F32"):
        kv.cpy_k(ctx, G.new_tensor(ctx, "f16", (E_HEAD, 2, 2)), idx, 0)
    with pytest.raises(ValueError, match="16 values per token; the cache row holds 8"):
        kv.cpy_k(ctx, G.new_tensor(ctx, "f32", (E_HEAD, 2, 2)), idx, 1)
    with pytest.raises(ValueError, match=r"k_idxs must be I64/I32 \[3\]"):
        kv.cpy_k(ctx, G.new_tensor(ctx, "f32", (E_HEAD, 2, 3)), idx, 0)
    with pytest.raises(ValueError, match="expected a ggml context"):
        kv.build_input_k_idxs(0, SimpleNamespace(n_tokens=2))
    kv.close()


# ---------------------------------------------------------------------------------------------- layer filter and reuse

N_HEAD_KV4 = (1, 2, 1, 2)  # 4 layers of 4 heads of E_HEAD dims, K/V heads varied per layer


def test_filter_keeps_only_the_layers_it_accepts(ctx):
    keep = [False, True, False, True]
    kv = make_cache(16, model=ToyModel(n_head=4, n_head_kv=N_HEAD_KV4), n_stream=2, v_trans=False,
                    filter=lambda il: keep[il])
    kept = [il for il in range(4) if keep[il]]
    assert [layer.il for layer in kv.layers] == kept
    for layer in kv.layers:
        gqa = 8 * N_HEAD_KV4[layer.il]
        assert G.ne(layer.k) == (gqa, 16, 2, 1) and G.ne(layer.v) == (gqa, 16, 2, 1)
        assert G.name(layer.k) == f"cache_k_l{layer.il}"
    f16 = 2
    assert kv.size_k_bytes() == kv.size_v_bytes() == sum(f16 * 8 * N_HEAD_KV4[il] * 16 * 2 for il in kept)
    for il in (0, 2):
        with pytest.raises(ValueError, match=f"layer {il} has no KV tensors"):
            kv.get_k(ctx, il, 16, SlotInfo(s0=0, s1=0, strm=[0]))
    kv.close()


def test_reused_layer_views_the_tensors_of_the_layer_it_reuses(ctx):
    # as gemma3n: layers 2 and 3 have no KV of their own (n_layer_kv_from_start = 2) and read layers 0 and 1's
    reuse = {2: 0, 3: 1}
    model = ToyModel(n_head=4, n_head_kv=(1, 2, 1, 2), n_layer_kv_from_start=2)
    kv = make_cache(16, model=model, reuse=lambda il: reuse.get(il, -1))
    assert [layer.il for layer in kv.layers] == [0, 1]
    own = {layer.il: layer for layer in kv.layers}
    si = SlotInfo(s0=0, s1=0, strm=[0])
    for il, src in reuse.items():
        k, v = kv.get_k(ctx, il, 16, si), kv.get_v(ctx, il, 16, si)
        assert same(G.view_src(k), own[src].k) and same(G.view_src(v), own[src].v)
        assert not same(G.view_src(k), own[1 - src].k)
        assert G.ne(k) == (8, N_HEAD_KV4[src], 16, 1)
        assert G.data_ptr(k) == G.data_ptr(own[src].k)  # the same memory, not a copy
    assert kv.size_k_bytes() == sum(2 * 8 * h * 16 for h in (1, 2))  # two layers' worth, f16
    kv.close()


def test_reuse_of_a_filtered_out_layer_raises_before_allocating(monkeypatch):
    made = []  # ggml contexts created and buffers allocated, seen through spies that call the real ggml

    class CountingContext(G.Context):
        __slots__ = ()

        def __init__(self, *args, **kwargs):
            made.append(("context", args))
            super().__init__(*args, **kwargs)

    alloc = G.ggml_backend_alloc_ctx_tensors_from_buft
    monkeypatch.setattr(G, "Context", CountingContext)
    monkeypatch.setattr(G, "ggml_backend_alloc_ctx_tensors_from_buft",
                        lambda *args: made.append(("buffer", args)) or alloc(*args))
    model = ToyModel(n_head=4, n_head_kv=N_HEAD_KV4)
    with pytest.raises(ValueError, match=r"layer 3 reuses layer 2, which has no tensors in this cache "
                                         r"\(kept layers: \[0, 1, 3\]\)"):
        make_cache(16, model=model, filter=lambda il: il != 2, reuse=lambda il: 2 if il == 3 else -1)
    assert made == []
    # the spies do see a cache being made: reusing a kept layer succeeds
    kv = make_cache(16, model=model, filter=lambda il: il != 2, reuse=lambda il: 1 if il == 3 else -1)
    assert [kind for kind, _ in made] == ["context", "buffer"]
    assert [layer.il for layer in kv.layers] == [0, 1, 3]
    kv.close()


# ---------------------------------------------------------------------------------------------- data

def k_idxs_np(kv, sinfo):
    """The seed's set_input_k_idxs (and non-transposed set_input_v_idxs), written out here."""
    return np.concatenate([s * kv.get_size() + idx for s, idx in zip(sinfo.strm, sinfo.idxs)]).astype(np.int64)


def v_idxs_np(kv, sinfo):
    """The seed's transposed set_input_v_idxs: one index per value, padded to n_embd_v_gqa_max."""
    size, width = kv.get_size(), kv.hparams.n_embd_v_gqa_max()
    out = []
    for s, idx in zip(sinfo.strm, sinfo.idxs):
        for cell in idx:
            out.append(s * size * width + np.arange(width) * size + cell)
    return np.concatenate(out).astype(np.int64)


def fill_random(kv, rng):
    for layer in kv.layers:
        for t in (layer.k, layer.v):
            a = G.to_numpy(t)
            a[...] = rng.standard_normal(a.shape).astype(a.dtype)


def store(kv, runner, sinfo, rng, strided=False):
    """cpy_k/cpy_v of random K/V for every layer into the slot; returns the values written, per layer."""
    n_tokens = sinfo.n_stream() * sinfo.size()
    ub = SimpleNamespace(n_tokens=n_tokens)
    with G.Context.for_tensors(64 + 16 * len(kv.layers), 256) as ctx:
        graph = G.Graph(ctx, 256)
        k_idxs = kv.build_input_k_idxs(ctx, ub)
        v_idxs = kv.build_input_v_idxs(ctx, ub)
        inputs = [(k_idxs, k_idxs_np(kv, sinfo)),
                  (v_idxs, v_idxs_np(kv, sinfo) if kv.v_trans else k_idxs_np(kv, sinfo))]
        written = []
        for layer in kv.layers:
            h = kv.hparams.n_head_kv(layer.il)
            k_np = rng.standard_normal((n_tokens, h, E_HEAD)).astype(np.float32)
            v_np = rng.standard_normal((n_tokens, h, E_HEAD_V)).astype(np.float32)
            k_cur = G.new_tensor(ctx, "f32", (E_HEAD, h, n_tokens))
            G.ggml_set_input(k_cur)
            if strided:
                parent = G.new_tensor(ctx, "f32", (E_HEAD_V * h + 4, n_tokens))
                G.ggml_set_input(parent)
                v_cur = G.ggml_view_3d(ctx.ptr, parent, E_HEAD_V, h, n_tokens, 4 * E_HEAD_V, G.nb(parent)[1], 0)
                wide = np.full((n_tokens, E_HEAD_V * h + 4), 99.0, np.float32)
                wide[:, :E_HEAD_V * h] = v_np.reshape(n_tokens, -1)
                inputs.append((parent, wide))
            else:
                v_cur = G.new_tensor(ctx, "f32", (E_HEAD_V, h, n_tokens))
                G.ggml_set_input(v_cur)
                inputs.append((v_cur, v_np))
            inputs.append((k_cur, k_np))
            graph.expand(kv.cpy_k(ctx, k_cur, k_idxs, layer.il, sinfo))
            graph.expand(kv.cpy_v(ctx, v_cur, v_idxs, layer.il, sinfo))
            written.append((k_np, v_np))
        runner.compute(graph, inputs)
    return written


def cache_copy(kv):
    return [(G.to_numpy(layer.k, copy=True, ndim=3), G.to_numpy(layer.v, copy=True, ndim=3)) for layer in kv.layers]


def expected_after_store(kv, before, sinfo, written):
    """The cache as numpy says it must be: the slot's rows replaced, every other byte as before."""
    size = kv.get_size()
    out = []
    for (k0, v0), (k_np, v_np), layer in zip(before, written, kv.layers):
        k, v = k0.copy(), v0.copy()                      # numpy [n_stream, kv_size, width]
        t = 0
        for s, idx in zip(sinfo.strm, sinfo.idxs):
            n = idx.size
            k[s, idx] = k_np[t:t + n].reshape(n, -1).astype(k.dtype)
            vals = v_np[t:t + n].reshape(n, -1).astype(v.dtype)
            if kv.v_trans:
                width = v.shape[2]
                planes = v.reshape(kv.n_stream, width, size)  # transposed: [stream][value][cell]
                pad = np.zeros((n, width), v.dtype)
                pad[:, :vals.shape[1]] = vals
                planes[s][:, idx] = pad.T
            else:
                v[s, idx] = vals
            t += n
        out.append((k, v))
    return out


@pytest.mark.parametrize("v_trans,n_stream,type_kv,strided", [
    (True, 1, "f16", False), (False, 1, "f32", False), (True, 2, "f32", True), (False, 3, "f16", False),
    (True, 3, "f16", True),
])
def test_store_writes_exactly_the_slot(runner, v_trans, n_stream, type_kv, strided):
    rng = np.random.default_rng(n_stream * 10 + v_trans)
    kv = make(v_trans=v_trans, n_stream=n_stream, type_k=type_kv, type_v=type_kv)
    fill_random(kv, rng)
    for step in range(2):
        sinfo = slot(kv, 5, rng)
        before = cache_copy(kv)
        written = store(kv, runner, sinfo, rng, strided=strided)
        for (k, v), (ek, ev) in zip(cache_copy(kv), expected_after_store(kv, before, sinfo, written)):
            np.testing.assert_array_equal(k, ek)
            np.testing.assert_array_equal(v, ev)
    kv.close()


def test_store_into_a_subset_of_streams(runner):
    rng = np.random.default_rng(7)
    kv = make(v_trans=True, n_stream=4, type_k="f32", type_v="f32")
    fill_random(kv, rng)
    sinfo = slot(kv, 3, rng, streams=[1, 3])
    before = cache_copy(kv)
    written = store(kv, runner, sinfo, rng)
    for (k, v), (ek, ev) in zip(cache_copy(kv), expected_after_store(kv, before, sinfo, written)):
        np.testing.assert_array_equal(k, ek)
        np.testing.assert_array_equal(v, ev)
    kv.close()


@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("type_k", ["f16", "q8_0"])
def test_get_views_read_the_cache(ctx, v_trans, type_k):
    rng = np.random.default_rng(3)
    kv = make(v_trans=v_trans, n_stream=3, type_k=type_k, type_v="f32", n_embd_head=32)
    for layer in kv.layers:
        for t in (layer.k, layer.v):
            a = G.to_numpy(t)
            if G.is_quantized(G.ttype(t)):  # valid q8_0 blocks: an f16 scale and 32 int8
                a[...] = rng.integers(-127, 128, a.shape).astype(np.int8).view(np.uint8)
                blocks = a.reshape(-1, 34)
                blocks[:, :2] = np.full(len(blocks), 0.5, np.float16).view(np.uint8).reshape(-1, 2)
            else:
                a[...] = rng.standard_normal(a.shape)
    n_kv, size, hp = 12, kv.get_size(), kv.hparams
    for layer in kv.layers:
        il, h = layer.il, hp.n_head_kv(layer.il)
        raw_k = G.to_numpy(layer.k, copy=True)          # [n_stream, kv_size, row bytes or width]
        raw_v = G.to_numpy(layer.v, copy=True)
        for s0, s1 in ((0, 0), (1, 2), (0, 2)):
            si = SlotInfo(s0=s0, s1=s1, strm=list(range(s0, s1 + 1)))
            got_k = G.to_numpy(kv.get_k(ctx, il, n_kv, si), copy=True, ndim=4)
            exp_k = raw_k[s0:s1 + 1, :n_kv].reshape(s1 - s0 + 1, n_kv, h, -1)
            np.testing.assert_array_equal(got_k, exp_k)
            got_v = G.to_numpy(kv.get_v(ctx, il, n_kv, si), copy=True, ndim=4)
            if v_trans:
                planes = raw_v.reshape(kv.n_stream, -1, size)[s0:s1 + 1]    # [stream][value][cell]
                exp_v = planes[:, :h * E_HEAD_V, :n_kv].reshape(s1 - s0 + 1, h, E_HEAD_V, n_kv).transpose(0, 2, 1, 3)
            else:
                exp_v = raw_v[s0:s1 + 1, :n_kv].reshape(s1 - s0 + 1, n_kv, h, E_HEAD_V)
            np.testing.assert_array_equal(got_v, exp_v)
    kv.close()

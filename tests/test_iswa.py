"""KVCacheISWA: sizes and layer split, bookkeeping against two independently driven KVCaches, state round trips."""
import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvcache_ggml import ggml as G
from kvcache_ggml.batch import Batch, BatchAllocator
from kvcache_ggml.cache import KVCache, KVCacheParams, Memory, MemoryStatus
from kvcache_ggml.hparams import HParams, SwaType
from kvcache_ggml.cache.iswa import STATE_SEQ_FLAGS_PARTIAL_ONLY, KVCacheISWA, KVCacheISWAContext, swa_cache_size

N_VOCAB = 64
PARTIAL = STATE_SEQ_FLAGS_PARTIAL_ONLY


class SwaModel:
    """4 layers: 0 and 2 slide over a window of n_swa, 1 and 3 attend to everything (Gemma 2's pattern)."""

    def __init__(self, n_swa=3, n_layer=4, period=2):
        self.hparams = HParams.simple(n_layer=n_layer, n_embd_head=8, n_head=2, n_head_kv=1, n_swa=n_swa,
                                      swa_type=SwaType.STANDARD)
        self.hparams.set_swa_pattern(period)

    def dev_layer(self, il):
        return None


def make(n_swa=3, kv_size=512, n_seq_max=1, unified=True, n_ubatch=8, **kw):
    return KVCacheISWA(SwaModel(n_swa), kv_size=kv_size, n_seq_max=n_seq_max, unified=unified, n_ubatch=n_ubatch,
                       **kw)


def alloc(mem, pos, seqs, n_seq_max):
    rows = [s if isinstance(s, (list, tuple)) else [s] for s in seqs]
    ba = BatchAllocator(1)
    ba.init(Batch(token=np.full(len(rows), 3), pos=pos, seq_id=rows), N_VOCAB, mem, 16, n_seq_max, False)
    return ba


def decode(mem, pos, seqs, n_ubatch=512):
    """balloc.init + init_batch + apply every ubatch; the context (status FAILED_PREPARE: nothing applied)."""
    ctx = mem.init_batch(alloc(mem, pos, seqs, mem.n_seq_max), n_ubatch)
    if ctx.get_status() == MemoryStatus.SUCCESS:
        while True:
            ctx.apply()
            if not ctx.next():
                break
    return ctx


def cells_of(kv):
    return ([c.pos_array.tolist() for c in kv.v_cells], [c.shift_array.tolist() for c in kv.v_cells],
            [c.seq_bits.tolist() for c in kv.v_cells], list(kv.v_heads))


# ------------------------------------------------------------------------------------------------ sizes and layers

@pytest.mark.parametrize("kv_size,n_swa,n_seq,n_ubatch,unified,full,want", [
    (1024, 16, 1, 512, True, False, 768),     # 16 + 512 = 528 -> padded to 768
    (1024, 100, 3, 64, True, False, 512),     # 3 windows share the stream: 300 + 64 = 364 -> 512
    (1024, 100, 3, 64, False, False, 256),    # one stream per sequence: 100 + 64 = 164 -> 256
    (256, 4096, 1, 512, True, False, 256),    # never more than the base cache needs... before padding
    (300, 4096, 1, 512, True, False, 512),    # ... then padded past it
    (1024, 16, 1, 512, True, True, 1024),     # swa_full: the base cache's size
])
def test_swa_cache_size(kv_size, n_swa, n_seq, n_ubatch, unified, full, want):
    assert swa_cache_size(kv_size, n_swa, n_seq, n_ubatch, unified, full) == want
    mem = KVCacheISWA(SwaModel(n_swa), kv_size=kv_size, n_seq_max=n_seq, unified=unified, n_ubatch=n_ubatch,
                      swa_full=full)
    assert mem.get_base().get_size() == mem.get_size() == kv_size
    assert mem.get_swa().get_size() == want
    assert mem.get_can_shift() == (want == kv_size)
    mem.close()


def test_layers_split_by_swa_flag_and_user_filter():
    mem = KVCacheISWA(SwaModel(n_layer=6, period=3), kv_size=256, filter=lambda il: il != 4)
    # period 3: layers 0, 1, 3, 4 slide, 2 and 5 are dense; the user filter drops layer 4
    assert [layer.il for layer in mem.get_base().layers] == [2, 5]
    assert [layer.il for layer in mem.get_swa().layers] == [0, 1, 3]
    assert mem.get_swa().n_swa == 3 and mem.get_base().n_swa == 0
    assert mem.get_base().swa_type == SwaType.NONE and mem.get_swa().swa_type == SwaType.STANDARD
    base, swa = mem.get_base().memory_breakdown()["CPU"], mem.get_swa().memory_breakdown()["CPU"]
    assert mem.memory_breakdown() == {"CPU": base + swa}
    mem.close()
    assert mem.closed
    with pytest.raises(ValueError, match="closed"):
        mem.seq_pos_max(0)


def test_model_without_swa_is_refused():
    class Dense:
        hparams = HParams.simple(n_layer=2, n_embd_head=8, n_head=2, n_head_kv=1)

        def dev_layer(self, il):
            return None
    with pytest.raises(ValueError, match="no sliding-window layers"):
        KVCacheISWA(Dense())


def test_both_memories_implement_the_memory_protocol():
    """KVCache and KVCacheISWA are both a Memory (llama_memory_i), what Context types its memory with; an object
    that lacks one of its methods is not."""
    mem = make()

    class NoStateRead:
        def __getattr__(self, name):
            if name == "state_read":
                raise AttributeError(name)
            return getattr(mem, name)
    try:
        assert isinstance(mem, Memory) and isinstance(mem.get_base(), Memory) and isinstance(mem.get_swa(), KVCache)
        assert all(hasattr(mem, n) for n in ("init_batch", "seq_rm", "state_write", "rpc", "lost"))
        assert not isinstance(NoStateRead(), Memory)
    finally:
        mem.close()


def test_context_routes_layers_to_their_cache():
    mem = make()
    ctx = mem.init_batch(alloc(mem, [0, 1, 2], [0, 0, 0], 1), 512)
    assert isinstance(ctx, KVCacheISWAContext) and ctx.get_status() == MemoryStatus.SUCCESS
    ctx.apply()
    assert [ctx.is_swa(il) for il in range(4)] == [True, False, True, False]
    assert ctx.layer_ctx(0) is ctx.get_swa() and ctx.layer_ctx(1) is ctx.get_base()
    assert ctx.get_swa().kv is mem.get_swa() and ctx.get_base().kv is mem.get_base()
    with G.Context.for_tensors(16) as gctx:
        assert G.name(ctx.get_k(gctx, 0)).startswith("cache_k_l0")
        assert G.name(ctx.get_v(gctx, 3)).startswith("cache_v_l3")
        # the SWA cache has no tensors of a dense layer, and the other way round
        with pytest.raises(ValueError, match="layer 1 has no KV tensors"):
            ctx.get_swa().get_k(gctx, 1)
    mem.close()


# ------------------------------------------------------------------------------------------------ batches

def test_sliding_window_reuses_swa_cells_while_base_keeps_everything():
    """One sequence of 300 tokens: the 256-cell SWA cache wraps over cells its window left behind."""
    mem = make(n_swa=3, kv_size=512)
    for p0 in range(0, 300, 4):
        assert decode(mem, list(range(p0, p0 + 4)), [0] * 4).get_status() == MemoryStatus.SUCCESS
    base, swa = mem.get_base(), mem.get_swa()
    assert sorted(base.v_cells[0].pos_array[base.v_cells[0].pos_array >= 0].tolist()) == list(range(300))
    held = swa.v_cells[0].pos_array
    # the SWA cache holds the newest 256 positions, the next token's window among them
    assert sorted(held[held >= 0].tolist()) == list(range(44, 300))
    assert mem.seq_pos_min(0) == 44 == swa.seq_pos_min(0) and base.seq_pos_min(0) == 0
    assert mem.seq_pos_max(0) == 299
    mem.close()


def test_a_batch_that_fits_the_base_cache_but_not_the_swa_cache_fails_and_changes_nothing():
    # 4 sequences with windows of 60 in a 256-cell SWA cache: 4 x 60 + a 40-token ubatch does not fit
    mem = make(n_swa=60, kv_size=1024, n_seq_max=4, n_ubatch=1)
    for s in range(4):
        decode(mem, list(range(60)), [s] * 60)
    before = (cells_of(mem.get_base()), cells_of(mem.get_swa()))
    ctx = decode(mem, list(range(60, 100)), [0] * 40)
    assert ctx.get_status() == MemoryStatus.FAILED_PREPARE
    assert (cells_of(mem.get_base()), cells_of(mem.get_swa())) == before
    # the same batch on the base cache alone has room
    assert mem.get_base().prepare([_split(mem, list(range(60, 100)), [0] * 40)[0]])
    # a smaller batch fits: 16 cells are still free
    assert decode(mem, list(range(60, 76)), [0] * 16).get_status() == MemoryStatus.SUCCESS
    mem.close()


def _split(mem, pos, seqs, n_ubatch=512):
    ba = alloc(mem, pos, seqs, mem.n_seq_max)
    ba.split_reset()
    out = []
    while ba.get_n_used() < ba.get_n_tokens():
        out.append(ba.split_simple(n_ubatch))
    return out


# ------------------------------------------------------------------------------------------------ state machine

class Twin:
    """Two KVCaches built and driven independently of KVCacheISWA, following llama_kv_cache_iswa's rules."""

    def __init__(self, model, kv_size, size_swa, n_seq_max, unified):
        hp = model.hparams
        common = dict(kv_size=kv_size, n_seq_max=n_seq_max, unified=unified)
        self.base = KVCache(model, KVCacheParams(filter=lambda il: not hp.is_swa(il), **common))
        self.swa = KVCache(model, KVCacheParams(filter=hp.is_swa, n_swa=hp.n_swa, swa_type=hp.swa_type,
                                                **dict(common, kv_size=size_swa)))
        self.unified = unified

    def decode(self, ba, n_ubatch):
        """The slots of every ubatch in both caches, applied; None when no split fits both."""
        strategies = [("simple", None), ("equal", False)] if self.unified else [("equal", True)]
        for kind, seq in strategies:
            ba.split_reset()
            ubs = []
            while True:
                ub = ba.split_simple(n_ubatch) if kind == "simple" else ba.split_equal(n_ubatch, seq)
                if ub.n_tokens == 0:
                    break
                ubs.append(ub)
            if ba.get_n_used() < ba.get_n_tokens():
                continue
            sb = self.base.prepare(ubs)
            if not sb:
                continue
            ss = self.swa.prepare(ubs)
            if not ss:
                continue
            for ub, a, b in zip(ubs, sb, ss):
                self.base.apply_ubatch(a, ub)
                self.swa.apply_ubatch(b, ub)
            return [(a.idxs[0].tolist(), b.idxs[0].tolist()) for a, b in zip(sb, ss)]
        return None


class ISWAMachine(RuleBasedStateMachine):
    CFG: dict = {}

    @initialize()
    def setup(self):
        c = self.CFG
        model = SwaModel(c["n_swa"])
        self.mem = KVCacheISWA(model, kv_size=c["kv_size"], n_seq_max=c["n_seq"], unified=c["unified"],
                               n_ubatch=c["n_ubatch"])
        size_swa = swa_cache_size(c["kv_size"], c["n_swa"], c["n_seq"], c["n_ubatch"], c["unified"])
        self.twin = Twin(model, c["kv_size"], size_swa, c["n_seq"], c["unified"])
        self.n_seq = c["n_seq"]

    def teardown(self):
        if hasattr(self, "mem"):
            self.mem.close()
            self.twin.base.close()
            self.twin.swa.close()

    @rule(data=st.data(), n_ubatch=st.sampled_from([1, 3, 16, 512]))
    def decode(self, data, n_ubatch):
        seqs = data.draw(st.lists(st.integers(0, self.n_seq - 1), min_size=1, max_size=2, unique=True))
        rows, pos = [], []
        for s in seqs:
            k = data.draw(st.sampled_from([1, 2, 5, 40, 90, 200]))
            p0 = self.twin.swa.seq_pos_max(s) + 1
            for j in range(k):
                row = [s]
                if self.CFG["unified"] and data.draw(st.integers(0, 7)) == 0:
                    other = data.draw(st.integers(0, self.n_seq - 1))
                    if other != s and self.twin.swa.seq_pos_max(other) + 1 == p0 + j:
                        row.append(other)
                rows.append(row)
                pos.append(p0 + j)
        if data.draw(st.booleans()):
            order = data.draw(st.permutations(range(len(rows))))
            rows, pos = [rows[i] for i in order], [pos[i] for i in order]
        try:
            ba = alloc(self.mem, pos, rows, self.n_seq)
        except ValueError:
            return
        ctx = self.mem.init_batch(ba, n_ubatch)
        want = self.twin.decode(alloc(self.twin.swa, pos, rows, self.n_seq), n_ubatch)
        if want is None:
            assert ctx.get_status() == MemoryStatus.FAILED_PREPARE
            return
        assert ctx.get_status() == MemoryStatus.SUCCESS
        got = []
        while True:
            ctx.apply()
            got.append((ctx.get_base().get_sinfo().idxs[0].tolist(), ctx.get_swa().get_sinfo().idxs[0].tolist()))
            if not ctx.next():
                break
        assert got == want

    @rule(data=st.data(), p0=st.integers(-1, 200), n=st.integers(-1, 120))
    def seq_rm(self, data, p0, n):
        s = data.draw(st.integers(-1, self.n_seq - 1))
        p1 = -1 if n < 0 else p0 + n
        assert self.mem.seq_rm(s, p0, p1) == (self.twin.base.seq_rm(s, p0, p1) & self.twin.swa.seq_rm(s, p0, p1))

    @rule(data=st.data(), p0=st.integers(-1, 200), n=st.integers(-1, 120))
    def seq_cp(self, data, p0, n):
        a, b = data.draw(st.integers(0, self.n_seq - 1)), data.draw(st.integers(0, self.n_seq - 1))
        p1 = -1 if n < 0 else p0 + n
        # a partial cross-stream copy is refused by a cache when the range ends inside it: a refusal by either
        # cache refuses the pair's copy and changes neither (the larger cache refuses first, or not at all)
        big, small = sorted((self.twin.base, self.twin.swa), key=lambda kv: -kv.get_size())
        try:
            big.seq_cp(a, b, p0, p1)
        except ValueError:
            with pytest.raises(ValueError, match="whole sequences"):
                self.mem.seq_cp(a, b, p0, p1)
            return
        small.seq_cp(a, b, p0, p1)
        self.mem.seq_cp(a, b, p0, p1)

    @rule(data=st.data())
    def seq_keep(self, data):
        s = data.draw(st.integers(0, self.n_seq - 1))
        self.mem.seq_keep(s)
        self.twin.base.seq_keep(s)
        self.twin.swa.seq_keep(s)

    @rule(data=st.data(), p0=st.integers(-1, 200), n=st.integers(-1, 120), d=st.integers(-30, 30))
    def seq_add(self, data, p0, n, d):
        s = data.draw(st.integers(0, self.n_seq - 1))
        p1 = -1 if n < 0 else p0 + n
        self.mem.seq_add(s, p0, p1, d)
        self.twin.base.seq_add(s, p0, p1, d)
        self.twin.swa.seq_add(s, p0, p1, d)

    @rule(data=st.data(), p0=st.integers(-1, 200), n=st.integers(-1, 120), d=st.integers(1, 4))
    def seq_div(self, data, p0, n, d):
        s = data.draw(st.integers(0, self.n_seq - 1))
        p1 = -1 if n < 0 else p0 + n
        self.mem.seq_div(s, p0, p1, d)
        self.twin.base.seq_div(s, p0, p1, d)
        self.twin.swa.seq_div(s, p0, p1, d)

    @rule()
    def update(self):
        pending = self.mem.has_pending_update()
        ctx = self.mem.init_update()
        want = (MemoryStatus.SUCCESS if self.twin.base.get_has_shift() or self.twin.swa.get_has_shift()
                or not self.twin.base.sc_info.empty() or not self.twin.swa.sc_info.empty()
                else MemoryStatus.NO_UPDATE)
        assert ctx.get_status() == want
        assert pending == (want == MemoryStatus.SUCCESS)
        ctx.apply()
        for kv in (self.twin.base, self.twin.swa):
            kv.init_update().apply()

    @invariant()
    def same(self):
        if not hasattr(self, "mem"):
            return
        assert cells_of(self.mem.get_base()) == cells_of(self.twin.base)
        assert cells_of(self.mem.get_swa()) == cells_of(self.twin.swa)
        for s in range(self.n_seq):
            assert self.mem.seq_pos_min(s) == self.twin.swa.seq_pos_min(s)
            assert self.mem.seq_pos_max(s) == self.twin.swa.seq_pos_max(s)


_SM = settings(max_examples=25, stateful_step_count=40, deadline=None)


def _machine(name, cfg):
    case = type(name, (ISWAMachine,), dict(CFG=cfg)).TestCase
    case.settings = _SM
    return case


TestISWAOneSeq = _machine("ISWAOneSeq", dict(n_swa=5, kv_size=512, n_seq=1, unified=True, n_ubatch=8))
TestISWAUnified = _machine("ISWAUnified", dict(n_swa=50, kv_size=512, n_seq=3, unified=True, n_ubatch=4))
TestISWAStreams = _machine("ISWAStreams", dict(n_swa=20, kv_size=512, n_seq=2, unified=False, n_ubatch=8))


# ------------------------------------------------------------------------------------------------ state

def filled(rng, n_seq=3, unified=True, **kw):
    """Three sequences of 100..300 tokens (the SWA cache wrapped), random K/V bytes in both caches."""
    mem = make(n_swa=7, kv_size=1024, n_seq_max=n_seq, unified=unified, **kw)
    for kv in (mem.get_base(), mem.get_swa()):
        for layer in kv.layers:
            for t in (layer.k, layer.v):
                a = rng.integers(0, 256, G.nbytes(t), dtype=np.uint8)
                G.ggml_backend_tensor_set(t, a.ctypes.data, 0, a.size)
    for s in range(n_seq):
        n = 100 * (s + 1)
        for p0 in range(0, n, 50):
            assert decode(mem, list(range(p0, p0 + 50)), [s] * 50, 16).get_status() == MemoryStatus.SUCCESS
    return mem


@pytest.mark.parametrize("unified", [True, False])
def test_state_is_base_then_swa_and_round_trips(unified):
    rng = np.random.default_rng(1)
    mem = filled(rng, unified=unified)
    base, swa = mem.get_base(), mem.get_swa()
    whole = mem.state_save()
    assert whole == base.state_save() + swa.state_save()
    assert mem.state_size() == len(whole)
    for s in range(3):
        assert mem.state_save(s) == base.state_save(s) + swa.state_save(s)
        assert mem.state_save(s, PARTIAL) == swa.state_save(s)
        assert mem.state_size(s, PARTIAL) == len(swa.state_save(s))
    other = make(n_swa=7, kv_size=1024, n_seq_max=3, unified=unified)
    assert other.state_load(whole) == len(whole)
    assert other.state_save() == whole
    for s in range(3):
        assert other.seq_pos_min(s) == mem.seq_pos_min(s) and other.seq_pos_max(s) == mem.seq_pos_max(s)
    # one sequence into an empty cache: the same state comes back
    one = make(n_swa=7, kv_size=1024, n_seq_max=3, unified=unified)
    blob = mem.state_save(2)
    assert one.state_load(blob, 2) == len(blob)
    assert one.state_save(2) == blob and one.seq_pos_max(1) == -1
    for kv in (mem, other, one):
        kv.close()


def test_partial_state_restores_the_swa_cache_only():
    rng = np.random.default_rng(2)
    mem = filled(rng, n_seq=1)
    cp = mem.state_save(0, PARTIAL)
    held = (mem.seq_pos_min(0), mem.seq_pos_max(0))
    for p0 in range(100, 400, 50):
        decode(mem, list(range(p0, p0 + 50)), [0] * 50, 16)
    assert mem.seq_pos_min(0) > held[1]          # the SWA cache forgot everything the checkpoint holds
    base_before = cells_of(mem.get_base())
    assert mem.state_load(cp, 0, PARTIAL) == len(cp)
    assert (mem.seq_pos_min(0), mem.seq_pos_max(0)) == held
    assert mem.get_swa().state_save(0) == cp
    assert cells_of(mem.get_base()) == base_before
    mem.close()


@pytest.mark.parametrize("seq_id", [-1, 1])
def test_failed_restore_leaves_both_caches_as_after_a_failed_restore(seq_id):
    rng = np.random.default_rng(3)
    mem = filled(rng)
    blob = mem.state_save(seq_id)
    n_base = len(mem.get_base().state_save(seq_id))
    for cut in (n_base // 2, n_base + 20):       # in the base part; in the SWA part (the base part restored)
        fresh = filled(np.random.default_rng(4))
        with pytest.raises(ValueError):
            fresh.state_load(blob[:cut], seq_id)
        for kv in (fresh.get_base(), fresh.get_swa()):
            if seq_id == -1:
                assert all(c.get_used() == 0 for c in kv.v_cells)
            else:
                assert kv.seq_pos_max(1) == -1 and kv.seq_pos_max(0) == 99 and kv.seq_pos_max(2) == 299
        fresh.close()
    # trailing bytes: refused the same way
    fresh = filled(np.random.default_rng(4))
    with pytest.raises(ValueError, match="trailing"):
        fresh.state_load(blob + b"\0", seq_id)
    assert fresh.get_base().seq_pos_max(1) == -1 and fresh.get_swa().seq_pos_max(1) == -1
    fresh.close()
    mem.close()


def test_bad_arguments_change_nothing():
    rng = np.random.default_rng(5)
    mem = filled(rng)
    before = (cells_of(mem.get_base()), cells_of(mem.get_swa()))
    blob = mem.state_save(0)
    for bad in (-2, 256):
        with pytest.raises(ValueError, match="seq_id"):
            mem.state_load(blob, bad)
        with pytest.raises(ValueError, match="seq_id"):
            mem.seq_rm(bad - (bad == -2), 0, -1)
    assert (cells_of(mem.get_base()), cells_of(mem.get_swa())) == before
    mem.close()

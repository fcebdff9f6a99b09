"""KVCache bookkeeping: hand-worked cases from the seed and a state machine against the brute-force model."""
import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvcache_ggml.batch import Batch, BatchAllocator
from kvcache_ggml.cache import KVCache, KVCacheParams, MemoryStatus, SlotInfo
from kvcache_ggml.hparams import RopeType, SwaType
from kvcache_ggml.inspect import check_invariants

from helpers import N_VOCAB, ToyModel, assert_same_snapshot, decode, snapshot
from helpers import make_cache as make
from kvmodel import ModelCache

# ---------------------------------------------------------------------------------------------- hand-worked cases

def test_decode_places_from_head_and_moves_it():
    kv = make(16)
    _, cells = decode(kv, [0, 1, 2], [0, 0, 0])
    assert cells == [0, 1, 2] and kv.v_heads == [3]
    _, cells = decode(kv, [3], [0])
    assert cells == [3] and kv.v_heads == [4]
    assert kv.seq_pos_min(0) == 0 and kv.seq_pos_max(0) == 3


def test_seq_rm_lowers_head_to_first_freed_cell():
    kv = make(16)
    decode(kv, list(range(6)), [0] * 6)
    kv.seq_rm(0, 2, 4)
    assert kv.v_heads == [2]
    np.testing.assert_array_equal(kv.v_cells[0].pos_array[:6], [0, 1, -1, -1, 4, 5])
    # freeing cells above the head does not move it
    kv.seq_rm(0, 5, -1)
    assert kv.v_heads == [2]


def test_seq_add_resets_head_and_frees_negative_cells():
    kv = make(16)
    decode(kv, list(range(6)), [0] * 6)
    kv.seq_add(0, 0, 2, -1)  # positions 0,1 -> -1 (freed), 0
    np.testing.assert_array_equal(kv.v_cells[0].pos_array[:6], [-1, 0, 2, 3, 4, 5])
    assert kv.v_heads == [0] and kv.get_has_shift()
    kv.seq_add(0, 10, 20, 5)  # no cell matched: head still reset to 0 (the seed always moves it)
    assert kv.v_heads == [0]
    kv.seq_add(0, 3, 3, 5)  # empty range: nothing at all
    assert kv.v_cells[0].pos_get(3) == 3


def test_seq_div_and_shift():
    kv = make(16)
    decode(kv, list(range(6)), [0] * 6)
    kv.seq_div(0, 2, -1, 2)
    np.testing.assert_array_equal(kv.v_cells[0].pos_array[:6], [0, 1, 1, 1, 2, 2])
    np.testing.assert_array_equal(kv.v_cells[0].shift_array[:6], [0, 0, 1, 2, 2, 3])


def test_head_heuristic_restarts_search_from_zero():
    kv = make(32)
    decode(kv, list(range(20)), [0] * 20)
    kv.seq_rm(0, 0, 16)  # 4 used, head stays at 0 (lowered)
    assert kv.v_heads == [0]
    kv.v_heads[0] = 25  # head far beyond used + 2*n_tokens -> search restarts at 0
    _, cells = decode(kv, [20], [0])
    assert cells == [0]


def test_find_slot_wraps_around():
    kv = make(8)
    decode(kv, list(range(8)), [0] * 8)
    kv.seq_rm(0, 0, 2)  # cells 0, 1 free; head -> 0
    kv.v_heads[0] = 7   # 7 > used(6) + 2? yes -> restart at 0; force a wrap with head 6 instead
    kv.v_heads[0] = 6
    _, cells = decode(kv, [8, 9], [0, 0])
    assert cells == [0, 1]


def test_multi_stream_seq_cp_copies_cells_and_queues_copy():
    kv = make(8, n_seq_max=2, unified=False)
    decode(kv, [0, 1, 2], [0, 0, 0])
    kv.seq_add(0, 1, -1, 2)  # shifted positions 3, 4
    kv.seq_cp(0, 1, -1, -1)
    assert kv.sc_info.ssrc == [0] and kv.sc_info.sdst == [1]
    np.testing.assert_array_equal(kv.v_cells[1].pos_array[:3], [0, 3, 4])
    np.testing.assert_array_equal(kv.v_cells[1].shift_array[:3], [0, 2, 2])
    assert kv.v_cells[1].seq_has(0, 1) and not kv.v_cells[1].seq_has(0, 0)
    assert kv.v_heads[1] == kv.v_heads[0]
    uctx = kv.init_update()
    assert uctx.get_status() == MemoryStatus.SUCCESS and kv.sc_info.empty()


def test_seq_cp_across_streams_rejects_partial_range_and_changes_nothing():
    kv = make(8, n_seq_max=2, unified=False)
    decode(kv, [0, 1, 2], [0, 0, 0])
    before = snapshot(kv)
    with pytest.raises(ValueError, match="whole sequences"):
        kv.seq_cp(0, 1, 1, 3)
    assert_same_snapshot(before, snapshot(kv))
    assert kv.sc_info.empty()


def test_bad_sequence_ids_raise_and_change_nothing():
    kv = make(8, n_seq_max=2, unified=False)
    decode(kv, [0, 1], [1, 1])
    before = snapshot(kv)
    for call in (lambda: kv.seq_rm(2, -1, -1), lambda: kv.seq_rm(-2, -1, -1), lambda: kv.seq_cp(0, 5, -1, -1),
                 lambda: kv.seq_keep(9), lambda: kv.seq_add(2, 0, 1, 1), lambda: kv.seq_div(3, 0, 1, 2),
                 lambda: kv.seq_pos_min(2), lambda: kv.seq_div(0, 0, 1, 0)):
        with pytest.raises(ValueError):
            call()
    assert_same_snapshot(before, snapshot(kv))
    # a unified cache accepts every id below LLAMA_MAX_SEQ for the memory API
    kvu = make(8)
    assert kvu.seq_pos_max(255) == -1
    with pytest.raises(ValueError, match=r"256"):
        kvu.seq_pos_max(256)


def test_arguments_that_are_not_integers_raise_type_errors_naming_them_and_change_nothing():
    """llama_seq_id and llama_pos are integers: a float, None or a string is a TypeError naming the method and the
    argument, raised before anything changes.  Before, seq_rm(1, 1.5) removed positions >= 2, seq_add with a shift
    of 1.5 moved cells, and a NaN position failed an internal assertion.  Numpy integers are integers."""
    kv = make(16, n_seq_max=3)
    decode(kv, list(range(6)), [1] * 6)
    before = snapshot(kv)
    nan = float("nan")
    for method, args, arg in [("seq_rm", (1, 1.5, -1), "p0"), ("seq_rm", (1, nan, 3), "p0"), ("seq_rm", (1.0, 0, -1),
                              "seq_id"), ("seq_rm", (1, 0, None), "p1"), ("seq_cp", (1, 2, 0, 2.5), "p1"),
                              ("seq_cp", ("1", 2, 0, -1), "seq_id_src"), ("seq_cp", (1, 2.0, 0, -1), "seq_id_dst"),
                              ("seq_keep", (1.0,), "seq_id"), ("seq_add", (1, 0, -1, 1.5), "shift"),
                              ("seq_add", (1, 0, -1, np.float64(1)), "shift"), ("seq_div", (1, 0, -1, 2.0), "d"),
                              ("seq_div", (1, nan, -1, 2), "p0"), ("seq_pos_min", (None,), "seq_id"),
                              ("seq_pos_max", ("1",), "seq_id")]:
        with pytest.raises(TypeError, match=rf"^{method}\(\) {arg} must be an integer, got "):
            getattr(kv, method)(*args)
        assert_same_snapshot(before, snapshot(kv))
    blob = kv.state_save(1)
    for method, args, arg in [("state_save", (1.0,), "seq_id"), ("state_size", (None,), "seq_id"),
                              ("state_load", (blob, 1.5), "seq_id"), ("check_seq_state", (1.0,), "seq_id"),
                              ("get_used", (0.0,), "stream")]:
        with pytest.raises(TypeError, match=rf"^{method}\(\) {arg} must be an integer, got "):
            getattr(kv, method)(*args)
        assert_same_snapshot(before, snapshot(kv))
    assert kv.seq_pos_max(np.int64(1)) == 5 and kv.seq_rm(np.int32(1), np.int64(4), np.int16(-1))
    assert kv.seq_pos_max(1) == 3 and kv.get_used(np.int64(0)) == 4


def test_seq_add_on_mrope_model_raises():
    kv = KVCache(ToyModel(rope_type=RopeType.MROPE), kv_size=8)
    with pytest.raises(ValueError, match="n_pos_per_embd"):
        kv.seq_add(0, 0, 1, 1)


def test_full_cache_fails_prepare_with_cells_unchanged():
    kv = make(8)
    decode(kv, list(range(6)), [0] * 6)
    before = snapshot(kv)
    ctx, _ = decode(kv, [6, 7, 8], [0, 0, 0])
    assert ctx.get_status() == MemoryStatus.FAILED_PREPARE
    assert_same_snapshot(before, snapshot(kv))


def test_prepare_rolls_back_every_ubatch():
    kv = make(8)
    decode(kv, [0, 1], [0, 0])
    before = snapshot(kv)
    ba = BatchAllocator(1)
    ba.init(Batch(token=np.full(6, 3), seq_id=[[0]] * 6), N_VOCAB, kv, 16, 1, False)
    ctx = kv.init_batch(ba, 2)  # three ubatches of 2
    assert ctx.get_status() == MemoryStatus.SUCCESS and len(ctx.sinfos) == 3
    assert [si.idxs[0].tolist() for si in ctx.sinfos] == [[2, 3], [4, 5], [6, 7]]
    assert_same_snapshot(before, snapshot(kv))


def test_ubatch_larger_than_cache_raises():
    kv = make(4)
    ba = BatchAllocator(1)
    ba.init(Batch(token=np.full(6, 3)), N_VOCAB, kv, 16, 1, False)
    with pytest.raises(ValueError, match="never fit"):
        kv.init_batch(ba, 512)


def test_swa_reuses_masked_cells_and_purges():
    kv = make(4, n_swa=2, swa_type=SwaType.STANDARD)
    decode(kv, [0, 1, 2, 3], [0] * 4)
    # cache full; positions 0 and 1 are outside the window of the next token (pos 4: 4 - p >= 2 for p <= 2)
    _, cells = decode(kv, [4], [0])
    assert cells == [0]
    np.testing.assert_array_equal(kv.v_cells[0].pos_array, [4, 1, 2, 3])
    # overwriting position 0 purges nothing below it; next overwrite of pos 1 keeps [2..5] contiguous
    _, cells = decode(kv, [5], [0])
    assert cells == [1]
    assert kv.seq_pos_min(0) == 2 and kv.seq_pos_max(0) == 5


def test_init_full_and_update_contexts():
    kv = make(16, n_seq_max=3, unified=False)
    ctx = kv.init_full()
    si = ctx.get_sinfo()
    assert ctx.get_n_kv() == 16 and si.s0 == 0 and si.s1 == 2 and si.strm == [0, 1, 2]
    assert kv.init_update().get_status() == MemoryStatus.NO_UPDATE
    decode(kv, [0, 1], [0, 0])
    kv.seq_add(0, 0, -1, 3)
    assert kv.init_update().get_status() == MemoryStatus.SUCCESS


def test_get_n_kv_pads_to_256():
    kv = make(1024, n_pad=32)
    ctx, _ = decode(kv, list(range(10)), [0] * 10)
    assert ctx.get_n_kv() == 256
    kv2 = make(200)
    ctx, _ = decode(kv2, [0], [0])
    assert ctx.get_n_kv() == 200  # capped at the cache size


def test_get_n_kv_pads_like_ggml_pad():
    # GGML_PAD(x, n) = (x + n - 1) & ~(n - 1): a true multiple only for powers of two
    kv = make(2304, n_pad=768)
    ctx, _ = decode(kv, list(range(770)), [0] * 770)
    assert ctx.get_n_kv() == (770 + 767) & ~767 == 1024


def test_slot_info_helpers():
    si = SlotInfo(s0=0, s1=0, strm=[0], idxs=[np.array([3, 4, 5])])
    assert si.is_contiguous() and si.head() == 3 and si.size() == 3 and si.n_stream() == 1 and not si.empty()
    assert not SlotInfo(s0=0, s1=0, strm=[0], idxs=[np.array([3, 5])]).is_contiguous()
    assert SlotInfo().empty()


def test_constructor_validation():
    with pytest.raises(ValueError, match="multiple of n_pad"):
        make(30, n_pad=8)
    with pytest.raises(ValueError, match="n_seq_max"):
        make(8, n_seq_max=257)
    with pytest.raises(TypeError):
        KVCache(ToyModel(), KVCacheParams(), kv_size=8)


def test_seq_div_divisor_beyond_int32_raises_and_changes_nothing():
    kv = make(16)
    decode(kv, list(range(5)), [0] * 5)
    before = snapshot(kv)
    with pytest.raises(ValueError, match="divisor"):
        kv.seq_div(0, -1, -1, 2**31)
    assert_same_snapshot(before, snapshot(kv))
    assert check_invariants(kv) == []


def test_seq_add_shift_beyond_int32_raises_and_changes_nothing():
    kv = make(16)
    decode(kv, list(range(5)), [0] * 5)
    before = snapshot(kv)
    with pytest.raises(ValueError, match="int32"):
        kv.seq_add(0, -1, -1, 2**31)
    assert_same_snapshot(before, snapshot(kv))


def test_cell_at_int32_max_is_outside_every_range_as_in_the_seed():
    # the seed's pos_in is strict: p1 = -1 becomes INT32_MAX, so a cell at INT32_MAX is never matched
    for n in (5, 70):  # the few-cells path and the full-scan path
        kv = make(128)
        decode(kv, list(range(n)), [0] * n)
        kv.seq_add(0, n - 1, n, 2**31 - 1 - (n - 1))
        assert kv.seq_pos_max(0) == 2**31 - 1
        kv.seq_rm(0, -1, -1)
        assert kv.v_cells[0].get_used() == 1 and kv.seq_pos_max(0) == 2**31 - 1


# ---------------------------------------------------------------------------------------------- state machine

def ub_dict(ub):
    n = ub.n_tokens
    return dict(n_tokens=n, pos=ub.pos.tolist(), n_pos=ub.n_pos,
                seq_ids=[[int(s) for s in row[:k]] for row, k in zip(ub.seq_id, ub.n_seq_id)],
                seq_id_unq=ub.seq_id_unq.tolist())


def compare(kv: KVCache, m: ModelCache):
    assert kv.v_heads == m.heads
    for strm, cells in enumerate(kv.v_cells):
        mc = m.cells[strm]
        np.testing.assert_array_equal(cells.pos_array, [c.pos for c in mc], err_msg=f"stream {strm} pos")
        np.testing.assert_array_equal(cells.shift_array, [c.shift for c in mc], err_msg=f"stream {strm} shift")
        for i, c in enumerate(mc):
            bits = cells.seq_bits[:, i]
            got = {w * 64 + b for w in range(4) for b in range(64) if int(bits[w]) >> b & 1}
            assert got == c.seqs, f"stream {strm} cell {i}"
        assert cells.get_used() == m.used(strm)
        assert cells.used_max_p1() == m.used_max_p1(strm)
        assert cells.get_has_shift() == m.has_shift[strm]
        for s in range(min(m.n_seq_ids, 8)):
            assert cells.seq_pos_min(s) == m.pos_min(strm, s) and cells.seq_pos_max(s) == m.pos_max(strm, s)


class CacheMachine(RuleBasedStateMachine):
    CFG = dict(kv_size=24, n_seq_max=3, unified=True)
    COUPLED = True

    @initialize()
    def setup(self):
        c = self.CFG
        self.kv = make(c["kv_size"], c["n_seq_max"], c["unified"], n_swa=c.get("n_swa", 0),
                       swa_type=c.get("swa_type", 0))
        self.m = ModelCache(c["kv_size"], c["n_seq_max"], c["unified"], c.get("n_swa", 0), c.get("swa_type", 0))
        self.n_seq = c["n_seq_max"]

    @rule(data=st.data(), n_ubatch=st.sampled_from([1, 2, 3, 512]), auto_pos=st.booleans())
    def decode(self, data, n_ubatch, auto_pos):
        seqs = data.draw(st.lists(st.integers(0, self.n_seq - 1), min_size=1, max_size=3, unique=True))
        toks, pos = [], []
        for s in seqs:
            k = data.draw(st.integers(1, 4))
            p0 = self.m.seq_pos_max(s) + 1
            for j in range(k):
                row = [s]
                if self.COUPLED and data.draw(st.integers(0, 5)) == 0:
                    other = data.draw(st.integers(0, self.n_seq - 1))
                    if other != s and self.m.seq_pos_max(other) + 1 == p0 + j:
                        row.append(other)
                toks.append(row)
                pos.append(p0 + j)
        order = data.draw(st.permutations(range(len(toks)))) if data.draw(st.booleans()) else range(len(toks))
        toks = [toks[i] for i in order]
        pos = [pos[i] for i in order]
        before = snapshot(self.kv)
        ba = BatchAllocator(1)
        try:
            ba.init(Batch(token=np.full(len(toks), 3), pos=None if auto_pos else pos, seq_id=toks),
                    N_VOCAB, self.kv, 16, self.n_seq, False)
        except ValueError:
            assert_same_snapshot(before, snapshot(self.kv))
            return
        try:
            ctx = self.kv.init_batch(ba, n_ubatch)
        except ValueError:
            assert_same_snapshot(before, snapshot(self.kv))
            return
        ba.split_reset()
        ubs = []
        while True:
            ub = ba.split_simple(n_ubatch) if self.kv.n_stream == 1 else ba.split_equal(n_ubatch, True)
            if ub.n_tokens == 0:
                break
            ubs.append(ub)
        slots = self.m.prepare([ub_dict(u) for u in ubs])
        if slots is None:
            assert ctx.get_status() == MemoryStatus.FAILED_PREPARE
            compare(self.kv, self.m)
            return
        assert ctx.get_status() == MemoryStatus.SUCCESS
        compare(self.kv, self.m)
        for k, ub in enumerate(ubs):
            ctx.apply()
            si = ctx.get_sinfo()
            assert [(st_, idx.tolist()) for st_, idx in zip(si.strm, si.idxs)] == slots[k]
            self.m.apply(slots[k], ub_dict(ub))
            compare(self.kv, self.m)
            ctx.next()

    @rule(data=st.data(), p0=st.integers(-1, 12), n=st.integers(-1, 8))
    def seq_rm(self, data, p0, n):
        s = data.draw(st.integers(-1, self.n_seq - 1))
        p1 = -1 if n < 0 else p0 + n
        self.kv.seq_rm(s, p0, p1)
        self.m.seq_rm(s, p0, p1)

    @rule(data=st.data(), p0=st.integers(-1, 12), n=st.integers(-1, 8))
    def seq_cp(self, data, p0, n):
        a = data.draw(st.integers(0, self.n_seq - 1))
        b = data.draw(st.integers(0, self.n_seq - 1))
        if self.kv.n_stream > 1:
            p0, n = -1, -1
        p1 = -1 if n < 0 else p0 + n
        self.kv.seq_cp(a, b, p0, p1)
        self.m.seq_cp(a, b, p0, p1)

    @rule(data=st.data())
    def seq_keep(self, data):
        s = data.draw(st.integers(0, self.n_seq - 1))
        self.kv.seq_keep(s)
        self.m.seq_keep(s)

    @rule(data=st.data(), p0=st.integers(-1, 12), n=st.integers(-1, 8), d=st.integers(-6, 6))
    def seq_add(self, data, p0, n, d):
        s = data.draw(st.integers(0, self.n_seq - 1))
        p1 = -1 if n < 0 else p0 + n
        self.kv.seq_add(s, p0, p1, d)
        self.m.seq_add(s, p0, p1, d)

    @rule(data=st.data(), p0=st.integers(-1, 12), n=st.integers(-1, 8), d=st.integers(1, 4))
    def seq_div(self, data, p0, n, d):
        s = data.draw(st.integers(0, self.n_seq - 1))
        p1 = -1 if n < 0 else p0 + n
        self.kv.seq_div(s, p0, p1, d)
        self.m.seq_div(s, p0, p1, d)

    @rule()
    def update(self):
        self.kv.init_update().apply()
        self.m.reset_shift()

    @invariant()
    def same(self):
        if hasattr(self, "kv"):
            compare(self.kv, self.m)


_SM = settings(max_examples=80, stateful_step_count=30, deadline=None)  # 2400 steps per configuration


def _machine(name, cfg, coupled=True):
    cls = type(name, (CacheMachine,), dict(CFG=cfg, COUPLED=coupled))
    case = cls.TestCase
    case.settings = _SM
    return case


TestUnifiedOneSeq = _machine("UnifiedOneSeq", dict(kv_size=16, n_seq_max=1, unified=True))
TestUnifiedThreeSeqs = _machine("UnifiedThreeSeqs", dict(kv_size=24, n_seq_max=3, unified=True))
TestMultiStream = _machine("MultiStream", dict(kv_size=12, n_seq_max=3, unified=False), coupled=False)
TestUnifiedSwaStandard = _machine("UnifiedSwaStandard",
                                  dict(kv_size=12, n_seq_max=2, unified=True, n_swa=4, swa_type=1))
TestUnifiedSwaChunked = _machine("UnifiedSwaChunked",
                                 dict(kv_size=12, n_seq_max=2, unified=True, n_swa=4, swa_type=2))
TestMultiStreamSwa = _machine("MultiStreamSwa", dict(kv_size=8, n_seq_max=2, unified=False, n_swa=3, swa_type=1),
                              coupled=False)


def test_debug_level_is_read_as_c_atoi_reads_it(monkeypatch):
    # what glibc's atoi gives for each (hand-checked): whitespace and a sign, then the leading ASCII digits; else 0
    from kvcache_ggml._env import atoi
    for text, want in ((" 2", 2), ("+3", 3), ("-1", -1), ("12x", 12), ("7_0", 7), ("0x10", 0), ("--5", 0),
                       ("- 5", 0), ("x", 0), ("", 0), ("\u00b2", 0), ("\u0663", 0)):
        assert atoi(text) == want, text
    monkeypatch.setenv("LLAMA_KV_CACHE_DEBUG", "--5")  # (int() of it raised while the cache was made)
    assert make(8).book.debug == 0
    monkeypatch.setenv("LLAMA_KV_CACHE_DEBUG", " 1")
    assert make(8).book.debug == 1

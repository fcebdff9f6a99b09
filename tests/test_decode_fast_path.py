"""The decode fast paths against the general paths, on the same random traces.

Two caches (and two allocators) receive the same operations: one as built (fast paths on), one with every fast
path turned off (``BatchAllocator.fast``, ``KVBookkeeping.fast``, ``KVInputs.fast``: the general code that the
golden traces check against llama.cpp).  After every operation both must agree on everything observable: the
outcome (or the error and its message), the allocator's filled-in batch, every ubatch field, every slot, n_kv,
the K/V index inputs and the kq mask bytes (F32 and F16, causal and not, right after each apply and again later
after other operations), every cell, head and sequence range, and the state blobs.  The traces favour the decode
step (one token of each of several sequences, the undo of a step) and mix in what disturbs the fast paths: longer
batches, coupled sequences, errors, seq_cp/seq_keep/seq_add/seq_div, clear, state restore, stream copies, a
sliding window, n_kv growth past 256 cells, and a ready-row budget of two rows (eviction).
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcache_ggml import ggml as G
from kvcache_ggml.batch import Batch, BatchAllocator
from kvcache_ggml.cache.inputs import host_tensor
from kvcache_ggml.cache import MemoryStatus
from kvcache_ggml.hparams import SwaType
from kvcache_ggml.inspect import check_invariants

from helpers import N_VOCAB, make_cache, snapshot

UB_FIELDS = ("n_tokens", "n_seq_tokens", "n_seqs", "n_seqs_unq", "n_pos", "b_equal_seqs", "token", "embd", "pos",
             "n_seq_id", "seq_id", "seq_id_unq", "seq_idx", "output")


def general(kv, ba=None):
    """Turn every fast path of ``kv`` (and of the allocator ``ba``) off."""
    kv.set_fast_paths(False)
    if ba is not None:
        ba.fast = False


def same_value(a, b, what):
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), what
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        assert a.tobytes() == b.tobytes(), f"{what}: {a} vs {b}"
    else:
        assert a == b, f"{what}: {a!r} vs {b!r}"


def same_ubatch(a, b):
    for f in UB_FIELDS:
        same_value(getattr(a, f), getattr(b, f), f"ubatch.{f}")
    for u in (a, b):  # a one-token decode ubatch's ints are its arrays' values
        if u.one is not None:
            assert u.n_tokens == 1 and u.n_pos == 1 and u.seq_id.shape == (1, 1), u
            assert u.one == (int(u.seq_id[0, 0]), int(u.pos[0])), (u.one, u.seq_id, u.pos)


def same_allocator(a: BatchAllocator, b: BatchAllocator):
    ga, gb = a.get_batch(), b.get_batch()
    for f in ("token", "embd", "pos", "n_seq_id", "seq_id", "logits", "n_tokens"):
        same_value(getattr(ga, f), getattr(gb, f), f"batch.{f}")
    assert a.get_n_outputs() == b.get_n_outputs() and a.get_n_tokens() == b.get_n_tokens()
    for s in range(8):
        assert (a.seq_pos_min(s), a.seq_pos_max(s)) == (b.seq_pos_min(s), b.seq_pos_max(s))


def same_cache(a, b):
    sa, sb = snapshot(a), snapshot(b)
    for k, (x, y) in enumerate(zip(sa, sb, strict=True)):
        if isinstance(x, list) and x and isinstance(x[0], np.ndarray):
            for u, v in zip(x, y, strict=True):
                np.testing.assert_array_equal(u, v, err_msg=f"snapshot part {k}")
        else:
            assert x == y, f"snapshot part {k}: {x} vs {y}"
    for ca, cb in zip(a.v_cells, b.v_cells, strict=True):
        np.testing.assert_array_equal(ca.ext_array, cb.ext_array)
        assert ca.seq_ids() == cb.seq_ids()
        for s in ca.seq_ids():
            assert (ca.seq_pos_min(s), ca.seq_pos_max(s)) == (cb.seq_pos_min(s), cb.seq_pos_max(s))
    assert check_invariants(a) == [] and check_invariants(b) == []


def same_inputs(ca, cb, type_):
    """The current ubatch's index inputs and kq masks of two applied contexts, bit for bit."""
    same_value(ca.k_idxs(), cb.k_idxs(), "k_idxs")
    same_value(ca.v_idxs(), cb.v_idxs(), "v_idxs")
    for causal in (True, False):
        ma, mb = ca.kq_mask(causal, type_), cb.kq_mask(causal, type_)
        same_value(ma.view(np.uint8), mb.view(np.uint8), f"kq_mask causal={causal} {type_}")


class FastGeneralMachine(RuleBasedStateMachine):
    """The same trace on a cache with its fast paths and on one without."""

    CFG = dict(kv_size=24, n_seq_max=3, unified=True)

    @initialize(type_=st.sampled_from(["f32", "f16"]))
    def setup(self, type_):
        c = self.CFG
        kw = dict(n_swa=c.get("n_swa", 0), swa_type=c.get("swa_type", SwaType.NONE), v_trans=c.get("v_trans", True))
        self.fast = make_cache(c["kv_size"], c["n_seq_max"], c["unified"], **kw)
        self.slow = make_cache(c["kv_size"], c["n_seq_max"], c["unified"], **kw)
        general(self.slow)
        if "rows_budget" in c:
            self.fast.inputs.mask_rows.budget = c["rows_budget"]
        self.n_seq = c["n_seq_max"]
        self.type_ = type_
        self.ctxs = None  # the last decode's contexts (fast, general), kept for later masks

    def teardown(self):
        for kv in (getattr(self, "fast", None), getattr(self, "slow", None)):
            if kv is not None:
                kv.close()

    # ------------------------------------------------------------------ batches

    def _batch(self, data, decode_shaped):
        """Tokens, positions (or None), sequence rows, output flags (or None) of a random batch."""
        seqs = data.draw(st.lists(st.integers(0, self.n_seq - 1), min_size=1, max_size=self.n_seq, unique=True))
        rows, pos = [], []
        for s in seqs:
            k = 1 if decode_shaped else data.draw(st.integers(1, 3))
            # now and then a position that breaks the sequence (an error on both paths); never -1, which llama.cpp
            # accepts but which leaves a cell that holds a sequence at an empty cell's position (both the seed's and
            # our position multisets then disagree with the cells: see the test at the end)
            p0 = max(0, self.fast.seq_pos_max(s) + 1 + (data.draw(st.integers(-1, 1)) if not data.draw(
                st.integers(0, 7)) else 0))
            for j in range(k):
                row = [s]
                if not decode_shaped and self.CFG["unified"] and data.draw(st.integers(0, 4)) == 0:
                    other = data.draw(st.integers(0, self.n_seq - 1))
                    if other != s:
                        row.append(other)
                rows.append(row)
                pos.append(p0 + j)
        order = data.draw(st.permutations(range(len(rows))))
        rows, pos = [rows[i] for i in order], [pos[i] for i in order]
        n = len(rows)
        logits = data.draw(st.sampled_from([None, "ones", "last", "random"]))
        out = (None if logits is None else np.ones(n, np.int8) if logits == "ones" else
               (np.arange(n) == n - 1).astype(np.int8) if logits == "last" else
               np.array(data.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)), np.int8))
        return rows, (None if data.draw(st.booleans()) else pos), out

    def _init(self, kv, rows, pos, out, token_dtype, seq_as_array, output_all, fast):
        ba = BatchAllocator(1)
        if not fast:
            ba.fast = False
        seq = (np.array([r[0] for r in rows], np.int32).reshape(-1, 1) if seq_as_array else rows)
        batch = Batch(token=np.full(len(rows), 3, token_dtype), pos=None if pos is None else np.array(pos, np.int32),
                      seq_id=seq, logits=out)
        try:
            ba.init(batch, N_VOCAB, kv, 16, self.n_seq, output_all)
        except ValueError as e:
            return None, str(e)
        return ba, None

    @rule(data=st.data(), decode_shaped=st.sampled_from([True, True, True, False]),
          n_ubatch=st.sampled_from([1, 2, 3, 512]), output_all=st.sampled_from([False, False, True]))
    def decode(self, data, decode_shaped, n_ubatch, output_all):
        rows, pos, out = self._batch(data, decode_shaped)
        token_dtype = data.draw(st.sampled_from([np.int32, np.int64]))
        seq_as_array = all(len(r) == 1 for r in rows) and data.draw(st.booleans())
        self._decode(rows, pos, out, token_dtype, seq_as_array, output_all, n_ubatch)

    @rule(data=st.data(), n_steps=st.integers(2, 12))
    def decode_run(self, data, n_steps):
        """Several one-token steps of the same sequences in a row (over a small cache with a window: the window
        wraps and the steps land on cells it left behind)."""
        seqs = data.draw(st.lists(st.integers(0, self.n_seq - 1), min_size=1, max_size=self.n_seq, unique=True))
        explicit = data.draw(st.booleans())
        for _ in range(n_steps):
            pos = [max(0, self.fast.seq_pos_max(s) + 1) for s in seqs] if explicit else None
            self._decode([[s] for s in seqs], pos, None, np.int32, False, False, 512)

    def _decode(self, rows, pos, out, token_dtype, seq_as_array, output_all, n_ubatch):
        """One decode of the same batch on both caches, everything compared after each step."""
        fa, ea = self._init(self.fast, rows, pos, out, token_dtype, seq_as_array, output_all, True)
        ga, eb = self._init(self.slow, rows, pos, out, token_dtype, seq_as_array, output_all, False)
        assert ea == eb
        if ea is not None:
            return
        same_allocator(fa, ga)
        results = []
        for kv, ba in ((self.fast, fa), (self.slow, ga)):
            try:
                results.append(kv.init_batch(ba, n_ubatch))
            except ValueError as e:
                results.append(str(e))
        ca, cb = results
        assert type(ca) is type(cb) and (not isinstance(ca, str) or ca == cb)
        if isinstance(ca, str):
            return
        assert ca.get_status() == cb.get_status()
        same_cache(self.fast, self.slow)
        if ca.get_status() != MemoryStatus.SUCCESS:
            return
        assert len(ca.ubatches) == len(cb.ubatches)
        while True:
            ca.apply()
            cb.apply()
            same_ubatch(ca.get_ubatch(), cb.get_ubatch())
            sa, sb = ca.get_sinfo(), cb.get_sinfo()
            assert sa.strm == sb.strm and [i.tolist() for i in sa.idxs] == [i.tolist() for i in sb.idxs]
            assert (sa.s0, sa.s1) == (sb.s0, sb.s1) and ca.get_n_kv() == cb.get_n_kv()
            same_cache(self.fast, self.slow)
            same_inputs(ca, cb, self.type_)
            na, nb = ca.next(), cb.next()
            assert na == nb
            if not na:
                break
        self.ctxs = (ca, cb)
        same_value(fa.get_out_ids(), ga.get_out_ids(), "out_ids")
        if fa.out_ids_in_order():  # (the runtime then skips get_out_ids)
            assert ga.get_out_ids().tolist() == list(range(ga.get_n_tokens()))

    @precondition(lambda self: self.ctxs is not None)
    @rule()
    def mask_again(self):
        """The last decode's last ubatch's inputs, after whatever happened since (n_kv stays the context's)."""
        ca, cb = self.ctxs
        ca.i_cur, cb.i_cur = len(ca.ubatches) - 1, len(cb.ubatches) - 1
        same_inputs(ca, cb, self.type_)

    # ------------------------------------------------------------------ memory operations

    def _both(self, name, *args):
        ra = rb = None
        try:
            ra = getattr(self.fast, name)(*args)
        except ValueError as e:
            ra = ("error", str(e))
        try:
            rb = getattr(self.slow, name)(*args)
        except ValueError as e:
            rb = ("error", str(e))
        assert ra == rb, f"{name}{args}: {ra} vs {rb}"

    @rule(data=st.data())
    def undo_newest(self, data):
        """seq_rm of a sequence's newest position: the undo of a decode step."""
        s = data.draw(st.integers(0, self.n_seq - 1))
        self._both("seq_rm", s, self.fast.seq_pos_max(s), -1)

    @rule(data=st.data(), p0=st.integers(-1, 12), n=st.integers(-1, 6))
    def seq_rm(self, data, p0, n):
        s = data.draw(st.integers(-1, self.n_seq - 1))
        self._both("seq_rm", s, p0, -1 if n < 0 else p0 + n)

    @rule(data=st.data(), p0=st.integers(-1, 12), n=st.integers(-1, 6))
    def seq_cp(self, data, p0, n):
        a, b = data.draw(st.integers(0, self.n_seq - 1)), data.draw(st.integers(0, self.n_seq - 1))
        if not self.CFG["unified"]:
            p0, n = -1, -1
        if self.CFG["unified"] and a != b:
            self._both("seq_rm", b, -1, -1)  # a copy onto cells holding the destination is a known deviation
        self._both("seq_cp", a, b, p0, -1 if n < 0 else p0 + n)

    @rule(data=st.data())
    def seq_keep(self, data):
        self._both("seq_keep", data.draw(st.integers(0, self.n_seq - 1)))

    @rule(data=st.data(), p0=st.integers(-1, 12), n=st.integers(-1, 6), d=st.integers(-4, 4))
    def seq_add(self, data, p0, n, d):
        self._both("seq_add", data.draw(st.integers(0, self.n_seq - 1)), p0, -1 if n < 0 else p0 + n, d)

    @rule(data=st.data(), d=st.integers(1, 3))
    def seq_div(self, data, d):
        self._both("seq_div", data.draw(st.integers(0, self.n_seq - 1)), -1, -1, d)

    @rule()
    def update(self):
        self.fast.init_update().apply()
        self.slow.init_update().apply()

    @rule()
    def clear(self):
        self.fast.clear()
        self.slow.clear()

    @rule(data=st.data())
    def state_restore(self, data):
        """Save a sequence (or everything) and load it back, as a host cache would."""
        s = data.draw(st.integers(-1, self.n_seq - 1))
        blob = self.fast.state_save(s)
        assert blob == self.slow.state_save(s)
        if s >= 0:
            self._both("seq_rm", s, -1, -1)
        # (no room when other sequences hold the cells, e.g. a full window of a copy: the same error on both)
        self._both("state_load", blob, s)

    @precondition(lambda self: self.CFG["kv_size"] > 256)
    @rule(data=st.data())
    def prefill(self, data):
        """A long prompt, so that n_kv grows past 256 cells."""
        s = data.draw(st.integers(0, self.n_seq - 1))
        n = data.draw(st.integers(100, 200))
        for kv, fast in ((self.fast, True), (self.slow, False)):
            ba = BatchAllocator(1)
            ba.fast = fast
            ba.init(Batch(token=np.full(n, 3, np.int32), seq_id=np.full(n, s, np.int32)), N_VOCAB, kv, 16,
                    self.n_seq, False)
            ctx = kv.init_batch(ba, 512)
            while ctx.get_status() == MemoryStatus.SUCCESS:
                ctx.apply()
                if not ctx.next():
                    break

    @invariant()
    def same(self):
        if hasattr(self, "fast"):
            same_cache(self.fast, self.slow)


_SM = settings(max_examples=40, stateful_step_count=30, deadline=None)


def _machine(name, **cfg):
    case = type(name, (FastGeneralMachine,), dict(CFG=cfg)).TestCase
    case.settings = _SM
    return case


TestUnifiedOne = _machine("UnifiedOne", kv_size=16, n_seq_max=1, unified=True)
TestUnifiedFour = _machine("UnifiedFour", kv_size=24, n_seq_max=4, unified=True)
TestUnifiedEvict = _machine("UnifiedEvict", kv_size=24, n_seq_max=4, unified=True, rows_budget=24 * 4 * 2)
TestStreams = _machine("Streams", kv_size=12, n_seq_max=3, unified=False)
TestStreamsNoVTrans = _machine("StreamsNoVTrans", kv_size=12, n_seq_max=3, unified=False, v_trans=False)
TestSwa = _machine("Swa", kv_size=12, n_seq_max=2, unified=True, n_swa=4, swa_type=SwaType.STANDARD)
# small caches whose window wraps within a trace: one-token steps over cells the window left behind
TestSwaWrapOne = _machine("SwaWrapOne", kv_size=6, n_seq_max=1, unified=True, n_swa=2, swa_type=SwaType.STANDARD)
TestSwaWrapUnified = _machine("SwaWrapUnified", kv_size=8, n_seq_max=3, unified=True, n_swa=2,
                              swa_type=SwaType.STANDARD)
TestSwaWrapChunked = _machine("SwaWrapChunked", kv_size=8, n_seq_max=2, unified=True, n_swa=3,
                              swa_type=SwaType.CHUNKED)
TestSwaWrapStreams = _machine("SwaWrapStreams", kv_size=6, n_seq_max=3, unified=False, n_swa=2,
                              swa_type=SwaType.STANDARD, v_trans=False)
TestLarge = _machine("Large", kv_size=768, n_seq_max=3, unified=True)
TestLargeStreams = _machine("LargeStreams", kv_size=512, n_seq_max=3, unified=False)  # n_kv grows in each stream


# ---------------------------------------------------------------------------------------------- hand-made cases

def decode_both(caches, seqs, n=1):
    """One batch of ``n`` tokens of each sequence of ``seqs`` into each cache, every ubatch applied: the contexts,
    each on its last ubatch."""
    ctxs = []
    for kv in caches:
        ba = BatchAllocator(1)
        ba.init(Batch(token=np.full(n * len(seqs), 3, np.int32), seq_id=np.repeat(np.array(seqs, np.int32), n)),
                N_VOCAB, kv, 16, kv.n_seq_max, False)
        ctx = kv.init_batch(ba, 2048)
        assert ctx.get_status() == MemoryStatus.SUCCESS
        while True:
            ctx.apply()
            if not ctx.next():
                break
        ctx.i_cur -= 1
        ctxs.append(ctx)
    return ctxs


def test_mask_rows_patch_and_rebuild_match_the_full_build():
    """Eight sequences decoding in one stream, undone and redone, with the log dropped in between: the ready rows
    give the bytes of the full build every step."""
    fast, slow = make_cache(512, 8), make_cache(512, 8)
    general(slow)
    for kv in (fast, slow):
        for s in range(8):
            ba = BatchAllocator(1)
            ba.init(Batch(token=np.full(40, 3, np.int32), seq_id=np.full(40, s, np.int32)), N_VOCAB, kv, 16, 8,
                    False)
            ctx = kv.init_batch(ba, 512)
            ctx.apply()
    for step in range(12):
        ctxs = []
        for kv in (fast, slow):
            ba = BatchAllocator(1)
            ba.init(Batch(token=np.full(8, 3, np.int32), seq_id=np.arange(8, dtype=np.int32)), N_VOCAB, kv, 16, 8,
                    False)
            ctx = kv.init_batch(ba, 512)
            ctx.apply()
            ctxs.append(ctx)
        same_inputs(*ctxs, "f32")
        for kv in (fast, slow):
            if step % 3 == 0:
                kv.seq_rm(step % 8, kv.seq_pos_max(step % 8), -1)
            if step == 7:
                kv.seq_keep(2)  # many cells at once: the change log is dropped, the rows rebuilt
    assert fast.inputs.mask_rows.held()["blocks"], "the ready rows were never used"


@pytest.mark.parametrize("type_", ["f32", "f16"])
def test_token_rows_across_streams_match_the_full_build(type_):
    """Decode steps over per-sequence streams take the mask from the rows of the last step's tokens, patched from
    each stream's log: through placements, an undo left in place (the cell lost its sequence), a range removal (the
    row rebuilt), n_kv growing past 256 cells in one stream (the rows extended: the other streams' new columns
    empty) and a change of the token set -- the bytes of the full build every time."""
    fast, slow = make_cache(1024, 3, False), make_cache(1024, 3, False)
    general(slow)

    def decode(seqs, n=1):
        return decode_both((fast, slow), seqs, n)

    def both(name, *args):
        assert getattr(fast, name)(*args) == getattr(slow, name)(*args)

    decode([0, 1, 2], 20)
    for step in range(4):
        ctxs = decode([0, 1, 2])
        same_inputs(*ctxs, type_)
    assert fast.inputs.mask_rows.held()["tokens"] == [0, 1, 2]
    both("seq_rm", 1, fast.seq_pos_max(1), -1)  # the undo of seq 1's step: its newest cell loses the sequence
    same_inputs(*ctxs, type_)                    # the same tokens again: patched, cell now -inf in row 1
    both("seq_rm", 2, 3, 9)                      # a range: row 2 rebuilt
    ctxs = decode([0, 1, 2])
    same_inputs(*ctxs, type_)
    decode([0], 300)                             # stream 0 grows past 256 cells: n_kv 512 for the next step
    ctxs = decode([0, 1, 2])
    assert ctxs[0].get_n_kv() == ctxs[1].get_n_kv() == 512
    same_inputs(*ctxs, type_)
    ctxs = decode([1, 2])                        # another token set: rows from the blocks, then kept
    same_inputs(*ctxs, type_)
    ctxs = decode([1, 2])
    same_inputs(*ctxs, type_)
    assert fast.inputs.mask_rows.held()["tokens"] == [1, 2]


@pytest.mark.parametrize("type_", ["f32", "f16"])
def test_token_row_of_one_sequence_matches_the_full_build(type_):
    """One sequence decoding (write_one's kept row): steps undone and redone on the same cell, an undo left in place
    (its cell -inf again), a range removal (rebuilt) and n_kv growing past 256 cells -- the full build's bytes."""
    fast, slow = make_cache(1024, 2), make_cache(1024, 2)
    general(slow)

    def decode(n=1, seq=0):
        ctxs = []
        for kv in (fast, slow):
            ba = BatchAllocator(1)
            ba.init(Batch(token=np.full(n, 3, np.int32), seq_id=np.full(n, seq, np.int32)), N_VOCAB, kv, 16, 2, False)
            ctx = kv.init_batch(ba, 2048)
            ctx.apply()
            ctxs.append(ctx)
        return ctxs

    decode(20)
    decode(5, seq=1)
    for step in range(3):  # a step, undone, redone: the log holds the cell twice
        ctxs = decode()
        same_inputs(*ctxs, type_)
        for kv in (fast, slow):
            kv.seq_rm(0, kv.seq_pos_max(0), -1)
        ctxs = decode()
        same_inputs(*ctxs, type_)
    assert fast.inputs.mask_rows.held()["one"] == [0]
    for kv in (fast, slow):
        kv.seq_rm(0, kv.seq_pos_max(0), -1)     # left in place: the same token's mask again
    same_inputs(*ctxs, type_)
    decode()                                    # placed and undone twice unseen: the newest of three entries a loss
    for kv in (fast, slow):
        kv.seq_rm(0, kv.seq_pos_max(0), -1)
    same_inputs(*ctxs, type_)
    for kv in (fast, slow):
        kv.seq_rm(0, 2, 6)                      # a range: the row rebuilt
    same_inputs(*decode(), type_)
    decode(300)                                 # n_kv 512 next
    ctxs = decode()
    assert ctxs[0].get_n_kv() == 512
    same_inputs(*ctxs, type_)


@pytest.mark.parametrize("type_", ["f32", "f16"])
@pytest.mark.parametrize("n_seq,unified,kv_size", [(1, True, 1024), (3, False, 256), (3, False, 1024)])
def test_one_mask_tensor_filled_step_after_step(type_, n_seq, unified, kv_size):
    """A runtime fills the same kq-mask tensor every step (the kept rows are then one byte copy into it), and the
    graph may have used its memory in between: scribbled over between steps, the tensor still gets the full
    build's bytes, through new cells, undone steps, a range removal and n_kv growth (one stream), or in streams
    whose rows span all their cells (n_kv = kv_size: several rows, one span) or not (a copy of strided rows)."""
    fast, slow = make_cache(kv_size, n_seq, unified), make_cache(kv_size, n_seq, unified)
    general(slow)
    seqs = list(range(n_seq))
    gt = np.float32 if type_ == "f32" else np.float16

    def decode(n=1):
        return decode_both((fast, slow), seqs, n)

    def undo(p0=None, p1=-1, seq=0):
        for kv in (fast, slow):
            assert kv.seq_rm(seq, kv.seq_pos_max(seq) if p0 is None else p0, p1)

    decode(20)
    tensors = {}
    with contextlib.ExitStack() as stack:
        def check(ctxs):
            ca, cb = ctxs
            n_kv, ns = ca.get_n_kv(), ca.get_sinfo().n_stream()
            t = tensors.get(n_kv)
            if t is None:
                t = tensors[n_kv] = stack.enter_context(host_tensor(G.parse_type(type_), (n_kv, n_seq // ns, 1, ns),
                                                                    "kq_mask"))
            data = G.to_numpy(t, ndim=4)
            data.view(np.uint8)[...] = 0x5A  # what the graph left in the memory
            ca.set_input_kq_mask(t, ca.get_ubatch(), True)
            want = cb.kq_mask(True, type_)
            assert want.dtype == gt
            same_value(data[:, 0].view(np.uint8), want.view(np.uint8), "kq_mask in the reused tensor")

        for step in range(3):
            check(decode())
            undo()
            check(decode())
        undo()                        # left in place: the same tokens' mask again
        undo(2, 6)                    # a range: the row rebuilt
        check(decode())
        if unified:
            decode(300)               # n_kv 512: another tensor, then the first again
            check(decode())
            undo(300, -1)
            undo()
            check(decode())
    held = fast.inputs.mask_rows.held()
    copy = held["one_copy"] if n_seq == 1 else held["tokens_copy"]
    assert copy == (n_seq == 1 or kv_size == 256), "the byte copy served (only) one span"


@pytest.mark.parametrize("unified", [True, False])
def test_decode_step_takes_the_fast_paths(unified):
    """The decode step's work goes through the fast paths (a guard against a condition that silently never holds):
    no general split groups, the newest-cell undo, the ready mask rows, a one-token ubatch's ints."""
    kv = make_cache(64, 4, unified)
    for s in range(4):
        ba = BatchAllocator(1)
        ba.init(Batch(token=np.full(5, 3, np.int32), seq_id=np.full(5, s, np.int32)), N_VOCAB, kv, 16, 4, False)
        kv.init_batch(ba, 512).apply()
    ba = BatchAllocator(1)
    ba.init(Batch(token=np.full(4, 3, np.int32), seq_id=np.arange(4, dtype=np.int32)), N_VOCAB, kv, 16, 4, False)
    ctx = kv.init_batch(ba, 512)
    assert not ba.has_split_groups()  # committed by init_decode, split without groups
    assert ba.get_out_ids().tolist() == [3] and not ba.out_ids_in_order()  # only the last token is an output
    every = BatchAllocator(1)
    every.init(Batch(token=np.full(4, 3, np.int32), pos=np.full(4, 5, np.int32), seq_id=np.arange(4, dtype=np.int32),
                     logits=np.ones(4, np.int8)), N_VOCAB, kv, 16, 4, False)
    kv.book.split(every, 512)
    assert every.out_ids_in_order() and every.get_out_ids().tolist() == [0, 1, 2, 3]
    ctx.apply()
    ub = ctx.get_ubatch()
    assert not ub.seq_id.flags.writeable and not ub.seq_idx.flags.writeable  # the shared per-set arrays
    ctx.kq_mask()
    assert kv.inputs.mask_rows.held()["blocks"]
    for s in range(4):
        cells = kv.v_cells[kv.book.stream_of[s]]
        assert cells.seq_rm_last(s, 5, 2**31 - 1) is not None
    one = BatchAllocator(1)  # one token: its ubatch carries (sequence, position) as ints
    one.init(Batch(token=np.full(1, 3, np.int32), seq_id=np.full(1, 2, np.int32)), N_VOCAB, kv, 16, 4, False)
    ctx = kv.init_batch(one, 512)
    assert ctx.get_ubatch().one == (2, 5) and ctx.get_sinfo().cell >= 0


@pytest.mark.parametrize("fast", [True, False])
def test_cell_at_position_minus_one_is_empty_to_the_mask(fast):
    """llama.cpp accepts a token at position -1 (its sequence empty) and the cell then counts as empty in the
    mask (``is_empty``: position -1), though it holds the sequence: -inf for every token (checked on the oracle:
    a token at -1, then one of another sequence at 0 -> rows [-inf, -inf, ...] and [-inf, 0, -inf, ...])."""
    kv = make_cache(16, 2)
    if not fast:
        general(kv)
    rows = []
    for pos, seq in ((-1, 0), (0, 1), (0, 0)):
        ba = BatchAllocator(1)
        ba.init(Batch(token=np.array([3], np.int32), pos=np.array([pos], np.int32), seq_id=np.array([seq], np.int32)),
                N_VOCAB, kv, 16, 2, False)
        ctx = kv.init_batch(ba, 512)
        ctx.apply()
        rows.append(ctx.kq_mask()[0, 0, :4].tolist())
    inf = -np.inf
    assert rows[:2] == [[inf, inf, inf, inf], [inf, 0.0, inf, inf]]
    assert kv.v_cells[0].pos_array[:3].tolist() == [-1, 0, 0] and rows[2] == [inf, inf, 0.0, inf]


# ---------------------------------------------------------------------------------------------- a wrapped window

def _step_both(fast, slow, seqs, pos=None):
    """One decode step of ``seqs`` (one token each) on both caches (KVCache or KVCacheISWA), compared between
    init_batch and apply too (prepare must leave what the general path leaves); the contexts."""
    ctxs = []
    for kv in (fast, slow):
        ba = BatchAllocator(1)
        p = None if pos is None else np.array(pos, np.int32)
        ba.init(Batch(token=np.full(len(seqs), 3, np.int32), pos=p, seq_id=np.array(seqs, np.int32)), N_VOCAB, kv,
                16, kv.n_seq_max, False)
        ctx = kv.init_batch(ba, 512)
        assert ctx.get_status() == MemoryStatus.SUCCESS
        ctxs.append(ctx)
    for a, b in ((fast, slow),) if hasattr(fast, "book") else ((fast.get_base(), slow.get_base()),
                                                                (fast.get_swa(), slow.get_swa())):
        same_cache(a, b)
    for ctx in ctxs:
        ctx.apply()  # (one ubatch: the context stays on it)
    return ctxs


@pytest.mark.parametrize("swa_type", [SwaType.STANDARD, SwaType.CHUNKED, SwaType.SYMMETRIC])
@pytest.mark.parametrize("n_seq,unified", [(1, True), (3, True), (3, False)])
def test_wrapped_window_takes_the_scalar_paths(swa_type, n_seq, unified):
    """Steps of one token per sequence around a small cache several times: once the window has wrapped every step
    lands on a cell it left behind, and the scalar search, prepare and apply serve each of them (counted), with the
    general path's cells, slots and masks."""
    kv_size, n_swa = (3 * n_seq if unified else 4), 2  # (a slot that would run past the end: the general search)
    fast = make_cache(kv_size, n_seq, unified, n_swa=n_swa, swa_type=swa_type)
    slow = make_cache(kv_size, n_seq, unified, n_swa=n_swa, swa_type=swa_type)
    general(slow)
    n_steps = 4 * kv_size // (n_seq if unified else 1)
    for step in range(n_steps):
        ca, cb = _step_both(fast, slow, list(range(n_seq)))
        assert ca.get_sinfo().idxs[0].tolist() == cb.get_sinfo().idxs[0].tolist()
        same_cache(fast, slow)
        same_inputs(ca, cb, "f32")
    stats, unused = fast.book.wrap_stats, slow.book.wrap_stats
    per_step = 1 if unified else n_seq   # slot_run: once per stream
    wrapped = n_steps - kv_size // (n_seq if unified else 1)
    # CHUNKED keeps a whole chunk: a step may find the head cell still in the window (then the general search)
    if swa_type != SwaType.CHUNKED:
        assert stats.found == wrapped * per_step and stats.kept == stats.placed == wrapped
    else:
        assert stats.kept == stats.placed > 0 and stats.found > 0
    assert (unused.found, unused.kept, unused.placed) == (0, 0, 0)
    # the ring: the cache holds the last kv_size positions of each sequence
    for s in range(n_seq):
        assert fast.seq_pos_max(s) == n_steps - 1


def test_wrapped_window_purges_as_the_general_path():
    """A step over a cell whose position is not its sequence's oldest: the placement purges the older ones.  Through
    init_batch, prepare's placement purges (and its roll-back keeps the purge: the scalar check declines); through
    find_slot + apply_ubatch, apply purges (the scalar path does)."""
    fast, slow = (make_cache(8, 1, n_swa=2, swa_type=SwaType.STANDARD) for _ in range(2))
    general(slow)
    for direct in (False, True):
        for kv in (fast, slow):
            kv.clear()
        for p in range(8):
            _step_both(fast, slow, [0])
        for kv in (fast, slow):
            kv.seq_rm(0, 3, 4)  # cell 3 freed, the head lowered to it
        _step_both(fast, slow, [0])  # position 8 into cell 3
        placed = fast.book.wrap_stats.placed
        if direct:  # position 9 over cell 4 (position 4): positions 0..4 purged by apply
            for kv in (fast, slow):
                ba = BatchAllocator(1)
                ba.init(Batch(token=np.full(1, 3, np.int32), seq_id=np.zeros(1, np.int32)), N_VOCAB, kv, 16, 1, False)
                ub = kv.book.split(ba, 512)[0]
                sinfo = kv.find_slot(ub)
                assert sinfo.idxs[0].tolist() == [4]
                kv.apply_ubatch(sinfo, ub)
            assert fast.book.wrap_stats.placed == placed + 1
        else:  # the same through init_batch: prepare purges 0..2, apply then purges nothing more
            ca, cb = _step_both(fast, slow, [0])
            same_inputs(ca, cb, "f16")
        same_cache(fast, slow)
        assert fast.seq_pos_min(0) == 5 and fast.v_cells[0].get_used() == 5
        assert fast.v_cells[0].pos_array.tolist() == [-1, -1, -1, 8, 9, 5, 6, 7]


def test_iswa_wrapped_window_matches_the_general_path():
    """The iSWA pair over a wrapped SWA cache, fast paths on and off: the same cells in both caches after every
    step, the same SWA masks, and the SWA cache's steps taken by the scalar paths."""
    from kvcache_ggml.hparams import HParams
    from kvcache_ggml.cache.iswa import KVCacheISWA

    class SwaModel:
        def __init__(self):
            self.hparams = HParams.simple(n_layer=4, n_embd_head=8, n_head=2, n_head_kv=1, n_swa=3,
                                          swa_type=SwaType.STANDARD)
            self.hparams.set_swa_pattern(2)

        def dev_layer(self, il):
            return None

    pair = [KVCacheISWA(SwaModel(), kv_size=512, n_seq_max=2, unified=True, n_ubatch=8) for _ in range(2)]
    fast, slow = pair
    for kv in (slow.get_base(), slow.get_swa()):
        general(kv)
    n_swa_cells = fast.get_swa().get_size()
    try:
        for step in range(n_swa_cells // 2 + 40):
            ca, cb = _step_both(fast, slow, [0, 1])
            for a, b in ((fast.get_base(), slow.get_base()), (fast.get_swa(), slow.get_swa())):
                same_cache(a, b)
            same_inputs(ca.get_swa(), cb.get_swa(), "f32")
        assert fast.get_swa().book.wrap_stats.placed == 40 and fast.get_swa().book.wrap_stats.kept == 40
        assert fast.get_base().book.wrap_stats.placed == 0
    finally:
        for kv in pair:
            kv.close()

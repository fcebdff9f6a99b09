"""KVCells against hand-worked cases and against a brute-force model of llama_kv_cells."""
import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache_ggml.cache.cells import KVCells, CellExt, LLAMA_MAX_SEQ


class RefCells:
    """Brute force: a list of cells, every derived value recomputed from scratch."""

    def __init__(self, n):
        self.cells = [dict(pos=-1, shift=0, seqs=set(), ext=(0, 0)) for _ in range(n)]
        self.has_shift = False

    def used(self):
        return [i for i, c in enumerate(self.cells) if c["pos"] != -1]

    def seq_pos(self, s):
        return [c["pos"] for c in self.cells if s in c["seqs"]]

    def clear_cell(self, c, ext=True):
        c.update(pos=-1, shift=0, seqs=set())
        if ext:
            c["ext"] = (0, 0)


def check_same(cells: KVCells, ref: RefCells):
    n = cells.size()
    assert n == len(ref.cells)
    np.testing.assert_array_equal(cells.pos_array, [c["pos"] for c in ref.cells])
    np.testing.assert_array_equal(cells.shift_array, [c["shift"] for c in ref.cells])
    used = ref.used()
    assert cells.get_used() == len(used)
    assert cells.used_min() == (used[0] if used else 0)
    assert cells.used_max_p1() == (used[-1] + 1 if used else 0)
    assert cells.get_has_shift() == ref.has_shift
    for i, c in enumerate(ref.cells):
        got = {s for s in range(LLAMA_MAX_SEQ) if cells.seq_has(i, s)} if c["seqs"] or cells.seq_bits[:, i].any() else set()
        assert got == c["seqs"], f"cell {i}"
        if c["pos"] != -1:
            assert cells.seq_count(i) == len(c["seqs"])
            assert cells.ext_get(i) == CellExt(*c["ext"])
    for s in set().union(*[c["seqs"] for c in ref.cells]) | {0, 1, 2, 3, 200}:
        ps = ref.seq_pos(s)
        assert cells.seq_pos_min(s) == (min(ps) if ps else -1), f"seq {s}"
        assert cells.seq_pos_max(s) == (max(ps) if ps else -1), f"seq {s}"


def test_hand_worked_basics():
    c = KVCells(8)
    assert c.size() == 8 and c.get_used() == 0 and c.used_max_p1() == 0
    for i, p in enumerate([10, 11, 12]):
        c.pos_set(i + 2, p)
        c.seq_add(i + 2, 5)
    c.seq_add(3, 7)
    assert c.get_used() == 3 and c.used_min() == 2 and c.used_max_p1() == 5
    assert c.seq_pos_min(5) == 10 and c.seq_pos_max(5) == 12
    assert c.seq_pos_min(7) == 11 and c.seq_pos_max(7) == 11
    assert c.seq_count(3) == 2 and c.seq_get(2) == 5
    # removing seq 5 from the shared cell keeps it (seq 7 still there)
    assert c.seq_rm(3, 5) is False
    assert c.seq_pos_min(5) == 10 and c.seq_pos_max(5) == 12
    # removing the last sequence empties the cell
    assert c.seq_rm(4, 5) is True
    assert c.is_empty(4) and c.used_max_p1() == 4 and c.seq_pos_max(5) == 10
    # seq_keep on a cell without the sequence empties it
    assert c.seq_keep(2, 7) is True and c.used_min() == 3
    assert c.seq_pos_min(5) == -1
    # pos_add below zero empties; shift accumulates otherwise
    assert c.pos_add(3, -5) is False and c.pos_get(3) == 6 and c.get_shift(3) == -5 and c.get_has_shift()
    assert c.pos_add(3, -7) is True and c.is_empty(3) and c.get_used() == 0
    c.reset_shift()
    assert not c.get_has_shift()


def test_pos_div_truncates_and_records_shift():
    c = KVCells(4)
    for i, p in enumerate([0, 5, 9, 10]):
        c.pos_set(i, p)
        c.seq_add(i, 1)
    for i in range(4):
        c.pos_div(i, 4)
    np.testing.assert_array_equal(c.pos_array, [0, 1, 2, 2])
    np.testing.assert_array_equal(c.shift_array, [0, 4, 7, 8])
    assert c.seq_pos_min(1) == 0 and c.seq_pos_max(1) == 2


def test_cp_and_set_round_trip():
    c = KVCells(6)
    for i, p in enumerate([3, 4, 5]):
        c.pos_set(i + 1, p)
        c.seq_add(i + 1, 2)
    c.ext_set(2, CellExt(7, 8))
    snap = c.cp([1, 2, 5])
    assert snap.size() == 3 and snap.get_used() == 2 and snap.seq_pos_max(2) == 4
    assert snap.ext_get(1) == CellExt(7, 8)
    c.rm(1)
    c.rm(2)
    c.pos_set(5, 9)
    c.seq_add(5, 3)
    c.set([1, 2, 5], snap)
    assert c.pos_get(1) == 3 and c.pos_get(2) == 4 and c.is_empty(5)
    assert c.seq_pos_min(2) == 3 and c.seq_pos_max(2) == 5 and c.seq_pos_max(3) == -1
    assert c.ext_get(2) == CellExt(7, 8)
    c2 = c.cp(1, 3)
    assert [c2.pos_get(i) for i in range(3)] == [3, 4, 5]
    with pytest.raises(ValueError, match="out of"):
        c.cp(5, 3)


def test_ext_is_2d_gt():
    e = CellExt(x=3, y=2)
    assert e.is_2d_gt(2, 2) and not e.is_2d_gt(3, 2) and e.is_2d_gt(9, 1) and not e.is_2d_gt(0, 3)


def test_seq_ids_up_to_max():
    c = KVCells(3)
    c.pos_set(0, 4)
    c.seq_add(0, LLAMA_MAX_SEQ - 1)
    c.seq_add(0, 63)
    c.seq_add(0, 64)
    assert c.seq_count(0) == 3 and c.seqs_in(np.array([0])) == [63, 64, 255]
    assert c.seq_pos_max(255) == 4


def test_multiset_counts_duplicates():
    c = KVCells(5)
    for i in range(5):
        c.pos_set(i, 7 if i < 3 else 8)
        c.seq_add(i, 0)
    assert c.seq_pos_min(0) == 7 and c.seq_pos_max(0) == 8
    c.rm(3)
    c.rm(4)
    assert c.seq_pos_max(0) == 7
    c.rm(0)
    c.rm(1)
    assert c.seq_pos_max(0) == 7 and c.seq_pos_min(0) == 7
    c.rm(2)
    assert c.seq_pos_max(0) == -1


N = 24
SEQS = st.sampled_from([0, 1, 2, 63, 64, 255])


class CellsMachine(RuleBasedStateMachine):
    """Random per-cell and bulk operations, compared with the brute-force model after every step."""

    def __init__(self):
        super().__init__()
        self.c = KVCells(N)
        self.r = RefCells(N)

    def _nonempty(self):
        return [i for i, c in enumerate(self.r.cells) if c["pos"] != -1]

    @rule(i=st.integers(0, N - 1), p=st.integers(0, 40), s=SEQS, x=st.integers(0, 5), y=st.integers(0, 5))
    def place_one(self, i, p, s, x, y):
        if self.r.cells[i]["pos"] != -1:
            return
        self.c.pos_set(i, p)
        self.c.seq_add(i, s)
        self.c.ext_set(i, CellExt(x, y))
        self.r.cells[i].update(pos=p, seqs={s}, ext=(x, y))

    @rule(data=st.data(), s=SEQS)
    def seq_add_cell(self, data, s):
        ne = [i for i in self._nonempty() if s not in self.r.cells[i]["seqs"]]
        if ne:
            i = data.draw(st.sampled_from(ne))
            self.c.seq_add(i, s)
            self.r.cells[i]["seqs"].add(s)

    @rule(data=st.data())
    def seq_rm_cell(self, data):
        ne = self._nonempty()
        if ne:
            i = data.draw(st.sampled_from(ne))
            s = data.draw(st.sampled_from(sorted(self.r.cells[i]["seqs"])))
            c = self.r.cells[i]
            c["seqs"].discard(s)
            emptied = not c["seqs"]
            if emptied:
                self.r.clear_cell(c)
            assert self.c.seq_rm(i, s) == emptied

    @rule(data=st.data(), s=SEQS)
    def seq_keep_cell(self, data, s):
        i = data.draw(st.integers(0, N - 1))
        c = self.r.cells[i]
        if s in c["seqs"]:
            c["seqs"] = {s}
            exp = False
        elif c["seqs"]:
            self.r.clear_cell(c)
            exp = True
        else:
            exp = False
        assert self.c.seq_keep(i, s) == exp

    @rule(data=st.data(), d=st.integers(-30, 30))
    def pos_add_cell(self, data, d):
        ne = self._nonempty()
        if ne:
            i = data.draw(st.sampled_from(ne))
            c = self.r.cells[i]
            c["pos"] += d
            c["shift"] += d
            self.r.has_shift = True
            exp = c["pos"] < 0
            if exp:
                self.r.clear_cell(c, ext=False)
            assert self.c.pos_add(i, d) == exp

    @rule(data=st.data(), d=st.integers(1, 5))
    def pos_div_cell(self, data, d):
        ne = self._nonempty()
        if ne:
            i = data.draw(st.sampled_from(ne))
            c = self.r.cells[i]
            old = c["pos"]
            c["pos"] = old // d
            c["shift"] += old - c["pos"]
            self.r.has_shift = True
            self.c.pos_div(i, d)

    @rule(data=st.data())
    def rm_cell(self, data):
        ne = self._nonempty()
        if ne:
            i = data.draw(st.sampled_from(ne))
            self.r.clear_cell(self.r.cells[i])
            self.c.rm(i)

    @rule(p0=st.integers(0, 40), p1=st.integers(0, 45), s=SEQS)
    def bulk_seq_rm(self, p0, p1, s):
        idxs = self.c.find(p0, p1, s)
        exp_idx = [i for i, c in enumerate(self.r.cells) if p0 <= c["pos"] < p1 and s in c["seqs"]]
        assert idxs.tolist() == exp_idx
        exp_emptied = []
        for i in exp_idx:
            c = self.r.cells[i]
            c["seqs"].discard(s)
            if not c["seqs"]:
                self.r.clear_cell(c)
                exp_emptied.append(i)
        if idxs.size:
            assert self.c.seq_rm_many(idxs, s).tolist() == exp_emptied

    @rule(data=st.data())
    def snapshot_restore(self, data):
        idxs = data.draw(st.lists(st.integers(0, N - 1), min_size=1, max_size=6, unique=True))
        if any(self.r.cells[i]["shift"] for i in idxs):
            return
        snap = self.c.cp(idxs)
        # scramble the cells, then put them back
        for i in idxs:
            if self.c.is_empty(i):
                self.c.pos_set(i, 3)
                self.c.seq_add(i, 1)
            else:
                self.c.rm(i)
        self.c.set(idxs, snap)

    @rule()
    def reset_shift(self):
        self.c.reset_shift()
        self.r.has_shift = False
        for c in self.r.cells:
            c["shift"] = 0

    @invariant()
    def same(self):
        check_same(self.c, self.r)


TestCellsMachine = CellsMachine.TestCase
TestCellsMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_rebuild_indices_matches_incremental():
    rng = np.random.default_rng(0)
    c = KVCells(64)
    for i in rng.permutation(64)[:40].tolist():
        c.pos_set(i, int(rng.integers(0, 30)))
        for s in rng.choice(8, size=int(rng.integers(1, 4)), replace=False).tolist():
            c.seq_add(i, s)
    before = {s: (c.seq_pos_min(s), c.seq_pos_max(s)) for s in range(8)}
    lo, hi, n = c.used_min(), c.used_max_p1(), c.get_used()
    c._rebuild_indices()
    assert {s: (c.seq_pos_min(s), c.seq_pos_max(s)) for s in range(8)} == before
    assert (c.used_min(), c.used_max_p1(), c.get_used()) == (lo, hi, n)


def test_position_multiset_bulk_updates_match_a_counter():
    import collections
    from kvcache_ggml.cache.cells.index import PosMultiset as _PosMultiset
    rng = np.random.default_rng(0)
    for _ in range(200):
        m, ref = _PosMultiset(), collections.Counter()
        for _ in range(10):
            if rng.random() < 0.6 or not ref:
                ps = rng.integers(0, 40, size=int(rng.integers(1, 30)))
                m.update(ps, +1)
                ref.update(ps.tolist())
            else:
                items = list(ref.elements())
                pick = rng.choice(len(items), size=min(len(items), int(rng.integers(1, 30))), replace=False)
                ps = np.array([items[i] for i in pick])
                m.update(ps, -1)
                ref.subtract(ps.tolist())
                ref = +ref
            assert m.keys == sorted(ref) and m.counts == [ref[k] for k in sorted(ref)]
            lo, hi = 5, 20
            assert m.count_in(lo, hi, 10**6) == sum(v for k, v in ref.items() if lo <= k < hi)

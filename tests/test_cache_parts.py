"""The cache's parts on their own: the bookkeeping without ggml, and the facade over the parts."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvcache_ggml.batch import Batch, BatchAllocator
from kvcache_ggml.cache import KVCacheParams
from kvcache_ggml.cache.bookkeeping import KVBookkeeping
from kvcache_ggml.hparams import SwaType

from kvmodel import ModelCache

N_VOCAB = 64


def test_bookkeeping_imports_and_runs_without_ggml():
    code = textwrap.dedent("""
        import sys
        import numpy as np
        from kvcache_ggml.batch import Batch, BatchAllocator
        from kvcache_ggml.cache.bookkeeping import KVBookkeeping
        from kvcache_ggml.cache.types import KVCacheParams
        book = KVBookkeeping(KVCacheParams(kv_size=8, n_seq_max=2))
        ba = BatchAllocator(1)
        ba.init(Batch(token=[1, 2, 3], seq_id=[[0], [0], [1]]), 16, book, 8, 2, False)
        ubs = book.split(ba, 8)
        for sinfo, ub in zip(book.prepare(ubs), ubs):
            book.apply_ubatch(sinfo, ub)
        loaded = sorted(m for m in sys.modules if m == "ggml" or m.startswith(("ggml.", "kvcache_ggml.ggml")))
        print(book.v_cells[0].pos_array[:4].tolist(), book.seq_pos_max(0), book.seq_pos_max(1), loaded)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[0, 1, 0, -1] 1 0 []"


def _ub_dict(ub):
    return dict(n_tokens=ub.n_tokens, pos=ub.pos.tolist(), n_pos=ub.n_pos,
                seq_ids=[[int(s) for s in row[:k]] for row, k in zip(ub.seq_id, ub.n_seq_id)],
                seq_id_unq=ub.seq_id_unq.tolist())


def _same(book: KVBookkeeping, m: ModelCache, where: str) -> None:
    assert book.v_heads == m.heads, where
    for strm, cells in enumerate(book.v_cells):
        mc = m.cells[strm]
        np.testing.assert_array_equal(cells.pos_array, [c.pos for c in mc], err_msg=f"{where}: stream {strm}")
        np.testing.assert_array_equal(cells.shift_array, [c.shift for c in mc], err_msg=f"{where}: stream {strm}")
        for i, c in enumerate(mc):
            assert set(cells.seqs_in(np.array([i]))) == c.seqs, f"{where}: stream {strm} cell {i}"
        assert cells.get_used() == m.used(strm) and cells.used_max_p1() == m.used_max_p1(strm), where
    assert book.check_invariants() == [], where


def _decode(book: KVBookkeeping, m: ModelCache, rng: np.random.Generator, where: str) -> None:
    """One batch of 1..6 tokens over random sequences, split, prepared and applied on both."""
    n_seq = book.n_seq_max
    toks, pos = [], []
    for s in rng.choice(n_seq, size=rng.integers(1, min(n_seq, 3) + 1), replace=False).tolist():
        p0 = m.seq_pos_max(s) + 1
        for j in range(int(rng.integers(1, 3))):
            toks.append([s])
            pos.append(p0 + j)
    ba = BatchAllocator(1)
    ba.init(Batch(token=np.full(len(toks), 3), pos=pos, seq_id=toks), N_VOCAB, book, 8, n_seq, False)
    n_ubatch = int(rng.choice([1, 2, 512]))
    ubs = book.split(ba, n_ubatch)
    sinfos = book.prepare(ubs)
    slots = m.prepare([_ub_dict(u) for u in ubs])
    assert (slots is None) == (not sinfos), where
    for k, (sinfo, ub) in enumerate(zip(sinfos, ubs)):
        assert [(s, idx.tolist()) for s, idx in zip(sinfo.strm, sinfo.idxs)] == slots[k], where
        book.apply_ubatch(sinfo, ub)
        m.apply(slots[k], _ub_dict(ub))


@pytest.mark.parametrize("cfg", [dict(kv_size=16, n_seq_max=3), dict(kv_size=8, n_seq_max=2, unified=False),
                                 dict(kv_size=12, n_seq_max=2, n_swa=4, swa_type=SwaType.STANDARD)],
                         ids=["unified", "streams", "swa"])
def test_bookkeeping_alone_matches_the_brute_force_model(cfg):
    """KVBookkeeping driven as a runtime without tensors would drive it: every step equal to the model's."""
    rng = np.random.default_rng(5)
    book = KVBookkeeping(KVCacheParams(**cfg))
    m = ModelCache(cfg["kv_size"], cfg["n_seq_max"], cfg.get("unified", True), cfg.get("n_swa", 0),
                   int(cfg.get("swa_type", 0)))
    n_seq = cfg["n_seq_max"]
    for step in range(300):
        op = rng.choice(["decode", "decode", "rm", "cp", "add", "div", "keep", "shifted"])
        s, p0 = int(rng.integers(0, n_seq)), int(rng.integers(-1, 10))
        p1 = -1 if rng.random() < 0.3 else p0 + int(rng.integers(0, 6))
        if op == "decode":
            _decode(book, m, rng, f"step {step}")
        elif op == "rm":
            book.seq_rm(s, p0, p1)
            m.seq_rm(s, p0, p1)
        elif op == "cp":
            d = int(rng.integers(0, n_seq))
            if book.n_stream > 1:
                p0 = p1 = -1
            book.seq_cp(s, d, p0, p1)
            m.seq_cp(s, d, p0, p1)
        elif op == "add":
            d = int(rng.integers(-4, 5))
            book.seq_add(s, p0, p1, d)
            m.seq_add(s, p0, p1, d)
        elif op == "div":
            d = int(rng.integers(1, 4))
            book.seq_div(s, p0, p1, d)
            m.seq_div(s, p0, p1, d)
        elif op == "keep":
            book.seq_keep(s)
            m.seq_keep(s)
        else:  # what an update does to the cells once the data moved
            book.take_stream_copies()
            book.reset_shift()
            m.reset_shift()
        _same(book, m, f"step {step} ({op})")


def test_failed_restore_of_a_sequence_leaves_the_cells_unchanged():
    book = KVBookkeeping(KVCacheParams(kv_size=4, n_seq_max=2))
    book.restore_seq(0, np.arange(3, dtype=np.int32))
    before = book.v_cells[0].pos_array.copy(), list(book.v_heads)
    with pytest.raises(ValueError, match=r"no room for the 2 cells of sequence 1 \(1 of 4 cells free\)"):
        book.restore_seq(1, np.arange(2, dtype=np.int32))
    np.testing.assert_array_equal(book.v_cells[0].pos_array, before[0])
    assert book.v_heads == before[1] and book.seq_pos_max(1) == -1

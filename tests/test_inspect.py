"""kvcache_ggml.inspect: the invariant checker against corrupted and random valid caches, the tables against values
computed cell by cell through the per-cell API, the figures' image data, the graph table and the DOT output."""
import shutil
import subprocess
import sys
from functools import partial

import numpy as np
import pytest

from kvcache_ggml import ggml as G
from kvcache_ggml import inspect as I
from kvcache_ggml.cache import UpdateContext
from kvcache_ggml._consts import LLAMA_MAX_SEQ
from kvcache_ggml.cache.cells import KVCells

from helpers import make_cache


def need_matplotlib():
    """Skip (the figures need the notebooks extra) unless matplotlib is installed; draw with Agg."""
    mpl = pytest.importorskip("matplotlib", reason="the figures need matplotlib (pip install -e .[notebooks])")
    mpl.use("Agg")


make = partial(make_cache, n_seq_max=3)  # make(kv_size, ...): a toy cache serving 3 sequences


def populated():
    """A unified cache with shared cells, a hole, a pending shift: 'MMM001.11'."""
    kv = make(16)
    I.decode(kv, [0, 1, 2, 3, 4], [0] * 5)
    I.decode(kv, [0, 1, 2, 3], [1] * 4)
    kv.seq_cp(0, 2, 0, 3)
    kv.seq_rm(1, 1, 2)
    kv.seq_add(1, 2, -1, 1)
    return kv


# ---------------------------------------------------------------------------------------------- invariants: corruption

def test_clean_cache_has_no_findings():
    kv = populated()
    assert I.check_invariants(kv) == []
    assert I.check_invariants(kv.v_cells[0]) == []


def _only(kv, *words):
    errs = I.check_invariants(kv)
    assert errs, "the corruption was not detected"
    assert any(all(w in e for w in words) for e in errs), errs
    return errs


def test_poked_position_breaks_the_multiset():
    kv = populated()
    kv.v_cells[0]._pos[3] = 9  # cell 3 holds sequence 0 at position 3
    _only(kv, "stream 0", "sequence 0 multiset", "positions [3, 9]")
    _only(kv, "seq_pos_min/max", "0/4", "0/9")


def test_poked_multiset_count():
    kv = populated()
    ms = kv.v_cells[0]._seq_pos[1]
    ms.counts[0] += 1
    _only(kv, "sequence 1 multiset")


def test_missing_and_extra_multiset():
    kv = populated()
    del kv.v_cells[0]._seq_pos[2]
    _only(kv, "sequence 2", "no position multiset")
    kv = populated()
    kv.v_cells[0]._ms(7).inc(3)
    _only(kv, "sequence 7 multiset")


def test_poked_used_count_and_bounds():
    kv = populated()
    kv.v_cells[0]._used.n += 1
    _only(kv, "used count 9 != 8")
    kv = populated()
    cells = kv.v_cells[0]
    cells.used_max_p1()  # resolve any stale bound first
    cells._used.hi -= 1
    _only(kv, "stored used_max_p1")
    _only(kv, "used_max_p1() =")
    kv = populated()
    kv.v_cells[0]._used.lo = 1  # clean bound above the first used cell (0)
    _only(kv, "stored used_min 1")


def test_stale_bound_enclosing_the_used_cells_is_fine():
    kv = populated()
    kv.seq_rm(1, 3, -1)  # frees the last used cells: the upper bound goes stale (dirty), still an enclosure
    cells = kv.v_cells[0]
    assert cells._used.hi_dirty
    assert I.check_invariants(kv) == []


def test_empty_cell_with_sequence_or_shift():
    kv = populated()
    kv.v_cells[0]._seq[0, 12] |= np.uint64(1 << 4)
    _only(kv, "empty cell 12 holds sequences [4]")
    kv = populated()
    kv.v_cells[0]._shift[13] = 2
    _only(kv, "empty cell 13 has shift 2")


def test_used_cell_without_sequence():
    kv = populated()
    kv.v_cells[0]._seq[:, 3] = 0
    _only(kv, "cell 3 holds position 3 but no sequence")


def test_shift_without_has_shift_flag():
    kv = populated()
    kv.v_cells[0]._has_shift = False
    _only(kv, "pending shift", "has_shift is False")


def test_head_out_of_range_and_sequence_in_wrong_stream():
    kv = populated()
    kv.v_heads[0] = 17
    _only(kv, "head 17 out of [0, 16]")
    kv = make(8, n_seq_max=2, unified=False)
    I.decode(kv, [0, 1], [0, 0])
    cells = kv.v_cells[0]
    cells.seq_add(0, 1)  # sequence 1 lives in stream 1
    _only(kv, "sequence 1 is held here but maps to stream 1")


def test_bad_array_shape_is_reported_without_crashing():
    kv = populated()
    kv.v_cells[0]._shift = np.zeros(3, np.int32)
    _only(kv, "_shift has shape (3,), expected (16,)")


# ------------------------------------------------------------------------------------------ invariants: random valid

def _random_ops(kv, rng, n_ops):
    """Random decodes and sequence operations, the invariants checked after each; returns (decodes tried,
    decodes that went in, the most cells in use at once, the most sequences sharing one cell)."""
    nseq = kv.n_seq_max
    tried = done = most_used = most_shared = 0
    for _ in range(n_ops):
        q = int(rng.integers(nseq))
        op = rng.choice(["decode", "decode", "rm", "cp", "add", "div", "keep"], p=[.3, .2, .15, .1, .1, .1, .05])
        p0, p1 = sorted(rng.integers(-1, 12, 2).tolist())
        if op == "decode":
            n = int(rng.integers(1, 5))
            tried += 1
            used = sum(c.get_used() for c in kv.v_cells)
            try:
                I.decode(kv, None, [q] * n)
            except (ValueError, RuntimeError):
                pass  # no room, or positions the allocator refuses: the cache is unchanged
            else:
                done += 1
                assert sum(c.get_used() for c in kv.v_cells) == used + n  # n new cells
        elif op == "rm":
            kv.seq_rm(q, p0, p1)
        elif op == "cp":
            r = int(rng.integers(nseq))
            kv.seq_cp(q, r, -1, -1) if kv.n_stream > 1 else kv.seq_cp(q, r, p0, p1)
        elif op == "add":
            kv.seq_add(q, p0, p1, int(rng.integers(-3, 4)))
        elif op == "div":
            kv.seq_div(q, p0, p1, 2)
        else:
            kv.seq_keep(q)
        errs = I.check_invariants(kv)
        assert errs == [], (op, errs)
        t = I.cells_table(kv)
        most_used = max(most_used, int(np.count_nonzero(t["pos"] >= 0)))
        most_shared = max(most_shared, int(t["n_seq"].max()))
    return tried, done, most_used, most_shared


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("unified", [True, False])
def test_random_valid_caches_have_no_findings(seed, unified):
    kv = make(24, n_seq_max=3, unified=unified)
    tried, done, most_used, most_shared = _random_ops(kv, np.random.default_rng(seed), 40)
    # the walk exercised the cache: most decodes went in, the cells filled up, and (unified) seq_cp shared cells
    assert done >= 5 and 3 * done >= tried, (tried, done)
    assert most_used >= kv.get_size() // 2, most_used
    assert most_shared >= (2 if unified else 1), most_shared
    _check_table(kv)


# ---------------------------------------------------------------------------------------------- tables

def _check_table(kv):
    t = I.cells_table(kv)
    size = kv.get_size()
    assert t.dtype == I.CELL_DTYPE and t.shape == (kv.n_stream * size,)
    for row in t:
        cells = kv.v_cells[row["stream"]]
        i = int(row["cell"])
        assert row["cell"] == i and 0 <= i < size
        if cells.is_empty(i):
            assert (row["pos"], row["n_seq"], row["seq"], row["shift"]) == (-1, 0, -1, 0)
            assert not row["seq_bits"].any()
            continue
        seqs = [q for q in range(LLAMA_MAX_SEQ) if cells.seq_has(i, q)]
        assert row["pos"] == cells.pos_get(i) and row["shift"] == cells.get_shift(i)
        assert row["n_seq"] == len(seqs) and row["seq"] == seqs[0]
        assert int(row["seq_mask"]) == sum(1 << q for q in seqs if q < 64)
        assert [q for q in range(LLAMA_MAX_SEQ) if int(row["seq_bits"][q // 64]) >> (q % 64) & 1] == seqs
        e = cells.ext_get(i)
        assert (row["ext_x"], row["ext_y"]) == (e.x, e.y)
    np.testing.assert_array_equal(t["stream"], np.repeat(np.arange(kv.n_stream), size))


def test_cells_table_of_populated_cache():
    kv = populated()
    _check_table(kv)
    t = I.cells_table(kv)
    assert t["pos"][:10].tolist() == [0, 1, 2, 3, 4, 0, -1, 3, 4, -1]
    assert t["n_seq"][:3].tolist() == [2, 2, 2] and int(t["seq_mask"][0]) == 0b101
    assert t["shift"][7] == 1 and t["shift"][3] == 0


def test_cells_table_ext_and_bare_cells():
    cells = KVCells(4)
    cells.place(np.array([1, 2]), np.array([5, 5], np.int32), np.array([[3], [3]], np.int32),
                np.array([[7, 1], [8, 1]], np.int32))
    t = I.cells_table(cells)
    assert t["ext_x"].tolist() == [0, 7, 8, 0] and t["ext_y"].tolist() == [0, 1, 1, 0]
    assert t["seq"].tolist() == [-1, 3, 3, -1] and (t["stream"] == 0).all()


def test_cells_table_of_an_iswa_cache_names_its_two_caches():
    """An iSWA cache has two caches of cells: the table asks for one of them, and takes each."""
    from test_iswa import make as make_iswa

    mem = make_iswa()
    with pytest.raises(TypeError, match=r"got KVCacheISWA \(an iSWA cache: pass its get_base\(\) or get_swa\(\)\)"):
        I.cells_table(mem)
    assert I.cells_table(mem.get_base()).size == 512 and I.cells_table(mem.get_swa()).size == mem.get_swa().get_size()
    with pytest.raises(TypeError, match=r"expected a KVCache or KVCells, got int$"):
        I.cells_table(3)


def test_cell_map_matches_debug_dump():
    from kvcache_ggml.cache import cell_map_text, cell_pos_text

    kv = populated()
    text = I.cell_map(kv, positions=True)
    lines = text.splitlines()
    assert lines[0] == "stream[0]: n =     9, used =     8, head =     0, size =    16"
    assert lines[1] == cell_map_text(kv.v_cells[0]) == "MMM001.11......."
    assert lines[2] == cell_pos_text(kv.v_cells[0])
    assert "stream[0] min[1] =     0, max[1] =     4" in lines


# ---------------------------------------------------------------------------------------------- figures

def test_cell_map_image():
    need_matplotlib()
    kv = make(8, n_seq_max=3, unified=False)
    I.decode(kv, [0, 1, 2, 0, 1, 2], [0, 0, 0, 2, 2, 2], n_ubatch=6)
    fig = I.plot_cell_map(kv)
    img = fig.axes[0].images[0].get_array()
    assert img.shape == (3, 8, 3)
    np.testing.assert_allclose(img[0, :3], [I.seq_color(0)] * 3)
    np.testing.assert_allclose(img[2, :3], [I.seq_color(2)] * 3)
    np.testing.assert_allclose(img[1], np.ones((8, 3)))  # stream 1 is empty
    fig.canvas.draw()
    kv = populated()
    img = I.plot_cell_map(kv).axes[0].images[0].get_array()
    assert img.shape == (1, 16, 3)
    np.testing.assert_allclose(img[0, 0], I._MULTI_RGB)
    np.testing.assert_allclose(img[0, 5], I.seq_color(1))
    np.testing.assert_allclose(img[0, 6], I._EMPTY_RGB)


def test_kq_mask_image():
    need_matplotlib()
    kv = populated()
    for ctx in I.decode_steps(kv, [5, 6], [0, 0]):
        mask = ctx.kq_mask()
    assert mask.shape == (1, 2, 16)
    fig = I.plot_kq_mask(mask, token_pos=[5, 6], cell_pos=kv.v_cells[0].pos_array)
    data = fig.axes[0].images[0].get_array()
    assert data.shape == (2, 16)
    np.testing.assert_array_equal(np.ma.getmaskarray(data), np.isinf(mask[0]))
    fig.canvas.draw()
    # two streams, a 2-D mask, and the ALiBi bias with its colour bar
    two = np.stack([mask[0], np.where(np.isinf(mask[0]), mask[0], -np.arange(16.0))])
    fig = I.plot_kq_mask(two)
    assert [a.images[0].get_array().shape for a in fig.axes if a.images] == [(2, 16), (2, 16)]
    assert len(fig.axes) == 4  # two panels, each with the colour bar of the ALiBi bias
    with pytest.raises(ValueError, match="mask must be"):
        I.plot_kq_mask(np.zeros(4))


@pytest.mark.parametrize("v_trans", [True, False])
def test_kv_rows_and_norms(v_trans):
    kv = make(8, n_seq_max=2, unified=False, v_trans=v_trans, type_k="f32", type_v="f16")
    I.decode(kv, [0, 1, 2], [1, 1, 1])
    rng = np.random.default_rng(1)
    want = {}
    for layer in kv.layers:
        n_embd, size, ns = G.ne(layer.v)[:3]
        k = rng.standard_normal((ns, size, G.ne(layer.k)[0])).astype(np.float32)
        v = rng.standard_normal((ns, size, n_embd)).astype(np.float16)
        G.set_tensor(layer.k, k)
        # V transposed: element j of cell i of stream s at s*size*n_embd + j*size + i
        raw = v.transpose(0, 2, 1).reshape(-1) if v_trans else v.reshape(-1)
        G.set_tensor(layer.v, raw.reshape(ns, size, n_embd))
        want[layer.il] = (k, v.astype(np.float32))
    for il, (k, v) in want.items():
        np.testing.assert_array_equal(I.kv_rows(kv, il, "k"), k)
        np.testing.assert_array_equal(I.kv_rows(kv, il, "v"), v)
    need_matplotlib()
    fig = I.plot_kv_norms(kv)
    panels = [a for a in fig.axes if a.images]
    assert len(panels) == 4  # 2 streams x (K, V)
    kimg = panels[2].images[0].get_array()  # stream 1, K
    assert kimg.shape == (2, 8)
    np.testing.assert_allclose(kimg[:, :3], np.stack([np.linalg.norm(want[il][0][1, :3], axis=1) for il in (0, 1)]),
                               rtol=1e-6)
    assert np.ma.getmaskarray(kimg)[:, 3:].all() and not np.ma.getmaskarray(kimg)[:, :3].any()
    assert np.ma.getmaskarray(panels[0].images[0].get_array()).all()  # stream 0 holds nothing
    if v_trans:
        fig.canvas.draw()


def test_kv_rows_dequantizes():
    kv = make(4, type_k="q8_0", n_embd_head=32)
    layer = kv.layers[0]
    x = np.linspace(-1, 1, 4 * 32, dtype=np.float32).reshape(4, 32)
    # q8_0 block: f16 scale d = max|x|/127, then int8 round(x/d)
    d = np.abs(x).max(axis=1, keepdims=True) / 127
    q = np.round(x / d).astype(np.int8)
    raw = np.concatenate([d.astype(np.float16).view(np.uint8), q.view(np.uint8)], axis=1)
    G.set_tensor(layer.k, raw.reshape(1, 4, 34))
    got = I.kv_rows(kv, 0, "k")
    assert got.shape == (1, 4, 32)
    np.testing.assert_allclose(got[0], q * d.astype(np.float16).astype(np.float32), rtol=1e-6)
    with pytest.raises(ValueError, match="which must be"):
        I.kv_rows(kv, 0, "q")


def test_matplotlib_is_not_imported_with_the_module():
    code = "import sys, kvcache_ggml.inspect; sys.exit('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---------------------------------------------------------------------------------------------- graphs

def _shift_graph(kv, lctx, ctx):
    I.decode(kv, [0, 1, 2], [0, 0, 0])
    kv.seq_add(0, 0, -1, 2)
    return kv.build_graph_shift(ctx, lctx)


@pytest.mark.parametrize("type_k, ops", [("f16", ["VIEW", "ROPE"]), ("q8_0", ["VIEW", "CPY", "ROPE", "CPY"])])
def test_graph_table_of_k_shift(type_k, ops, tmp_path):
    kv = make(8, type_k=type_k, n_embd_head=32)
    with UpdateContext.for_cache(kv) as lctx, kv.shift_context() as ctx:
        sg = _shift_graph(kv, lctx, ctx)
        table = I.graph_table(sg)
        assert table.column("op") == ops * 2
        assert all(table.column("cache"))  # every node of the K-shift graph is the cache's
        first = table[0]
        k = kv.layers[0].k
        assert first["name"] == "cache_k_l0 (view)" and first["view_src"] == "cache_k_l0"
        assert first["ne"] == (32, 1, 8, 1) and first["type"] == type_k and first["view_offs"] == 0
        assert first["nb"][1] == G.row_size(type_k, 32) == G.nb(k)[1]
        rope = table[ops.index("ROPE")]
        assert "k_shift" in rope["srcs"]
        assert [G.name(t) for t in I.cache_nodes(sg)] == table.column("name")
        # allocated by the scheduler: buffers and backends are known
        G.ggml_backend_sched_alloc_graph(lctx.sched.ptr, sg.graph.ptr)
        table = I.graph_table(sg, lctx.sched)
        assert set(table.column("backend")) == {"CPU"}
        assert table[0]["buffer"] == "CPU"
        text = str(table)
        assert text.splitlines()[0].split() == list(I.GraphTable.COLUMNS)
        assert "cache_k_l1 (view)" in text and "<tr" in table._repr_html_()
        path = I.graph_dot(sg, tmp_path / "shift.dot")
        lctx.sched.reset()
    dot = path.read_text()
    assert dot.startswith("digraph G {") and dot.count("fillcolor = gold") == len(ops) * 2
    assert dot.count("fillcolor = orange") == 2  # cache_k_l0, cache_k_l1
    assert "fillcolor = pink" in dot  # the k_shift input stays a plain leaf


def test_cache_nodes_of_a_mixed_graph():
    kv = make(8, n_embd_head=8)
    with G.Context.for_tensors(32, graph_size=64) as ctx:
        ub_idx = ctx.new_tensor("i64", (2,), "k_idxs")
        k_cur = ctx.new_tensor("f32", (8, 1, 2), "k_cur")
        q = ctx.new_tensor("f32", (8, 2, 1), "q")  # [n_embd_head, n_tokens, n_head]
        stored = kv.cpy_k(ctx, k_cur, ub_idx, 0)
        from kvcache_ggml.cache import SlotInfo

        k = kv.get_k(ctx, 0, 8, SlotInfo(s0=0, s1=0, strm=[0], idxs=[np.array([0, 1])]))
        k = G.ggml_permute(ctx.ptr, k, 0, 2, 1, 3)  # [n_embd_head, n_kv, n_head_kv, 1]
        kq = G.ggml_mul_mat(ctx.ptr, k, q)  # reads the cache but is not one of its nodes
        g = G.Graph(ctx, 64)
        g.expand(stored)
        g.expand(kq)
        table = I.graph_table(g)
        flagged = {r["op"] for r in table if r["cache"]}
        assert flagged == {"SET_ROWS", "VIEW", "PERMUTE"}
        assert [r["cache"] for r in table if r["name"] == "k_cur (view)"] == [False]
        assert [r["cache"] for r in table if r["op"] == "MUL_MAT"] == [False]
        assert len(table.cache_only()) == len(I.cache_nodes(g))


def test_render_svg(tmp_path, monkeypatch):
    kv = make(8, n_embd_head=32)
    with UpdateContext.for_cache(kv) as lctx, kv.shift_context() as ctx:
        path = I.graph_dot(_shift_graph(kv, lctx, ctx), tmp_path / "g.dot", highlight=False)
    assert "gold" not in path.read_text()
    if I.dot_available():
        svg = I.render_svg(path)
        assert svg.suffix == ".svg" and "<svg" in svg.read_text()
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert not I.dot_available()
    with pytest.raises(RuntimeError, match="install Graphviz"):
        I.render_svg(path)
    with pytest.raises(FileNotFoundError):
        I.render_svg(tmp_path / "missing.dot")


# ---------------------------------------------------------------------------------------------- decode helper

def test_decode_places_and_reports_full_cache():
    kv = make(4)
    ctx = I.decode(kv, [0, 1, 2], [0, [0, 1], 1])
    assert [s.idxs[0].tolist() for s in ctx.sinfos] == [[0, 1, 2]]
    assert I.cells_table(kv)["n_seq"].tolist() == [1, 2, 1, 0]
    with pytest.raises(RuntimeError, match="no slot"):
        I.decode(kv, [2, 3], [0, 0])
    assert I.check_invariants(kv) == []


def test_format_cells():
    kv = populated()
    text = I.format_cells(I.cells_table(kv), ["cell", "pos", "shift", "seqs"])
    lines = text.splitlines()
    assert lines[0].split() == ["cell", "pos", "shift", "seqs"] and len(lines) == 1 + 8
    assert lines[1].split() == ["0", "0", "0", "0,2"] and lines[-1].split() == ["8", "4", "1", "1"]
    assert len(I.format_cells(I.cells_table(kv), used_only=False).splitlines()) == 1 + 16
    with pytest.raises(ValueError, match="unknown column 'nope'"):
        I.format_cells(I.cells_table(kv), ["nope"])

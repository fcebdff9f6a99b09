"""runtime/fa_tiles.py and the throwaway rows of ``PrefixCache.advance``: the decision against a brute-force sum of
its two estimates, which contexts qualify, the calibration on a real tiny model, and a padded step against the same
step decoded by hand in a fresh context (logits bit for bit, the cells after it, the next step)."""
from __future__ import annotations

import numpy as np
import pytest

from kvcache_ggml.batch import Batch
from kvcache_ggml.prefix import PrefixCache, check
from kvcache_ggml.runtime import Context, Model, make_model
from kvcache_ggml.runtime.fa_tiles import TILE_Q, FaTiles
from kvcache_ggml.runtime.modelmaker import ModelSpec
from kvcache_ggml.serve.engine import Engine, EngineParams

from helpers import prefill

VOCAB = 64
ALWAYS = FaTiles(c=0.0, m=0.0, f=1.0, t=0.0)   # every step of 2..63 rows takes the rows (row cells cost, tiles free)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("fat") / "tiny.gguf",
                      ModelSpec(layers=2, embd=64, heads=4, heads_kv=2, ff=64, vocab=VOCAB, seed=5))
    with Model(path) as m:
        yield m


def ctx_of(model, **kw):
    p = dict(n_ctx=1024, n_seq_max=4, n_batch=256, n_ubatch=128, n_threads=1, n_threads_batch=1, kv_unified=True,
             flash_attn=True)
    p.update(kw)
    return Context(model, **p)


def toks(n, seed):
    return np.random.default_rng(seed).integers(3, VOCAB, n).astype(np.int32)


# ============================================================================================== the decision


def brute_rows(ft, sizes, seen, used):
    """The two estimates summed cell by cell: every row of part i sees its sequence's seen[i] cells and the part's
    tokens up to itself."""
    n = sum(sizes)
    if not 2 <= n < TILE_Q:
        return 0
    row_cells = 0
    for k, s in zip(sizes, seen):
        for j in range(k):
            row_cells += s + j + 1
    by_row = ft.c + n * ft.m + ft.f * row_cells
    tiled = ft.c + TILE_Q * ft.m + ft.t * TILE_Q * (used + TILE_Q)
    return TILE_Q - n if tiled < ft.margin * by_row else 0


@pytest.mark.parametrize("seed", range(6))
def test_rows_follow_the_two_estimates(seed):
    rng = np.random.default_rng(seed)
    ft = FaTiles(c=float(rng.uniform(0, 2e-3)), m=float(rng.uniform(1e-5, 1e-4)), f=float(rng.uniform(5e-7, 2e-6)),
                 t=float(rng.uniform(0, 1e-7)))
    took = 0
    for _ in range(300):
        parts = int(rng.integers(1, 9))
        sizes = rng.integers(1, 40, parts).tolist()
        seen = rng.integers(0, 3000, parts).tolist()
        used = int(sum(seen) + rng.integers(0, 3000))
        got = ft.rows(sizes, seen, used)
        assert got == brute_rows(ft, sizes, seen, used), (sizes, seen, used)
        took += got > 0
    assert 0 < took < 300  # (the draws reach both answers)


def test_rows_never_for_one_row_or_a_whole_tile():
    assert ALWAYS.rows([1], [5000], 5000) == 0          # one row: ggml's split-cells path
    assert ALWAYS.rows([TILE_Q], [5000], 5000) == 0     # already tiles
    assert ALWAYS.rows([40, 30], [100, 100], 300) == 0  # 70 rows
    assert ALWAYS.rows([2], [0], 0) == TILE_Q - 2


@pytest.mark.parametrize("seed", range(4))
def test_fit_recovers_the_costs_the_times_were_made_of(seed):
    """Six step times made from known costs (each step: c + n m, plus f or t per row and cell it adds after `seen`
    cells) give those costs back."""
    rng = np.random.default_rng(seed)
    c, m, f, t = rng.uniform(1e-4, 1e-2), rng.uniform(1e-6, 1e-4), rng.uniform(1e-7, 1e-5), rng.uniform(1e-9, 1e-7)
    seen = int(rng.integers(64, 1024))
    times = {f"z{n}": c + n * m for n in (16, 48, 64)}
    times |= {f"a{n}": c + n * m + f * n * seen for n in (16, 48)}
    times["a64"] = c + 64 * m + t * 64 * seen
    ft = FaTiles.fit(times, seen)
    assert np.allclose([ft.c, ft.m, ft.f, ft.t], [c, m, f, t], rtol=1e-9, atol=0)


def test_plausible_fits():
    assert FaTiles(1e-3, 4e-5, 1.1e-6, 8e-8).plausible()          # an idle AVX2 machine: f/t = 14
    assert not FaTiles(1e-3, 4e-5, 1.1e-6, 0.0).plausible()       # no tiled cost: every step would pad
    assert not FaTiles(1e-3, 4e-5, 1.1e-6, 2e-8).plausible()      # f/t = 55
    assert not FaTiles(1e-3, 4e-5, 1.1e-6, 1e-6).plausible()      # f/t = 1.1: the kernels' order lost in noise
    assert not FaTiles(-1e-4, 4e-5, 1.1e-6, 8e-8).plausible()     # a negative fixed cost
    assert not FaTiles(1e-3, 0.0, 1.1e-6, 8e-8).plausible()


def test_a_fit_pads_a_turn_and_not_a_decode_step():
    """With an idle machine's costs: 56 new tokens after 700 cells take the rows, 8 generating tokens of 600 cells
    each (the cache holding 2000) do not, nor does a fit measured busy that puts f/t at 36."""
    idle, busy = FaTiles(1.2e-3, 4.3e-5, 1.1e-6, 8.6e-8), FaTiles(4.4e-3, 5e-5, 2.9e-6, 8e-8)
    for ft in (idle, busy):
        assert ft.plausible() and ft.rows([56], [700], 2000) == 8
        assert ft.rows([1] * 8, [600] * 8, 2000) == 0


# ============================================================================================== which contexts


@pytest.mark.parametrize("kw,why", [
    (dict(flash_attn=False), "flash attention is off"),
    (dict(type_k="bf16", type_v="bf16"), "bf16/bf16"),  # (the model's heads of 16 take no block of 32)
    (dict(type_k="f16", type_v="f32"), "f16/f32"),
    (dict(n_ubatch=32), "n_ubatch 32 < 64"),
])
def test_unsupported_names_the_reason(model, kw, why):
    with ctx_of(model, **kw) as c:
        assert why in FaTiles.unsupported(c)
        assert FaTiles.calibrate(c) is None


def test_calibrate_measures_and_leaves_the_cache_empty(model):
    with ctx_of(model) as c:
        assert FaTiles.unsupported(c) == "" and c.cpu_only
        times = FaTiles.measure(c, 256, 2)
        assert sorted(times) == ["a16", "a48", "a64", "z16", "z48", "z64"] and min(times.values()) > 0
        assert c.kv.get_used() == 0 and c.memory_seq_pos_max(0) == -1
        ft = FaTiles.calibrate(c, seen=256)
        assert ft is None or ft.plausible()  # (None: this machine was too busy for three fits in a row)
        assert c.kv.get_used() == 0 and c.memory_seq_pos_max(0) == -1
        c.decode(Batch(token=toks(3, 1)))
        with pytest.raises(RuntimeError, match="empty cache"):
            FaTiles.calibrate(c)
        assert c.memory_seq_pos_max(0) == 2  # (refused before touching it)


# ============================================================================================== a padded step


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("n", [2, 23, 63])
def test_padded_step_is_the_same_step_decoded_by_hand(model, kv_type, n):
    """A prompt of 100 tokens, then a chunk of n with throwaway rows: its logits are those of a fresh context that
    decodes the chunk followed by 64 - n copies of its last token at the next positions; the throwaway cells are
    gone afterwards, and the next token's logits are again the hand-made context's after it removes them."""
    kw = dict(type_k=kv_type, type_v=kv_type)
    head, chunk, nxt = toks(100, 2), toks(n, 3), toks(1, 4)
    pad = TILE_Q - n
    with ctx_of(model, **kw) as c:
        pc = PrefixCache(c)
        prefill(pc, head, 0)
        (row,) = pc.advance([(0, chunk, True)], tiles=ALWAYS)
        row = row.copy()
        assert (pc.stats.padded_steps, pc.stats.padded_rows) == (1, pad)
        assert c.memory_seq_pos_max(0) == 100 + n - 1 and c.kv.get_used() == 100 + n
        assert check(pc) == []
        (row2,) = pc.advance([(0, nxt, True)], tiles=ALWAYS)  # one row: never padded
        assert pc.stats.padded_steps == 1
        row2 = row2.copy()
    with ctx_of(model, **kw) as r:
        r.decode(Batch(token=head))
        ids = np.concatenate([chunk, np.full(pad, chunk[-1], np.int32)])
        flags = np.zeros(TILE_Q, np.int8)
        flags[n - 1] = 1
        want = r.decode(Batch(token=ids, pos=np.arange(100, 164, dtype=np.int32), logits=flags))[0].copy()
        r.memory_seq_rm(0, 100 + n, -1)
        want2 = r.decode(Batch(token=nxt, pos=np.array([100 + n], np.int32)))[0].copy()
    assert np.array_equal(row, want)
    assert np.array_equal(row2, want2)


def test_padded_mixed_step_with_a_draft_is_the_batch_decoded_by_hand(model):
    """Three parts in one unified cache -- a generating token, a verified draft (every row's logits) and a prompt
    chunk -- get their throwaway rows after the last part, in its sequence: every returned row equals the same batch
    decoded by hand with those rows, and the cells afterwards are the unpadded step's."""
    heads = [toks(80, 20), toks(120, 21), toks(60, 22)]
    parts = [toks(1, 23), toks(5, 24), toks(17, 25)]
    n = sum(p.size for p in parts)
    pad = TILE_Q - n
    with ctx_of(model) as c:
        pc = PrefixCache(c)
        for s, h in enumerate(heads):
            prefill(pc, h, s)
        out = pc.advance([(s, p, True) for s, p in enumerate(parts)], all_rows=[1], tiles=ALWAYS)
        got = [o.copy() for o in out]
        assert (pc.stats.padded_steps, pc.stats.padded_rows) == (1, pad)
        assert [c.memory_seq_pos_max(s) for s in range(3)] == [h.size + p.size - 1 for h, p in zip(heads, parts)]
        assert c.kv.get_used() == sum(h.size + p.size for h, p in zip(heads, parts)) and check(pc) == []
    with ctx_of(model) as r:
        for s, h in enumerate(heads):
            r.decode(Batch(token=h, pos=np.arange(h.size, dtype=np.int32), seq_id=np.full(h.size, s, np.int32)))
        ids = np.concatenate(parts + [np.full(pad, parts[2][-1], np.int32)])
        pos = np.concatenate([np.arange(h.size, h.size + p.size) for h, p in zip(heads, parts)]
                             + [np.arange(heads[2].size + parts[2].size, heads[2].size + parts[2].size + pad)])
        seq = np.repeat(np.int32([0, 1, 2, 2]), [1, 5, 17, pad])
        flags = np.zeros(TILE_Q, np.int8)
        flags[[0, 1, 2, 3, 4, 5, 22]] = 1
        want = r.decode(Batch(token=ids, pos=pos.astype(np.int32), seq_id=seq, logits=flags))
    assert got[0].shape == want[0].shape and np.array_equal(got[0], want[0])
    assert got[1].shape == want[1:6].shape and np.array_equal(got[1], want[1:6])
    assert np.array_equal(got[2], want[6])


@pytest.mark.parametrize("kv_type,tol", [("f32", 1e-5), ("f16", 1e-2)])
def test_padding_changes_the_logits_only_at_rounding_level(model, kv_type, tol):
    """The tiled kernel against the row-by-row one, same tokens: F32 K/V differ in the order of the sums only; with
    F16 K/V the row-by-row path also rounds Q to F16 (the tiled one multiplies in F32)."""
    head, chunk = toks(300, 5), toks(40, 6)
    rows = []
    for tiles in (None, ALWAYS):
        with ctx_of(model, type_k=kv_type, type_v=kv_type) as c:
            pc = PrefixCache(c)
            prefill(pc, head, 0)
            rows.append(pc.advance([(0, chunk, True)], tiles=tiles)[0].copy())
            assert pc.stats.padded_steps == (tiles is not None)
    a, b = rows
    assert not np.array_equal(a, b)  # (two kernels)
    assert np.abs(a - b).max() <= tol * np.abs(a).max()


def test_no_rows_without_room(model):
    """No throwaway rows where they would pass the sequence's context, nor across streams."""
    with ctx_of(model, n_ctx=256, n_seq_max=1) as c:
        assert c.n_ctx_seq() == 256
        pc = PrefixCache(c)
        prefill(pc, toks(170, 7), 0)
        pc.advance([(0, toks(30, 8), True)], tiles=ALWAYS)  # 200 + 34 throwaway cells <= 256: padded
        assert pc.stats.padded_steps == 1
        pc.advance([(0, toks(30, 9), True)], tiles=ALWAYS)  # 230 + 34 > 256: not
        assert pc.stats.padded_steps == 1 and c.kv.get_used() == 230
    with ctx_of(model, kv_unified=False, n_seq_max=2) as c:
        pc = PrefixCache(c)
        prefill(pc, toks(50, 10), 0)
        prefill(pc, toks(50, 11), 1)
        pc.advance([(0, toks(10, 12), True), (1, toks(10, 13), True)], tiles=ALWAYS)  # two streams
        assert pc.stats.padded_steps == 0
        pc.advance([(1, toks(10, 14), True)], tiles=ALWAYS)
        assert pc.stats.padded_steps == 1
        assert check(pc) == []


# ============================================================================================== the engine


def test_engine_measures_at_warm_up_and_pads_a_next_turn(model):
    """warm_up() measures (or, with fa_tiles off, does not); a conversation's next turn reads its new tokens in a
    padded step, and the cache ends as an engine without throwaway rows leaves it."""
    from kvcache_ggml.runtime.tokenizer import Vocab
    from kvcache_ggml.serve.protocol import SamplingParams
    from kvcache_ggml.serve.request import Job
    from kvcache_ggml.serve.sampling import Sampler
    from kvcache_ggml.serve.text import TextStream
    vocab = Vocab.from_kv(model.gguf_kv)
    with ctx_of(model) as c:
        off = Engine(c, vocab, EngineParams(n_parallel=1, fa_tiles=False))
        off.warm_up()
        assert off.tiles is None
    ends = []
    for tiles in (None, ALWAYS):
        with ctx_of(model) as c:
            eng = Engine(c, vocab, EngineParams(n_parallel=1))
            eng.warm_up()
            assert (eng.tiles is None or eng.tiles.plausible()) and c.kv.get_used() == 0
            eng.tiles = tiles
            first = toks(200, 15)
            for prompt in (first, np.concatenate([first, toks(30, 16)])):
                sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
                eng.submit(Job(prompt, Sampler(sp, VOCAB, [vocab.eos]), TextStream(vocab), lambda ev: None,
                               max_tokens=4))
                eng.run_until_idle()
            assert check(eng.prefix) == []
            assert eng.snapshot().padded_steps == eng.prefix.stats.padded_steps
            ends.append((eng.prefix.stats.padded_steps, eng.prefix.stats.padded_rows, eng.stats.cached_tokens,
                         c.kv.get_used(), {s: c.memory_seq_pos_max(s) for s in eng.prefix.seqs}))
    (p0, r0, cached0, used0, pos0), (p1, r1, cached1, used1, pos1) = ends
    n_new = 230 - cached1                              # the second prompt's tokens not reused (the first reused none)
    assert (p0, r0) == (0, 0) and n_new >= 30 and (p1, r1) == (1, TILE_Q - n_new)
    assert (cached1, used1, pos1) == (cached0, used0, pos0)  # no throwaway cell left

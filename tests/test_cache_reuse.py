"""Chunk reuse by K-shift (``PrefixCache.attach(..., n_cache_reuse=N)``, llama-server's ``--cache-reuse``).

The plan is checked against a line-by-line Python transcription of llama-server's loop (tools/server's
``n_cache_reuse`` walk) on many random token lists; the cells against the same transcription run on a list of
(original position -> new position) cells; the logits against a float64 reference: with one layer a shifted cache
equals a fresh decode of the new prompt (``Reference.forward``), with two it equals a float64 cache replaying the
same ``seq_rm``/``seq_add`` (``ReferenceCache``).  F32 caches: 1e-4 of the largest logit (tests/test_runtime.py).
"""
from __future__ import annotations

import numpy as np
import pytest

from kvcache_ggml.batch import Batch
from kvcache_ggml.inspect import cells_table
from kvcache_ggml.prefix import PrefixCache, check
from kvcache_ggml.prefix.reuse import plan_chunks
from kvcache_ggml.runtime import Context, Model, Reference, make_model
from kvcache_ggml.runtime.modelmaker import ModelSpec

TOL = 1e-4
VOCAB = 64


def rel_err(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


def server_walk(cache, prompt, n_reuse):
    """llama-server's cache-reuse loop, transcribed token by token: (n_past, [(head_c, head_p, n_match)], the
    cells as {original position: new position} after its seq_rm/seq_add calls)."""
    cache = [int(t) for t in cache]
    prompt = [int(t) for t in prompt]
    n_past = 0
    while n_past < len(cache) and n_past < len(prompt) and cache[n_past] == prompt[n_past]:
        n_past += 1
    cells = {p: p for p in range(len(cache))}
    head_c = head_p = n_past
    moves = []
    while head_c < len(cache) and head_p < len(prompt):
        n_match = 0
        while (head_c + n_match < len(cache) and head_p + n_match < len(prompt)
               and cache[head_c + n_match] == prompt[head_p + n_match]):
            n_match += 1
        if n_match >= n_reuse:
            moves.append((head_c, head_p, n_match))
            shift = head_p - head_c
            cells = {o: p for o, p in cells.items() if not head_p <= p < head_c}             # seq_rm
            cells = {o: p + shift if head_c <= p < head_c + n_match else p for o, p in cells.items()}  # seq_add
            for i in range(n_match):
                cache[head_p + i] = cache[head_c + i]
                n_past += 1
            head_c += n_match
            head_p += n_match
        else:
            head_c += 1
    return n_past, moves, cells


def edited(rng, p, n_new, a, b):
    """p with its tokens [a, a + b) replaced by n_new fresh ones (n_new 0: cut out)."""
    return np.concatenate([p[:a], rng.integers(3, VOCAB, n_new), p[a + b:]]).astype(np.int32)


# ---------------------------------------------------------------------------------------------- the plan

def test_plan_equals_the_server_loop_on_random_lists():
    rng = np.random.default_rng(0)
    n_moves = 0
    for trial in range(3000):
        vocab = int(rng.integers(2, 8))           # few distinct tokens: many repeats and near-misses
        cache = rng.integers(0, vocab, int(rng.integers(0, 40))).astype(np.int32)
        if trial % 2:   # an edited copy: chunks of the cache reappear shifted
            cut = sorted(rng.integers(0, cache.size + 1, 2))
            prompt = np.concatenate([cache[:cut[0]], rng.integers(0, vocab, int(rng.integers(0, 6))),
                                     cache[cut[1]:]]).astype(np.int32)
        else:
            prompt = rng.integers(0, vocab, int(rng.integers(0, 40))).astype(np.int32)
        n_min = int(rng.integers(1, 6))
        n_past, moves, _ = server_walk(cache, prompt, n_min)
        prefix = next((i for i in range(min(cache.size, prompt.size)) if cache[i] != prompt[i]),
                      min(cache.size, prompt.size))
        plan = plan_chunks(cache, prompt, prefix, n_min)
        assert plan.n_reused == n_past
        assert [(m.src, m.dst, m.n) for m in plan.moves] == moves
        assert plan.n_shifted == sum(m[2] for m in moves)
        assert all(m.dst < m.src for m in plan.moves)
        n_moves += len(moves)
    assert n_moves > 1000  # the lists do exercise the moves


def test_plan_rejects_bad_arguments():
    t = np.arange(5, dtype=np.int32)
    with pytest.raises(ValueError, match="n_min must be >= 1, got 0"):
        plan_chunks(t, t, 0, 0)
    with pytest.raises(ValueError, match="n_prefix 6 out of range"):
        plan_chunks(t, t, 6, 2)


# ---------------------------------------------------------------------------------------------- the cache

@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("reuse")
    return {n: make_model(d / f"l{n}.gguf", ModelSpec(layers=n, embd=64, heads=4, heads_kv=2, ff=96, vocab=VOCAB,
                                                      seed=5))
            for n in (1, 2)}


def ctx_of(model, n_seq=2, unified=True):
    return Context(model, n_ctx=256, n_batch=128, n_ubatch=128, n_seq_max=n_seq, kv_unified=unified,
                   type_k="f32", type_v="f32", n_threads=2, n_threads_batch=2)


def run_prompt(pc, toks, seq, n_reuse):
    adm = pc.attach(toks, seq, n_cache_reuse=n_reuse)
    (row,) = pc.advance([(seq, toks[adm.n_reused:], True)])
    pc.release(seq)
    return adm, row


@pytest.mark.parametrize("unified", [True, False])
def test_one_layer_reuse_equals_a_fresh_decode(paths, unified):
    """One layer: a moved cell is what a fresh decode at its new position leaves, so the logits are the new
    prompt's from scratch; the moved tokens are not decoded again, and the cells sit where the server puts them."""
    rng = np.random.default_rng(1)
    p = rng.integers(3, VOCAB, 60).astype(np.int32)
    q = edited(rng, p, 0, 10, 7)                     # 10 kept, 7 cut out: the tail moves back by 7
    n_past, moves, cells = server_walk(p, q, 4)
    assert moves == [(17, 10, 43)] and n_past == 53
    with Model(paths[1]) as m, ctx_of(m, unified=unified) as ctx:
        pc = PrefixCache(ctx)
        run_prompt(pc, p, 0, 4)
        decoded = pc.stats.tokens_decoded
        adm, row = run_prompt(pc, q, 0, 4)
        assert (adm.n_reused, adm.n_decoded, adm.n_shifted, adm.source) == (52, 1, 42, "own")  # last token: decoded
        assert pc.stats.tokens_decoded - decoded == 1 and pc.stats.tokens_shifted == 42
        t = cells_table(ctx.kv)
        t = t[(t["pos"] >= 0) & (t["stream"] == pc.stream_of(0))]
        want = {o: n for o, n in cells.items() if n < 52}
        got = {int(c): int(pp) for c, pp in zip(t["cell"], t["pos"]) if int(c) in want}
        assert got == want                           # cell i held position i: it now holds where the server moved it
        assert rel_err(row, Reference(paths[1]).forward(q)[-1]) < TOL
        assert check(pc) == [] and np.array_equal(pc.seqs[0].tokens, q)


def test_random_edits_reuse_what_the_server_reuses(paths):
    """40 random prompt pairs over a few distinct tokens (runs reappear often, near misses too), one layer: the
    tokens reused are the server loop's (all but the last at most), the cells sit where its seq_rm/seq_add put
    them, the audit holds, and the logits equal a fresh decode of the new prompt."""
    rng = np.random.default_rng(7)
    ref = Reference(paths[1])
    n_moved = 0
    with Model(paths[1]) as m, ctx_of(m, n_seq=1) as ctx:
        for trial in range(40):
            pc = PrefixCache(ctx)
            p = rng.integers(3, 8, int(rng.integers(8, 40))).astype(np.int32)
            q = p.copy()
            for _ in range(int(rng.integers(1, 4))):   # cuts and small insertions
                a = int(rng.integers(0, q.size))
                q = edited(rng, q, int(rng.integers(0, 2)), a, int(rng.integers(0, 6)))
            if q.size == 0:
                continue
            q = np.where(q >= 8, 3 + q % 5, q).astype(np.int32)   # (inserted tokens from the few too)
            n_min = int(rng.integers(1, 5))
            n_past, moves, cells = server_walk(p, q, n_min)
            run_prompt(pc, p, 0, 0)
            adm, row = run_prompt(pc, q, 0, n_min)
            n = min(n_past, q.size - 1)
            own = common_len(p, q, q.size - 1)
            assert adm.n_reused == (n if moves and n > own else own), (p, q, n_min)
            if moves and n > own:
                n_moved += 1
                t = cells_table(ctx.kv)
                t = t[t["pos"] >= 0]
                got = {int(c): int(pp) for c, pp in zip(t["cell"], t["pos"])}
                assert {o: x for o, x in got.items() if x < n} == {o: x for o, x in cells.items() if x < n}
            assert check(pc) == []
            assert rel_err(row, ref.forward(q)[-1]) < TOL
            pc.clear()
    assert n_moved >= 10


def common_len(a, b, limit):
    n = 0
    while n < min(a.size, b.size, limit) and a[n] == b[n]:
        n += 1
    return n


def test_two_layers_equal_a_cache_replaying_the_shifts(paths):
    """Two layers: the moved K/V carry their old context, as in a float64 cache replaying seq_rm/seq_add; the
    next request extends the shifted sequence (indexed as holding the new prompt)."""
    rng = np.random.default_rng(2)
    p = rng.integers(3, VOCAB, 70).astype(np.int32)
    q = edited(rng, edited(rng, p, 0, 5, 6), 0, 30, 5)   # two cuts: two chunks move
    n_past, moves, _ = server_walk(p, q, 3)
    assert len(moves) == 2
    ref = Reference(paths[2])
    with Model(paths[2]) as m, ctx_of(m) as ctx:
        pc = PrefixCache(ctx)
        run_prompt(pc, p, 1, 3)
        adm, row = run_prompt(pc, q, 1, 3)
        rc = ref.cache()
        rc.decode(p)
        for hc, hp, n in moves:
            rc.seq_rm(hp, hc)
            rc.seq_add(hc, hc + n, hp - hc)
        rc.seq_rm(adm.n_reused, -1)
        assert adm.n_reused == min(n_past, q.size - 1)
        assert rel_err(row, rc.decode(q[adm.n_reused:])[-1]) < TOL
        assert rel_err(row, ref.forward(q)[-1]) > 10 * TOL  # (not a fresh decode: the deeper layer differs)
        more = np.concatenate([q, rng.integers(3, VOCAB, 4)]).astype(np.int32)
        adm2, row2 = run_prompt(pc, more, 1, 3)
        assert (adm2.n_reused, adm2.n_shifted, adm2.source) == (q.size, 0, "own")
        assert rel_err(row2, rc.decode(more[q.size:])[-1]) < TOL
        assert check(pc) == []


def test_pick_seq_takes_the_sequence_with_the_chunks(paths):
    """Without chunk reuse the server picks a free sequence (copying the short common prefix); with it, the parked
    sequence whose chunks give more."""
    rng = np.random.default_rng(3)
    p = rng.integers(3, VOCAB, 50).astype(np.int32)
    q = edited(rng, p, 0, 3, 4)
    with Model(paths[1]) as m, ctx_of(m, n_seq=3) as ctx:
        pc = PrefixCache(ctx)
        run_prompt(pc, p, 1, 0)
        assert pc.pick_seq(q) != 1
        assert pc.pick_seq(q, n_cache_reuse=8) == 1
        assert pc.pick_seq(q, n_cache_reuse=47) != 1   # no run that long: as without
        adm = pc.attach(q, 1, n_cache_reuse=8)
        assert adm.n_reused == 45 and adm.n_shifted == 42


def test_shared_cells_move_for_every_holder(paths):
    """Unified cache: a moved cell shared with another sequence (seq_cp) moves for both; the index cuts the other
    one where its cells moved, and the audit agrees with the cells."""
    rng = np.random.default_rng(4)
    p = rng.integers(3, VOCAB, 40).astype(np.int32)
    q = edited(rng, p, 0, 8, 5)
    with Model(paths[1]) as m, ctx_of(m) as ctx:
        pc = PrefixCache(ctx)
        run_prompt(pc, p, 0, 0)
        pc.seq_cp(0, 1)
        assert pc.seqs[1].tokens.size == 40
        adm, row = run_prompt(pc, q, 0, 5)
        assert adm.n_shifted == 26 and pc.seqs[1].tokens.size == 8   # cut at the first moved position
        assert check(pc) == []
        assert rel_err(row, Reference(paths[1]).forward(q)[-1]) < TOL


def test_shared_cells_move_for_every_holder_of_a_unified_iswa_memory(tmp_path):
    """The same on Gemma 2's iSWA memory (swa_full: it can shift), unified: which sequences share the moved cells is
    read in the base cache (before: cells_table refused the iSWA memory, and the admission failed in the server).
    The SWA cache moves alike: it holds the base cache's positions of each sequence from its window's start on."""
    from kvcache_ggml.runtime.arch import load_model
    from kvcache_ggml.runtime.gemma_maker import GemmaSpec, make_gemma_model

    path = make_gemma_model(tmp_path / "g.gguf", GemmaSpec(arch="gemma2", n_swa=8, vocab=VOCAB, seed=3))
    rng = np.random.default_rng(4)
    p = rng.integers(3, VOCAB, 40).astype(np.int32)
    q = edited(rng, p, 0, 8, 5)
    with load_model(path) as m, Context(m, n_ctx=256, n_batch=128, n_ubatch=128, n_seq_max=2, kv_unified=True,
                                        swa_full=True, n_threads=2, n_threads_batch=2) as ctx:
        pc = PrefixCache(ctx)
        assert ctx.memory_can_shift()
        run_prompt(pc, p, 0, 0)
        pc.seq_cp(0, 1)
        adm, _ = run_prompt(pc, q, 0, 5)
        assert adm.n_shifted == 26 and pc.seqs[1].tokens.size == 8   # cut at the first moved position
        assert check(pc) == []
        for s in (0, 1):
            base, swa = (np.sort(t["pos"][(t["pos"] >= 0) & ((t["seq_mask"] >> np.uint64(s)) & np.uint64(1) > 0)])
                         for t in (cells_table(ctx.kv.get_base()), cells_table(ctx.kv.get_swa())))
            assert swa.size and np.array_equal(swa, base[base >= swa[0]]), s


def test_bad_input_changes_nothing(paths, tmp_path):
    rng = np.random.default_rng(5)
    p = rng.integers(3, VOCAB, 30).astype(np.int32)
    with Model(paths[1]) as m, ctx_of(m) as ctx:
        pc = PrefixCache(ctx)
        run_prompt(pc, p, 0, 0)
        before, tokens = ctx.state_get_data(), pc.seqs[0].tokens.copy()
        for call in (lambda: pc.attach(edited(rng, p, 2, 2, 2), 0, n_cache_reuse=-1),
                     lambda: pc.pick_seq(p, n_cache_reuse=-3)):
            with pytest.raises(ValueError, match="n_cache_reuse must be >= 0"):
                call()
        assert ctx.state_get_data() == before and np.array_equal(pc.seqs[0].tokens, tokens)
        assert not pc.seqs[0].active and pc.stats.requests == 1


def test_a_memory_that_cannot_shift_refuses(tmp_path):
    from kvcache_ggml.runtime.arch import load_model
    from kvcache_ggml.runtime.gemma_maker import GemmaSpec, make_gemma_model

    path = make_gemma_model(tmp_path / "g.gguf", GemmaSpec(arch="gemma2", n_swa=8, vocab=VOCAB, seed=3))
    p = np.random.default_rng(6).integers(3, VOCAB, 30).astype(np.int32)
    with load_model(path) as m, Context(m, n_ctx=512, n_ubatch=32, n_seq_max=1, swa_full=False, n_threads=1,
                                        n_threads_batch=1) as ctx:
        pc = PrefixCache(ctx)
        assert not ctx.memory_can_shift()
        run_prompt(pc, p, 0, 0)
        before = ctx.state_get_data()
        with pytest.raises(ValueError, match="n_cache_reuse 4: this memory cannot shift positions"):
            pc.attach(p[3:], 0, n_cache_reuse=4)
        assert ctx.state_get_data() == before and pc.seqs[0].tokens.size == 30 and not pc.seqs[0].active
        assert pc.attach(p[3:], 0).n_reused == 0   # without chunk reuse: attached as before

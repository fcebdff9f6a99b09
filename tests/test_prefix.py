"""kvcache_ggml.prefix: the radix tree against brute force, the host tier's budgets, and the prefix cache on a real
tiny model -- reuse from every source, logits against decoding from scratch in a fresh context, the index after
every memory operation, eviction and retention, and the serving loop.

Logits and placement: the CPU kernels reduce over cells in fixed blocks (flash attention in 64-cell tiles,
mul_mat + soft_max in SIMD lanes), so a decode's logits depend, at rounding level, on where its cells sit.  A reused
prefix sits in exactly the cells it was decoded in; where the rest of the request lands where a fresh decode puts it
(the cases of ``test_reuse_is_exact``) the logits are bitwise equal, elsewhere they agree to ``TOL`` -- as a decode
from scratch at another offset does (``test_placement_alone_moves_logits``).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvcache_ggml.batch import Batch
from kvcache_ggml.prefix import (HostParams, HostTier, LRUPolicy, PrefixCache, PrefixParams, PrefixStats, RadixTree,
                                 Retention, check, common_prefix)
from kvcache_ggml.prefix.policy import Candidate
from kvcache_ggml.runtime import Context, DecodeError, Model, make_model
from kvcache_ggml.runtime.modelmaker import ModelSpec
from kvcache_ggml.cache.state import read_state_file

from helpers import prefill

VOCAB = 64
TOL = 1e-5      # relative to the largest logit, F32 K/V: placement-dependent rounding is ~1e-6 here
TOL_F16 = 2e-3  # F16 K/V: ggml's flash attention rounds Q to F16 for batches under 64 tokens, not above


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def toks(n, seed):
    return np.random.default_rng(seed).integers(3, VOCAB, n).astype(np.int32)


# ============================================================================================== the tree


def lcp(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


token_lists = st.lists(st.integers(0, 3), min_size=1, max_size=9).map(lambda xs: np.array(xs, np.int32))


@settings(max_examples=300, deadline=None)
@given(st.lists(token_lists, min_size=1, max_size=12), st.lists(token_lists, min_size=1, max_size=6),
       st.data())
def test_tree_matches_brute_force(entries, queries, data):
    tree = RadixTree()
    held = {}
    for i, t in enumerate(entries):
        tree.insert(i, t)
        held[i] = t
    assert tree.check(held) == []
    gone = data.draw(st.lists(st.sampled_from(sorted(held)), unique=True))
    for i in gone:
        tree.remove(i, held.pop(i))
        assert tree.check(held) == []
    for i in data.draw(st.lists(st.sampled_from(sorted(held)), unique=True)) if held else []:
        more = data.draw(token_lists)
        tree.extend(i, held[i], more)          # in place at a leaf of its own, a new leaf below a shared node,
        #                                        else remove + insert
        held[i] = np.concatenate([held[i], more])
        assert tree.check(held) == []
    for q in queries + list(held.values()):
        limit = data.draw(st.one_of(st.none(), st.integers(0, 10)))
        d, node = tree.match(q, limit)
        best = max((lcp(t, q) for t in held.values()), default=0)
        assert d == min(best, len(q) if limit is None else limit)
        want = {i for i, t in held.items() if lcp(t, q) >= d} if d else set(held)
        assert node.holders == want
        assert sorted(tree.ends_along(q)) == sorted(i for i, t in held.items() if lcp(t, q) == len(t))
    for i in list(held):
        tree.remove(i, held.pop(i))
    assert len(tree) == 0 and not tree.root.children and tree.check({}) == []


def test_tree_render_names_each_entry():
    tree = RadixTree()
    tree.insert("a", np.array([1, 2, 3, 4], np.int32))
    tree.insert("b", np.array([1, 2, 9], np.int32))
    tree.insert("c", np.array([1, 2], np.int32))
    text = tree.render(str)
    assert text.splitlines()[0] == "(root) 3 entries"
    assert "[0:2] 1 2  (3 below)  <- c" in text
    assert "[2:4] 3 4  (1 below)  <- a" in text and "[2:3] 9  (1 below)  <- b" in text


# ============================================================================================== policy, host tier


def test_lru_policy_prefers_low_priority_then_oldest():
    c = [Candidate("x", 5, 0, 3, 35), Candidate("y", 5, 0, 1, 35), Candidate("z", 5, 0, 0, 80)]
    assert LRUPolicy()(c).entry == "y"
    assert LRUPolicy()(c[2:] + [Candidate("w", 1, 0, 9, 10)]).entry == "w"
    with pytest.raises(ValueError):
        LRUPolicy()([])
    with pytest.raises(ValueError, match="priority"):
        Retention(101).check()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 300)), min_size=1, max_size=30),
       st.integers(0, 600), st.integers(0, 900), st.booleans())
def test_host_tier_never_exceeds_its_budgets(tmp_path_factory, puts, budget, disk_budget, use_disk):
    d = tmp_path_factory.mktemp("host") if use_disk else None
    stats = PrefixStats()
    tier = HostTier(HostParams(budget=budget, disk_dir=d, disk_budget=disk_budget), stats)
    live = set()
    for k, (n_tok, n_blob) in enumerate(puts):
        e, dropped = tier.put(np.arange(n_tok, dtype=np.int32), bytes(n_blob), k, Retention(), 0.0, 0.0)
        live -= set(dropped)
        if e is not None:
            live.add(e)
        assert tier.check() == []
        assert stats.host_bytes <= budget and stats.disk_bytes <= (disk_budget if use_disk else 0)
        assert set(tier.entries()) == live
        fits = n_blob + 4 * n_tok <= max(budget, disk_budget if use_disk else 0)
        assert (e is not None) == fits
    tier.close()
    assert stats.host_bytes == stats.disk_bytes == 0 and (d is None or not list(d.iterdir()))


# ============================================================================================== the prefix cache


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("pc") / "tiny.gguf",
                      ModelSpec(layers=2, embd=32, heads=2, heads_kv=1, ff=64, vocab=VOCAB, seed=3))


@pytest.fixture(scope="module")
def model(tiny):
    with Model(tiny) as m:
        yield m


def ctx_of(model, **kw):
    p = dict(n_ctx=512, n_seq_max=4, type_k="f32", type_v="f32", n_threads=1, n_threads_batch=1, kv_unified=True)
    p.update(kw)
    return Context(model, **p)


def fresh_logits(model, tokens, **kw):
    """The last token's logits of ``tokens`` decoded from scratch, in one batch, in a fresh context."""
    with ctx_of(model, **kw) as c:
        return c.decode(Batch(token=np.asarray(tokens, np.int32)))[-1].copy()


MODES = [pytest.param(fa, uni, id=f"{'fa' if fa else 'nofa'}-{'unified' if uni else 'streams'}")
         for fa in (True, False) for uni in (True, False)]


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
@pytest.mark.parametrize("fa,unified", MODES)
def test_reuse_is_exact(model, fa, unified, kv_type):
    """Reused prefixes whose rest lands where a fresh decode puts it: the same logits, bit for bit."""
    kw = dict(flash_attn=fa, kv_unified=unified, type_k=kv_type, type_v=kv_type)
    system = toks(40, 1)
    a = np.concatenate([system, toks(9, 2)])
    b = np.concatenate([system, toks(13, 3)])
    with ctx_of(model, **kw) as c:
        pc = PrefixCache(c, host=HostParams(budget=1 << 20))
        assert prefill(pc, system, 0)[0].source == "none"  # a sequence holding the system prompt, cells 0..39
        pc.release(0)
        adm, logits = prefill(pc, b, 1)          # seq_cp (unified) or whole-stream copy + cut (streams)
        assert (adm.source, adm.source_seq, adm.n_reused, adm.n_decoded) == ("device", 0, 40, 13)
        assert np.array_equal(logits, fresh_logits(model, b, **kw))
        pc.release(1)
        turn2 = np.concatenate([b, toks(5, 4)])
        adm, logits = prefill(pc, turn2, 1)      # the same sequence, extended in place
        assert (adm.source, adm.n_reused) == ("own", b.size)
        assert np.array_equal(logits, fresh_logits(model, turn2, **kw))
        pc.release(1)
        pc.evict(1)                              # a blob in RAM
        pc.clear()                               # nothing left on the device
        turn3 = np.concatenate([turn2, toks(4, 5)])
        adm, logits = prefill(pc, turn3, 2)      # restored into the empty cache, from cell 0
        assert (adm.source, adm.n_reused) == ("host", turn2.size)
        assert np.array_equal(logits, fresh_logits(model, turn3, **kw))
        assert check(pc) == []


@pytest.mark.parametrize("fa", [True, False])
def test_placement_alone_moves_logits(model, fa):
    """Why the general case needs a tolerance: a decode from scratch 13 cells further on differs too (flash
    attention tiles the cells of a long prompt; mul_mat + soft_max sum them in SIMD lanes)."""
    p = toks(87, 6)
    want = fresh_logits(model, p, flash_attn=fa)
    with ctx_of(model, flash_attn=fa) as c:
        c.decode(Batch(token=np.full(13, 5, np.int32), seq_id=np.full(13, 3, np.int32)))
        got = c.decode(Batch(token=p, seq_id=np.ones(87, np.int32)))[-1]
    assert 0 < rel_err(got, want) < TOL


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
@pytest.mark.parametrize("fa,unified", MODES)
def test_reuse_in_a_busy_cache_within_tolerance(model, fa, unified, kv_type):
    kw = dict(flash_attn=fa, kv_unified=unified, type_k=kv_type, type_v=kv_type, n_ctx=4 * 96)
    system = toks(24, 7)
    reqs = [np.concatenate([system, toks(3 + 13 * i % 57, 10 + i)]) for i in range(10)]
    with ctx_of(model, **kw) as c:
        pc = PrefixCache(c, host=HostParams(budget=1 << 20))
        for i, r in enumerate(reqs):
            s = pc.pick_seq(r)
            adm, logits = prefill(pc, r, s)
            assert adm.n_reused >= (0 if i == 0 else 24)
            assert rel_err(logits, fresh_logits(model, r, **kw)) < (TOL if kv_type == "f32" else TOL_F16)
            if i % 3:
                pc.advance([(s, [7], True)])
            pc.release(s)
            assert check(pc) == []
        assert pc.stats.evictions > 0 and pc.stats.hits_device + pc.stats.hits_host == 9


def test_unified_reuse_shares_cells(model):
    system = toks(20, 8)
    with ctx_of(model) as c:
        pc = PrefixCache(c)
        prefill(pc, np.append(system, 9), 0)
        adm, _ = prefill(pc, np.append(system, 11), 1)
        assert adm.n_reused == 20
        cells = c.kv.v_cells[0]
        shared = np.flatnonzero(cells.seq_mask(0) & cells.seq_mask(1))
        assert shared.size == 20 and cells.get_used() == 22       # 20 shared cells + one of each
        m = pc.match(np.append(system, [11, 4]))
        assert (m.n_tokens, m.tier, m.seq_id, list(m.positions)) == (21, "device", 1, list(range(21)))


def test_match_needs_min_reuse_and_reuse_flag(model):
    with ctx_of(model) as c:
        pc = PrefixCache(c, min_reuse=5)
        prefill(pc, toks(10, 9), 0)
        assert pc.match(toks(10, 9)[:4].tolist() + [1]).n_tokens == 0
        assert pc.match(toks(10, 9)).n_tokens == 10
        pc.params.reuse = False
        assert pc.match(toks(10, 9)).tier == "none"


# ---------------------------------------------------------------------------------------------- invalidation


def served(pc, seq, tokens):
    prefill(pc, tokens, seq)
    pc.release(seq)


def test_shifted_sequence_no_longer_matches_its_old_positions(model):
    t = toks(30, 11)
    with ctx_of(model) as c:
        pc = PrefixCache(c)
        served(pc, 0, t)
        pc.context_shift(0, 4, 10)                    # positions 14.. move to 4..
        assert pc.seqs[0].tokens.tolist() == t[:4].tolist() and not pc.seqs[0].clean
        assert pc.match(t).n_tokens == 4
        assert check(pc) == []
        adm, _ = prefill(pc, np.concatenate([t[:4], toks(3, 12)]), 1)
        assert adm.n_reused == 4
        pc.release(1)
        # the decode ran the K-shift; the entry of the shifted sequence still only claims its first 4 tokens
        assert check(pc) == [] and pc.match(t).n_tokens == 4


def test_shift_of_shared_cells_cuts_every_sharer(model):
    t = toks(20, 13)
    with ctx_of(model) as c:
        pc = PrefixCache(c)
        served(pc, 0, t)
        served(pc, 1, np.append(t[:15], 5))           # shares cells 0..14 with sequence 0
        pc.seq_add(0, 10, -1, 3)                      # moves shared cells 10..14: sequence 1 moves too
        assert pc.seqs[0].tokens.size == 10 and pc.seqs[1].tokens.size == 10
        assert check(pc) == []


@pytest.mark.parametrize("op,args,keep", [
    ("seq_rm", (0, 7, 9), 7), ("seq_rm", (0, 12, -1), 12), ("seq_rm", (0, 40, 50), 20), ("seq_rm", (-1, 3, -1), 3),
    ("seq_add", (0, 5, 8, 2), 5), ("seq_add", (0, 8, -1, -3), 5), ("seq_add", (0, 30, -1, 4), 20),
    ("seq_div", (0, 6, 20, 2), 3), ("seq_keep", (1,), 0), ("clear", (), 0)])
def test_operations_cut_the_index(model, op, args, keep):
    t = toks(20, 14)
    with ctx_of(model) as c:
        pc = PrefixCache(c)
        served(pc, 0, t)
        served(pc, 1, toks(6, 15))
        getattr(pc, op)(*args)
        e = pc.seqs.get(0)
        assert (e.tokens.size if e else 0) == keep
        if e:
            assert e.tokens.tolist() == t[:keep].tolist()
            assert e.clean == (c.memory_seq_pos_max(0) + 1 == keep)
        assert check(pc) == []
        other = pc.seqs[1].tokens if 1 in pc.seqs else []
        assert pc.match(t).n_tokens == max(keep, lcp(other, t))


@pytest.mark.parametrize("unified", [True, False])
def test_seq_cp_and_state_load_through_the_cache(model, unified):
    t = toks(16, 16)
    with ctx_of(model, kv_unified=unified) as c:
        pc = PrefixCache(c)
        served(pc, 0, t)
        pc.seq_cp(0, 2, -1, -1 if not unified else 10)
        assert pc.seqs[2].tokens.tolist() == t[:16 if not unified else 10].tolist() and pc.seqs[2].clean
        blob = c.state_seq_get_data(0)
        pc.state_load(blob, 3, tokens=t)
        assert pc.seqs[3].tokens.tolist() == t.tolist()
        pc.state_load(blob, 1)                        # no tokens given: cached, not indexed
        assert pc.seqs[1].tokens.size == 0 and not pc.seqs[1].clean
        whole = c.state_get_data()
        pc.state_load(whole, tokens={0: t, 3: t})
        assert pc.seqs[0].tokens.tolist() == t.tolist() and pc.seqs[2].tokens.size == 0
        assert check(pc) == []
        adm, _ = prefill(pc, np.append(t, 3), pc.free_seq())   # every sequence is taken: one is evicted
        assert adm.n_reused == 16 and pc.stats.evictions == 1


def test_attach_over_cells_put_behind_the_back(model):
    t = toks(10, 18)
    with ctx_of(model) as c:
        pc = PrefixCache(c)
        c.decode(Batch(token=toks(7, 19), seq_id=np.full(7, 2, np.int32)))   # sequence 2, not indexed
        adm, logits = prefill(pc, t, 2)
        assert adm.n_decoded == 10 and c.memory_seq_pos_min(2) == 0 and c.memory_seq_pos_max(2) == 9
        assert check(pc) == []
        assert rel_err(logits, fresh_logits(model, t)) < TOL


def test_pick_seq_falls_back_to_the_holder(model):
    t = toks(12, 21)
    with ctx_of(model, n_seq_max=2) as c:
        pc = PrefixCache(c)
        served(pc, 0, t)
        prefill(pc, toks(5, 22), 1)                   # active: sequence 0 is the only one left
        branch = np.concatenate([t[:8], toks(3, 23)])
        assert pc.pick_seq(branch) == 0
        adm, _ = prefill(pc, branch, 0)
        assert (adm.source, adm.n_reused) == ("own", 8) and check(pc) == []


@pytest.mark.parametrize("kept", [10, 15, 20])
def test_own_sequence_cut_below_half_is_saved_to_the_host_tier(model, kept):
    """One sequence: a prompt that keeps ``kept`` of the 30 tokens its sequence holds reuses them in place; under
    half kept (llama-server's f_keep < 0.5), the whole 30 are first saved as a host blob, and the conversation cut
    off comes back from it (the logits a fresh decode gives); half or more kept, nothing is saved."""
    a = toks(30, 51)
    b = np.concatenate([a[:kept], toks(8, 52)])
    back = np.concatenate([a, toks(4, 53)])
    with ctx_of(model, n_seq_max=1) as c:
        pc = PrefixCache(c, host=HostParams(budget=1 << 20))
        served(pc, 0, a)
        assert pc.pick_seq(b) == 0
        adm, _ = prefill(pc, b, 0)
        assert (adm.source, adm.n_reused) == ("own", kept)
        saved = 2 * kept < a.size
        assert pc.stats.host_saves == int(saved) and c.memory_seq_pos_max(0) == b.size - 1
        pc.release(0)
        m = pc.match(back)
        assert (m.n_tokens, m.tier) == ((30, "host") if saved else (kept, "device"))
        adm, logits = prefill(pc, back, pc.pick_seq(back))
        assert adm.n_reused == (30 if saved else kept)
        assert rel_err(logits, fresh_logits(model, back, n_seq_max=1)) < TOL
        assert check(pc) == []
    with ctx_of(model, n_seq_max=1) as c:  # no host tier: the cut part is gone
        pc = PrefixCache(c)
        served(pc, 0, a)
        assert prefill(pc, b, 0)[0].n_reused == kept and pc.stats.host_saves == 0
        assert check(pc) == []


def test_attach_without_reuse_decodes_everything_on_its_own_sequence(model):
    """attach(reuse=False) on a parked sequence whose content the prompt extends: nothing is reused (the whole
    prompt is left to decode), the old content goes to the host tier as any retired sequence, and the logits are
    a fresh decode's; the new content is indexed as usual."""
    t = toks(20, 41)
    longer = np.concatenate([t, toks(5, 42)])
    with ctx_of(model, n_seq_max=2) as c:
        pc = PrefixCache(c, host=HostParams(budget=1 << 20))
        served(pc, 0, t)
        adm = pc.attach(longer, 0, reuse=False)
        assert (adm.n_reused, adm.n_decoded, adm.source) == (0, 25, "none")
        assert c.memory_seq_pos_max(0) == -1 and pc.stats.host_saves == 1
        (row,) = pc.advance([(0, longer, True)])
        assert rel_err(row, fresh_logits(model, longer, n_seq_max=2)) < TOL
        pc.release(0)
        assert check(pc) == []
        m = pc.match(t)
        assert (m.n_tokens, m.tier) == (20, "device")             # the new content holds it too
        assert pc.match(np.append(t[:19], 3)).n_tokens == 19


def test_changes_behind_the_back_are_caught_as_stale(model):
    t = toks(12, 17)
    with ctx_of(model) as c:
        pc = PrefixCache(c)
        served(pc, 0, t)
        c.memory_seq_rm(0, 5, -1)                     # not through the prefix cache
        m = pc.match(t)
        assert m.n_tokens == 0 and pc.stats.stale == 1 and check(pc) == []


# ---------------------------------------------------------------------------------------------- eviction


def test_full_cache_evicts_least_recently_used_to_the_host_tier(model, tmp_path):
    with ctx_of(model, n_ctx=64, n_seq_max=4) as c:
        pc = PrefixCache(c, host=HostParams(budget=30_000, disk_dir=tmp_path, disk_budget=1 << 20))
        prompts = [toks(96, 20 + i) for i in range(4)]
        for i, p in enumerate(prompts):
            served(pc, i, p)                          # 96 tokens each in 256 cells: evictions from the third on
            assert check(pc) == []
        assert [e.seq_id for e in pc.entries()] == [2, 3] and pc.stats.evictions == 2
        assert pc.stats.host_saves == 2 and 0 < pc.stats.host_bytes <= 30_000
        assert sorted(h.where() for h in pc.host_entries()) == ["disk", "ram"] and pc.stats.disk_writes == 1
        for h in pc.host_entries():
            if h.path is not None:                    # a llama.cpp sequence state file
                info = read_state_file(h.path)
                assert info.kind == "seq" and info.tokens.tolist() == h.tokens.tolist()
        adm, logits = prefill(pc, np.append(prompts[0], 7), 0)  # back from the host tier
        assert (adm.source, adm.n_reused) == ("host", 96)
        assert rel_err(logits, fresh_logits(model, np.append(prompts[0], 7))) < TOL
        assert check(pc) == []
        pc.close()
        assert not list(tmp_path.iterdir())


def test_a_restore_whose_room_drops_its_own_blob_computes_the_prompt(model):
    """Restoring a host blob may first evict a parked sequence for room; saving that one to a host tier with room for
    one blob drops the blob being restored.  The restore then gives up: the prompt is computed, with the logits of a
    fresh decode, and the blob that took the room is the one kept.  Before, the blob, without bytes or a file, was
    loaded anyway: a TypeError, and the engine's admission failed (found by fuzzing a Gemma 2 server)."""
    a, b = toks(150, 50), toks(150, 51)
    with ctx_of(model, n_ctx=64, n_seq_max=4) as c:  # (one stream of 256 cells: a and b do not fit together)
        pc = PrefixCache(c, host=HostParams(budget=1 << 20))
        served(pc, 0, a)
        blob_bytes = len(c.state_seq_get_data(0)) + 4 * a.size
        pc.close()
    with ctx_of(model, n_ctx=64, n_seq_max=4) as c:
        pc = PrefixCache(c, host=HostParams(budget=blob_bytes * 3 // 2))  # room for one blob of 150 tokens
        served(pc, 0, a)
        pc.evict(0)                                   # a: a host blob
        served(pc, 1, b)                              # b: parked on the device
        assert [h.tokens.size for h in pc.host_entries()] == [150] and sorted(pc.seqs) == [1]
        adm, logits = prefill(pc, np.append(a, 7), 0)  # a's restore evicts b, whose blob replaces a's
        assert adm.n_reused == 0 and pc.stats.host_restores == 0
        assert rel_err(logits, fresh_logits(model, np.append(a, 7))) < TOL
        assert [h.tokens.tolist() for h in pc.host_entries()] == [b.tolist()]
        assert check(pc) == []
        pc.close()


def test_retention_priority_keeps_a_sequence(model):
    now = [0.0]
    with ctx_of(model, n_ctx=64, n_seq_max=4) as c:
        pc = PrefixCache(c, clock=lambda: now[0])
        prefill(pc, toks(96, 30), 0, retention=Retention(priority=90, duration=10.0))
        pc.release(0)
        served(pc, 1, toks(96, 31))
        served(pc, 2, toks(96, 32))                   # needs room: sequence 1 goes, not the older 0
        assert sorted(pc.seqs) == [0, 2]
        now[0] = 11.0                                 # the priority has expired: plain LRU again
        served(pc, 3, toks(96, 33))
        assert sorted(pc.seqs) == [2, 3]


def test_no_room_and_bad_requests(model):
    with ctx_of(model, n_ctx=64, n_seq_max=2) as c:
        pc = PrefixCache(c)
        prefill(pc, toks(200, 40), 0)                 # active: never evicted
        with pytest.raises(DecodeError) as e:
            prefill(pc, toks(100, 41), 1)
        assert e.value.code == 1
        with pytest.raises(RuntimeError, match="serving a request"):
            prefill(pc, toks(3, 42), 0)
        with pytest.raises(ValueError, match="n_vocab"):
            prefill(pc, [VOCAB], 1)
        with pytest.raises(ValueError, match="out of range"):
            prefill(pc, [5], 2)
        with pytest.raises(RuntimeError, match="serves no request"):
            pc.advance([(1, [3], True)])              # the failed prefill left sequence 1 without a request
        assert check(pc) == []


def distinct(n, i):
    """n tokens starting with 3 + i: prompts with distinct first tokens share no prefix (and no cell)."""
    return np.concatenate([[3 + i], toks(n - 1, 50 + i)]).astype(np.int32)


def test_claim_evicts_parked_sequences_in_policy_order(model):
    with ctx_of(model, n_ctx=64, n_seq_max=4) as c:
        pc = PrefixCache(c, host=HostParams(budget=1 << 20))
        prefill(pc, distinct(60, 0), 0, retention=Retention(priority=90))   # kept longest by the policy
        pc.release(0)
        served(pc, 1, distinct(60, 1))
        served(pc, 2, distinct(60, 2))
        prefill(pc, distinct(60, 3), 3)               # active: never evicted
        size = c.kv.get_size()
        free = size - 240
        assert c.kv.get_used(0) == 240
        assert pc.claim({0: free}) and sorted(pc.seqs) == [0, 1, 2, 3] and pc.stats.evictions == 0
        assert not pc.claim({0: size + 1})            # can never fit: nothing evicted
        assert sorted(pc.seqs) == [0, 1, 2, 3]
        for bad in ({1: 3}, {0: -1}):                 # one stream in a unified cache; a negative count
            with pytest.raises(ValueError, match="claim: stream"):
                pc.claim(bad)
        assert sorted(pc.seqs) == [0, 1, 2, 3]
        assert pc.claim({0: free + 1}, keep=[1])      # least recently used is 1, kept: 2 goes
        assert sorted(pc.seqs) == [0, 1, 3] and pc.seqs[1].tokens.tolist() == distinct(60, 1).tolist()
        assert pc.claim({0: free + 61})               # then 1 (priority 35 before 0's 90)
        assert sorted(pc.seqs) == [0, 3]
        assert not pc.claim({0: size})                # the active sequence holds 60 cells: evicts 0, still short
        assert sorted(pc.seqs) == [3] and pc.seqs[3].active and pc.seqs[3].tokens.size == 60
        assert c.kv.get_used(0) == 60 and pc.stats.evictions == pc.stats.host_saves == 3
        assert check(pc) == []


def test_claim_per_stream(model):
    with ctx_of(model, n_ctx=64, n_seq_max=4, kv_unified=False) as c:
        pc = PrefixCache(c)
        assert [pc.stream_of(s) for s in range(4)] == [0, 1, 2, 3]
        with pytest.raises(ValueError, match="out of range"):
            pc.stream_of(4)
        served(pc, 0, distinct(30, 0))
        served(pc, 1, distinct(30, 1))
        prefill(pc, distinct(30, 2), 2)               # active
        size = c.kv.get_size()
        assert not pc.claim({2: size}) and sorted(pc.seqs) == [0, 1, 2]   # only its own stream's sequences go
        assert pc.claim({1: size}) and sorted(pc.seqs) == [0, 2]
        assert pc.claim({0: size}, keep=[0]) is False and sorted(pc.seqs) == [0, 2]
        assert c.kv.get_used(1) == 0 and c.kv.get_used(0) == 30 and check(pc) == []
    with ctx_of(model, n_seq_max=4) as c:
        assert PrefixCache(c).stream_of(3) == 0


@settings(max_examples=200, deadline=None)
@given(token_lists, token_lists, st.integers(0, 12))
def test_common_prefix_matches_brute_force(a, b, limit):
    assert common_prefix(a, b, limit) == min(lcp(a, b), limit)


def _outcome(fn):
    """(result, None) or (None, (exception type, message))."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 -- compared
        return None, (type(e), str(e))


@pytest.mark.parametrize("unified", [True, False])
def test_advance_token_is_advance_of_one_token(model, unified):
    """A request's next token through ``advance_token`` (what ``advance`` takes for one part of one token given as
    an array) against the general ``advance`` (a list of one token takes it): the same logits bit for bit, then the
    same cells, entries and counters, on a trace whose steps evict parked sequences for room; the same errors."""
    with ctx_of(model, n_ctx=256, n_seq_max=2, kv_unified=unified) as a, \
            ctx_of(model, n_ctx=256, n_seq_max=2, kv_unified=unified) as b:
        pa, pb = PrefixCache(a), PrefixCache(b)
        view = lambda pc: [(e.seq_id, e.tokens.tolist(), e.clean, e.active, e.last_used) for e in pc.entries()]
        for r in range(5):
            seq, p = r % 2, distinct(14 + 3 * r, r)
            (_, la), (_, lb) = prefill(pa, p, seq), prefill(pb, p, seq)
            assert np.array_equal(la, lb)
            t = int(np.argmax(la))
            for _ in range(120):  # (256 cells, unified: from the second request on, room made by evicting)
                (ra,), rb = pa.advance([(seq, [t], True)]), pb.advance_token(seq, np.array([t], np.int32))
                assert rb.shape == (VOCAB,) and np.array_equal(ra, rb)
                t = int(np.argmax(ra))
            assert view(pa) == view(pb)
            pa.release(seq)
            pb.release(seq)
        assert pa.stats.evictions >= 3 * unified and pa.stats == pb.stats
        assert a.state_get_data() == b.state_get_data()
        assert view(pa) == view(pb) and check(pa) == [] == check(pb)
        prefill(pa, distinct(5, 9), 0)
        prefill(pb, distinct(5, 9), 0)
        before = b.state_get_data()
        for seq, tok in [(0, [VOCAB]), (1, [3]), (5, [3])]:  # (a token out of range, no request, no sequence)
            want = _outcome(lambda: pa.advance([(seq, list(tok), True)]))[1]
            got = _outcome(lambda: pb.advance_token(seq, np.array(tok, np.int32)))[1]
            assert want is not None and got == want, (seq, tok, want, got)
        with pytest.raises(ValueError, match="2 tokens, expected 1"):
            pb.advance_token(0, np.array([3, 4], np.int32))
        assert a.state_get_data() == b.state_get_data() == before

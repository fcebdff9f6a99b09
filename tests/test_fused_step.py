"""The runtime's fused decode step against the general path, on the same random traces.

Two contexts on the same tiny model receive the same operations: one as built (``Context.fused``), one with
``fused = None`` (the general path: allocator, init_batch, apply, graph key, set_inputs; held to llama.cpp by the
golden traces, the oracle suite and tests/test_decode_fast_path.py).  After every operation both must agree on
everything observable: the outcome (or the error code and message), the logits (bytes: both compute the same
graph on the same data), the output ids, every cell, head and sequence range, the allocator's getters, the step
counters, the inputs of the graph (tokens, positions, K/V rows, kq mask bytes) and the state blob.

The traces favour decode steps (a random subset of the sequences, in random order, one token each) and mix in
what moves a step off the fused path: a prompt batch, an output flag off, an invalid token or position, seq_rm
and seq_cp, a context shift (a pending K-shift), clear, a state restore, a full cache, and ``n_kv`` growing past
a padding boundary (the graph cannot be reused).
"""
from __future__ import annotations

import numpy as np
import pytest

from kvcache_ggml.batch import Batch
from kvcache_ggml.runtime import Context, DecodeError, Model, make_model
from kvcache_ggml.runtime.modelmaker import ModelSpec

from helpers import assert_same_snapshot, snapshot

VOCAB = 48
N_SEQ = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("fused") / "tiny.gguf",
                      ModelSpec(layers=2, embd=32, heads=4, heads_kv=2, ff=48, vocab=VOCAB))
    with Model(path) as m:
        yield m


def outcome(ctx: Context, fn):
    try:
        return "ok", fn(ctx)
    except (DecodeError, ValueError, RuntimeError) as e:
        return type(e).__name__, (getattr(e, "code", None), str(e))


def graph_inputs(ctx: Context) -> list[bytes]:
    g = ctx.last_graph
    if g is None or g.kv_views is None:
        return []
    return [b"" if v is None else v.tobytes() for v in (g.tokens_h, g.pos_h, g.out_ids_h, *g.kv_views)]


def same(a: Context, b: Context, ra, rb, what: str) -> None:
    assert ra[0] == rb[0], f"{what}: {ra} vs {rb}"
    if ra[0] != "ok":
        assert ra[1] == rb[1], what
    va, vb = ra[1], rb[1]
    if isinstance(va, np.ndarray):
        assert va.dtype == vb.dtype and va.shape == vb.shape and va.tobytes() == vb.tobytes(), what
    assert a.output_ids.tolist() == b.output_ids.tolist(), what
    assert a.logits.tobytes() == b.logits.tobytes(), what
    assert_same_snapshot(snapshot(a.kv), snapshot(b.kv))
    assert [c.used_max_p1() for c in a.kv.v_cells] == [c.used_max_p1() for c in b.kv.v_cells], what
    ta, tb = a.times, b.times
    assert (ta.n_decode, ta.n_ubatch, ta.n_tokens, ta.n_graph_reused) == \
        (tb.n_decode, tb.n_ubatch, tb.n_tokens, tb.n_graph_reused), what
    ba, bb = a.balloc, b.balloc
    held = outcome(ba, lambda x: x.get_batch())[0], outcome(bb, lambda x: x.get_batch())[0]
    assert held[0] == held[1], f"{what}: allocator holds a batch {held}"
    if held[0] == "ok":
        assert (ba.get_n_tokens(), ba.get_n_outputs(), ba.get_n_used()) == \
            (bb.get_n_tokens(), bb.get_n_outputs(), bb.get_n_used()), what
        assert ba.get_out_ids().tolist() == bb.get_out_ids().tolist(), what
        ga, gb = ba.get_batch(), bb.get_batch()
        for f in ("token", "pos", "n_seq_id", "seq_id", "logits"):
            assert np.array_equal(getattr(ga, f), getattr(gb, f)), f"{what}: batch.{f}"
        assert graph_inputs(a) == graph_inputs(b), f"{what}: graph inputs"


def step_batch(rng, ctx: Context, seqs: list[int], kind: str) -> Batch:
    """One token for each of ``seqs`` (in that order), at its next position; ``kind`` spoils it sometimes."""
    n = len(seqs)
    tok = rng.integers(0, VOCAB, n).astype(np.int32)
    pos = np.array([ctx.memory_seq_pos_max(s) + 1 for s in seqs], np.int32)
    logits = np.ones(n, np.int8)
    if kind == "bad_token":
        tok[rng.integers(n)] = VOCAB + 3
    elif kind == "bad_pos":
        pos[rng.integers(n)] += 2
    elif kind == "no_output":
        logits[rng.integers(n)] = 0
    if kind == "auto_pos":
        return Batch(token=tok, seq_id=np.array(seqs, np.int32), logits=logits)
    if kind == "bare" and n == 1:  # sequence 0, position and output decided by the allocator
        return Batch(token=tok) if seqs == [0] else Batch(token=tok, seq_id=np.array(seqs, np.int32))
    return Batch(token=tok, pos=pos, seq_id=np.array(seqs, np.int32), logits=logits)


def run_trace(model, seed: int, fa: bool, unified: bool, n_ctx: int, n_ops: int) -> int:
    rng = np.random.default_rng(seed)
    kw = dict(n_ctx=n_ctx, n_batch=64, n_ubatch=16, n_seq_max=N_SEQ, kv_unified=unified, flash_attn=fa,
              type_k="f16", type_v="f16", n_threads=1, n_threads_batch=1)
    with Context(model, **kw) as a, Context(model, **kw) as b:
        assert a.fused is not None
        b.fused = None
        taken, cur = 0, list(range(N_SEQ))
        for k in range(n_ops):
            r = rng.random()
            if r < 0.72:
                if rng.random() < 0.25:  # another set of sequences (else the last one: the graph is reused)
                    cur = rng.permutation(N_SEQ)[:rng.integers(1, N_SEQ + 1)].tolist()
                    if rng.random() < 0.6:
                        cur.sort()
                seqs = cur
                kind = rng.choice(["plain"] * 12 + ["bad_token", "bad_pos", "no_output", "auto_pos", "bare"])
                batch = step_batch(rng, a, seqs, str(kind))
                before = a.fused.n_steps
                ra = outcome(a, lambda c: c.decode(batch))
                rb = outcome(b, lambda c: c.decode(batch))
                taken += a.fused.n_steps - before
                what = f"step {k}: decode {seqs} {kind}"
            elif r < 0.80:
                s = int(rng.integers(N_SEQ))
                n = int(rng.integers(2, 9))
                p0 = a.memory_seq_pos_max(s) + 1
                batch = Batch(token=rng.integers(0, VOCAB, n).astype(np.int32),
                              pos=np.arange(p0, p0 + n, dtype=np.int32), seq_id=np.full(n, s, np.int32))
                ra, rb = outcome(a, lambda c: c.decode(batch)), outcome(b, lambda c: c.decode(batch))
                what = f"step {k}: prompt of {n} in {s}"
            elif r < 0.86:
                s = int(rng.integers(N_SEQ))
                hi = max(a.memory_seq_pos_max(s), 0)
                p0 = int(rng.integers(0, hi + 1))
                ra = outcome(a, lambda c: c.memory_seq_rm(s, p0, -1))
                rb = outcome(b, lambda c: c.memory_seq_rm(s, p0, -1))
                what = f"step {k}: seq_rm({s}, {p0})"
            elif r < 0.90:
                s, d = (int(x) for x in rng.permutation(N_SEQ)[:2])
                ra = outcome(a, lambda c: (c.memory_seq_rm(d, -1, -1), c.memory_seq_cp(s, d, -1, -1)))
                rb = outcome(b, lambda c: (c.memory_seq_rm(d, -1, -1), c.memory_seq_cp(s, d, -1, -1)))
                what = f"step {k}: seq_cp({s}, {d})"
            elif r < 0.94:
                s = int(rng.integers(N_SEQ))
                ra = outcome(a, lambda c: c.context_shift(s, 2, 3))
                rb = outcome(b, lambda c: c.context_shift(s, 2, 3))
                what = f"step {k}: context_shift({s})"
            elif r < 0.97:
                blob = a.state_get_data()
                assert blob == b.state_get_data()
                ra = outcome(a, lambda c: c.state_set_data(blob))
                rb = outcome(b, lambda c: c.state_set_data(blob))
                what = f"step {k}: state restore"
            else:
                ra, rb = outcome(a, lambda c: c.memory_clear(True)), outcome(b, lambda c: c.memory_clear(True))
                what = f"step {k}: clear"
            same(a, b, ra, rb, what)
        assert a.state_get_data() == b.state_get_data()
        return taken


@pytest.mark.parametrize("fa", [True, False], ids=["fa", "nofa"])
@pytest.mark.parametrize("unified", [True, False], ids=["unified", "streams"])
def test_fused_step_equals_general_path(model, fa, unified):
    taken = sum(run_trace(model, seed, fa, unified, n_ctx=96 if unified else 96 * N_SEQ, n_ops=160)
                for seed in range(3))
    assert taken > 100, f"the fused path ran {taken} times only: the trace does not test it"


def test_fused_step_across_the_padding_boundary(model):
    """One token per sequence per step past 256 cells: n_kv grows from 256 to 512 (the graph cannot be reused, the
    general path builds the next one), then the fused path resumes."""
    kw = dict(n_ctx=300 * N_SEQ, n_batch=64, n_ubatch=16, n_seq_max=N_SEQ, kv_unified=False, flash_attn=False,
              type_k="f16", type_v="f16", n_threads=1, n_threads_batch=1)
    rng = np.random.default_rng(5)
    with Context(model, **kw) as a, Context(model, **kw) as b:
        b.fused = None
        n_kv = set()
        for k in range(280):
            batch = step_batch(rng, a, list(range(N_SEQ)), "plain")
            same(a, b, outcome(a, lambda c: c.decode(batch)), outcome(b, lambda c: c.decode(batch)), f"step {k}")
            n_kv.add(a.last_graph.key.n_kv)
        assert n_kv == {256, 512} and a.fused.n_steps >= 270


@pytest.mark.parametrize("unified", [True, False], ids=["unified", "streams"])
def test_one_switch_turns_every_decode_fast_path_off(model, unified):
    """ContextParams.fast_paths=False: no fused step, and the allocator's, the bookkeeping's and the inputs' fast
    paths off -- with the same logits, outputs and cells as the fast context, step after step."""
    kw = dict(n_ctx=64 * N_SEQ, n_seq_max=N_SEQ, kv_unified=unified, n_threads=1, n_threads_batch=1)
    with Context(model, **kw) as a, Context(model, fast_paths=False, **kw) as b:
        assert b.fused is None and not b.balloc.fast and not b.kv.book.fast and not b.kv.inputs.fast
        assert a.fused is not None and a.balloc.fast and a.kv.book.fast and a.kv.inputs.fast
        prompt = Batch(token=np.arange(1, 7, dtype=np.int32), seq_id=np.repeat(np.arange(2, dtype=np.int32), 3))
        same(a, b, outcome(a, lambda c: c.decode(prompt)), outcome(b, lambda c: c.decode(prompt)), "prompt")
        for i in range(6):
            step = Batch(token=np.array([7 + i, 20 + i], np.int32), seq_id=np.arange(2, dtype=np.int32),
                         logits=np.ones(2, np.int8))
            same(a, b, outcome(a, lambda c: c.decode(step)), outcome(b, lambda c: c.decode(step)), f"step {i}")
            assert a.kv.state_save() == b.kv.state_save()
        assert a.fused.n_steps >= 4


@pytest.mark.parametrize("unified", [True, False], ids=["unified", "streams"])
@pytest.mark.parametrize("p0", [5, 6, 7])
def test_fused_step_restarts_the_slot_search_as_find_slot(model, unified, p0):
    """find_slot starts again at cell 0 when the head is more than two cells (per token) past the used count: 9
    cells, seq_rm(0, p0, -1), the head put back at 9 (as a failed prepare's roll-back of the heads can leave it in
    a multi-stream cache), the used count p0: on both sides of that rule."""
    kw = dict(n_ctx=64 * N_SEQ, n_seq_max=N_SEQ, kv_unified=unified, n_threads=1, n_threads_batch=1)
    with Context(model, **kw) as a, Context(model, **kw) as b:
        b.fused = None
        for c in (a, b):
            c.decode(Batch(token=np.arange(1, 9, dtype=np.int32)))
            c.decode(Batch(token=np.array([9], np.int32)))
            c.memory_seq_rm(0, p0, -1)
            c.kv.v_heads[0] = 9
        assert a.kv.v_heads[0] == 9 and a.kv.v_cells[0].get_used() == p0
        batch = Batch(token=np.array([10], np.int32), pos=np.array([p0], np.int32))
        same(a, b, outcome(a, lambda c: c.decode(batch)), outcome(b, lambda c: c.decode(batch)), f"p0 {p0}")
        assert a.kv.v_cells[0].pos_array[9 if p0 == 7 else p0] == p0
        assert a.fused.n_steps == (p0 == 7)  # cell 0 is taken: the restarted search needs the scan


@pytest.mark.parametrize("head", [6, 12])
def test_fused_multi_sequence_step_restarts_the_slot_search_as_find_slot(model, head):
    """The same rule for a step of two sequences in a unified cache (one cell per token, from the head or from
    cell 0): sequence 0 removed, sequence 1 keeping 2 cells, the head put at ``head``; find_slot restarts at 0
    when head > 2 + 2 * 2.  Head 6: cells 6 and 7; head 12: cells 0 and 1 -- not 12 and 13, also free."""
    kw = dict(n_ctx=64 * N_SEQ, n_seq_max=N_SEQ, kv_unified=True, n_threads=1, n_threads_batch=1)
    with Context(model, **kw) as a, Context(model, **kw) as b:
        b.fused = None
        for c in (a, b):
            c.decode(Batch(token=np.arange(1, 17, dtype=np.int32), seq_id=np.repeat(np.arange(2, dtype=np.int32), 8)))
            c.decode(Batch(token=np.array([3, 4], np.int32), seq_id=np.arange(2, dtype=np.int32),
                           logits=np.ones(2, np.int8)))
            c.memory_seq_rm(0, -1, -1)
            c.memory_seq_rm(1, 2, -1)
            c.kv.v_heads[0] = head
        assert a.kv.v_cells[0].get_used() == 2
        n0 = a.fused.n_steps
        batch = Batch(token=np.array([5, 6], np.int32), pos=np.array([0, 2], np.int32),
                      seq_id=np.arange(2, dtype=np.int32), logits=np.ones(2, np.int8))
        same(a, b, outcome(a, lambda c: c.decode(batch)), outcome(b, lambda c: c.decode(batch)), f"head {head}")
        cells = [0, 1] if head == 12 else [6, 7]
        assert a.kv.v_cells[0].pos_array[cells].tolist() == [0, 2]
        assert b.kv.v_cells[0].pos_array.tobytes() == a.kv.v_cells[0].pos_array.tobytes()
        assert a.fused.n_steps == n0 + 1  # the fused step placed them

"""The soak: a bounded run of random work, every invariant checked after every operation, resident memory flat.

    python3 build.py test -m soak                                   # 10 minutes
    KVCACHE_SOAK_SECONDS=3600 python3 build.py test -m soak         # an hour

Rounds alternate between a unified cache and per-sequence streams (F16 and F32 K/V, flash attention on and off) on
a tiny model.  A round mixes decode batches over up to four sequences, ``seq_rm`` / ``seq_cp`` / ``seq_keep`` /
``seq_add`` / ``seq_div`` and context shifts (the K-shift at the next decode), sequence state saved and restored
into another sequence (the same positions, as many bytes), whole-state save / clear / restore (the same bytes), and
prefix-cache admissions whose evictions go to a small host tier.  After every operation the cache's bookkeeping is
rebuilt from scratch and compared (``check_invariants``), and after every admission the prefix cache's index
(``prefix.check``).  Resident memory is sampled every minute: from the end of the first minute to the end it must
grow by less than 5 %.
"""
from __future__ import annotations

import gc
import os
import time
from pathlib import Path

import numpy as np
import pytest

from kvcache_ggml.batch import Batch
from kvcache_ggml.inspect import check_invariants
from kvcache_ggml.prefix import HostParams, PrefixCache, check
from kvcache_ggml.runtime import Context, DecodeError, Model, make_model
from kvcache_ggml.runtime.modelmaker import ModelSpec

from helpers import prefill, rss_bytes

pytestmark = pytest.mark.soak

SECONDS = float(os.environ.get("KVCACHE_SOAK_SECONDS", "600"))
SAMPLE_EVERY = 60.0
VOCAB, N_SEQ, N_CTX = 64, 4, 4 * 64
MODES = [dict(kv_unified=u, flash_attn=fa, type_k=t, type_v=t)
         for u, fa, t in ((True, True, "f16"), (False, True, "f16"), (True, False, "f32"), (False, False, "f32"))]


class Round:
    """One round of random operations on one context; every operation checked."""

    def __init__(self, ctx: Context, rng: np.random.Generator) -> None:
        self.ctx, self.rng = ctx, rng
        self.ops = 0

    def checked(self) -> None:
        errs = check_invariants(self.ctx.kv)
        assert errs == [], errs
        self.ops += 1

    def decode(self) -> None:
        c, rng = self.ctx, self.rng
        seqs = rng.choice(N_SEQ, size=rng.integers(1, N_SEQ + 1), replace=False)
        n = {int(s): int(rng.integers(1, 9)) for s in seqs}
        if any(c.memory_seq_pos_max(s) + k >= N_CTX // N_SEQ - 1 for s, k in n.items()):
            for s in n:  # keep each sequence inside its share of the cache
                if c.memory_seq_pos_max(s) > 16:
                    c.context_shift(s, 4, 12) if c.memory_can_shift() else c.memory_seq_rm(s, -1, -1)
            self.checked()
        tok = np.concatenate([rng.integers(3, VOCAB, k) for k in n.values()]).astype(np.int32)
        seq = np.concatenate([np.full(k, s, np.int32) for s, k in n.items()])
        pos = np.concatenate([np.arange(k, dtype=np.int32) + c.memory_seq_pos_max(s) + 1 for s, k in n.items()])
        try:
            logits = c.decode(Batch(token=tok, pos=pos, seq_id=seq, logits=np.ones(len(tok), np.int8)))
        except DecodeError as e:
            # no slot (llama_decode's 1): state copies filled the shared cells; refused with the cells as they
            # were -- make room and go on
            assert e.code == 1, e
            self.checked()
            c.memory_seq_rm(int(max(range(N_SEQ), key=c.memory_seq_pos_max)), -1, -1)
            self.checked()
            return
        assert np.isfinite(logits).all()
        self.checked()

    def seq_op(self) -> None:
        c, rng = self.ctx, self.rng
        s, d = (int(x) for x in rng.choice(N_SEQ, size=2, replace=False))
        n = c.memory_seq_pos_max(s) + 1
        op = rng.integers(5)
        if op == 0:
            c.memory_seq_rm(s, int(rng.integers(0, n + 1)), -1)
        elif op == 1 and n > 0:
            c.memory_seq_rm(d, -1, -1)
            c.memory_seq_cp(s, d, -1, -1)
        elif op == 2 and rng.random() < 0.1:
            c.memory_seq_keep(s)
        elif op == 3 and n > 8 and c.memory_can_shift():
            c.context_shift(s, 2, 4)
        elif op == 4 and n > 4 and c.memory_can_shift():
            c.memory_seq_div(s, n - 4, n, 2)
            c.memory_seq_add(s, n - 4, -1, int(rng.integers(-2, 3)) or 1)
        self.checked()

    def state(self) -> None:
        c, rng = self.ctx, self.rng
        s, d = (int(x) for x in rng.choice(N_SEQ, size=2, replace=False))
        if c.memory_seq_pos_max(s) < 0:
            return
        blob = c.state_seq_get_data(s)
        c.memory_seq_rm(d, -1, -1)
        try:
            assert c.state_seq_set_data(blob, d) == len(blob)
        except ValueError as e:  # a unified cache too full for a second copy: refused, the cells consistent
            assert "no room" in str(e), e
            self.checked()
            assert c.memory_seq_pos_max(d) < 0
            return
        self.checked()
        # the copy holds the same positions, and saves as many bytes (the blob records each cell's sequence id)
        assert (c.memory_seq_pos_min(d), c.memory_seq_pos_max(d)) == (c.memory_seq_pos_min(s),
                                                                       c.memory_seq_pos_max(s))
        assert len(c.state_seq_get_data(d)) == len(blob)
        if rng.random() < 0.2:
            whole = c.state_get_data()
            c.memory_clear(True)
            self.checked()
            c.state_set_data(whole)
            self.checked()
            assert c.state_get_data() == whole

    def run(self, n: int) -> None:
        for _ in range(n):
            r = self.rng.random()
            self.decode() if r < 0.5 else self.seq_op() if r < 0.85 else self.state()


def prefix_round(ctx: Context, rng: np.random.Generator, n: int, totals: dict[str, int]) -> int:
    """Admissions sharing a few system prompts: device hits, evictions to a small host tier, restores; the prefix
    cache's counters are added to ``totals``."""
    systems = [rng.integers(3, VOCAB, 16).astype(np.int32) for _ in range(3)]
    ctx.memory_clear(True)  # the prefix cache owns the context's sequences from here on
    pc = PrefixCache(ctx, host=HostParams(budget=8 << 10))  # a few blobs: the tier fills and drops
    try:
        for _ in range(n):
            req = np.concatenate([systems[rng.integers(3)], rng.integers(3, VOCAB, rng.integers(1, 24))])
            s = pc.pick_seq(req)
            _, logits = prefill(pc, req.astype(np.int32), s)
            assert np.isfinite(logits).all()
            if rng.random() < 0.5:
                pc.advance([(s, [int(rng.integers(3, VOCAB))], True)])
            pc.release(s)
            assert check(pc) == []
            assert check_invariants(ctx.kv) == []
        for k in totals:
            totals[k] += getattr(pc.stats, k)
        return n
    finally:
        pc.close()


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads /proc/self/statm")
def test_soak(tmp_path):
    path = make_model(tmp_path / "soak.gguf", ModelSpec(layers=2, embd=32, heads=2, heads_kv=1, ff=64, vocab=VOCAB,
                                                        seed=11))
    rng = np.random.default_rng(int(os.environ.get("KVCACHE_SOAK_SEED", "0")))
    t0 = time.monotonic()
    samples: list[tuple[float, int]] = []
    next_sample = SAMPLE_EVERY
    rounds = ops = 0
    totals = dict(evictions=0, host_saves=0, host_restores=0, host_drops=0, hits_device=0)
    with Model(path) as model:
        while (elapsed := time.monotonic() - t0) < SECONDS:
            mode = MODES[rounds % len(MODES)]
            with Context(model, n_ctx=N_CTX, n_seq_max=N_SEQ, n_threads=1, n_threads_batch=1, **mode) as ctx:
                r = Round(ctx, rng)
                r.run(40)
                ops += r.ops + prefix_round(ctx, rng, 8, totals)
            rounds += 1
            gc.collect()
            if elapsed >= next_sample:
                samples.append((elapsed, rss_bytes()))
                next_sample += SAMPLE_EVERY
    samples.append((time.monotonic() - t0, rss_bytes()))
    print(f"\nsoak: {rounds} rounds, {ops} checked operations in {samples[-1][0]:.0f} s; prefix cache {totals}; "
          f"RSS (s, MiB): " + ", ".join(f"{t:.0f} {m / 2**20:.1f}" for t, m in samples))
    assert rounds >= 4 and ops > 0
    # the mix did what it is for: evictions into the host tier, restores from it, and drops when it was full
    assert all(totals[k] > 0 for k in ("evictions", "host_saves", "host_restores", "host_drops")), totals
    if len(samples) >= 2:
        first, last = samples[0][1], samples[-1][1]
        assert last < 1.05 * first, f"resident memory grew {100 * (last / first - 1):.1f} % after the first minute"

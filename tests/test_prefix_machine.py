"""A hypothesis state machine over a PrefixCache on a real tiny model: random requests (prompts built to share
prefixes with what is cached), generation steps, releases, evictions to a small host tier (RAM and disk), and every
memory operation through the prefix cache.  After every step:

* ``prefix.check``: the tree, the host tier's budgets and files, and every entry against the cells (positions
  0..n-1 once each, no pending shift, ``clean`` iff no other cell);
* the K and V rows of the last layer in the cells of every indexed prefix equal (to ``TOL``) those of the same
  tokens decoded from scratch in a reference context -- the last layer's K/V depend on every earlier token and on
  the position, so a cell from another context, a moved cell or a wrong blob shows;
* every admitted request's logits equal (to ``TOL``) those of its prompt decoded from scratch.

The default run is short (a few hundred steps per configuration); ``-m slow`` runs 10 000 steps in all.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from kvcache_ggml.batch import Batch
from kvcache_ggml.inspect import cells_table, kv_rows
from kvcache_ggml.prefix import HostParams, PrefixCache, check
from kvcache_ggml.runtime import Context, DecodeError, Model, make_model
from kvcache_ggml.runtime.modelmaker import ModelSpec

from helpers import prefill

VOCAB = 24          # few distinct tokens: random prompts share prefixes often
TOL = 1e-4          # relative to the largest value; placement-dependent rounding is ~1e-6
CONFIGS = {
    "unified-fa": dict(n_ctx=256, n_seq_max=6, kv_unified=True, flash_attn=True),
    "streams-nofa": dict(n_ctx=4 * 256, n_seq_max=4, kv_unified=False, flash_attn=False),
}


@pytest.fixture(scope="module")
def machine_model(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("pcm") / "m.gguf",
                      ModelSpec(layers=2, embd=32, heads=2, heads_kv=1, ff=32, vocab=VOCAB, seed=5))
    with Model(path) as m:
        yield m


def _ctx(model, cfg):
    return Context(model, type_k="f32", type_v="f32", n_threads=1, n_threads_batch=1, **cfg)


class Reference:
    """Fresh decodes of token lists: the last token's logits and the last layer's K/V rows, memoised."""

    def __init__(self, model, cfg):
        self.ctx = _ctx(model, dict(cfg, n_ctx=512, n_seq_max=1, kv_unified=True))
        self.memo: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def get(self, tokens):
        key = tuple(int(t) for t in tokens)
        hit = self.memo.get(key)
        if hit is None:
            if len(self.memo) > 4000:
                self.memo.clear()
            c = self.ctx
            c.memory_clear()
            logits = c.decode(Batch(token=np.asarray(key, np.int32)))[-1].copy()
            il = c.kv.hparams.n_layer - 1
            n = len(key)
            hit = (logits, kv_rows(c.kv, il, "k")[0, :n].copy(), kv_rows(c.kv, il, "v")[0, :n].copy())
            self.memo[key] = hit
        return hit

    def close(self):
        self.ctx.close()


def rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / max(np.abs(b).max(), 1e-30))


class PrefixMachine(RuleBasedStateMachine):
    MODEL = None                 # set by the test
    CFG: dict = {}
    TMP = None
    steps = 0

    @initialize(budget=st.sampled_from([0, 6_000, 20_000]), disk=st.booleans())
    def setup(self, budget, disk):
        self.ctx = _ctx(self.MODEL, self.CFG)
        host = HostParams(budget=budget, disk_dir=self.TMP if disk else None, disk_budget=30_000 if disk else 0)
        self.pc = PrefixCache(self.ctx, host=host)
        self.ref = Reference(self.MODEL, self.CFG)
        rng = np.random.default_rng(len(self.CFG))
        self.systems = [rng.integers(3, VOCAB, n).astype(np.int32) for n in (6, 15, 28)]
        self.blobs: list[tuple[int, bytes, object]] = []  # (sequence or -1, blob, tokens to vouch for)

    def teardown(self):
        if hasattr(self, "pc"):
            self.pc.close()
            self.ctx.close()
            self.ref.close()

    # ------------------------------------------------------------------ helpers

    def ids(self, active=None):
        return sorted(s for s, e in self.pc.seqs.items() if active is None or e.active == active)

    def prompt(self, data):
        kind = data.draw(st.sampled_from(["system", "system", "entry", "entry", "host", "random"]))
        base = np.zeros(0, np.int32)
        if kind == "system":
            base = data.draw(st.sampled_from(self.systems))
        elif kind == "entry" and self.pc.seqs:
            base = self.pc.seqs[data.draw(st.sampled_from(self.ids()))].tokens
        elif kind == "host" and self.pc.host_entries():
            base = data.draw(st.sampled_from(self.pc.host_entries())).tokens
        cut = data.draw(st.integers(0, base.size))
        tail = data.draw(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=12))
        return np.concatenate([base[:cut], np.asarray(tail, np.int32)])[:72]

    # ------------------------------------------------------------------ requests

    @precondition(lambda self: hasattr(self, "pc"))
    @rule(data=st.data(), n=st.integers(1, 3))
    def requests(self, data, n):
        for _ in range(n):
            self.request(data, data.draw(st.sampled_from(["pick", "pick", "any"])), data.draw(st.booleans()))

    def request(self, data, how, keep_active):
        toks = self.prompt(data)
        try:
            if how == "pick":
                s = self.pc.pick_seq(toks)
            else:
                free = [s for s in range(self.pc.n_seq) if s not in self.ids(active=True)]
                if not free:
                    return
                s = data.draw(st.sampled_from(free))
            adm, logits = prefill(self.pc, toks, s)
        except (ValueError, DecodeError):
            return  # every sequence busy, or no room left beside the active ones
        assert adm.n_reused + adm.n_decoded == toks.size and adm.n_decoded >= 1
        assert rel(logits, self.ref.get(toks)[0]) < TOL
        if not keep_active:
            self.pc.release(s)

    @precondition(lambda self: hasattr(self, "pc") and any(e.active for e in self.pc.seqs.values()))
    @rule(data=st.data())
    def generate(self, data):
        act = self.ids(active=True)
        seqs = data.draw(st.lists(st.sampled_from(act), min_size=1, unique=True))
        toks = data.draw(st.lists(st.integers(3, VOCAB - 1), min_size=len(seqs), max_size=len(seqs)))
        try:
            self.pc.advance([(s, [t], True) for s, t in zip(seqs, toks)])
        except DecodeError:
            return

    @precondition(lambda self: hasattr(self, "pc") and any(e.active for e in self.pc.seqs.values()))
    @rule(data=st.data())
    def release(self, data):
        self.pc.release(data.draw(st.sampled_from(self.ids(active=True))))

    @precondition(lambda self: hasattr(self, "pc") and any(not e.active for e in self.pc.seqs.values()))
    @rule(data=st.data(), keep=st.booleans())
    def evict(self, data, keep):
        self.pc.evict(data.draw(st.sampled_from(self.ids(active=False))), keep)

    # ------------------------------------------------------------------ memory operations

    @precondition(lambda self: hasattr(self, "pc"))
    @rule(data=st.data(), op=st.sampled_from(["rm", "rm", "add", "div", "shift", "cp", "cp", "keep", "clear"]),
          p0=st.integers(-1, 40), n=st.integers(-1, 20), d=st.integers(-12, 12))
    def memory_op(self, data, op, p0, n, d):
        pc = self.pc
        held = [q for q, e in pc.seqs.items() if e.tokens.size]
        if held and data.draw(st.booleans()):  # mostly an indexed sequence, inside its tokens
            s = data.draw(st.sampled_from(sorted(held)))
            p0 = min(p0, pc.seqs[s].tokens.size)
        else:
            s = data.draw(st.integers(-1 if op == "rm" else 0, pc.n_seq - 1))
        p1 = -1 if n < 0 else p0 + n
        if op == "rm":
            pc.seq_rm(s, p0, p1)
        elif op == "add":
            pc.seq_add(s, p0, p1, d)
        elif op == "div":
            pc.seq_div(s, p0, p1, abs(d) % 4 + 1)
        elif op == "shift":
            try:
                pc.context_shift(s, max(p0, 0), abs(d) + 1)
            except ValueError:
                pass  # more than the sequence holds: refused before any change
        elif op == "cp":
            dst = data.draw(st.integers(0, pc.n_seq - 1))
            pc.seq_cp(s, dst, p0, p1) if pc.unified else pc.seq_cp(s, dst)
        elif op == "keep":
            pc.seq_keep(s)
        else:
            pc.clear()

    @precondition(lambda self: hasattr(self, "pc"))
    @rule(data=st.data(), load=st.booleans(), vouch=st.booleans())
    def state(self, data, load, vouch):
        if load and self.blobs:
            s, blob, tokens = data.draw(st.sampled_from(self.blobs))
            dest = -1 if s == -1 else data.draw(st.integers(0, self.pc.n_seq - 1))
            try:
                self.pc.state_load(blob, dest, tokens if vouch else None)
            except ValueError:
                pass  # no room for the sequence: restored nothing
            return
        s = data.draw(st.integers(-1, self.pc.n_seq - 1))
        if s == -1:
            tokens = {q: e.tokens.copy() for q, e in self.pc.seqs.items() if e.clean and e.tokens.size}
        else:
            e = self.pc.seqs.get(s)
            tokens = e.tokens.copy() if e is not None and e.clean and e.tokens.size else None
        self.blobs.append((s, self.ctx.state_seq_get_data(s) if s >= 0 else self.ctx.state_get_data(), tokens))
        self.blobs = self.blobs[-4:]

    # ------------------------------------------------------------------ invariants

    @invariant()
    def consistent(self):
        if not hasattr(self, "pc"):
            return
        PrefixMachine.steps += 1
        problems = check(self.pc)
        assert problems == [], problems
        kv = self.ctx.kv
        il = kv.hparams.n_layer - 1
        entries = [e for e in self.pc.seqs.values() if e.tokens.size]
        if not entries:
            return
        k, v = kv_rows(kv, il, "k"), kv_rows(kv, il, "v")
        t = cells_table(kv)
        for e in entries:
            _, k_ref, v_ref = self.ref.get(e.tokens)
            has = (t["seq_bits"][:, e.seq_id // 64] >> np.uint64(e.seq_id % 64)) & np.uint64(1) != 0
            rows = t[(t["stream"] == e.stream) & has & (t["pos"] >= 0) & (t["pos"] < e.tokens.size)]
            cells = rows["cell"][np.argsort(rows["pos"])]
            assert rel(k[e.stream, cells], k_ref) < TOL, f"K of sequence {e.seq_id}"
            assert rel(v[e.stream, cells], v_ref) < TOL, f"V of sequence {e.seq_id}"


def _run(model, tmp_path, name, max_examples, steps, **kw):
    machine = type(f"PrefixMachine_{name}", (PrefixMachine,),
                   dict(MODEL=model, CFG=CONFIGS[name], TMP=tmp_path))
    run_state_machine_as_test(machine, settings=settings(
        max_examples=max_examples, stateful_step_count=steps, deadline=None, **kw,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefix_machine(machine_model, tmp_path, name):
    PrefixMachine.steps = 0
    _run(machine_model, tmp_path, name, max_examples=15, steps=40)
    assert PrefixMachine.steps >= 200


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefix_machine_long(machine_model, tmp_path, name):
    """5 000 steps per configuration, 10 000 in all (fresh random examples in each round, even under CI)."""
    PrefixMachine.steps = 0
    while PrefixMachine.steps < 5000:
        _run(machine_model, tmp_path, name, max_examples=50, steps=60, derandomize=False, database=None)
    print(f"{name}: {PrefixMachine.steps} steps")

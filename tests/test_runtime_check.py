"""kvcache_ggml.parity.runtime_check: the runtime on a backend against the CPU, and the decode-step timing table.

On this machine the backend is a loopback RPC server, which runs the CPU's own code: every logit must be equal.
The comparison itself is checked against figures computed here from the two contexts' logits.
"""
from __future__ import annotations

import numpy as np
import pytest

from kvcache_ggml import ggml as G
from kvcache_ggml.batch import Batch
from kvcache_ggml.runtime import Context, Model, make_model
from kvcache_ggml.parity.runtime_check import (CONFIGS, QUICK_MODELS, ParityRow, Lockstep, logit_tolerance,
                                                main_step_times, runtime_parity)
from kvcache_ggml.runtime.modelmaker import ModelSpec

needs_rpc = pytest.mark.skipif(not G.rpc_available(), reason="ggml built without RPC")


@needs_rpc
def test_runtime_on_rpc_equals_the_cpu(tmp_path):
    rows = runtime_parity("rpc", tmp_path, threads=1, models=QUICK_MODELS, n_gen=12)
    # the tiny model's head of 16 cannot hold q8_0 blocks: its q8_0-cache configuration is left out
    assert [(r.model, r.config) for r in rows] == [(m, c.name) for m in QUICK_MODELS for c in CONFIGS
                                                   if not (m == "tiny f32" and c.type_kv == "q8_0")]
    for r in rows:
        assert r.steps == 13 and r.rows == sum((9, 17, 5)) + 12 * 4  # prompt rows, then 4 sequences x 12 steps
        assert (r.rel_err, r.agree, r.ambiguous, r.failures) == (0.0, r.rows, 0, []) and r.passed
        assert "RPC" in r.devices


def test_weight_buffers_are_weights(tmp_path):
    """Every weight buffer tells the scheduler it holds weights (llama.cpp's load_tensors): ops using a weight then
    stay on the weight's backend."""
    path = make_model(tmp_path / "q.gguf", ModelSpec(layers=1, embd=64, heads=2, heads_kv=1, ff=64, vocab=48,
                                                     type="q4_0"))
    with Model(path) as m:
        assert m.buffers() and {b.usage for b in m.buffers()} == {G.BufferUsage.WEIGHTS}


@needs_rpc
def test_split_model_on_rpc_equals_the_cpu(tmp_path):
    """Half the layers of a Q4_0 model (repacked on the CPU where ggml repacks it) on an RPC server: the scheduler
    runs two backends over one graph.  Before weight buffers were marked, ops of the CPU's layers could be moved to
    the other backend and their repacked weights copied: a NULL call.  The server keeps Q4_0 in its plain layout
    and multiplies with the plain kernel, which sums in another order than the repacked one: the logits agree within
    the quantized-weight tolerance, not bit for bit."""
    rows = runtime_parity("rpc", tmp_path, threads=1, configs=CONFIGS[:2], models=("llama q4_0",), n_gen=4,
                          split="half")
    assert len(rows) == 2
    for r in rows:
        assert r.failures == [] and r.steps == 5 and r.agree + r.ambiguous == r.rows, r
        assert r.rel_err < logit_tolerance("q4_0", "f16", "cuda"), r
        assert "CPU" in r.devices and "RPC" in r.devices


def test_lockstep_measures_the_difference(tmp_path):
    path = make_model(tmp_path / "m.gguf", ModelSpec(layers=2, embd=64, heads=4, heads_kv=2, ff=96, vocab=48))
    toks = np.random.default_rng(1).integers(3, 48, 12).astype(np.int32)
    kw = dict(n_ctx=64, n_threads=1, n_threads_batch=1)
    with Model(path) as m, Context(m, flash_attn=False, type_k="f32", type_v="f32", **kw) as ref, \
            Context(m, flash_attn=True, type_k="f16", type_v="f16", **kw) as dev:
        row = ParityRow("m", "f32 vs f16 cache", tolerance=0.0)
        ls = Lockstep(ref, dev, row)
        ls.decode(Batch(token=toks, logits=np.ones(12, np.int8)))
        want, got = ref.logits.astype(np.float64), dev.logits.astype(np.float64)
    diff = np.abs(got - want)
    assert row.rel_err == pytest.approx(diff.max() / np.abs(want).max()) and row.rel_err > 0
    same = got.argmax(1) == want.argmax(1)
    top2 = np.sort(want, axis=1)[:, -2:]
    assert (row.rows, row.steps, row.agree) == (12, 1, int(same.sum()))
    assert row.ambiguous == int((~same & (top2[:, 1] - top2[:, 0] < 2 * diff.max(1))).sum())
    assert not row.passed  # tolerance 0: an F16 cache cannot give the F32 cache's logits
    row.tolerance = 1.0
    assert row.passed == (row.agree + row.ambiguous == row.rows)


def test_step_times_table(capsys):
    assert main_step_times(["--backends", "cpu", "--layers", "1", "--embd", "64", "--n-prompt", "8", "--n-gen",
                            "3", "--n-seq", "1,2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| cpu |")]
    assert [int(r[1]) for r in rows] == [1, 2]
    for r in rows:
        step, host, compute = float(r[2]), float(r[8]), float(r[9])
        assert sum(float(x) for x in r[3:8]) == pytest.approx(host, abs=3)  # the phases add up (rounded)
        assert 0 < host and 0 < compute and step >= 0.99 * (host + compute) - 1
        assert r[-1].strip() == "3/3"  # the one-token graph is reused at every timed step


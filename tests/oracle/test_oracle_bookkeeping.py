"""Differential: random traces on llama.cpp's own llama_kv_cache and on KVCache, compared after every step.

Compared: the result of each call (cells of every token in ubatch order and the ubatch sizes, or the rejection),
every cell's position, shift and sequences, and every head.
"""
import numpy as np
import pytest

from bookkeeping_trace import CONFIGS, make_trace
from conftest import run_oracle

pytestmark = pytest.mark.oracle


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", range(6))
def test_random_trace_matches_llama_cpp(name, seed):
    cfg = CONFIGS[name]
    rng = np.random.default_rng(1000 * seed + sum(name.encode()))
    ops, ours = make_trace(rng, cfg, 60)
    theirs = run_oracle({"cache": cfg, "ops": ops})
    assert len(theirs) == len(ops), f"oracle stopped early: {theirs[-1] if theirs else 'no output'}"
    for k, (op, (res, (pos, sh, seq, heads)), t) in enumerate(zip(ops, ours, theirs, strict=True)):
        where = f"step {k}: {op}"
        if op[0] == "decode":
            assert res == t["r"], where
        assert pos == t["pos"], where
        assert sh == t["shift"], where
        assert seq == t["seq"], where
        assert heads == t["heads"], where

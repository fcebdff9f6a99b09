"""kvcache_ggml.runtime.parallel.fork_decode: one prompt forked with seq_cp, one batch per step, checked against
the float64 numpy forward pass of each sequence encoded alone."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from kvcache_ggml.runtime import Context, Model, Reference, make_model
from kvcache_ggml.runtime.modelmaker import ModelSpec
from kvcache_ggml.runtime.parallel import fork_decode
from kvcache_ggml.serve.sampling import ForcedSampler


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("par") / "m.gguf",
                      ModelSpec(layers=2, embd=64, heads=4, heads_kv=2, ff=96, vocab=64, seed=12))


@dataclass
class _Params:
    ignore_eos: bool = False


@dataclass
class _Recorder:
    """Returns fixed tokens and keeps a copy of every logits row it was given."""

    tokens: list[int]
    params: _Params = field(default_factory=_Params)
    rows: list[np.ndarray] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def sample(self, logits: np.ndarray) -> int:
        self.rows.append(np.array(logits, np.float64))
        return self.tokens[len(self.rows) - 1]

    def accept(self, token: int) -> None:
        self.accepted.append(token)


def _ctx(m, **kw):
    return Context(m, n_ctx=256, n_seq_max=3, kv_unified=True, flash_attn=False, type_k="f32", type_v="f32",
                   n_threads=1, n_threads_batch=1, **kw)


def test_each_sequence_sees_the_logits_of_its_own_history(model_path):
    prompt = np.random.default_rng(1).integers(3, 64, 9).astype(np.int32)
    forced = [[5, 6, 7, 8], [9, 9, 9, 9], [40, 3, 41, 3]]
    recs = [_Recorder(f) for f in forced]
    with Model(model_path) as m, _ctx(m) as ctx:
        run = fork_decode(ctx, prompt, recs, 4)
        assert run.stopped is None and run.n_steps == 3
        assert run.tokens == forced and [r.accepted for r in recs] == forced
        assert run.n_past.tolist() == [len(prompt) + 3] * 3
        for s in range(3):  # the last token was chosen, never decoded
            assert ctx.memory_seq_pos_max(s) == len(prompt) + 2
    ref = Reference(model_path)
    for s, rec in enumerate(recs):
        want = ref.forward(list(prompt) + forced[s][:3])[len(prompt) - 1:]  # rows for the 4 choices
        got = np.stack(rec.rows)
        assert got.shape == want.shape
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_first_overrides_the_first_choice_and_eog_ends_a_sequence(model_path):
    prompt = np.arange(3, 12, dtype=np.int32)
    recs = [_Recorder([7, 1, 1]), _Recorder([2, 7, 1])]    # asked from the second token on (first gives the first)
    recs.append(ForcedSampler([7, 7, 7]))                  # ignore_eos: 7 does not end it
    seen: list[tuple[int, int]] = []
    with Model(model_path) as m, _ctx(m) as ctx:
        run = fork_decode(ctx, prompt, recs, 4, first=lambda row: np.array([4, 5, 6]), is_eog=lambda t: t == 7,
                          on_token=lambda s, t: seen.append((s, t)))
    assert run.tokens == [[4, 7], [5, 2, 7], [6, 7, 7, 7]]
    assert [len(r.rows) for r in recs[:2]] == [1, 2]   # rows after the prompt's: the first was not sampled
    assert sorted(seen) == sorted((s, t) for s, toks in enumerate(run.tokens) for t in toks)
    assert run.n_steps == 3


def test_a_full_cache_stops_the_run_unless_on_full_makes_room(model_path):
    prompt = np.random.default_rng(2).integers(3, 64, 250).astype(np.int32)
    with Model(model_path) as m:
        with _ctx(m, n_batch=256) as ctx:
            run = fork_decode(ctx, prompt, [ForcedSampler([3] * 20)], 20)
            assert run.stopped is not None and run.stopped.code == 1
            assert run.n_steps == 6 and len(run.tokens[0]) == 7    # 250 + 6 cells fill 256
        with _ctx(m, n_batch=256) as ctx:
            calls = []

            def shift(r):
                calls.append(int(r.n_past[0]))
                ctx.context_shift(0, 4, 100)
                return np.array([100])

            run = fork_decode(ctx, prompt, [ForcedSampler([3] * 20)], 20, on_full=shift)
            assert run.stopped is None and calls == [256] and len(run.tokens[0]) == 20
            # 256 - 100 cells after the shift, then the 13 steps that took the run from 7 tokens to 20
            assert run.n_past[0] == 156 + 13 and ctx.memory_seq_pos_max(0) == run.n_past[0] - 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="n_predict >= 1, got 1 and 0"):
        fork_decode(None, np.ones(2, np.int32), [ForcedSampler([1])], 0)
    with pytest.raises(ValueError, match="got 0 and 3"):
        fork_decode(None, np.ones(2, np.int32), [], 3)
    with pytest.raises(ValueError, match="empty prompt"):
        fork_decode(None, np.zeros(0, np.int32), [ForcedSampler([1])], 1)

"""kvcache_ggml.serve.sampling: llama.cpp's sampler chain on numpy logits."""
from __future__ import annotations

import numpy as np
import pytest

from kvcache_ggml.serve.protocol import RequestError, SamplingParams
from kvcache_ggml.serve.sampling import ForcedSampler, Sampler, logprobs

N = 1000


def _logits(seed: int = 0, n: int = N) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 3.0, n).astype(np.float32)


def _draws(s: Sampler, x: np.ndarray, k: int) -> list[int]:
    return [s.sample(x) for _ in range(k)]


def test_greedy_is_argmax():
    for seed in range(5):
        x = _logits(seed)
        assert Sampler(SamplingParams(temperature=0.0), N).sample(x) == int(np.argmax(x))
    x = np.zeros(N, np.float32)
    x[[7, 3, 900]] = 5.0  # ties go to the lowest id, as np.argmax
    assert Sampler(SamplingParams(temperature=0.0), N).sample(x) == 3


def test_seeded_reproducible_and_seed_dependent():
    x = _logits(1) / 3  # flat enough that draws vary
    a = _draws(Sampler(SamplingParams(seed=42), N), x, 50)
    b = _draws(Sampler(SamplingParams(seed=42), N), x, 50)
    c = _draws(Sampler(SamplingParams(seed=43), N), x, 50)
    assert a == b and a != c
    assert len(set(a)) > 5
    assert len(set(_draws(Sampler(SamplingParams(), N), x, 50))) > 5  # unseeded: from OS entropy


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_p=1e-6),
                                    SamplingParams(min_p=1.0), SamplingParams(top_k=50, top_p=1e-3, temperature=2)])
def test_filters_that_leave_one_token_are_greedy(params):
    for seed in range(3):
        x = _logits(seed)
        params.seed = seed
        assert set(_draws(Sampler(params, N), x, 20)) == {int(np.argmax(x))}


def test_top_k_keeps_the_k_best():
    x = _logits(2)
    best = set(np.argsort(-x)[:5].tolist())
    got = set(_draws(Sampler(SamplingParams(top_k=5, temperature=2.0, seed=1), N), x, 400))
    assert got <= best and len(got) >= 3


def test_top_p_cut_keeps_crossing_token():
    x = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    # mass 0.5 then 0.8: p=0.6 keeps the first two (the second crosses p), never the others
    got = _draws(Sampler(SamplingParams(top_p=0.6, seed=3), 4), x, 500)
    assert set(got) == {0, 1}
    assert abs(got.count(0) / 500 - 0.5 / 0.8) < 0.07


def test_top_p_large_vocab_past_first_block():
    x = np.zeros(5000, np.float32)  # uniform: top_p=0.5 needs 2500 tokens, past the first sorted block
    got = _draws(Sampler(SamplingParams(top_p=0.5, seed=4), 5000), x, 3000)
    assert len(set(got)) > 1000 and max(got) < 5000


def test_min_p_drops_unlikely():
    x = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    got = set(_draws(Sampler(SamplingParams(min_p=0.25, seed=5), 4), x, 500))  # keeps p >= 0.125
    assert got == {0, 1, 2}


def test_penalties_change_the_choice():
    x = np.array([2.0, 1.8, 1.0, 0.0], np.float32)
    s = Sampler(SamplingParams(temperature=0.0, presence_penalty=0.5), 4)
    assert s.sample(x) == 0
    s.accept(0)
    assert s.sample(x) == 1  # 2.0 - 0.5 < 1.8
    s = Sampler(SamplingParams(temperature=0.0, frequency_penalty=0.15), 4)
    s.accept(0)
    assert s.sample(x) == 0  # 2.0 - 0.15 > 1.8
    s.accept(0)
    assert s.sample(x) == 1  # 2.0 - 0.3 < 1.8
    s = Sampler(SamplingParams(temperature=0.0, presence_penalty=-2.0), 4)
    s.accept(2)
    assert s.sample(x) == 2  # a negative penalty favours repeats: 1.0 + 2.0 > 2.0
    adj = Sampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), 4)
    for t in (1, 1, 3):
        adj.accept(t)
    np.testing.assert_allclose(adj.adjusted(x), [2.0, 1.8 - 0.5 - 0.5, 1.0, -0.5 - 0.25], rtol=1e-6)


def test_logit_bias_moves_greedy():
    x = _logits(6)
    order = np.argsort(-x, kind="stable")
    s = Sampler(SamplingParams(temperature=0.0, logit_bias={int(order[0]): -100.0}), N)
    assert s.sample(x) == int(order[1])
    biased = x.copy()
    biased[17] += np.float32(100.0)
    assert Sampler(SamplingParams(temperature=0.0, logit_bias={17: 100.0}), N).sample(x) == int(np.argmax(biased))
    with pytest.raises(RequestError, match="1000"):
        Sampler(SamplingParams(logit_bias={1000: 1.0}), N)


def test_many_logit_biases_each_added_once():
    x = _logits(8)
    rng = np.random.default_rng(8)
    ids = rng.choice(N, 300, replace=False)
    bias = {int(i): float(b) for i, b in zip(ids, rng.uniform(-100, 100, ids.size))}
    want = x.copy()
    for i, b in bias.items():
        want[i] += np.float32(b)
    got = Sampler(SamplingParams(logit_bias=bias), N).adjusted(x)
    np.testing.assert_array_equal(got, want)
    assert not np.shares_memory(got, x)


@pytest.mark.parametrize("seed", range(40))
def test_greedy_without_the_copy_equals_argmax_of_the_adjusted_row(seed):
    """Greedy sampling skips the row's copy where only logit_bias and ignore_eos apply (Sampler._greedy): the
    token is np.argmax of adjusted() whatever the ties, biases, masked end tokens and NaNs (small integer logits
    make ties common; the raw argmax is often a biased or masked id, where the copy is taken)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 60))
    x = rng.integers(-3, 4, n).astype(np.float32)
    if seed % 7 == 3:
        x[rng.integers(n)] = np.nan
    bias = {int(i): float(rng.choice([-100.0, -1.0, 0.0, 1.0, 2.0, 100.0]))
            for i in rng.choice(n, int(rng.integers(0, n // 3 + 1)), replace=False)}
    eog = rng.choice(n, int(rng.integers(0, 3)), replace=False).tolist()
    for ignore_eos in (False, True):
        s = Sampler(SamplingParams(temperature=0.0, logit_bias=bias, ignore_eos=ignore_eos), n, eog=eog)
        want = int(np.argmax(s.adjusted(x)))
        assert s.sample(x) == want
        fast = s._greedy(x)
        assert fast in (-1, want)  # (the shortcut answers the argmax or hands over to the copy)
        assert s.sample(x.astype(np.float64)) == int(np.argmax(s.adjusted(x.astype(np.float64))))


@pytest.mark.parametrize("seed", range(40))
def test_greedy_with_biases_that_only_lower_answers_the_untouched_raw_argmax(seed):
    """Where logit_bias only lowers logits (and ignore_eos masks), _greedy answers an untouched raw argmax without
    reading the touched ids: checked against np.argmax of adjusted() with many ties (small integer logits), biases
    down to a float32 rounding's size, and touched ids both below and above the raw argmax."""
    rng = np.random.default_rng(1000 + seed)
    n = int(rng.integers(2, 60))
    x = rng.integers(-3, 4, n).astype(np.float32)
    bias = {int(i): float(rng.choice([-100.0, -1.0, -1e-9, 0.0]))
            for i in rng.choice(n, int(rng.integers(1, n // 2 + 2)), replace=False)}
    eog = rng.choice(n, int(rng.integers(0, 3)), replace=False).tolist()
    for ignore_eos in (False, True):
        s = Sampler(SamplingParams(temperature=0.0, logit_bias=bias, ignore_eos=ignore_eos), n, eog=eog)
        want = int(np.argmax(s.adjusted(x)))
        raw = int(np.argmax(x))
        touched = set(bias) | (set(eog) if ignore_eos else set())
        assert s._greedy(x) == (-1 if raw in touched else want)
        assert s.sample(x) == want


def test_greedy_shortcut_answers_when_the_argmax_is_untouched():
    x = _logits(9)
    top = int(np.argmax(x))
    others = [i for i in range(N) if i != top][:200]
    s = Sampler(SamplingParams(temperature=0.0, logit_bias={i: -5.0 for i in others}, ignore_eos=True), N, eog=[5])
    assert s._greedy(x) == top == int(np.argmax(s.adjusted(x)))
    s = Sampler(SamplingParams(temperature=0.0, logit_bias={others[0]: 100.0}), N)
    assert s._greedy(x) == others[0] == int(np.argmax(s.adjusted(x)))  # a boosted id wins over the raw argmax
    y = np.array([0.0, 1.0, 3.0, 2.0, 3.0], np.float32)   # raw argmax 2, untouched
    for bias, eog, want in [({1: 2.0}, [], 1),             # a tie at 3.0: the lower id, a touched one, wins
                            ({3: 1.0}, [], 2),             # a tie at 3.0: the lower id, the raw argmax, wins
                            ({1: 5.0}, [1], 2),            # the boosted id is an end token, masked
                            ({0: 9.0, 1: 9.5}, [1], 0)]:   # ... and the next boosted one wins
        s = Sampler(SamplingParams(temperature=0.0, logit_bias=bias, ignore_eos=True), 5, eog=eog)
        assert s._greedy(y) == want == int(np.argmax(s.adjusted(y))), (bias, eog)
    z = np.array([2.75, 3.0], np.float32)  # any raise, however small, may tie the raw argmax from below
    s = Sampler(SamplingParams(temperature=0.0, logit_bias={0: 0.25}), 2)
    assert s._greedy(z) == 0 == int(np.argmax(s.adjusted(z)))


def test_ignore_eos():
    x = np.array([0.0, 5.0, 1.0], np.float32)
    assert Sampler(SamplingParams(temperature=0.0), 3, eog=[1]).sample(x) == 1
    assert Sampler(SamplingParams(temperature=0.0, ignore_eos=True), 3, eog=[1]).sample(x) == 2
    got = set(_draws(Sampler(SamplingParams(ignore_eos=True, seed=0), 3, eog=[1]), x, 300))
    assert got == {0, 2}


def test_frequencies_match_softmax():
    x = np.array([1.0, 0.5, -0.3, 2.0], np.float32)
    e = np.exp(x.astype(np.float64) - x.max())
    want = e / e.sum()
    s = Sampler(SamplingParams(temperature=1.0, seed=1234), 4)
    counts = np.bincount(_draws(s, x, 20000), minlength=4) / 20000
    assert np.abs(counts - want).max() < 0.02


def test_temperature_sharpens():
    x = np.array([1.0, 0.0], np.float32)
    cold = np.mean(_draws(Sampler(SamplingParams(temperature=0.25, seed=2), 2), x, 4000))  # p(1) = 1/(1+e^4)
    assert abs(cold - 1 / (1 + np.exp(4.0))) < 0.02


def test_logprobs_equal_float64_log_softmax():
    x = _logits(7)
    x64 = x.astype(np.float64)
    want = x64 - np.log(np.sum(np.exp(x64 - x64.max()))) - x64.max()
    lp, top = logprobs(x, 123, 5)
    assert lp == pytest.approx(want[123], rel=0, abs=1e-12)
    ids = np.argsort(-want, kind="stable")[:5]
    assert [i for i, _ in top] == ids.tolist()
    np.testing.assert_allclose([v for _, v in top], want[ids], rtol=0, atol=1e-12)
    s = Sampler(SamplingParams(temperature=0.0, logit_bias={0: 100.0}), N)
    assert s.logprobs(x, 0, 0) == (pytest.approx(want[0], abs=1e-12), [])  # raw logits, not the biased ones
    x = np.array([1.0, 3.0, 3.0, 0.0], np.float32)
    assert [i for i, _ in logprobs(x, 0, 4)[1]] == [1, 2, 0, 3]


def test_wrong_logits_shape():
    with pytest.raises(ValueError, match="vocabulary of 4"):
        Sampler(SamplingParams(), 4).sample(np.zeros(5, np.float32))


def test_forced_sampler_returns_its_tokens_in_order_then_refuses():
    x = _logits(3)
    s = ForcedSampler(np.array([5, 2, 5], np.int32))
    assert s.n_forced == 3 and s.params.ignore_eos is True and s.first_logits is None
    got = []
    for _ in range(3):
        got.append(s.sample(x))
        s.accept(got[-1])
    assert got == [5, 2, 5] and s.first_logits is None  # not asked to keep the logits
    with pytest.raises(ValueError, match="all 3 forced tokens"):
        s.sample(x)
    with pytest.raises(ValueError, match="all 0 forced tokens"):
        ForcedSampler([]).sample(x)


def test_forced_sampler_keeps_a_float32_copy_of_the_first_row():
    rows = [_logits(4).astype(np.float64), _logits(5)]
    s = ForcedSampler([1, 2], keep_logits=True)
    assert [s.sample(r) for r in rows] == [1, 2]
    assert s.first_logits.dtype == np.float32 and np.array_equal(s.first_logits, rows[0].astype(np.float32))
    rows[0][:] = 0.0  # a copy: the caller's buffer may be reused
    assert np.abs(s.first_logits).max() > 0


def test_forced_sampler_logprobs_are_the_models():
    x = _logits(6)
    lp, top = ForcedSampler([0]).logprobs(x, 17, 3)
    want_lp, want_top = logprobs(x, 17, 3)
    assert lp == want_lp and top == want_top
    x64 = x.astype(np.float64)
    assert lp == pytest.approx(x64[17] - np.log(np.exp(x64 - x64.max()).sum()) - x64.max(), abs=1e-12)

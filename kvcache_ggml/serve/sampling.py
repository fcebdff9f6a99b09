"""llama.cpp-style sampling of one token from a row of logits, per request, on numpy.

:class:`Sampler` applies, in llama-server's default order where the steps touch the same thing:

1. ``logit_bias``: each listed id's bias is added to its logit;
2. penalties on the tokens generated so far (:meth:`Sampler.accept` records them; OpenAI semantics, prompt tokens
   do not count): ``presence_penalty`` is subtracted once from each token seen at least once,
   ``frequency_penalty * count`` from each token seen ``count`` times;
3. ``ignore_eos``: the end-of-generation ids get ``-inf``;
4. ``temperature <= 0``: greedy -- ``np.argmax`` of the logits so far (ties to the lowest id);
5. otherwise ``top_k`` (k > 0 and below the vocabulary: the k largest logits, found with ``argpartition``), then
   ``top_p`` (< 1: the smallest set of most likely tokens whose probability, softmax of the candidates at
   temperature 1, reaches p -- the token that crosses p is kept, as llama.cpp keeps it), then ``min_p`` (> 0: the
   tokens whose probability is at least min_p times the best one, ``logit >= max + log(min_p)``), then the
   temperature divides the logits, a softmax and one draw from the request's own ``np.random.Generator``.

Steps 1-3 are applied to a float32 copy of the row; the candidates' softmax and the draw are float64.  Greedy
sampling without penalties takes no copy: the raw argmax, unless steps 1 or 3 touch it, against the adjusted
values of the few ids they touch (the same token as the copy's argmax, ties included); where they only lower
logits (bans, masked end tokens), an untouched raw argmax is the answer without looking at them.  No step loops
in Python over the vocabulary.  ``top_p`` sorts only as many of the largest logits as it needs (128, then 8 times
more, then all).

:func:`logprobs` reports the model's own distribution -- the log-softmax of the *raw* logits, before any of the
steps above, as OpenAI reports it -- in float64.

:class:`ForcedSampler` has the same interface and returns fixed tokens in order instead of drawing them: replays of
a recorded workload (the same replies whatever the cache does), with the first logits kept for comparing runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from .protocol import SamplingParams

__all__ = ["Sampler", "ForcedSampler", "ForcedParams", "logprobs"]

_TOP_P_FIRST = 128  # largest logits sorted first when looking for the top_p cut (then 8x more)


def logprobs(logits: np.ndarray, token: int, top_n: int = 0) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of ``token`` and the ``top_n`` most likely (id, log-probability) pairs (most likely
    first, ties to the lowest id), from the log-softmax of the raw ``logits`` in float64."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max()
    lp = x - (m + np.log(np.exp(x - m).sum()))
    top: list[tuple[int, float]] = []
    n = min(top_n, lp.size)
    if n > 0:
        idx = np.argpartition(-lp, n - 1)[:n] if n < lp.size else np.arange(lp.size)
        idx = idx[np.lexsort((idx, -lp[idx]))]
        top = [(int(i), float(lp[i])) for i in idx]
    return float(lp[token]), top


class Sampler:
    """The sampling state of one request: its parameters, random generator and generated-token counts."""

    logprobs = staticmethod(logprobs)

    def __init__(self, params: SamplingParams, n_vocab: int, eog: Iterable[int] = ()) -> None:
        params.check_vocab(n_vocab)
        self.params = params      # the request's sampling parameters
        self.n_vocab = n_vocab    # length of a logits row
        # ids that end generation (EOS, EOT...), masked when params.ignore_eos
        self.eog = np.array(sorted({int(t) for t in eog if 0 <= int(t) < n_vocab}), dtype=np.int64)
        seed = params.seed
        # the request's own generator: seeded (reproducible) or from OS entropy
        self.rng = np.random.default_rng(None if seed is None else seed % (1 << 64))
        self.counts: dict[int, int] = {}  # generated token id -> times generated (for the penalties)
        self._bias_ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64, count=len(params.logit_bias))
        self._bias = np.fromiter(params.logit_bias.values(), dtype=np.float32, count=len(params.logit_bias))
        # greedy without penalties (_greedy): the ids steps 1 and 3 change (sorted), what step 1 adds to each
        # (float32, 0 where it adds nothing) and which of them step 3 masks
        masked = self.eog if params.ignore_eos else np.zeros(0, np.int64)
        self._touched = np.union1d(self._bias_ids, masked)
        self._touch_add = np.zeros(self._touched.size, np.float32)
        self._touch_add[np.searchsorted(self._touched, self._bias_ids)] = self._bias
        self._touch_masked = np.isin(self._touched, masked)
        # ... the same ids as a set (is the raw argmax touched?), and whether steps 1 and 3 only lower logits: then
        # an untouched raw argmax is the answer, no touched id can pass it (nor tie it from below: the raw argmax
        # is the lowest id of the largest logit)
        self._touched_set = frozenset(self._touched.tolist())
        self._only_lower = bool(np.all(self._touch_add <= 0))

    def accept(self, token: int) -> None:
        """Record a generated token (it counts for the presence and frequency penalties from now on)."""
        self.counts[token] = self.counts.get(token, 0) + 1

    def adjusted(self, logits: np.ndarray) -> np.ndarray:
        """A float32 copy of ``logits`` after logit_bias, the penalties and ignore_eos (steps 1-3)."""
        if logits.shape != (self.n_vocab,):
            raise ValueError(f"logits of shape {logits.shape} for a vocabulary of {self.n_vocab} tokens")
        x = np.array(logits, dtype=np.float32, copy=True)
        p = self.params
        if self._bias_ids.size:  # (a dict's keys: no id twice, so the indexed add is np.add.at's at half the cost)
            x[self._bias_ids] += self._bias
        if self.counts and (p.presence_penalty or p.frequency_penalty):
            ids = np.fromiter(self.counts.keys(), dtype=np.int64, count=len(self.counts))
            c = np.fromiter(self.counts.values(), dtype=np.float32, count=len(self.counts))
            x[ids] -= np.float32(p.frequency_penalty) * c + np.float32(p.presence_penalty)
        if p.ignore_eos and self.eog.size:
            x[self.eog] = -np.inf
        return x

    def _greedy(self, logits: np.ndarray) -> int:
        """``argmax(adjusted(logits))`` without the copy, where steps 1 and 3 are all there is: the raw argmax,
        unless steps 1 and 3 touch it, against the adjusted values of the ids they touch (ties to the lowest id, as
        argmax has them); -1 where that cannot say (the raw argmax is touched, a NaN, a row that is not float32):
        the caller takes the copy."""
        if logits.shape != (self.n_vocab,) or logits.dtype != np.float32:
            return -1
        i = int(logits.argmax())  # (the method: numpy's function wrapper costs a few us a token)
        best = logits[i]
        touched = self._touched
        if not touched.size:
            return i
        if i in self._touched_set or best != best:
            return -1
        if self._only_lower:
            return i
        v = logits[touched] + self._touch_add
        v[self._touch_masked] = -np.inf
        j = int(np.argmax(v))  # (no NaN here: a NaN anywhere is the raw argmax, answered above)
        t = int(touched[j])
        return t if v[j] > best or (v[j] == best and t < i) else i

    def sample(self, logits: np.ndarray) -> int:
        """One token id drawn from ``logits`` (float32, n_vocab) by the chain above."""
        p = self.params
        if p.temperature <= 0 and not (self.counts and (p.presence_penalty or p.frequency_penalty)):
            tok = self._greedy(logits)
            if tok >= 0:
                return tok
        x = self.adjusted(logits)
        if p.temperature <= 0:
            return int(np.argmax(x))
        ids: np.ndarray | None = None  # ids of the candidates in v; None: all, in id order
        if 0 < p.top_k < self.n_vocab:
            ids = np.argpartition(-x, p.top_k - 1)[:p.top_k]
            x = x[ids]
        v = x.astype(np.float64)
        m = v.max()
        if not np.isfinite(m):
            raise ValueError(f"no token can be sampled: the largest logit left is {m}")
        if p.top_p < 1.0:
            keep = _top_p(v, m, p.top_p)
            ids, v = (keep if ids is None else ids[keep]), v[keep]
        if p.min_p > 0.0:
            keep = np.flatnonzero(v >= m + np.log(p.min_p))
            ids, v = (keep if ids is None else ids[keep]), v[keep]
        w = np.exp((v - m) / p.temperature)
        cum = np.cumsum(w)
        i = min(int(np.searchsorted(cum, self.rng.random() * cum[-1], side="right")), v.size - 1)
        return i if ids is None else int(ids[i])


@dataclass(frozen=True, slots=True)
class ForcedParams:
    """The parameters a :class:`ForcedSampler` shows the engine: it never masks nor stops at an end token."""

    ignore_eos: bool = True   # an end-of-generation token in the forced list is generated, and generation goes on


class ForcedSampler:
    """A sampler that returns ``tokens`` in order, whatever the logits say (replays of recorded replies).

    The same interface as :class:`Sampler`: :meth:`sample`, :meth:`accept`, :meth:`logprobs` (of the model's raw
    logits, as Sampler reports them) and ``params.ignore_eos`` (True, so a forced end token does not end the
    replay).  With ``keep_logits`` the first row it is given is kept as a float32 copy in ``first_logits`` (the
    prompt's logits: what a benchmark compares between engines or cache settings).
    """

    logprobs = staticmethod(logprobs)

    def __init__(self, tokens: Sequence[int] | np.ndarray, keep_logits: bool = False) -> None:
        self.tokens = np.array(tokens, dtype=np.int64).reshape(-1)  # the tokens to return, in order
        self.n_forced = int(self.tokens.size)   # how many there are
        self.params = ForcedParams()            # ignore_eos: True
        self.keep_logits = keep_logits          # keep a copy of the first row given to sample()
        self.first_logits: np.ndarray | None = None  # float32 copy of that row (keep_logits), else None
        self.n_sampled = 0                      # tokens returned so far
        self.counts: dict[int, int] = {}        # accepted token id -> times (as Sampler counts them)

    def sample(self, logits: np.ndarray) -> int:
        """The next forced token; ValueError once all ``n_forced`` have been returned."""
        if self.n_sampled >= self.n_forced:
            raise ValueError(f"forced sampler exhausted: all {self.n_forced} forced tokens were already returned")
        if self.keep_logits and self.first_logits is None:
            self.first_logits = np.array(logits, dtype=np.float32, copy=True)
        tok = int(self.tokens[self.n_sampled])
        self.n_sampled += 1
        return tok

    def accept(self, token: int) -> None:
        """Record a generated token (kept for symmetry with :class:`Sampler`; nothing depends on it)."""
        self.counts[token] = self.counts.get(token, 0) + 1


def _top_p(v: np.ndarray, m: float, p: float) -> np.ndarray:
    """Indices into ``v`` (logits, largest ``m``) of the smallest most-likely set whose softmax mass reaches ``p``,
    most likely first; the token that crosses ``p`` is kept."""
    w = np.exp(v - m)
    target = p * w.sum()
    n = min(_TOP_P_FIRST, v.size)
    while True:
        part = np.argpartition(-v, n - 1)[:n] if n < v.size else np.arange(v.size)
        order = part[np.argsort(-v[part], kind="stable")]
        cum = np.cumsum(w[order])
        if cum[-1] >= target or n == v.size:
            cut = int(np.searchsorted(cum, target, side="left")) + 1
            return order[:min(cut, n)]
        n = v.size if 4 * n > v.size else 8 * n

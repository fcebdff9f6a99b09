"""Drafts for speculative decoding: tokens a request will probably generate next, verified by the target model.

The engine (:mod:`.engine`) asks a :class:`Drafter` once per step for a draft per decoding request
(:class:`DraftRequest`: its sequence, its tokens so far -- the prompt and what it generated, the last one not yet
decoded -- and the most tokens worth proposing).  It puts each draft after the request's last token in the step's
batch, with logits on every row, and keeps llama.cpp's rule (``common_sampler_sample_and_accept_n``): the request's
sampler draws a token at each row in turn; while it equals the draft's token there, the next row is sampled too.
The tokens drawn are the output, exactly what decoding without a draft would give (one draw per output token, each
from the logits of the accepted tokens before it); the cells of the rejected draft tokens are removed.

Two drafters:

* :class:`NgramDrafter` -- prompt lookup, no model: the longest n-gram (``n_min`` .. ``n_max`` tokens) ending the
  request's tokens that appeared before in them, most recent occurrence; the tokens that followed it there are the
  draft.  Replies that repeat their prompt (code edits, quotes) draft well.
* :class:`ModelDrafter` -- a small model with the target's vocabulary (llama.cpp's ``-md``), on its own
  :class:`~kvcache_ggml.runtime.context.Context` whose sequences mirror the target's: each step it catches up the
  tokens its cache lacks (all requests in one batch), then drafts greedily for all requests at once, one token per
  request a decode, while the best token's probability (softmax of the 10 best logits, as llama.cpp's draft
  sampler has it) stays >= ``p_min``; the first token below it is still proposed, then drafting stops.  What the
  target rejected is cut from its cache at the next call (the common prefix of what it holds and the request's
  tokens is kept).

:func:`check_vocab_compatible` is llama.cpp's ``common_speculative_are_compatible``: the same tokenizer type, BOS and
EOS, sizes within 128 of each other, the same text for every shared id from 5 on.
"""
from __future__ import annotations

from dataclasses import dataclass
from argparse import ArgumentParser, Namespace
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np

from ..batch import Batch
from ..prefix import common_prefix
from ..runtime.context import DecodeError

__all__ = ["DraftRequest", "Drafter", "NgramDrafter", "ModelDrafter", "check_vocab_compatible", "VOCAB_SIZE_SLACK",
           "add_spec_args", "check_spec_args", "open_drafter", "close_drafter"]

VOCAB_SIZE_SLACK = 128      # largest difference of vocabulary sizes llama.cpp accepts between draft and target
_VOCAB_CHECK_FROM = 5       # ids below this one may differ (llama.cpp's SPEC_VOCAB_CHECK_START_TOKEN_ID)
_DRAFT_TOP_K = 10           # the draft's probability is its softmax among this many best logits (llama.cpp)


@dataclass(slots=True)
class DraftRequest:
    """One decoding request's part of a drafting call."""

    seq: int                 # the target sequence it runs on (a drafter may keep state per sequence)
    tokens: np.ndarray       # int32: its prompt and generated tokens; the last one is not decoded by the target yet
    n_max: int               # most tokens to propose (>= 1)


class Drafter(Protocol):
    """What the engine asks of a drafter."""

    def bind(self, vocab: Any, n_vocab: int, n_seq: int) -> None:
        """Called once by the engine: its vocabulary, logits row size and sequence count; ValueError where this
        drafter cannot draft for them (nothing changed)."""

    def propose(self, reqs: Sequence[DraftRequest]) -> list[np.ndarray]:
        """Per request, int32 draft tokens (at most its ``n_max``; possibly none)."""


class NgramDrafter:
    """Prompt-lookup drafts from the request's own tokens (no model)."""

    def __init__(self, n_min: int = 2, n_max: int = 8) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes must satisfy 1 <= n_min <= n_max, got n_min {n_min}, n_max {n_max}")
        self.n_min = n_min        # shortest n-gram that counts as a match
        self.n_max = n_max        # longest n-gram looked for (the longest match wins)

    def bind(self, vocab: Any, n_vocab: int, n_seq: int) -> None:
        pass  # (any vocabulary: the drafts are the request's own tokens)

    def propose(self, reqs: Sequence[DraftRequest]) -> list[np.ndarray]:
        return [self.lookup(r.tokens, r.n_max) for r in reqs]

    def lookup(self, tokens: np.ndarray, n: int) -> np.ndarray:
        """The continuation (at most ``n`` tokens) of the most recent earlier occurrence of the longest n-gram
        that ends ``tokens``; empty when none of ``n_min`` tokens or more occurs."""
        h = np.asarray(tokens)
        size = h.size
        # candidate ends i (< size - 1) of an earlier occurrence: h[i - k] == h[size - 1 - k] for k < depth
        cand = np.flatnonzero(h[:size - 1] == h[size - 1])
        best = cand if self.n_min <= 1 else cand[:0]
        for k in range(1, min(self.n_max, size - 1)):
            cand = cand[cand >= k]
            cand = cand[h[cand - k] == h[size - 1 - k]]
            if cand.size == 0:
                break
            if k + 1 >= self.n_min:
                best = cand
        if best.size == 0:
            return h[:0].astype(np.int32)
        start = int(best[-1]) + 1
        return h[start:start + n].astype(np.int32)


def check_vocab_compatible(target: Any, draft: Any) -> None:
    """ValueError unless ``draft``'s vocabulary can draft for ``target``'s (llama.cpp's rule, module docstring);
    the message names both sizes."""
    nt, nd = len(target.tokens), len(draft.tokens)
    what = f"the draft model's vocabulary ({nd} tokens) cannot draft for the target's ({nt} tokens)"
    if target.model != draft.model:
        raise ValueError(f"{what}: tokenizer {draft.model!r} vs {target.model!r}")
    for name in ("bos", "eos", "add_bos", "add_eos"):
        if getattr(target, name) != getattr(draft, name):
            raise ValueError(f"{what}: {name} {getattr(draft, name)} vs {getattr(target, name)}")
    if abs(nt - nd) > VOCAB_SIZE_SLACK:
        raise ValueError(f"{what}: the sizes differ by {abs(nt - nd)} > {VOCAB_SIZE_SLACK}")
    for i in range(_VOCAB_CHECK_FROM, min(nt, nd)):
        if target.tokens[i] != draft.tokens[i]:
            raise ValueError(f"{what}: token {i} is {draft.tokens[i]!r} vs {target.tokens[i]!r}")


class ModelDrafter:
    """Drafts from a second model on its own context (module docstring).  ``ctx`` is the draft model's context:
    at least the target's sequences, ``n_ctx_seq`` at least the target's; ``vocab`` its vocabulary."""

    def __init__(self, ctx: Any, vocab: Any, p_min: float = 0.8) -> None:
        if not 0.0 <= p_min <= 1.0:
            raise ValueError(f"p_min must be in [0, 1], got {p_min}")
        self.ctx = ctx                       # the draft model's context (its cache mirrors the target's sequences)
        self.vocab = vocab                   # the draft model's vocabulary
        self.p_min = p_min                   # drafting stops after the first token less likely than this
        self.n_vocab_target = 0              # the target's logits row size (bind); draft ids beyond it end a draft
        self.held: dict[int, np.ndarray] = {}  # sequence -> the tokens its cells hold in the draft cache
        self.owned: tuple[Any, ...] = ()     # what close() closes (open() loads them)

    @classmethod
    def open(cls, path: str | Path, target_ctx: Any, p_min: float = 0.8, n_threads: int = 4) -> "ModelDrafter":
        """Load the draft model at ``path`` with a context shaped like ``target_ctx``'s (its sizes, sequences and
        cache layout; F16 cache); :meth:`close` frees both."""
        from ..cparams import ContextParams
        from ..runtime.arch import load_model
        from ..runtime.context import Context
        from ..runtime.tokenizer import Vocab

        model = load_model(path)
        try:
            vocab = Vocab.from_kv(model.gguf_kv, str(path))
            cp = target_ctx.cparams
            params = ContextParams(n_ctx=int(target_ctx.n_ctx()), n_batch=int(cp.n_batch), n_ubatch=int(cp.n_ubatch),
                                   n_seq_max=int(cp.n_seq_max), kv_unified=bool(cp.kv_unified),
                                   flash_attn=cp.flash_attn, n_threads=n_threads, n_threads_batch=n_threads)
            ctx = Context(model, params)
        except BaseException:
            model.close()
            raise
        d = cls(ctx, vocab, p_min)
        d.owned = (ctx, model)
        return d

    def close(self) -> None:
        for x in self.owned:
            x.close()
        self.owned = ()

    def bind(self, vocab: Any, n_vocab: int, n_seq: int) -> None:
        check_vocab_compatible(vocab, self.vocab)
        have = int(self.ctx.cparams.n_seq_max)
        if have < n_seq:
            raise ValueError(f"the draft context has {have} sequences; the target has {n_seq}")
        self.n_vocab_target = n_vocab

    def propose(self, reqs: Sequence[DraftRequest]) -> list[np.ndarray]:
        if not reqs:
            return []
        mine = [r.seq for r in reqs]
        try:
            try:
                rows = self._catch_up(reqs)
            except DecodeError as err:
                if err.code != 1:
                    raise
                self._forget([s for s in self.held if s not in mine] + mine)  # no room: start these over alone
                rows = self._catch_up(reqs)
            return self._draft(reqs, rows)
        except DecodeError:
            self._forget(mine)  # (its cells and ``held`` may disagree: these sequences start over next time)
            return [np.zeros(0, np.int32) for _ in reqs]

    # ------------------------------------------------------------------ the draft cache

    def _forget(self, seqs: Sequence[int]) -> None:
        for s in seqs:
            self.ctx.memory_seq_rm(s, -1, -1)
            self.held.pop(s, None)

    def _catch_up(self, reqs: Sequence[DraftRequest]) -> np.ndarray:
        """Make each request's sequence hold all its tokens (cells beyond their common prefix with what it held
        removed, the rest decoded, all requests in batches of n_batch); float32 [len(reqs), n_vocab] logits of
        each one's last token."""
        pieces = []
        for r in reqs:
            held = self.held.get(r.seq)
            keep = common_prefix(held, r.tokens, r.tokens.size - 1) if held is not None else 0
            if held is None or keep < held.size:
                self.ctx.memory_seq_rm(r.seq, keep, -1)
            pieces.append(r.tokens[keep:])
        n_batch = int(self.ctx.cparams.n_batch)
        done = [0] * len(reqs)  # tokens of each piece decoded so far
        rows: list[np.ndarray | None] = [None] * len(reqs)
        while any(d < p.size for d, p in zip(done, pieces)):
            toks, seqs, flags, lasts, left = [], [], [], [], n_batch
            for i, (r, p) in enumerate(zip(reqs, pieces)):
                take = min(p.size - done[i], left)
                if take <= 0:
                    continue
                toks.append(p[done[i]:done[i] + take])
                seqs.append(np.full(take, r.seq, np.int32))
                f = np.zeros(take, np.int8)
                if done[i] + take == p.size:
                    f[-1] = 1
                    lasts.append(i)
                flags.append(f)
                done[i] += take
                left -= take
            logits = self.ctx.decode(Batch(token=np.concatenate(toks), seq_id=np.concatenate(seqs),
                                           logits=np.concatenate(flags)))
            for i, row in zip(lasts, logits):
                rows[i] = row
        for r in reqs:
            self.held[r.seq] = r.tokens.copy()
        return np.stack(rows)

    def _draft(self, reqs: Sequence[DraftRequest], rows: np.ndarray) -> list[np.ndarray]:
        """Greedy drafts for all requests at once from the logits of their last tokens (module docstring)."""
        drafts: list[list[int]] = [[] for _ in reqs]
        live = np.arange(len(reqs))
        while live.size:
            top, p = _best(rows)
            go = []
            for j, i in enumerate(live.tolist()):
                t = int(top[j])
                if t >= self.n_vocab_target:
                    continue  # (an id the target does not have: the draft ends before it)
                drafts[i].append(t)
                if len(drafts[i]) < reqs[i].n_max and p[j] >= self.p_min:
                    go.append(j)
            if not go:
                break
            live = live[go]
            toks = top[go].astype(np.int32)
            rows = self.ctx.decode(Batch(token=toks, seq_id=np.array([reqs[i].seq for i in live], np.int32),
                                         logits=np.ones(toks.size, np.int8)))
            for i, t in zip(live.tolist(), toks.tolist()):
                self.held[reqs[i].seq] = np.append(self.held[reqs[i].seq], np.int32(t))
        return [np.array(d, np.int32) for d in drafts]


def _best(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the best token (ties to the lowest id) and its probability among the ``_DRAFT_TOP_K`` best
    logits (softmax at temperature 1)."""
    top = np.argmax(rows, axis=1)
    k = min(_DRAFT_TOP_K, rows.shape[1])
    best = np.partition(rows, rows.shape[1] - k, axis=1)[:, -k:].astype(np.float64)
    m = best.max(axis=1, keepdims=True)
    p = 1.0 / np.exp(best - m).sum(axis=1)
    return top, p


# ---------------------------------------------------------------------------------------------- command lines

def add_spec_args(ap: ArgumentParser) -> None:
    """The speculative decoding options of ``serve`` and ``generate`` (llama-server's names and defaults, but
    ``--draft-p-min``'s)."""
    ap.add_argument("--model-draft", "-md", type=Path, default=None,
                    help="draft model for speculative decoding, with the model's vocabulary (default: none)")
    ap.add_argument("--spec-ngram", action="store_true",
                    help="speculative decoding without a draft model: drafts looked up in the request's own tokens")
    ap.add_argument("--spec-ngram-min", type=int, default=2,
                    help="--spec-ngram: shortest n-gram that counts as a match (default %(default)s)")
    ap.add_argument("--spec-ngram-max", type=int, default=8,
                    help="--spec-ngram: longest n-gram looked for (default %(default)s)")
    ap.add_argument("--draft-max", "--draft", "--draft-n", type=int, default=16,
                    help="most draft tokens per request and step (default %(default)s)")
    ap.add_argument("--draft-min", "--draft-n-min", type=int, default=0,
                    help="a shorter draft is not verified (default %(default)s)")
    ap.add_argument("--draft-p-min", type=float, default=0.8,
                    help="-md: drafting stops after a token less likely than this (default %(default)s)")


def check_spec_args(ap: ArgumentParser, a: Namespace) -> None:
    """``ap.error`` (the value and its limit named) for speculative options out of range."""
    if a.draft_max < 1:
        ap.error(f"--draft-max must be >= 1, got {a.draft_max}")
    if not 0 <= a.draft_min <= a.draft_max:
        ap.error(f"--draft-min must be in [0, --draft-max = {a.draft_max}], got {a.draft_min}")
    if not 0.0 <= a.draft_p_min <= 1.0:
        ap.error(f"--draft-p-min must be in [0, 1], got {a.draft_p_min}")
    if not 1 <= a.spec_ngram_min <= a.spec_ngram_max:
        ap.error(f"--spec-ngram-min must be >= 1 and <= --spec-ngram-max, got {a.spec_ngram_min} and "
                 f"{a.spec_ngram_max}")
    if a.model_draft is not None and a.spec_ngram:
        ap.error("--model-draft and --spec-ngram: choose one drafter")
    if a.model_draft is not None and not a.model_draft.is_file():
        ap.error(f"--model-draft {a.model_draft}: no such file")


def open_drafter(a: Namespace, target_ctx: Any) -> "Drafter | None":
    """The drafter the checked options ask for (None: no speculative decoding); a :class:`ModelDrafter` owns its
    model and context (:func:`close_drafter`)."""
    if a.spec_ngram:
        return NgramDrafter(a.spec_ngram_min, a.spec_ngram_max)
    if a.model_draft is not None:
        return ModelDrafter.open(a.model_draft, target_ctx, a.draft_p_min, a.threads)
    return None


def close_drafter(d: Any) -> None:
    """Free what a drafter from :func:`open_drafter` owns (nothing for None or an n-gram drafter)."""
    if isinstance(d, ModelDrafter):
        d.close()

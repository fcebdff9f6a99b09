"""The prefix cache proper: :class:`PrefixCache` over a runtime :class:`~kvcache_ggml.runtime.context.Context`.

See the package docstring (:mod:`kvcache_ggml.prefix`) for the design.  This module holds the value objects, the
lookup (:meth:`PrefixCache.match`), the request API (:meth:`~PrefixCache.admit`, :meth:`~PrefixCache.step`,
:meth:`~PrefixCache.extend`, :meth:`~PrefixCache.release`, :meth:`~PrefixCache.free_seq`) and eviction to the host
tier; the memory operations that keep the index in step with the cells live in :mod:`.ops`, the consistency check
in :mod:`.audit`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..batch import Batch
from ..runtime.context import DecodeError
from .host import HostEntry, HostParams, HostTier
from .ops import MemoryOpsMixin
from .policy import Candidate, EvictionPolicy, LRUPolicy, Retention, effective_priority
from .stats import PrefixStats
from .tree import RadixTree, as_tokens

__all__ = ["PrefixCache", "PrefixParams", "SeqEntry", "Match", "Admission"]

_perf = time.perf_counter


@dataclass(slots=True)
class PrefixParams:
    """How a prefix cache reuses, evicts and keeps sequences."""

    reuse: bool = True                                           # reuse cached prefixes; False: decode every prompt
    min_reuse: int = 1                                           # shortest prefix worth reusing, in tokens
    host: HostParams = field(default_factory=HostParams)         # host tier budgets (all 0: no host tier)
    policy: EvictionPolicy = field(default_factory=LRUPolicy)   # victim choice, device sequences and host blobs
    clock: Callable[[], float] = time.monotonic                  # seconds, for retention durations

    def check(self) -> None:
        if self.min_reuse < 1:
            raise ValueError(f"min_reuse must be >= 1 token, got {self.min_reuse}")
        self.host.check()


@dataclass(slots=True, eq=False)
class SeqEntry:
    """A sequence of the cache that the prefix cache indexes."""

    seq_id: int                      # the cache's sequence id
    stream: int                      # the stream holding it
    tokens: np.ndarray               # int32 [n]: token p sits at position p, in the cell a fresh decode would fill
    clean: bool = True               # no cell of the sequence lies beyond ``tokens`` (decoding more extends them)
    active: bool = True              # a request owns it (never evicted); False once released
    last_used: int = 0               # tick of its last use
    retention: Retention = field(default_factory=Retention)  # how strongly it is kept once released
    since: float = 0.0               # clock time the retention started

    def __repr__(self) -> str:
        state = "active" if self.active else "parked"
        return f"<seq {self.seq_id} (stream {self.stream}) {self.tokens.size} tokens, {state}" \
               f"{'' if self.clean else ', tail'}>"


@dataclass(slots=True)
class Match:
    """The longest cached prefix of a token list."""

    n_tokens: int = 0                # length of the prefix (0: nothing cached)
    tier: str = "none"               # "device" (a sequence in the cache), "host" (a saved blob) or "none"
    seq_id: int = -1                 # device: the sequence holding the prefix
    stream: int = -1                 # device: its stream
    entry: Any = None                # the SeqEntry or HostEntry

    @property
    def positions(self) -> range:
        """The positions the prefix occupies in the holding sequence."""
        return range(self.n_tokens)


@dataclass(slots=True)
class Admission:
    """What :meth:`PrefixCache.admit` did for one request."""

    seq_id: int              # the sequence now holding the request
    n_prompt: int            # tokens asked for
    n_reused: int            # of them taken from the cache
    n_decoded: int           # of them decoded
    source: str              # "own" (the sequence itself), "device" (seq_cp), "host" (state_load) or "none"
    source_seq: int          # device: the sequence copied from; else -1
    logits: np.ndarray | None  # float32 [n_vocab] of the last token ([n_decoded, n_vocab] with logits_all;
                               # None from attach(), which decodes nothing)
    seconds: float           # wall time of the admit (time to first token)


def _common_prefix(a: np.ndarray, b: np.ndarray, limit: int) -> int:
    m = min(a.size, b.size, limit)
    neq = np.flatnonzero(a[:m] != b[:m])
    return int(neq[0]) if neq.size else m


class PrefixCache(MemoryOpsMixin):
    """A radix-tree index of the sequences in a context's KV cache, with eviction and a host tier."""

    def __init__(self, ctx: Any, params: PrefixParams | None = None, **kwargs: Any) -> None:
        if params is None:
            params = PrefixParams(**kwargs)
        elif kwargs:
            raise TypeError(f"pass either params or keyword arguments, not both: {sorted(kwargs)}")
        params.check()
        if ctx.closed:
            raise ValueError("the context is closed")
        self.ctx = ctx
        self.params = params
        self.n_seq = int(ctx.cparams.n_seq_max)       # sequence ids 0..n_seq-1 are the prefix cache's
        self.unified = ctx.kv.get_n_stream() == 1
        self.tree = RadixTree()
        self.seqs: dict[int, SeqEntry] = {}
        self.stats = PrefixStats()
        self.host = HostTier(params.host, self.stats, params.policy) if params.host.enabled() else None
        self._tick = 0

    # ------------------------------------------------------------------ lookup

    def match(self, tokens: Sequence[int], limit: int | None = None) -> Match:
        """The longest prefix of ``tokens`` (at most ``limit`` tokens) held by a cached sequence or host blob."""
        toks = self._tokens(tokens)
        if not self.params.reuse:
            return Match()
        while True:
            d, node = self.tree.match(toks, limit)
            if d < self.params.min_reuse:
                return Match()
            best = min(node.holders, key=_holder_rank)
            if isinstance(best, HostEntry):
                return Match(d, "host", entry=best)
            if self._audit(best):
                return Match(d, "device", best.seq_id, best.stream, best)

    # ------------------------------------------------------------------ requests

    def admit(self, tokens: Sequence[int], seq_id: int, *, retention: Retention | None = None,
              logits_all: bool = False) -> Admission:
        """Make ``seq_id`` hold ``tokens``: reuse the longest cached prefix (its own, ``seq_cp`` from another
        sequence, or a host blob), decode the rest, return the logits of the last token.

        The last token is always decoded (its logits are the answer).  The sequence is active until
        :meth:`release`.  Parked sequences are evicted as room is needed; ``DecodeError`` when none is left.
        """
        t0 = _perf()
        adm = self.attach(tokens, seq_id, retention=retention)
        e = self.seqs[seq_id]
        try:
            adm.logits = self._decode_into(e, self._tokens(tokens)[adm.n_reused:], logits_all)
        except BaseException:
            e.active = False  # what was decoded stays cached, parked
            self._settle(e)
            raise
        adm.seconds = _perf() - t0
        return adm

    def attach(self, tokens: Sequence[int], seq_id: int, *, retention: Retention | None = None) -> Admission:
        """The first half of :meth:`admit`: make ``seq_id`` hold the longest cached prefix of ``tokens`` (at most
        all but the last token) and mark it active, decoding nothing; ``logits`` is None and ``n_decoded`` the
        tokens left to decode (with :meth:`advance`, in chunks a serving loop chooses)."""
        t0 = _perf()
        toks = self._tokens(tokens)
        if toks.size == 0:
            raise ValueError("admit needs at least one token")
        self._check_seq(seq_id)
        own = self.seqs.get(seq_id)
        if own is not None and own.active:
            raise RuntimeError(f"sequence {seq_id} is serving a request; release() it first")
        if own is None and self.ctx.memory_seq_pos_max(seq_id) >= 0:
            own = self._adopt(seq_id)  # cells put there behind the prefix cache's back: removed below
        retention = retention or Retention()
        retention.check()
        self._tick += 1
        limit = toks.size - 1
        m = self.match(toks, limit)
        own_n = _common_prefix(own.tokens, toks, limit) if own is not None and self.params.reuse else 0
        if own is not None and own_n >= max(m.n_tokens, self.params.min_reuse):
            n, source, src = own_n, "own", seq_id
            self._truncate_seq(own, own_n)
            e = own
        else:
            if own is not None:
                self._retire(own, keep=True)
                m = self.match(toks, limit)  # the retirement may have changed the host tier
            e = SeqEntry(seq_id, self._stream_of(seq_id), toks[:0].copy())
            self.seqs[seq_id] = e
            n, source, src = self._reuse(m, e), m.tier, m.seq_id
        e.active, e.last_used, e.retention, e.since = True, self._tick, retention, self.params.clock()
        if n == 0:
            source, src = "none", -1
        st = self.stats
        st.requests += 1
        st.tokens_requested += toks.size
        st.tokens_reused += n
        st.hits_device += source in ("own", "device")
        st.hits_host += source == "host"
        st.misses += source == "none"
        return Admission(seq_id, toks.size, n, toks.size - n, source, src, None, _perf() - t0)

    def extend(self, seq_id: int, tokens: Sequence[int], logits_all: bool = False) -> np.ndarray:
        """Decode more tokens into an active sequence; the logits of the last (or of every) token."""
        e = self._active(seq_id)
        toks = self._tokens(tokens)
        if toks.size == 0:
            raise ValueError("extend needs at least one token")
        self._tick += 1
        e.last_used = self._tick
        return self._decode_into(e, toks, logits_all)

    def step(self, seq_ids: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """One generation step: token i appended to active sequence ``seq_ids[i]``, all in one batch; float32
        [len(seq_ids), n_vocab] logits."""
        ids = np.asarray(seq_ids, np.int32).reshape(-1)
        toks = self._tokens(tokens)
        if ids.size != toks.size or ids.size == 0 or np.unique(ids).size != ids.size:
            raise ValueError(f"step needs one token for each of distinct sequences, got {toks.size} tokens for "
                             f"sequences {ids.tolist()}")
        entries = [self._active(int(s)) for s in ids.tolist()]
        self._tick += 1
        logits = self._decode(Batch(token=toks, seq_id=ids, logits=np.ones(ids.size, np.int8)),
                              {e.stream for e in entries})
        for k, e in enumerate(entries):
            e.last_used = self._tick
            if e.clean:
                self._append(e, toks[k:k + 1])
        self.stats.tokens_decoded += ids.size
        return logits

    def advance(self, parts: Sequence[tuple[int, Sequence[int], bool]]) -> list[np.ndarray | None]:
        """Decode several active sequences' next tokens in one batch: ``parts`` are (seq_id, tokens, want_logits)
        for distinct sequences, each part's tokens following what its sequence holds; returns, per part, the
        float32 [n_vocab] logits of its last token (a row of the decode's new array) or None.  A serving loop mixes
        one-token generation steps and chunks of prompts this way.  The batch must fit n_batch; parked sequences are
        evicted while the cache has no slot for it (``DecodeError`` when none is left, nothing changed)."""
        if not parts:
            raise ValueError("advance needs at least one part")
        entries, chunks = [], []
        for seq_id, tokens, _ in parts:
            toks = self._tokens(tokens)
            if toks.size == 0:
                raise ValueError(f"advance: sequence {seq_id} has no tokens")
            entries.append(self._active(int(seq_id)))
            chunks.append(toks)
        if len({e.seq_id for e in entries}) != len(entries):
            raise ValueError(f"advance needs distinct sequences, got {[int(p[0]) for p in parts]}")
        sizes = np.array([c.size for c in chunks])
        n = int(sizes.sum())
        if n > self.ctx.cparams.n_batch:
            raise ValueError(f"advance: {n} tokens exceed n_batch = {self.ctx.cparams.n_batch}")
        ends = np.cumsum(sizes) - 1
        flags = np.zeros(n, np.int8)
        want = np.array([bool(p[2]) for p in parts])
        flags[ends[want]] = 1
        seq = np.repeat(np.array([e.seq_id for e in entries], np.int32), sizes)
        self._tick += 1
        logits = self._decode(Batch(token=np.concatenate(chunks), seq_id=seq, logits=flags),
                              {e.stream for e in entries})
        for e, c in zip(entries, chunks):
            e.last_used = self._tick
            if e.clean:
                self._append(e, c)
        self.stats.tokens_decoded += n
        rows = iter(logits)  # (the decode's own new array: its rows need no copy)
        return [next(rows) if w else None for w in want.tolist()]

    def release(self, seq_id: int) -> None:
        """The request on ``seq_id`` is done: its sequence stays cached (parked) until evicted."""
        e = self._active(seq_id)
        e.active = False
        self._tick += 1
        e.last_used = self._tick
        if e.tokens.size == 0 and self.ctx.memory_seq_pos_max(seq_id) < 0:
            self._drop_entry(e)

    def free_seq(self, exclude: Sequence[int] = ()) -> int:
        """A sequence id holding nothing, evicting a parked sequence (by the policy) when none is free."""
        skip = set(exclude)
        for s in range(self.n_seq):
            if s not in self.seqs and s not in skip:
                if self.ctx.memory_seq_pos_max(s) < 0:
                    return s
                self._adopt(s)
        victim = self._victim([e for e in self.seqs.values() if not e.active and e.seq_id not in skip])
        if victim is None:
            raise ValueError(f"no free sequence: all {self.n_seq} sequences serve requests")
        self._retire(victim, keep=True)
        return victim.seq_id

    def pick_seq(self, tokens: Sequence[int]) -> int:
        """The sequence a server should admit ``tokens`` on: a parked sequence whose whole content the request
        extends (reused in place), else a free (or freed) sequence -- never the best holder of its prefix."""
        toks = self._tokens(tokens)
        m = self.match(toks, toks.size - 1)
        holder = m.entry if m.tier == "device" and not m.entry.active else None
        if holder is not None and m.n_tokens == holder.tokens.size:
            return m.seq_id
        try:
            return self.free_seq(exclude=[m.seq_id] if m.tier == "device" else [])
        except ValueError:
            if holder is None:
                raise
            return m.seq_id  # the only parked sequence: reused in place, its tail cut

    def evict(self, seq_id: int, keep: bool = True) -> None:
        """Evict the parked sequence ``seq_id`` now (kept as a host blob when ``keep`` and a host tier exists)."""
        e = self.seqs.get(seq_id)
        if e is None:
            raise ValueError(f"sequence {seq_id} is not cached")
        if e.active:
            raise RuntimeError(f"sequence {seq_id} is serving a request; release() it first")
        self._retire(e, keep)

    # ------------------------------------------------------------------ inspection

    def entries(self) -> list[SeqEntry]:
        return [self.seqs[s] for s in sorted(self.seqs)]

    def host_entries(self) -> list[HostEntry]:
        return self.host.entries() if self.host is not None else []

    def tree_text(self, max_tokens: int = 6) -> str:
        return self.tree.render(_label, max_tokens)

    def close(self) -> None:
        """Delete the host tier's files (the context stays open: its owner closes it)."""
        if self.host is not None:
            for h in self.host.entries():
                self.tree.remove(h, h.tokens)
            self.host.close()

    def __repr__(self) -> str:
        n_act = sum(e.active for e in self.seqs.values())
        return (f"<PrefixCache {len(self.seqs)} sequences ({n_act} active), {len(self.host_entries())} host "
                f"blobs, {sum(1 for _ in self.tree.nodes()) - 1} tree nodes>")

    # ------------------------------------------------------------------ reuse and decoding

    def _reuse(self, m: Match, e: SeqEntry) -> int:
        """Give the (empty) sequence of ``e`` the prefix found by ``m``; the tokens reused."""
        n, s = m.n_tokens, e.seq_id
        if m.tier == "device":
            src: SeqEntry = m.entry
            src.last_used = self._tick
            if src.stream == e.stream:
                self.ctx.memory_seq_cp(src.seq_id, s, 0, n)
            else:
                self._stream_copy(src.seq_id, s)
                if self.ctx.memory_seq_pos_max(s) >= n:
                    self.ctx.memory_seq_rm(s, n, -1)
        elif m.tier == "host":
            if not self._restore(m.entry, e):
                return 0
            if m.entry.tokens.size > n:
                self.ctx.memory_seq_rm(s, n, -1)
        if n:
            self._set_tokens(e, m.entry.tokens[:n].copy())
        e.clean = self.ctx.memory_seq_pos_max(s) + 1 == n
        return n

    def _restore(self, h: HostEntry, e: SeqEntry) -> bool:
        """Load blob ``h`` into the sequence of ``e``, evicting parked sequences for room; False if impossible."""
        need = h.tokens.size
        while self._free_cells(e.stream) < need:
            v = self._victim([x for x in self.seqs.values() if not x.active and x.stream == e.stream])
            if v is None:
                return False
            self._retire(v, keep=True)
        try:
            if h.blob is not None:
                self.ctx.state_seq_set_data(h.blob, e.seq_id)
            else:
                got = self.ctx.state_seq_load_file(h.path, e.seq_id)
                self.stats.disk_reads += 1
                if not np.array_equal(got, h.tokens):
                    raise ValueError(f"{h.path} holds other tokens than its host entry")
        except (ValueError, OSError):
            self.ctx.memory_seq_rm(e.seq_id, -1, -1)
            self.tree.remove(h, h.tokens)
            self.host.drop(h)
            return False
        h.last_used = self._tick
        self.stats.host_restores += 1
        return True

    def _decode_into(self, e: SeqEntry, toks: np.ndarray, logits_all: bool) -> np.ndarray:
        """Decode ``toks`` into the sequence of ``e`` in n_batch chunks (the tokens join ``e`` if it is clean)."""
        n_batch = self.ctx.cparams.n_batch
        rows = []
        for i in range(0, toks.size, n_batch):
            chunk = toks[i:i + n_batch]
            flags = np.zeros(chunk.size, np.int8)
            if logits_all:
                flags[:] = 1
            elif i + n_batch >= toks.size:
                flags[-1] = 1
            out = self._decode(Batch(token=chunk, seq_id=np.full(chunk.size, e.seq_id, np.int32), logits=flags),
                               {e.stream})
            rows.append(out.copy())
            if e.clean:
                self._append(e, chunk)
            self.stats.tokens_decoded += chunk.size
        return np.concatenate(rows) if logits_all else rows[-1][-1]

    def _decode(self, batch: Batch, streams: set[int]) -> np.ndarray:
        """ctx.decode, evicting parked sequences of ``streams`` while the cache has no slot for the batch."""
        while True:
            try:
                return self.ctx.decode(batch)
            except DecodeError as err:
                if err.code != 1:
                    raise
                v = self._victim([e for e in self.seqs.values() if not e.active and e.stream in streams])
                if v is None:
                    raise
                self._retire(v, keep=True)

    # ------------------------------------------------------------------ eviction

    def _victim(self, pool: list[SeqEntry]) -> SeqEntry | None:
        if not pool:
            return None
        now = self.params.clock()
        cands = [Candidate(e, e.tokens.size, 0, e.last_used,
                           effective_priority(e.retention.priority, e.since, e.retention.duration, now))
                 for e in pool]
        return self.params.policy(cands).entry

    def _retire(self, e: SeqEntry, keep: bool) -> None:
        """Remove the sequence of ``e`` from the cache, first saving its prefix as a host blob when ``keep``, a
        host tier exists and no other entry holds the same tokens."""
        s = e.seq_id
        if keep and self.host is not None and e.tokens.size and not self._covered(e):
            if self.ctx.memory_seq_pos_max(s) >= e.tokens.size:
                self.ctx.memory_seq_rm(s, e.tokens.size, -1)  # the blob holds the indexed prefix only
            blob = self.ctx.state_seq_get_data(s)
            now = self.params.clock()
            h, dropped = self.host.put(e.tokens, blob, self._tick, e.retention, e.since, now)
            for d in dropped:
                self.tree.remove(d, d.tokens)
            if h is not None:
                self.stats.host_saves += 1
                for old in self.tree.ends_along(h.tokens):
                    if isinstance(old, HostEntry):  # a shorter blob of the same tokens: superseded
                        self.tree.remove(old, old.tokens)
                        self.host.drop(old)
                self.tree.insert(h, h.tokens)
        self.ctx.memory_seq_rm(s, -1, -1)
        self._drop_entry(e)
        self.stats.evictions += 1

    def _covered(self, e: SeqEntry) -> bool:
        """Another entry (device or host) holds all the tokens of ``e``."""
        d, node = self.tree.match(e.tokens)
        return d == e.tokens.size and any(h is not e for h in node.holders)

    # ------------------------------------------------------------------ entries

    def _set_tokens(self, e: Any, tokens: np.ndarray) -> None:
        if e in self.tree:
            self.tree.remove(e, e.tokens)
        e.tokens = tokens
        if tokens.size:
            self.tree.insert(e, tokens)

    def _append(self, e: SeqEntry, more: np.ndarray) -> None:
        """``e`` now also holds ``more`` after its tokens."""
        old = e.tokens
        e.tokens = np.concatenate([old, more])
        if old.size:
            self.tree.extend(e, old, more)
        else:
            self.tree.insert(e, e.tokens)

    def _drop_entry(self, e: SeqEntry) -> None:
        if e in self.tree:
            self.tree.remove(e, e.tokens)
        del self.seqs[e.seq_id]

    def _adopt(self, s: int) -> SeqEntry:
        """An entry for a sequence found in the cache without one (content unknown: nothing indexed)."""
        e = SeqEntry(s, self._stream_of(s), np.zeros(0, np.int32), clean=False, active=False,
                     last_used=self._tick)
        self.seqs[s] = e
        return e

    def _audit(self, e: SeqEntry) -> bool:
        """Cheap check of an entry against its cells (seq_pos_min/max); a stale entry is emptied."""
        n = e.tokens.size
        pmin, pmax = self.ctx.memory_seq_pos_min(e.seq_id), self.ctx.memory_seq_pos_max(e.seq_id)
        if n == 0 or (pmin == 0 and pmax >= n - 1 and (not e.clean or pmax == n - 1)):
            return True
        self.stats.stale += 1
        self._set_tokens(e, e.tokens[:0])
        self._settle(e)
        return False

    def _active(self, seq_id: int) -> SeqEntry:
        e = self.seqs.get(seq_id)
        if e is None or not e.active:
            raise RuntimeError(f"sequence {seq_id} serves no request (admit() it first)")
        return e

    def _check_seq(self, seq_id: int) -> None:
        if not 0 <= seq_id < self.n_seq:
            raise ValueError(f"seq_id {seq_id} out of range [0, {self.n_seq})")

    def _stream_of(self, seq_id: int) -> int:
        return 0 if self.unified else seq_id

    def _free_cells(self, stream: int) -> int:
        cells = self.ctx.kv.v_cells[stream]
        return cells.size() - cells.get_used()

    def _tokens(self, tokens: Any) -> np.ndarray:
        toks = as_tokens(tokens)
        if toks.size and int(toks.max()) >= self.ctx.n_vocab:
            raise ValueError(f"token id {int(toks.max())} out of range [0, n_vocab={self.ctx.n_vocab})")
        return toks


def _holder_rank(h: Any) -> tuple:
    """Device sequences first (most recent first), then RAM blobs, then disk blobs."""
    if isinstance(h, SeqEntry):
        return (0, -h.last_used, h.seq_id)
    return (1 if h.blob is not None else 2, -h.last_used, h.key)


def _label(h: Any) -> str:
    if isinstance(h, SeqEntry):
        return f"seq {h.seq_id}{'*' if h.active else ''}"
    return f"host #{h.key}{'' if h.blob is not None else ' (disk)'}"

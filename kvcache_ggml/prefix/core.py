"""The prefix cache proper: :class:`PrefixCache` over a runtime :class:`~kvcache_ggml.runtime.context.Context`.

See the package docstring (:mod:`kvcache_ggml.prefix`) for the design.  This module holds the lookup
(:meth:`PrefixCache.match`), the request API (:meth:`~PrefixCache.attach`, :meth:`~PrefixCache.advance`,
:meth:`~PrefixCache.release`), the choice of sequences (:meth:`~PrefixCache.pick_seq`,
:meth:`~PrefixCache.free_seq`), room in the cache (:meth:`~PrefixCache.claim`, :meth:`~PrefixCache.evict`) and
eviction to the host tier.  The entries, the tree and the memory operations that keep them in step with the cells
are a :class:`~kvcache_ggml.prefix.index.SeqIndex` (:mod:`.index`); the consistency check is :mod:`.audit`; the value
objects are in :mod:`.values`.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Any, Collection, Mapping, Sequence

import numpy as np

from ..batch import Batch
from ..runtime.context import DecodeError
from ..runtime.fa_tiles import FaTiles
from .host import HostEntry, HostTier
from .index import SeqEntry, SeqIndex
from .policy import Candidate, Retention, effective_priority
from .reuse import ReusePlan, plan_chunks
from .stats import PrefixStats
from .tree import RadixTree, common_prefix
from .values import Admission, Match, PrefixParams

__all__ = ["PrefixCache", "PrefixParams", "Match", "Admission"]


class PrefixCache:
    """A radix-tree index of the sequences in a context's KV cache, with eviction and a host tier.

    One request API: :meth:`attach` gives a sequence the longest cached prefix of a prompt, :meth:`advance` decodes
    chunks of several active sequences in one batch (prompt pieces and generated tokens alike), :meth:`release`
    parks the sequence.  Memory operations (``seq_rm`` ... ``state_load``) go through the index."""

    def __init__(self, ctx: Any, params: PrefixParams | None = None, **kwargs: Any) -> None:
        if params is None:
            params = PrefixParams(**kwargs)
        elif kwargs:
            raise TypeError(f"pass either params or keyword arguments, not both: {sorted(kwargs)}")
        params.check()
        if ctx.closed:
            raise ValueError("the context is closed")
        self.ctx = ctx                       # the runtime Context whose sequences this cache owns
        self.params = params                 # reuse, eviction and host-tier settings
        self.index = SeqIndex(ctx)           # the entries, their tree and the memory operations
        self.stats = PrefixStats()           # counters (print(pc.stats))
        self.host = HostTier(params.host, self.stats, params.policy) if params.host.enabled() else None

    @property
    def seqs(self) -> dict[int, SeqEntry]:
        """Sequence id -> its entry, for every sequence the cache knows (active or parked)."""
        return self.index.seqs

    @property
    def tree(self) -> RadixTree:
        """The radix tree of the entries (device sequences and host blobs)."""
        return self.index.tree

    @property
    def n_seq(self) -> int:
        """Sequence ids 0..n_seq-1 are the prefix cache's."""
        return self.index.n_seq

    @property
    def unified(self) -> bool:
        """One stream holds every sequence (``kv_unified``)."""
        return self.index.unified

    def stream_of(self, seq_id: int) -> int:
        """The stream holding sequence ``seq_id`` (0 in a unified cache): tokens meant for sequences of one stream
        compete for its cells."""
        self.index.check_seq(seq_id)
        return self.index.stream_of(seq_id)

    # ------------------------------------------------------------------ lookup

    def match(self, tokens: Sequence[int], limit: int | None = None) -> Match:
        """The longest prefix of ``tokens`` (at most ``limit`` tokens) held by a cached sequence or host blob."""
        toks = self.index.check_tokens(tokens)
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

    def attach(self, tokens: Sequence[int], seq_id: int, *, retention: Retention | None = None,
               n_cache_reuse: int = 0, reuse: bool = True) -> Admission:
        """Make ``seq_id`` hold the longest cached prefix of ``tokens`` (its own, ``seq_cp`` from another sequence,
        or a host blob; at most all but the last token) and mark it active, decoding nothing: ``n_decoded`` of the
        admission is the tokens left to decode with :meth:`advance` (in chunks the caller chooses; the last one's
        logits are the answer).  The sequence is active until :meth:`release`.  Its own content reused in place
        but cut to under half is first saved whole to the host tier (llama-server's ``--cache-ram`` rule).

        ``n_cache_reuse`` N > 0 (llama-server's ``--cache-reuse``): after the common prefix of the sequence's own
        tokens, runs of at least N of them that reappear in the prompt are moved into place by K-shift
        (:mod:`.reuse`) and count as reused; the sequence is then indexed as holding the prompt's first
        ``n_reused`` tokens (offered to later requests, as llama-server's slot offers them).

        ``reuse=False``: nothing cached is reused for this request (as with ``PrefixParams.reuse`` off): the sequence
        is emptied (its own content kept as a host blob like any retired sequence) and the whole prompt is left to
        decode -- a result that does not depend on what the cache held (llama-server's ``cache_prompt: false``)."""
        toks = self.index.check_tokens(tokens)
        if toks.size == 0:
            raise ValueError("attach needs at least one token")
        self.index.check_seq(seq_id)
        self._check_reuse(n_cache_reuse)
        own = self.seqs.get(seq_id)
        if own is not None and own.active:
            raise RuntimeError(f"sequence {seq_id} is serving a request; release() it first")
        if own is None and self.ctx.memory_seq_pos_max(seq_id) >= 0:
            own = self.index.adopt(seq_id)  # cells put there behind the prefix cache's back: removed below
        retention = retention or Retention()
        retention.check()
        tick = self._touch()
        limit = toks.size - 1
        m = self.match(toks, limit) if reuse else Match()
        own_n = common_prefix(own.tokens, toks, limit) if own is not None and self.params.reuse and reuse else 0
        plan, shifted = self._chunk_plan(own, toks, n_cache_reuse) if reuse else None, 0
        if plan is not None and min(plan.n_reused, limit) >= max(m.n_tokens, self.params.min_reuse, own_n + 1):
            n, source, src = self._shift_chunks(own, toks, plan), "own", seq_id
            shifted, e = plan.n_shifted - (plan.n_reused - n), own
        elif own is not None and own_n >= max(m.n_tokens, self.params.min_reuse):
            if 2 * own_n < own.tokens.size:  # (llama-server saves a slot to --cache-ram when f_keep < 0.5)
                self._save_host(own)
            n, source, src = own_n, "own", seq_id
            self.index.truncate(own, own_n)
            e = own
        else:
            if own is not None:
                self._retire(own, keep=True)
                m = self.match(toks, limit) if reuse else m  # the retirement may have changed the host tier
            e = SeqEntry(seq_id, self.index.stream_of(seq_id), toks[:0].copy())
            self.seqs[seq_id] = e
            n, source, src = self._reuse(m, e), m.tier, m.seq_id
        e.active, e.last_used, e.retention, e.since = True, tick, retention, self.params.clock()
        if n == 0:
            source, src = "none", -1
        st = self.stats
        st.requests += 1
        st.tokens_requested += toks.size
        st.tokens_reused += n
        st.tokens_shifted += shifted
        st.hits_device += source in ("own", "device")
        st.hits_host += source == "host"
        st.misses += source == "none"
        return Admission(seq_id, toks.size, n, toks.size - n, source, src, shifted)

    def advance(self, parts: Sequence[tuple[int, Sequence[int], bool]],
                all_rows: Collection[int] = (), tiles: FaTiles | None = None) -> list[np.ndarray | None]:
        """Decode several active sequences' next tokens in one batch: ``parts`` are (seq_id, tokens, want_logits)
        for distinct sequences, each part's tokens following what its sequence holds; returns, per part, the
        float32 [n_vocab] logits of its last token (a row of the decode's new array) or None; the parts whose
        index is in ``all_rows`` get the [n, n_vocab] logits of all their n tokens instead (a draft's
        verification).  A serving loop mixes one-token generation steps and chunks of prompts this way.  The batch
        must fit n_batch; parked sequences are evicted while the cache has no slot for it (``DecodeError`` when none
        is left, nothing changed).  With ``tiles`` (:class:`~kvcache_ggml.runtime.fa_tiles.FaTiles`), a step of
        fewer than 64 tokens may get throwaway tokens after the last part's, their cells removed after the decode:
        the real tokens are computed as in a 64-token step (flash attention in tiles), what the cache holds after
        is the same; ``stats.padded_steps`` / ``padded_rows`` count them."""
        one = parts[0][1] if len(parts) == 1 and not all_rows and parts[0][2] else None
        if isinstance(one, np.ndarray) and one.size == 1:  # (a request generating alone: fewer calls, same step)
            return [self.advance_token(parts[0][0], one)]
        if not parts:
            raise ValueError("advance needs at least one part")
        every = sorted({int(i) for i in all_rows}) if all_rows else []
        if every and not 0 <= every[0] <= every[-1] < len(parts):
            raise ValueError(f"advance: all_rows {every} out of range [0, {len(parts)})")
        entries, chunks = [], []
        for seq_id, tokens, _ in parts:
            toks = self.index.check_tokens(tokens)
            if toks.size == 0:
                raise ValueError(f"advance: sequence {seq_id} has no tokens")
            entries.append(self._active(int(seq_id)))
            chunks.append(toks)
        if len({e.seq_id for e in entries}) != len(entries):
            raise ValueError(f"advance needs distinct sequences, got {[int(p[0]) for p in parts]}")
        sizes = [c.size for c in chunks]  # (lists, not arrays: a step has few parts, most of one token)
        n = sum(sizes)
        if n > self.ctx.cparams.n_batch:
            raise ValueError(f"advance: {n} tokens exceed n_batch = {self.ctx.cparams.n_batch}")
        ends = list(accumulate(sizes))  # (one past each part's last token)
        want = [bool(p[2]) for p in parts]
        if n == len(parts) and all(want):  # (a generating step: one token a part, every one an output)
            flags = np.ones(n, np.int8)
        else:
            flags = np.zeros(n, np.int8)
            for i in every:
                flags[ends[i] - sizes[i]:ends[i]] = 1
                want[i] = True
            flags[[ends[i] - 1 for i in range(len(parts)) if want[i]]] = 1
        seq = np.array([e.seq_id for e in entries], np.int32)
        if n != len(parts):
            seq = np.repeat(seq, sizes)
        tokens = np.concatenate(chunks)
        pad, p_pad = (tiles.pad(self.ctx, [e.seq_id for e in entries], [e.stream for e in entries], sizes)
                      if tiles is not None and n > 1 else (0, 0))  # (one token is never padded)
        if pad:  # throwaway tokens after the last part's (no logits): the step reaches flash attention's tiles
            last = entries[-1]
            tokens = np.concatenate([tokens, np.full(pad, tokens[-1], np.int32)])
            seq = np.concatenate([seq, np.full(pad, last.seq_id, np.int32)])
            flags = np.concatenate([flags, np.zeros(pad, np.int8)])
        tick = self._touch()
        try:
            logits = self._decode(Batch(token=tokens, seq_id=seq, logits=flags), {e.stream for e in entries})
        finally:
            if pad:  # (after a failed decode, nothing is there to remove)
                self.ctx.memory_seq_rm(last.seq_id, p_pad, -1)
        if pad:
            self.stats.padded_steps += 1
            self.stats.padded_rows += pad
        for e, c in zip(entries, chunks):
            e.last_used = tick
            if e.clean:
                self.index.append(e, c)
        self.stats.tokens_decoded += n
        out: list[np.ndarray | None] = [None] * len(parts)  # (rows of the decode's own new array: no copy)
        k, full = 0, set(every)
        for i in range(len(parts)):
            if not want[i]:
                continue
            if i in full:
                out[i] = logits[k:k + sizes[i]]
                k += sizes[i]
            else:
                out[i] = logits[k]
                k += 1
        return out

    def advance_token(self, seq_id: int, token: Sequence[int]) -> np.ndarray:
        """``advance([(seq_id, token, True)])[0]`` for one token (a request generating alone), in fewer calls: the
        float32 [n_vocab] logits of the token, after the same checks, eviction and bookkeeping."""
        toks = self.index.check_tokens(token)
        if toks.size != 1:
            raise ValueError(f"advance_token: {toks.size} tokens, expected 1")
        e = self._active(int(seq_id))
        tick = self._touch()
        logits = self._decode(Batch(token=toks, seq_id=np.array([e.seq_id], np.int32), logits=np.ones(1, np.int8)),
                              {e.stream})
        e.last_used = tick
        if e.clean:
            self.index.append(e, toks)
        self.stats.tokens_decoded += 1
        return logits[0]

    def release(self, seq_id: int) -> None:
        """The request on ``seq_id`` is done: its sequence stays cached (parked) until evicted."""
        e = self._active(seq_id)
        e.active = False
        e.last_used = self._touch()
        if e.tokens.size == 0 and self.ctx.memory_seq_pos_max(seq_id) < 0:
            self.index.drop(e)

    # ------------------------------------------------------------------ sequences and room

    def free_seq(self, exclude: Sequence[int] = ()) -> int:
        """A sequence id holding nothing, evicting a parked sequence (by the policy) when none is free."""
        skip = set(exclude)
        for s in range(self.n_seq):
            if s not in self.seqs and s not in skip:
                if self.ctx.memory_seq_pos_max(s) < 0:
                    return s
                self.index.adopt(s)
        victim = self._victim([e for e in self.seqs.values() if not e.active and e.seq_id not in skip])
        if victim is None:
            raise ValueError(f"no free sequence: all {self.n_seq} sequences serve requests")
        self._retire(victim, keep=True)
        return victim.seq_id

    def pick_seq(self, tokens: Sequence[int], n_cache_reuse: int = 0) -> int:
        """The sequence a server should attach ``tokens`` to: a parked sequence whose whole content the request
        extends (reused in place), else a free (or freed) sequence -- never the best holder of its prefix.  With
        ``n_cache_reuse`` > 0, first the parked sequence whose chunks (:meth:`attach`) give the request more
        tokens than the longest cached prefix does (its content is rewritten in place, as llama-server's slot)."""
        toks = self.index.check_tokens(tokens)
        self._check_reuse(n_cache_reuse)
        m = self.match(toks, toks.size - 1)
        best, most = -1, m.n_tokens
        for e in self.seqs.values():
            plan = None if e.active else self._chunk_plan(e, toks, n_cache_reuse)
            if plan is not None and min(plan.n_reused, toks.size - 1) > most:
                best, most = e.seq_id, min(plan.n_reused, toks.size - 1)
        if best >= 0:
            return best
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

    def claim(self, need: Mapping[int, int], keep: Collection[int] = ()) -> bool:
        """Room for a batch before it is decoded: for each stream s, ``need[s]`` free cells, evicting parked
        sequences of that stream (by the policy, kept as host blobs where a host tier takes them; never an active
        one, never a sequence in ``keep``) until ``ctx.kv.get_size() - ctx.kv.get_used(s) >= need[s]``.  Whether
        every stream now has its room; the evictions done stay done.  A need beyond a stream's size evicts nothing
        (it can never fit).  ValueError for a stream or a count out of range, before any eviction."""
        n_stream, size = self.ctx.kv.get_n_stream(), self.ctx.kv.get_size()
        for s, n in need.items():
            if not 0 <= s < n_stream:
                raise ValueError(f"claim: stream {s} out of range [0, {n_stream})")
            if n < 0:
                raise ValueError(f"claim: stream {s} needs {n} cells, expected >= 0")
        kept = set(keep)
        return all([n <= size and self._make_room(s, int(n), kept) for s, n in need.items()])  # every stream tries

    # ------------------------------------------------------------------ memory operations (through the index)

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """``ctx.memory_seq_rm`` with the index cut to match."""
        return self.index.seq_rm(seq_id, p0, p1)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """``ctx.memory_seq_add`` with the index cut to match (every sequence sharing a moved cell)."""
        self.index.seq_add(seq_id, p0, p1, delta)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """``ctx.memory_seq_div`` with the index cut to match (every sequence sharing a moved cell)."""
        self.index.seq_div(seq_id, p0, p1, d)

    def seq_keep(self, seq_id: int) -> None:
        """``ctx.memory_seq_keep`` with the index cut to match."""
        self.index.seq_keep(seq_id)

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        """``ctx.memory_seq_cp``; the destination indexed as holding what it now holds of the source."""
        self.index.seq_cp(seq_id_src, seq_id_dst, p0, p1)

    def context_shift(self, seq_id: int, n_keep: int, n_discard: int, *, reindex: bool = False) -> None:
        """``ctx.context_shift`` with the index cut to match (every sequence sharing a moved cell).  ``reindex``
        (a server's context shift): a clean entry then holds its tokens less the discarded ones, at their new
        positions, with the K-shift applied at once -- as llama-server's slot keeps them, so the request's next
        tokens and a later request extend them (their K/V are a shifted cache's, not a fresh decode's)."""
        e = self.seqs.get(seq_id)
        old = e.tokens if reindex and e is not None and e.clean else None
        self.index.context_shift(seq_id, n_keep, n_discard)
        if old is not None and seq_id in self.seqs:
            self.ctx.memory_update()
            self.index.set_tokens(e, np.concatenate([old[:n_keep], old[n_keep + n_discard:]]))
            e.clean = self.ctx.memory_seq_pos_max(seq_id) + 1 == e.tokens.size

    def clear(self, data: bool = True) -> None:
        """``ctx.memory_clear``: every parked entry goes, active ones are emptied."""
        self.index.clear(data)

    def state_load(self, data: Any, seq_id: int = -1, tokens: Any = None) -> int:
        """Restore the whole cache (``seq_id`` -1) or one sequence from a blob, indexed as holding ``tokens`` when
        given (see :meth:`SeqIndex.state_load <kvcache_ggml.prefix.index.SeqIndex.state_load>`)."""
        return self.index.state_load(data, seq_id, tokens)

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
            src.last_used = self.index.tick
            if src.stream == e.stream:
                self.ctx.memory_seq_cp(src.seq_id, s, 0, n)
            else:
                self.index.stream_copy(src.seq_id, s)
                if self.ctx.memory_seq_pos_max(s) >= n:
                    self.ctx.memory_seq_rm(s, n, -1)
        elif m.tier == "host":
            if not self._restore(m.entry, e):
                return 0
            if m.entry.tokens.size > n:
                self.ctx.memory_seq_rm(s, n, -1)
        if n:
            self.index.set_tokens(e, m.entry.tokens[:n].copy())
        e.clean = self.ctx.memory_seq_pos_max(s) + 1 == n
        return n

    def _check_reuse(self, n_cache_reuse: int) -> None:
        """ValueError for a chunk size below 0, or above 0 on a memory that cannot shift positions."""
        if n_cache_reuse < 0:
            raise ValueError(f"n_cache_reuse must be >= 0 (0: off), got {n_cache_reuse}")
        if n_cache_reuse and not self.ctx.memory_can_shift():
            raise ValueError(f"n_cache_reuse {n_cache_reuse}: this memory cannot shift positions (an iSWA cache "
                             "whose sliding-window part is smaller than the whole cache: use swa_full), so no "
                             "chunk can be reused")

    def _chunk_plan(self, own: SeqEntry | None, toks: np.ndarray, n_cache_reuse: int) -> ReusePlan | None:
        """The chunks of the parked sequence of ``own`` that ``toks`` can take by K-shift; None without any."""
        if own is None or not n_cache_reuse or not self.params.reuse or own.tokens.size == 0:
            return None
        plan = plan_chunks(own.tokens, toks, common_prefix(own.tokens, toks, toks.size), n_cache_reuse)
        return plan if plan.moves else None

    def _shift_chunks(self, e: SeqEntry, toks: np.ndarray, plan: ReusePlan) -> int:
        """Apply ``plan`` to the sequence of ``e`` (llama-server's seq_rm of the gap, seq_add of the run, through
        the index; then the tail cut and the K-shift applied at once, so that no indexed cell has a shift
        pending); the tokens it now holds, indexed: the prompt's first ones, never its last."""
        s = e.seq_id
        for mv in plan.moves:
            self.index.seq_rm(s, mv.dst, mv.src)
            self.index.seq_add(s, mv.src, mv.src + mv.n, mv.delta)
        n = min(plan.n_reused, toks.size - 1)
        self.index.truncate(e, n)
        self.ctx.memory_update()
        self.index.set_tokens(e, toks[:n].copy())
        e.clean = self.ctx.memory_seq_pos_max(s) + 1 == n
        return n

    def _restore(self, h: HostEntry, e: SeqEntry) -> bool:
        """Load blob ``h`` into the sequence of ``e``, evicting parked sequences for room; False if impossible."""
        if not self._make_room(e.stream, h.tokens.size, set()):
            return False
        if h.blob is None and h.path is None:  # (the blobs saved to make the room dropped it from the host tier)
            return False
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
        h.last_used = self.index.tick
        self.stats.host_restores += 1
        return True

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

    def _make_room(self, stream: int, n: int, keep: set[int]) -> bool:
        """Evict parked sequences of ``stream`` (not those in ``keep``) until n cells are free; whether they are."""
        kv = self.ctx.kv
        while kv.get_size() - kv.get_used(stream) < n:
            v = self._victim([e for e in self.seqs.values()
                              if not e.active and e.stream == stream and e.seq_id not in keep])
            if v is None:
                return False
            self._retire(v, keep=True)
        return True

    def _victim(self, pool: list[SeqEntry]) -> SeqEntry | None:
        if not pool:
            return None
        now = self.params.clock()
        cands = [Candidate(e, e.tokens.size, 0, e.last_used,
                           effective_priority(e.retention.priority, e.since, e.retention.duration, now))
                 for e in pool]
        return self.params.policy(cands).entry

    def _retire(self, e: SeqEntry, keep: bool) -> None:
        """Remove the sequence of ``e`` from the cache, first saved (:meth:`_save_host`) when ``keep``."""
        if keep:
            self._save_host(e)
        self.ctx.memory_seq_rm(e.seq_id, -1, -1)
        self.index.drop(e)
        self.stats.evictions += 1

    def _save_host(self, e: SeqEntry) -> None:
        """Save the indexed prefix of ``e``'s sequence as a host blob, where a host tier exists and no other entry
        holds the same tokens; cells past the indexed tokens are removed first (the blob holds the prefix only)."""
        s = e.seq_id
        if self.host is not None and e.tokens.size and not self._covered(e):
            if self.ctx.memory_seq_pos_max(s) >= e.tokens.size:
                self.ctx.memory_seq_rm(s, e.tokens.size, -1)  # the blob holds the indexed prefix only
            blob = self.ctx.state_seq_get_data(s)
            h, dropped = self.host.put(e.tokens, blob, self.index.tick, e.retention, e.since, self.params.clock())
            for d in dropped:
                self.tree.remove(d, d.tokens)
            if h is not None:
                self.stats.host_saves += 1
                for old in self.tree.ends_along(h.tokens):
                    if isinstance(old, HostEntry):  # a shorter blob of the same tokens: superseded
                        self.tree.remove(old, old.tokens)
                        self.host.drop(old)
                self.tree.insert(h, h.tokens)

    def _covered(self, e: SeqEntry) -> bool:
        """Another entry (device or host) holds all the tokens of ``e``."""
        d, node = self.tree.match(e.tokens)
        return d == e.tokens.size and any(h is not e for h in node.holders)

    # ------------------------------------------------------------------ entries

    def _touch(self) -> int:
        """The next tick of the use counter (the entries' and blobs' ``last_used``)."""
        self.index.tick += 1
        return self.index.tick

    def _audit(self, e: SeqEntry) -> bool:
        """Cheap check of an entry against its cells (seq_pos_min/max); a stale entry is emptied."""
        n = e.tokens.size
        pmin, pmax = self.ctx.memory_seq_pos_min(e.seq_id), self.ctx.memory_seq_pos_max(e.seq_id)
        if n == 0 or (pmin == 0 and pmax >= n - 1 and (not e.clean or pmax == n - 1)):
            return True
        self.stats.stale += 1
        self.index.cut(e.seq_id, 0)
        return False

    def _active(self, seq_id: int) -> SeqEntry:
        e = self.seqs.get(seq_id)
        if e is None or not e.active:
            raise RuntimeError(f"sequence {seq_id} serves no request (attach() it first)")
        return e


def _holder_rank(h: Any) -> tuple:
    """Device sequences first (most recent first), then RAM blobs, then disk blobs."""
    if isinstance(h, SeqEntry):
        return (0, -h.last_used, h.seq_id)
    return (1 if h.blob is not None else 2, -h.last_used, h.key)


def _label(h: Any) -> str:
    if isinstance(h, SeqEntry):
        return f"seq {h.seq_id}{'*' if h.active else ''}"
    return f"host #{h.key}{'' if h.blob is not None else ' (disk)'}"

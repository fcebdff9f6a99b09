"""Prompt reuse: a radix-tree index of the sequences in a KV cache, eviction by policy, and a host-memory tier.

:class:`PrefixCache` sits on a runtime :class:`~kvcache_ggml.runtime.context.Context` and owns its sequence ids
(0..n_seq_max-1).  Requests come as token lists and go through one API: :meth:`PrefixCache.attach` finds the
longest prefix the cache already holds and reuses it; :meth:`PrefixCache.advance` decodes the rest -- chunks of
several sequences' prompts and their generated tokens, mixed in one batch, as a serving loop plans them;
:meth:`PrefixCache.release` parks the sequence.  :meth:`PrefixCache.claim` makes room for a batch before it is
decoded.

The tree
--------
:class:`~kvcache_ggml.prefix.tree.RadixTree` is keyed by token ids with compressed edges.  Its entries are the
cached sequences (:class:`SeqEntry`: sequence id, stream, the tokens it holds at positions 0..n-1) and the saved
blobs of the host tier (:class:`~kvcache_ggml.prefix.host.HostEntry`).  Every node knows the entries below it, so
:meth:`PrefixCache.match` walks the tokens once and returns the longest prefix and who holds it (a device
sequence before a RAM blob before a disk file).  An entry indexes only a *valid* prefix: token p at position p, in a
cell whose K/V are what decoding ``tokens[:p+1]`` from scratch leaves.  Reuse is then exact by construction:

* same stream: ``seq_cp(src, dst, 0, n)`` -- the destination joins the source's cells, nothing is copied;
* across streams (``kv_unified=False``): llama.cpp copies whole sequences only -- ``seq_cp(src, dst)`` replaces
  the destination stream by the source's cells and queues a whole-buffer copy; the prefix cache makes that copy at
  once (``init_update().apply()``) and cuts the copy back to n tokens with ``seq_rm``;
* host tier: ``state_load(blob, dst)`` (the cells of the blob placed as a ubatch would be), then the same cut.

The last prompt token is always decoded, since its logits are the answer (as llama.cpp's server does).

Two opt-in operations index cells that are *not* a fresh decode's, as llama-server reuses them: chunk reuse
(``attach(..., n_cache_reuse=N)``, :mod:`.reuse`: runs of the sequence's own cached tokens moved into the new prompt
by K-shift) and a server's context shift (``context_shift(..., reindex=True)``).  A moved cell sits at its new
position with its K rotated (no shift pending), but its K/V were computed in its old context; such an entry is
offered to later requests like any other.  Without them every entry is exact.

How the tree learns of operations
---------------------------------
Eagerly, by wrapping: every operation that changes cells goes through the prefix cache (``attach``/``advance``
for reuse and decodes, and ``seq_rm``, ``seq_cp``, ``seq_keep``, ``seq_add``, ``seq_div``, ``context_shift``,
``clear``, ``state_load`` with the context's signatures), which calls the context and then cuts each affected
entry back to the prefix the operation cannot have changed (the table in :mod:`.index`: the entries, their tree
and these operations are a :class:`~kvcache_ggml.prefix.index.SeqIndex`, which the prefix cache owns).  A shifted
sequence keeps only the positions below the shift; in a unified cache a cell has one position for all its
sequences, so ``seq_add``/``seq_div``/context shifts also cut every sequence sharing a moved cell.

Why not re-validate lazily against the cells alone?  ``seq_pos_min``/``seq_pos_max`` cannot see a hole, a
duplicated position or a cell rewritten with other tokens at the same position (``seq_rm`` then a decode), and the
cache has no per-sequence generation counter without changing it; wrapping sees every change and costs one
tree update per operation.  The cheap lazy check remains as a safety net: before a device entry is used for
reuse, its ``seq_pos_min/max`` must still cover its tokens, else the entry is dropped (counted as ``stale``).
:func:`~kvcache_ggml.prefix.audit.check` compares everything with the cells from scratch (tests call it after every
step).

Eviction and the host tier
--------------------------
A released request leaves its sequence *parked*: cached, indexed, evictable.  When a batch needs room
(:meth:`PrefixCache.claim` before it, or ``DecodeError`` 1 from it), no sequence id is free, or a blob has no room
to be restored, whole parked sequences of the stream are evicted, chosen by
:class:`~kvcache_ggml.prefix.policy.LRUPolicy` (lowest retention priority first, then least recently used;
priorities as in TensorRT-LLM, set per request with :class:`~kvcache_ggml.prefix.policy.Retention`; any callable
can replace it).  With a host budget, an evicted
sequence not already covered by another entry is kept as its llama.cpp state blob (``state_save(seq_id)``, its
tail beyond the indexed prefix cut first) in RAM, and RAM victims move to disk as llama.cpp sequence state files
when a directory and a disk budget are given.  Budgets are never exceeded; a blob that fits none is not kept.
:class:`~kvcache_ggml.prefix.stats.PrefixStats` counts hits per tier, reused and decoded tokens, evictions, saves,
restores and bytes (``print(pc.stats)``).
"""
from __future__ import annotations

from .audit import check
from .core import PrefixCache
from .host import HostEntry, HostParams, HostTier
from .index import SeqEntry, SeqIndex
from .policy import DEFAULT_PRIORITY, Candidate, EvictionPolicy, LRUPolicy, Retention
from .stats import PrefixStats
from .tree import RadixTree, common_prefix
from .values import Admission, Match, PrefixParams

__all__ = ["PrefixCache", "PrefixParams", "SeqEntry", "SeqIndex", "Match", "Admission", "HostParams", "HostEntry",
           "HostTier", "Retention", "Candidate", "EvictionPolicy", "LRUPolicy", "DEFAULT_PRIORITY", "PrefixStats",
           "RadixTree", "common_prefix", "check"]

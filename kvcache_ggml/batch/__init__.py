"""Input batches and their split into micro-batches: llama.cpp's ``llama_batch``, ``llama_ubatch`` and
``llama_batch_allocr`` (llama-batch.h/.cpp), on numpy only.

* :class:`Batch` is the caller's input (``llama_batch``): tokens or embeddings with optional positions, sequence ids
  and output flags.  Arrays are converted to their dtype once and validated for shape; values that depend on the
  model (token ids, sequence ids) are checked by :meth:`BatchAllocator.init`.
* :class:`UBatch` is one micro-batch (``llama_ubatch``) as numpy arrays that it owns.
* :class:`BatchAllocator` (``llama_batch_allocr``) validates a batch against a vocabulary and a memory module,
  fills in what the caller left out, and cuts the batch into ubatches with the same three strategies, in the same
  order and with the same output ids as llama.cpp.

Representation.  A token's sequence ids are a row of an int32 [n_tokens, w] array padded with -1, ``w`` the largest
number of ids of any token.  Tokens with the same sequence *set* form a group: each group keeps its member tokens in
batch order and its set as a Python int bitmask.  Batches without coupled sequences (one id per token, the common
case) group by sequence id (bincount and a stable argsort); coupled ones build per-token uint64 bitset words and
group them with a lexsort.

An invariant the splitters rely on: every split method consumes, in each group, a prefix of the group's members
(llama.cpp's splitters always take a group's tokens in batch order), so the number of used members of a group is
also the index of its first unused member.

Speed.  The hot path is a decode step of one token per sequence.  Every numpy call costs about a microsecond, so the
code counts them: C-level methods rather than ``np.`` wrappers, ``np.count_nonzero`` rather than ``any``/``all``
reductions, and the per-sequence grouping computed once per batch and shared by positions, statistics and splits.
No path loops in Python over tokens; loops over sequences or sequence sets (at most a few hundred) are fine.
The decode step itself -- n tokens of n distinct sequences -- takes a fast path through init
(``BatchAllocator._init_decode``: scalar Python, falling back to the general sections for anything else or anything
they would reject) and through the splits (``BatchAllocator._ubatch_decode``: the ubatch shares read-only arrays
that only depend on its sequences);
``BatchAllocator.fast = False`` turns both off (tests/test_decode_fast_path.py compares the two).

Modules: ``_input`` (Batch), ``_ubatch`` (UBatch and the shared numpy helpers), ``_allocator`` (BatchAllocator, one
class: init's sections, its decode fast path, the getters and split_simple/split_equal/split_seq).  Import from
``kvcache_ggml.batch``.

Errors: ``ValueError`` for bad input (llama.cpp logs and returns false), ``RuntimeError`` for misuse (splitting
without a batch), ``assert`` for internal invariants.  ``LLAMA_BATCH_DEBUG`` (read once per process, again with
``read_debug_env()``) logs the batch and every ubatch through ``logging.getLogger("kvcache_ggml.batch")`` at DEBUG
level.
"""

from .._consts import LLAMA_MAX_SEQ
from ._allocator import BatchAllocator, MemoryPositions, read_debug_env
from ._input import Batch
from ._ubatch import UBatch

__all__ = ["LLAMA_MAX_SEQ", "Batch", "UBatch", "BatchAllocator", "MemoryPositions", "read_debug_env"]

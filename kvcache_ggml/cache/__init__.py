"""The KV cache: llama.cpp's ``llama_kv_cache`` as a facade over its parts (see ``docs/architecture.md``).

======================  =====================================================================  ============
module                  owns                                                                   ggml
======================  =====================================================================  ============
``types``               value objects: KVCacheParams, SlotInfo, StreamCopyInfo, MemoryStatus   no
``cells/``              KVCells, the cells of one stream (llama_kv_cells), and their indices   no
``bookkeeping``         cells and heads per stream, seq -> stream, queued stream copies,       no
                        ``seq_*``, ``find_slot``/``apply_ubatch``/``prepare``, ``get_n_kv``
``swa_step``            the decode step over cells a sliding window left behind                no
``celltext``            the cells as text (inspection)                                         no
``masks``               the kq mask kernels (numpy)                                            no
``mask_rows``           ready kq-mask rows patched step to step (the decode step)              no
``tensors``             K/V tensors and buffers (the native handles), views, stores, copies    yes
``shift``               the K-shift graph, UpdateContext                                       yes
``inputs``              ``set_input_*``: indices, shifts, mask, position buckets               yes
``decode_step``         CacheStep: the fused step's placement and inputs, in two calls         yes
``state/``              save and restore: ``format`` (layout, checks), ``io`` (writers,        yes
                        readers), ``codec`` (``state_write``/``state_read``), ``files``
                        (sequence state files, ``parse_state``), ``cli`` (``inspect``)
``context``             KVCacheContext (llama_kv_cache_context)                                yes
``kvcache``             KVCache, the facade with llama.cpp's method names                      yes
``memory``              Memory, the protocol KVCache and KVCacheISWA implement (llama_memory_i) no
``iswa``                KVCacheISWA (llama_kv_cache_iswa): a base and a small SWA KVCache      yes
``swa_checkpoint``      SWACheckpoints: the SWA cache's part saved for prompt reuse            yes
======================  =====================================================================  ============

Importing this package is light: the names below are loaded on first access, so ``kvcache_ggml.cache.bookkeeping``
can be imported without ggml.
"""
from __future__ import annotations

from .._lazy import lazy_exports

# public name -> module defining it, imported on first access
_LAZY = {
    "KVCacheParams": ".types", "SlotInfo": ".types", "StreamCopyInfo": ".types", "MemoryStatus": ".types",
    "ModelLike": ".types",
    "KVBookkeeping": ".bookkeeping",
    "cell_map_text": ".celltext", "cell_pos_text": ".celltext",
    "KVTensors": ".tensors", "KVLayer": ".tensors",
    "KShift": ".shift", "ShiftGraph": ".shift", "UpdateContext": ".shift",
    "KVInputs": ".inputs",
    "StateCodec": ".state.codec",
    "KVCacheContext": ".context",
    "KVCache": ".kvcache",
    "Memory": ".memory",
    "KVCells": ".cells",
    "KVCacheISWA": ".iswa", "KVCacheISWAContext": ".iswa", "KVCacheISWAParams": ".iswa",
    "SWACheckpoints": ".swa_checkpoint",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())

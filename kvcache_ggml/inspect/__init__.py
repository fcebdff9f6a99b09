"""Looking inside a KV cache: its cells as data and pictures, its ggml graphs as tables and DOT files, and a
from-scratch consistency check of its bookkeeping.

* cells: :func:`cells_table` (a structured numpy array, one row per stream and cell) and :func:`format_cells` (it as
  text), :func:`cell_map` (the text map of the seed's ``LLAMA_KV_CACHE_DEBUG`` dump), :func:`check_invariants`;
* pictures: :func:`plot_cell_map`, :func:`plot_kq_mask`, :func:`plot_kv_norms` return matplotlib ``Figure`` objects
  (not managed by pyplot; a notebook shows them inline after ``%matplotlib inline``, a script saves them with
  ``fig.savefig``) -- matplotlib is imported by these functions only, never at module import;
* graphs: :func:`graph_table`, :func:`cache_nodes`, :func:`graph_dot` (ggml's own ``ggml_graph_dump_dot``, with the
  cache's nodes highlighted), :func:`render_svg` (needs Graphviz's ``dot``);
* driving a cache without a model: :func:`decode_steps` / :func:`decode`, the memory half of ``llama_decode``.

Every function takes a :class:`~kvcache_ggml.cache.KVCache`; the cell functions also take a bare
:class:`~kvcache_ggml.cache.cells.KVCells` (one stream, no head).

Modules: ``_cells``, ``_invariants``, ``_pictures``, ``_graphs``, ``_drive`` (one per item above).
"""
from ._cells import CELL_DTYPE, cell_map, cells_table, format_cells
from ._drive import decode, decode_steps
from ._graphs import GraphTable, cache_nodes, dot_available, graph_dot, graph_table, is_cache_tensor, render_svg
from ._invariants import check_invariants
from ._pictures import _EMPTY_RGB, _MULTI_RGB, kv_rows, plot_cell_map, plot_kq_mask, plot_kv_norms, seq_color

__all__ = [
    "CELL_DTYPE", "cells_table", "format_cells", "cell_map", "check_invariants",
    "plot_cell_map", "plot_kq_mask", "plot_kv_norms", "seq_color",
    "GraphTable", "graph_table", "cache_nodes", "is_cache_tensor", "graph_dot", "dot_available", "render_svg",
    "kv_rows", "decode_steps", "decode",
]

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
:class:`~kvcache_ggml.cells.KVCells` (one stream, no head).
"""
from __future__ import annotations

import html
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from . import _ggml as G
from ._consts import SEQ_WORDS
from .cells import KVCells

__all__ = [
    "CELL_DTYPE", "cells_table", "format_cells", "cell_map", "check_invariants",
    "plot_cell_map", "plot_kq_mask", "plot_kv_norms", "seq_color",
    "GraphTable", "graph_table", "cache_nodes", "is_cache_tensor", "graph_dot", "dot_available", "render_svg",
    "kv_rows", "decode_steps", "decode",
]

#: one row of :func:`cells_table`
CELL_DTYPE = np.dtype([
    ("stream", np.int32),                     # stream of the cell
    ("cell", np.int32),                       # index of the cell in its stream
    ("pos", np.int32),                        # position, -1 when empty
    ("shift", np.int32),                      # pending K-shift
    ("n_seq", np.int32),                      # number of sequences holding the cell
    ("seq", np.int32),                        # lowest sequence id of the cell, -1 when none
    ("seq_mask", np.uint64),                  # bitmask of sequences 0..63 (bit q = sequence q)
    ("seq_bits", np.uint64, (SEQ_WORDS,)),    # the whole bitset, word w holding sequences 64w..64w+63
    ("ext_x", np.int32),                      # M-RoPE column
    ("ext_y", np.int32),                      # M-RoPE row
])

_CACHE_NAME = re.compile(r"^cache_[kv]_l\d+$")
# ops that carry cache data on into a new tensor (the quantized K-shift: cast (a CPY op) -> rope -> cpy back)
_CACHE_FOLLOW_OPS = {G.GGMLOp.CPY, G.GGMLOp.ROPE, G.GGMLOp.SET_ROWS}
_EMPTY_RGB = (1.0, 1.0, 1.0)
_MULTI_RGB = (0.55, 0.55, 0.55)


# ============================================================================================== cells as data

def _streams(kv: Any) -> tuple[list[KVCells], list[int] | None]:
    """(cells of each stream, head of each stream or None) of a KVCache or a bare KVCells."""
    if isinstance(kv, KVCells):
        return [kv], None
    cells = getattr(kv, "v_cells", None)
    if cells is None:
        raise TypeError(f"expected a KVCache or KVCells, got {type(kv).__name__}")
    return list(cells), list(kv.v_heads)


def cells_table(kv: Any) -> np.ndarray:
    """Structured array (:data:`CELL_DTYPE`) with one row per stream and cell, streams in order."""
    streams, _ = _streams(kv)
    parts = []
    for s, cells in enumerate(streams):
        n = cells.size()
        t = np.zeros(n, CELL_DTYPE)
        idx = np.arange(n, dtype=np.int64)
        t["stream"] = s
        t["cell"] = idx
        t["pos"] = cells.pos_array
        t["shift"] = cells.shift_array
        t["ext_x"] = cells.ext_array[:, 0]
        t["ext_y"] = cells.ext_array[:, 1]
        t["seq_bits"] = cells.seq_bits.T
        t["seq_mask"] = cells.seq_bits[0]
        if n:
            t["n_seq"] = cells.seq_count_many(idx)
            t["seq"] = np.where(t["n_seq"] > 0, cells.seq_get_many(idx), -1)
        else:
            t["seq"] = -1
        parts.append(t)
    return np.concatenate(parts) if parts else np.zeros(0, CELL_DTYPE)


def format_cells(table: np.ndarray, columns: Sequence[str] = ("stream", "cell", "pos", "shift", "seqs"),
                 used_only: bool = True) -> str:
    """A :func:`cells_table` as aligned text: the given fields, plus ``seqs`` (the sequence ids of each cell, from
    its bitset); only the non-empty cells unless ``used_only`` is False."""
    rows = table[table["pos"] >= 0] if used_only else table
    for c in columns:
        if c != "seqs" and c not in CELL_DTYPE.names:
            raise ValueError(f"unknown column {c!r}; columns: {', '.join(CELL_DTYPE.names)}, seqs")
    body = [[",".join(map(str, _seq_list(r["seq_bits"]))) if c == "seqs" else str(r[c]) for c in columns]
            for r in rows]
    widths = [max([len(c)] + [len(b[j]) for b in body]) for j, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def cell_map(kv: Any, positions: bool = False) -> str:
    """Text map of every stream, as the seed's debug dump: a header line, then one character per cell ('.' empty,
    the sequence id, 'M' for several; 256 cells a line) and, with ``positions``, each cell's position."""
    from .cache import cell_map_text, cell_pos_text

    streams, heads = _streams(kv)
    out = []
    for s, cells in enumerate(streams):
        head = "" if heads is None else f", head = {heads[s]:5d}"
        out.append(f"stream[{s}]: n = {cells.used_max_p1():5d}, used = {cells.get_used():5d}{head}, "
                   f"size = {cells.size():5d}")
        out.append(cell_map_text(cells))
        if positions:
            out.append(cell_pos_text(cells))
        for q in sorted(cells._seq_pos):
            out.append(f"stream[{s}] min[{q}] = {cells.seq_pos_min(q):5d}, max[{q}] = {cells.seq_pos_max(q):5d}")
    return "\n".join(out)


# ============================================================================================== invariants

def check_invariants(kv: Any) -> list[str]:
    """Every disagreement between the cells' arrays and the indices derived from them, recomputed from scratch;
    an empty list when the cache is consistent.

    Checked per stream: array shapes; empty cells (position -1) hold no sequence and no shift; used cells hold a
    position >= 0 and at least one sequence, and only sequences mapped to their stream; the used count and the
    used bounds (the raw, possibly stale enclosure and the values ``used_min``/``used_max_p1`` return -- which
    resolves a stale bound, as any caller would); each sequence's position multiset, min and max; the has_shift
    flag; the head within ``[0, size]``.  Per cache: one head per stream, equal sizes, the K/V tensor shapes.
    """
    streams, heads = _streams(kv)
    errors: list[str] = []
    if heads is not None and len(heads) != len(streams):
        errors.append(f"{len(heads)} heads for {len(streams)} streams")
    seq_to_stream = getattr(kv, "_seq_to_stream_list", None)
    for s, cells in enumerate(streams):
        where = f"stream {s}"
        errs = _check_arrays(cells, where)
        if not errs:  # the other checks index the arrays
            errs = (_check_cells(cells, where, s, seq_to_stream) + _check_used(cells, where)
                    + _check_seq_pos(cells, where) + _check_shift(cells, where))
        if heads is not None and s < len(heads) and not 0 <= heads[s] <= cells.size():
            errs.append(f"{where}: head {heads[s]} out of [0, {cells.size()}]")
        errors += errs
    if heads is not None:
        errors += _check_cache(kv, streams)
    return errors


def _check_arrays(cells: KVCells, where: str) -> list[str]:
    n = cells._pos.shape[0]
    want = {"_pos": (n,), "_shift": (n,), "_ext": (n, 2), "_seq": (SEQ_WORDS, n)}
    return [f"{where}: {name} has shape {getattr(cells, name).shape}, expected {shape}"
            for name, shape in want.items() if getattr(cells, name).shape != shape]


def _check_cells(cells: KVCells, where: str, strm: int, seq_to_stream: list[int] | None) -> list[str]:
    pos, shift, bits = cells._pos, cells._shift, cells._seq
    errs = []
    empty = pos == -1
    has_seq = bits.any(axis=0)
    for i in np.flatnonzero(pos < -1).tolist():
        errs.append(f"{where}: cell {i} has position {pos[i]} (< -1)")
    for i in np.flatnonzero(empty & has_seq).tolist():
        errs.append(f"{where}: empty cell {i} holds sequences {_seq_list(bits[:, i])}")
    for i in np.flatnonzero(empty & (shift != 0)).tolist():
        errs.append(f"{where}: empty cell {i} has shift {shift[i]} (expected 0)")
    for i in np.flatnonzero((pos >= 0) & ~has_seq).tolist():
        errs.append(f"{where}: cell {i} holds position {pos[i]} but no sequence")
    if seq_to_stream is not None:
        present = np.bitwise_or.reduce(bits, axis=1) if bits.shape[1] else np.zeros(SEQ_WORDS, np.uint64)
        for q in _seq_list(present):
            if q >= len(seq_to_stream):
                errs.append(f"{where}: sequence {q} is held but the cache maps only {len(seq_to_stream)} sequences")
            elif seq_to_stream[q] != strm:
                errs.append(f"{where}: sequence {q} is held here but maps to stream {seq_to_stream[q]}")
    return errs


def _check_used(cells: KVCells, where: str) -> list[str]:
    used = np.flatnonzero(cells._pos >= 0)
    lo, hi = (int(used[0]), int(used[-1]) + 1) if used.size else (0, 0)
    errs = []
    if cells._n_used != used.size:
        errs.append(f"{where}: used count {cells._n_used} != {used.size} non-empty cells")
    if used.size:
        # a stale (dirty) bound only has to enclose the used cells; a clean one must be exact
        if cells._used_lo > lo or (not cells._lo_dirty and cells._used_lo != lo):
            errs.append(f"{where}: stored used_min {cells._used_lo} (stale: {cells._lo_dirty}), first used "
                        f"cell {lo}")
        if cells._used_hi < hi or (not cells._hi_dirty and cells._used_hi != hi):
            errs.append(f"{where}: stored used_max_p1 {cells._used_hi} (stale: {cells._hi_dirty}), last used "
                        f"cell + 1 = {hi}")
    if cells.used_min() != lo:
        errs.append(f"{where}: used_min() = {cells.used_min()}, first used cell is {lo}")
    if cells.used_max_p1() != hi:
        errs.append(f"{where}: used_max_p1() = {cells.used_max_p1()}, last used cell + 1 is {hi}")
    return errs


def _check_seq_pos(cells: KVCells, where: str) -> list[str]:
    pos, bits = cells._pos, cells._seq
    used = np.flatnonzero(pos >= 0)
    want: dict[int, Counter] = {}
    for q in cells.seqs_in(used):
        held = used[cells.seq_mask_at(q, used)]
        want[q] = Counter(pos[held].tolist())
    errs = []
    for q in sorted(set(want) | set(cells._seq_pos)):
        ms = cells._seq_pos.get(q)
        w = want.get(q, Counter())
        if ms is None:
            errs.append(f"{where}: sequence {q} holds {sum(w.values())} cells but has no position multiset")
            continue
        if len(ms.keys) != len(ms.counts) or ms.keys != sorted(set(ms.keys)) or any(c <= 0 for c in ms.counts):
            errs.append(f"{where}: sequence {q} multiset is malformed (keys {ms.keys[:8]}..., counts "
                        f"{ms.counts[:8]}...)")
        have = Counter(dict(zip(ms.keys, ms.counts)))
        if have != w:
            diff = sorted(set(have) ^ set(w) | {p for p in have if have[p] != w.get(p)})[:8]
            errs.append(f"{where}: sequence {q} multiset {{pos: count}} disagrees with its cells at positions "
                        f"{diff} (multiset {[have.get(p, 0) for p in diff]}, cells {[w.get(p, 0) for p in diff]})")
        pmin, pmax = (min(w), max(w)) if w else (-1, -1)
        if (cells.seq_pos_min(q), cells.seq_pos_max(q)) != (pmin, pmax):
            errs.append(f"{where}: sequence {q} seq_pos_min/max = {cells.seq_pos_min(q)}/{cells.seq_pos_max(q)}, "
                        f"its cells give {pmin}/{pmax}")
    return errs


def _check_shift(cells: KVCells, where: str) -> list[str]:
    shifted = np.flatnonzero(cells._shift != 0)
    if shifted.size and not cells._has_shift:
        return [f"{where}: {shifted.size} cells have a pending shift (first: cell {int(shifted[0])}) but "
                f"has_shift is False"]
    return []


def _check_cache(kv: Any, streams: list[KVCells]) -> list[str]:
    errs = []
    sizes = {c.size() for c in streams}
    if len(sizes) > 1:
        errs.append(f"streams have different sizes {sorted(sizes)}")
    if len(streams) != kv.n_stream:
        errs.append(f"{len(streams)} streams, n_stream = {kv.n_stream}")
    size = streams[0].size() if streams else 0
    for layer in getattr(kv, "layers", []):
        for t in (layer.k, layer.v):
            ne = G.ne(t)
            if ne[1] != size or ne[2] != kv.n_stream:
                errs.append(f"tensor {G.name(t)} has ne {ne}: expected ne[1] = {size} cells and ne[2] = "
                            f"{kv.n_stream} streams")
    if kv.get_has_shift() != any(c._has_shift for c in streams):
        errs.append("get_has_shift() disagrees with the streams' flags")
    return errs


def _seq_list(words: np.ndarray) -> list[int]:
    out = []
    for w, v in enumerate(int(x) for x in words.tolist()):
        while v:
            low = v & -v
            out.append(w * 64 + low.bit_length() - 1)
            v ^= low
    return out


# ============================================================================================== pictures

def seq_color(seq_id: int) -> tuple[float, float, float]:
    """The colour of a sequence in every picture (tab10, repeating every 10 ids)."""
    from matplotlib import colormaps

    return tuple(colormaps["tab10"](seq_id % 10)[:3])


def _new_figure(width: float, height: float):
    """A matplotlib Figure with an Agg canvas, independent of pyplot's figure manager."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _cell_rgb(streams: list[KVCells]) -> tuple[np.ndarray, list[int]]:
    """float [n_stream, size, 3] colour of each cell, and the sequences present."""
    size = max((c.size() for c in streams), default=0)
    img = np.ones((len(streams), size, 3))
    seen: set[int] = set()
    for s, cells in enumerate(streams):
        used = np.flatnonzero(cells.pos_array >= 0)
        if not used.size:
            continue
        cnt = cells.seq_count_many(used)
        first = cells.seq_get_many(used)
        img[s, used[cnt > 1]] = _MULTI_RGB
        for q in np.unique(first[cnt == 1]).tolist():
            img[s, used[(cnt == 1) & (first == q)]] = seq_color(q)
        seen.update(cells.seqs_in(used))
    return img, sorted(seen)


def plot_cell_map(kv: Any, *, show_pos: bool | None = None, title: str | None = None):
    """Figure: streams x cells, each cell coloured by its sequence (white empty, grey several); each stream's
    head marked with a triangle and its used range ``[used_min, used_max_p1)`` with a bar under the row.
    ``show_pos`` writes each cell's position in it (default: when a stream has at most 64 cells)."""
    from matplotlib.patches import Patch

    streams, heads = _streams(kv)
    img, seqs = _cell_rgb(streams)
    n_stream, size = img.shape[:2]
    if show_pos is None:
        show_pos = size <= 64
    fig = _new_figure(min(16.0, max(5.0, 0.32 * size + 1.5)), 0.75 * n_stream + 1.6)
    ax = fig.add_subplot()
    ax.imshow(img, aspect="auto", interpolation="nearest", extent=(-0.5, size - 0.5, n_stream - 0.5, -0.5))
    _grid(ax, size, n_stream, color="0.8")
    ax.set_yticks(range(n_stream), [f"stream {s}" for s in range(n_stream)])
    ax.set_xlabel("cell")
    for s, cells in enumerate(streams):
        lo, hi = cells.used_min(), cells.used_max_p1()
        if hi > lo:
            ax.plot([lo - 0.5, hi - 0.5], [s + 0.42, s + 0.42], color="black", linewidth=3, solid_capstyle="butt")
        if heads is not None:
            ax.plot([heads[s]], [s - 0.42], marker="v", color="red", markersize=9, clip_on=False)
        if show_pos:
            for i in np.flatnonzero(cells.pos_array >= 0).tolist():
                ax.text(i, s, str(cells.pos_array[i]), ha="center", va="center", fontsize=7)
    handles = [Patch(color=seq_color(q), label=f"seq {q}") for q in seqs[:20]]
    handles.append(Patch(facecolor=_MULTI_RGB, label="several"))
    handles.append(Patch(facecolor=_EMPTY_RGB, edgecolor="0.6", label="empty"))
    if heads is not None:
        handles.append(ax.plot([], [], marker="v", color="red", linestyle="", label="head")[0])
    handles.append(ax.plot([], [], color="black", linewidth=3, label="used range")[0])
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(title or f"KV cells ({n_stream} stream{'s' * (n_stream > 1)} x {size} cells)")
    return fig


def plot_kq_mask(mask: Any, *, token_pos: Sequence[int] | None = None, cell_pos: Sequence[int] | None = None,
                 title: str | None = None):
    """Figure: a ubatch's kq mask (``[n_stream, n_tps, n_kv]`` or ``[n_tps, n_kv]``), one heat map per stream:
    tokens down, cells across; black where masked (-inf), coloured where visible (0, or the ALiBi bias
    ``-|p0 - p1|`` on a colour bar).  ``token_pos``/``cell_pos`` label the axes with positions ('.' for -1)."""
    m = np.asarray(mask, dtype=np.float32)
    if m.ndim == 2:
        m = m[None]
    if m.ndim != 3:
        raise ValueError(f"mask must be [n_stream, n_tokens, n_kv] or [n_tokens, n_kv], got shape {m.shape}")
    ns, n_tps, n_kv = m.shape
    vis = m[np.isfinite(m)]
    lo = float(vis.min()) if vis.size else 0.0
    bias = vis.size and lo < 0
    panel = min(6.0, max(1.8, 0.3 * n_tps + 1.0))  # inches per stream
    fig = _new_figure(min(16.0, max(4.0, 0.3 * n_kv + 2.0)), min(40.0, ns * panel))
    axes = fig.subplots(ns, 1, squeeze=False)[:, 0]
    cmap = _mask_cmap()
    for s, ax in enumerate(axes):
        im = ax.imshow(np.ma.masked_invalid(m[s]), cmap=cmap, vmin=lo if bias else -1.0, vmax=0.0,
                       interpolation="nearest", aspect="auto")
        _grid(ax, n_kv, n_tps)
        ax.set_ylabel(f"token (stream {s})" if ns > 1 else "token")
        if cell_pos is not None and n_kv <= 64:
            ax.set_xticks(range(n_kv), [str(p) if p >= 0 else "." for p in list(cell_pos)[:n_kv]], fontsize=7)
            ax.set_xlabel("cell (labelled with its position)")
        else:
            ax.set_xlabel("cell")
        if token_pos is not None and n_tps <= 64:
            tp = list(token_pos)[s * n_tps:(s + 1) * n_tps]
            ax.set_yticks(range(len(tp)), [f"p={p}" for p in tp], fontsize=7)
        if bias:
            fig.colorbar(im, ax=ax, label="bias")
    axes[0].set_title(title or f"kq mask ({n_tps} tokens x {n_kv} cells); black = masked")
    return fig


def _mask_cmap():
    from matplotlib import colormaps

    return colormaps["viridis"].with_extremes(bad="black")


def _grid(ax: Any, nx: int, ny: int, color: str = "0.5") -> None:
    """Thin lines between the pixels of an image, when there are few enough to see them."""
    if nx <= 128 and ny <= 128:
        ax.set_xticks(np.arange(-0.5, nx, 1), minor=True)
        ax.set_yticks(np.arange(-0.5, ny, 1), minor=True)
        ax.grid(which="minor", color=color, linewidth=0.4)
        ax.tick_params(which="minor", length=0)


def kv_rows(kv: Any, il: int, which: str = "k") -> np.ndarray:
    """float32 [n_stream, kv_size, n_embd]: layer il's K (``which="k"``) or V rows, one per cell, whatever the
    type (quantized rows are dequantized by ggml on the CPU) and the V layout (transposed or not)."""
    if which not in ("k", "v"):
        raise ValueError(f"which must be 'k' or 'v', got {which!r}")
    if not hasattr(kv, "layers"):
        raise TypeError(f"kv_rows needs a KVCache (with tensors), got {type(kv).__name__}")
    layer = kv._layer(il)
    t = layer.k if which == "k" else layer.v
    n_embd, size, ns = G.ne(t)[:3]
    flat = _as_f32(t).reshape(-1)
    if which == "v" and kv.v_trans:
        return flat.reshape(ns, n_embd, size).transpose(0, 2, 1).copy()  # stored [stream][dim][cell]
    return flat.reshape(ns, size, n_embd)


def _as_f32(t: Any) -> np.ndarray:
    """The data of tensor t as float32 (copied from any buffer)."""
    tt = G.ttype(t)
    if tt == G.GGMLType.F32:
        return G.to_numpy(t, copy=True)
    if tt == G.GGMLType.F16:
        return G.to_numpy(t, copy=True).astype(np.float32)
    if tt == G.GGMLType.BF16:
        return (G.to_numpy(t, copy=True).astype(np.uint32) << 16).view(np.float32)
    return G.dequantize(G.to_numpy(t, copy=True), tt)


def plot_kv_norms(kv: Any, *, mask_empty: bool = True, title: str | None = None):
    """Figure: the L2 norm of every layer's K and V row in every cell -- one panel per stream and K/V, layers
    down, cells across.  Empty cells are drawn grey unless ``mask_empty`` is False (their stale data show)."""
    streams, _ = _streams(kv)
    layers = [layer.il for layer in kv.layers]
    if not layers:
        raise ValueError("the cache has no K/V tensors (every layer filtered out)")
    norms = {w: np.stack([np.linalg.norm(kv_rows(kv, il, w), axis=2) for il in layers], axis=1)
             for w in ("k", "v")}  # [n_stream, n_layer, size]
    ns, size = len(streams), streams[0].size()
    fig = _new_figure(min(16.0, max(6.0, 0.25 * size * 2 + 3)), ns * max(1.6, 0.35 * len(layers) + 1.0))
    axes = fig.subplots(ns, 2, squeeze=False)
    cmap = _norm_cmap()
    for s in range(ns):
        empty = streams[s].pos_array < 0
        for j, w in enumerate(("k", "v")):
            data = norms[w][s]
            if mask_empty:
                data = np.ma.masked_array(data, np.broadcast_to(empty, data.shape))
            ax = axes[s, j]
            im = ax.imshow(data, cmap=cmap, aspect="auto", interpolation="nearest")
            _grid(ax, size, len(layers))
            ax.set_yticks(range(len(layers)), [f"l{il}" for il in layers], fontsize=7)
            ax.set_xlabel("cell")
            ax.set_title(f"|{w.upper()}| stream {s}", fontsize=9)
            fig.colorbar(im, ax=ax)
    if title:
        fig.suptitle(title)
    return fig


def _norm_cmap():
    from matplotlib import colormaps

    return colormaps["magma"].with_extremes(bad="0.85")


# ============================================================================================== graphs

def _nodes(graph: Any) -> list[Any]:
    g = getattr(graph, "graph", graph)  # a ShiftGraph holds its G.Graph in .graph
    if isinstance(g, G.Graph):
        return g.nodes()
    if isinstance(g, (list, tuple)):
        return list(g)
    raise TypeError(f"expected a G.Graph (or an object with .graph, or a list of tensors), got {type(graph).__name__}")


def _root(t: Any) -> Any:
    """The tensor owning t's storage: t itself, or the end of its view_src chain."""
    while True:
        v = G.view_src(t)
        if v is None:
            return t
        t = v


def _srcs(t: Any) -> list[Any]:
    return [s for s in (G.src(t, j) for j in range(G.GGML_MAX_SRC)) if s is not None]


def is_cache_tensor(t: Any) -> bool:
    """True for a cache's own K/V tensor (named ``cache_k_l{il}`` / ``cache_v_l{il}``)."""
    return bool(_CACHE_NAME.match(G.name(t)))


def _cache_addrs(nodes: list[Any]) -> set[int]:
    """Addresses of the cache nodes: views of a cache tensor (get_k/v, set_rows, in-place rope, cpy into the
    cache) and, transitively, the cast/rope/cpy/set_rows nodes fed by one (the quantized K-shift)."""
    found: set[int] = set()
    for t in nodes:
        if is_cache_tensor(_root(t)):
            found.add(G.addr(t))
            continue
        if G.op(t) in _CACHE_FOLLOW_OPS:
            if any(G.addr(s) in found or is_cache_tensor(_root(s)) for s in _srcs(t)):
                found.add(G.addr(t))
    return found


def cache_nodes(graph: Any) -> list[Any]:
    """The graph's nodes that belong to the cache (see :func:`graph_table`'s ``cache`` column), in graph order."""
    nodes = _nodes(graph)
    found = _cache_addrs(nodes)
    return [t for t in nodes if G.addr(t) in found]


class GraphTable:
    """Rows of :func:`graph_table`: a list of dicts, printable as text, shown as an HTML table in notebooks."""

    COLUMNS = ("i", "op", "name", "type", "ne", "nb", "view_offs", "view_src", "srcs", "buffer", "backend", "cache")

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[dict]:
        return iter(self.rows)

    def __getitem__(self, k: int) -> dict:
        return self.rows[k]

    def cache_only(self) -> "GraphTable":
        """The rows of the cache's nodes."""
        return GraphTable([r for r in self.rows if r["cache"]])

    def column(self, name: str) -> list:
        return [r[name] for r in self.rows]

    def _cells(self, columns: Sequence[str]) -> list[list[str]]:
        def fmt(k: str, v: Any) -> str:
            if k == "cache":
                return "*" if v else ""
            if k in ("ne", "nb", "srcs"):
                return ",".join(map(str, v))
            return str(v)
        return [[fmt(k, r[k]) for k in columns] for r in self.rows]

    def to_text(self, columns: Sequence[str] | None = None) -> str:
        cols = list(columns or self.COLUMNS)
        body = self._cells(cols)
        widths = [max([len(c)] + [len(row[j]) for row in body]) for j, c in enumerate(cols)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()]
        lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in body]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()

    def __repr__(self) -> str:
        return f"GraphTable({len(self.rows)} nodes, {sum(r['cache'] for r in self.rows)} cache nodes)\n" + \
            self.to_text()

    def _repr_html_(self) -> str:
        cols = list(self.COLUMNS)
        head = "".join(f"<th>{c}</th>" for c in cols)
        rows = []
        for r, cells in zip(self.rows, self._cells(cols)):
            style = ' style="background:#ffe9a8"' if r["cache"] else ""
            rows.append(f"<tr{style}>" + "".join(f"<td>{html.escape(v)}</td>" for v in cells) + "</tr>")
        return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def graph_table(graph: Any, sched: Any = None) -> GraphTable:
    """One row per node of ``graph`` (a G.Graph, an object with ``.graph``, or a list of tensors): index, op,
    name, type, ne, nb, view offset, view source, source names, buffer name ('' when not allocated), backend (the
    scheduler's choice when ``sched`` is given) and ``cache`` (the node belongs to the cache)."""
    nodes = _nodes(graph)
    found = _cache_addrs(nodes)
    rows = []
    for i, t in enumerate(nodes):
        vs = G.view_src(t)
        rows.append({
            "i": i,
            "op": G.op_name(G.op(t)),
            "name": G.name(t),
            "type": G.type_name(G.ttype(t)),
            "ne": G.ne(t),
            "nb": G.nb(t),
            "view_offs": G.view_offs(t),
            "view_src": G.name(vs) if vs is not None else "",
            "srcs": tuple(G.name(s) or f"#{G.addr(s):x}" for s in _srcs(t)),
            "buffer": _buffer_name(t),
            "backend": _backend_name(sched, t),
            "cache": G.addr(t) in found,
        })
    return GraphTable(rows)


def _buffer_name(t: Any) -> str:
    buf = G.buffer(t)
    if not buf:
        return ""
    raw = G.ggml_backend_buffer_name(buf)
    return raw.decode("utf-8", "replace") if raw else "?"


def _backend_name(sched: Any, t: Any) -> str:
    if sched is None:
        return ""
    b = sched.tensor_backend(t)
    if not b:
        return ""
    raw = G.ggml_backend_name(b)
    return raw.decode("utf-8", "replace") if raw else "?"


def graph_dot(graph: Any, path: str | Path, highlight: bool = True) -> Path:
    """Write ``graph`` as Graphviz DOT with ggml's ``ggml_graph_dump_dot``; with ``highlight`` the cache's nodes
    are filled gold and the cache's K/V tensors orange.  Returns the path."""
    g = getattr(graph, "graph", graph)
    if not isinstance(g, G.Graph):
        raise TypeError(f"graph_dot needs a G.Graph (or an object with .graph), got {type(graph).__name__}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    G.ggml_graph_dump_dot(g.ptr, g.ptr, str(path).encode())
    if highlight:
        nodes = g.nodes()
        found = _cache_addrs(nodes)
        # the cache's K/V tensors are leafs: reach them through the nodes' view sources and sources
        reached = [_root(t) for t in nodes] + [s for t in nodes for s in _srcs(t)]
        storage = {G.addr(t) for t in reached if is_cache_tensor(t)}
        path.write_text(_recolor_dot(path.read_text(), {a: "gold" for a in found} | {a: "orange" for a in storage}))
    return path


_DOT_NODE = re.compile(r'^(\s*"(0x[0-9a-fA-F]+)" \[ style = filled; fillcolor = )(\w+)(;.*)$')


def _recolor_dot(text: str, colors: dict[int, str]) -> str:
    """Give the DOT node statements whose address is in ``colors`` that fill colour."""
    out = []
    for line in text.splitlines():
        m = _DOT_NODE.match(line)
        if m and int(m.group(2), 16) in colors:
            line = f"{m.group(1)}{colors[int(m.group(2), 16)]}{m.group(4)}"
        out.append(line)
    return "\n".join(out) + "\n"


def dot_available() -> bool:
    """True when Graphviz's ``dot`` executable is on PATH."""
    return shutil.which("dot") is not None


def render_svg(dot_path: str | Path, svg_path: str | Path | None = None) -> Path:
    """Render a DOT file to SVG with Graphviz's ``dot`` (next to it unless ``svg_path``); RuntimeError with what to
    install when ``dot`` is missing or fails."""
    dot_path = Path(dot_path)
    if not dot_path.exists():
        raise FileNotFoundError(f"no DOT file at {dot_path}")
    exe = shutil.which("dot")
    if exe is None:
        raise RuntimeError("Graphviz's `dot` executable is not on PATH: install Graphviz (e.g. `apt-get install "
                           f"graphviz` or `brew install graphviz`), or open {dot_path} in any DOT viewer")
    out = Path(svg_path) if svg_path is not None else dot_path.with_suffix(".svg")
    proc = subprocess.run([exe, "-Tsvg", str(dot_path), "-o", str(out)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"dot -Tsvg {dot_path} failed with exit code {proc.returncode}: {proc.stdout.strip()}")
    return out


# ============================================================================================== driving a cache

def decode_steps(kv: Any, pos: Sequence[int] | np.ndarray | None, seqs: Iterable[Any], *, n_ubatch: int = 512,
                 output_all: bool = False) -> Iterator[Any]:
    """The memory half of ``llama_decode`` for one batch, without a model: validate the batch (positions ``pos``,
    or None to continue each sequence; ``seqs`` one sequence id or a list of ids per token), find a slot for
    every ubatch (``init_batch``), then ``apply()`` each ubatch in turn, yielding the memory context after each
    apply -- the place to read ``ctx.kq_mask()``, ``ctx.get_sinfo()``, ``ctx.k_idxs()``.  The generator must be
    consumed for every ubatch to land.  RuntimeError when no slot is found."""
    from .batch import Batch, BatchAllocator
    from .cache import MemoryStatus

    rows = [list(s) if isinstance(s, (list, tuple, np.ndarray)) else [int(s)] for s in seqs]
    if not rows:
        raise ValueError("decode needs at least one token")
    hp = kv.hparams
    ba = BatchAllocator(hp.n_pos_per_embd())
    ba.init(Batch(token=np.zeros(len(rows), np.int32), pos=pos, seq_id=rows), 1, kv, hp.n_embd, kv.n_seq_max,
            output_all)
    ctx = kv.init_batch(ba, n_ubatch)
    if ctx.get_status() != MemoryStatus.SUCCESS:
        raise RuntimeError(f"no slot for a batch of {len(rows)} tokens ({ctx.get_status().name}): the cache has "
                           f"{[c.size() - c.get_used() for c in kv.v_cells]} free cells per stream")
    while True:
        ctx.apply()
        yield ctx
        if not ctx.next():
            return


def decode(kv: Any, pos: Sequence[int] | np.ndarray | None, seqs: Iterable[Any], *, n_ubatch: int = 512) -> Any:
    """:func:`decode_steps` run to the end; returns the memory context (its ``sinfos`` say where each ubatch
    went)."""
    ctx = None
    for ctx in decode_steps(kv, pos, seqs, n_ubatch=n_ubatch):
        pass
    return ctx

"""Inspection: pictures of a cache (cell map, kq mask, K/V norms) as matplotlib figures, and its K/V rows as
float32 (:func:`kv_rows`).  matplotlib is imported by these functions only, never at module import."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .. import ggml as G
from ..cache.cells.kvcells import KVCells
from ._cells import _streams


_EMPTY_RGB = (1.0, 1.0, 1.0)
_MULTI_RGB = (0.55, 0.55, 0.55)


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
    layer = kv.tensors.layer(il)
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

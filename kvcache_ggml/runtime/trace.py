"""Node traces: the value of every named graph node as it is computed, and the first one two traces disagree on.

:class:`NodeTrace` records our runtime's nodes through the scheduler's eval callback (what llama.cpp's ``cb_eval``
does for llama.cpp; ``tests/oracle/llama_runner.py`` records llama.cpp's the same way).  The decoder graph
names its nodes as llama.cpp's graph callback does (``attn_norm-0``, ``Qcur-0``, ``kq-0``, ``kq_soft_max-0``,
``kqv-0``, ``kqv_out-0``, ... ``result_output``), so :func:`first_difference` can walk both traces in compute
order and name the first node whose bytes differ.  A name can occur more than once in a graph (``Qcur-0`` before and
after RoPE): nodes are matched by (name, occurrence).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from .. import ggml as G

__all__ = ["NodeTrace", "NodeList", "NodeDiff", "first_difference", "node_wanted"]

# ops that only re-describe memory: their data is some earlier node's
_VIEW_OPS = frozenset({G.GGMLOp.VIEW, G.GGMLOp.RESHAPE, G.GGMLOp.PERMUTE, G.GGMLOp.TRANSPOSE})


def node_wanted(name: str) -> bool:
    """A node named by the graph (llama.cpp style), not one ggml named after its source ("x (reshaped)")."""
    return bool(name) and "(" not in name and not name.startswith(("leaf_", "node_"))


class NodeTrace:
    """``with NodeTrace(ctx) as tr: ctx.decode(...)``: ``tr.nodes`` lists (name, float32 or raw bytes) per node.

    Only contiguous, non-view nodes that :func:`node_wanted` (or ``want``) accepts are copied.
    """

    def __init__(self, ctx: Any, want: Callable[[str], bool] = node_wanted) -> None:
        self.ctx = ctx
        self.want = want
        self.nodes: list[tuple[str, np.ndarray]] = []

    def _observe(self, t: Any, ask: bool) -> bool:
        if ask:
            return self.want(G.name(t)) and G.op(t) not in _VIEW_OPS and G.is_contiguous(t)
        self.nodes.append((G.name(t), G.to_numpy(t, copy=True)))
        return True

    def __enter__(self) -> "NodeTrace":
        self.ctx.set_eval_callback(self._observe)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.ctx.set_eval_callback(None)


class NodeList:
    """``with NodeList(ctx) as nl: ctx.decode(...)``: ``nl.nodes`` lists ``[op, name, ggml type, ne, nb]`` of every
    node the scheduler computes, in order (views included), without observing any (no data is read, the graph runs
    in one piece).  llama_runner's ``"graph": true`` lists llama.cpp's the same way, so two graphs can be compared
    node by node: count, ops, shapes, strides (views and conts), types."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.nodes: list[list[Any]] = []

    def _observe(self, t: Any, ask: bool) -> bool:
        tt, ne, nb, _, _ = G.header(t)
        self.nodes.append([G.ggml_op_desc(t).decode(), G.name(t), int(tt), list(ne), list(nb)])
        return False

    def __enter__(self) -> "NodeList":
        self.ctx.set_eval_callback(self._observe)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.ctx.set_eval_callback(None)


@dataclass(slots=True)
class NodeDiff:
    """Where two traces first disagree."""

    name: str            # the node's name
    occurrence: int      # 0 for its first node of that name, 1 for the second, ...
    index: int           # position in the reference trace
    n_differ: int        # elements that differ
    n: int               # elements compared
    max_rel: float       # largest |a - b| / max |b|
    compared: int        # nodes compared before and including this one


def _keyed(nodes: Iterable[tuple[str, np.ndarray]]) -> list[tuple[tuple[str, int], np.ndarray]]:
    seen: dict[str, int] = {}
    out = []
    for name, data in nodes:
        k = seen.get(name, 0)
        seen[name] = k + 1
        out.append(((name, k), np.asarray(data)))
    return out


def first_difference(ours: Iterable[tuple[str, np.ndarray]], ref: Iterable[tuple[str, np.ndarray]]
                     ) -> tuple[NodeDiff | None, int]:
    """Walk ``ref`` in order; the first node also in ``ours`` whose bytes differ (None if none) and the count of
    nodes compared."""
    mine = dict(_keyed(ours))
    compared = 0
    for i, (key, b) in enumerate(_keyed(ref)):
        a = mine.get(key)
        if a is None or a.nbytes != b.nbytes:
            continue
        compared += 1
        ra = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        rb = np.ascontiguousarray(b).reshape(-1).view(np.uint8)
        if np.array_equal(ra, rb):
            continue
        fa = np.ascontiguousarray(a).reshape(-1)
        fb = np.ascontiguousarray(b).reshape(-1).view(fa.dtype)
        if fa.dtype.kind == "f":
            x, y = fa.astype(np.float64), fb.astype(np.float64)
            n_differ = int(np.count_nonzero(x != y))
            rel = float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30))
        else:
            n_differ, rel = int(np.count_nonzero(ra != rb)), float("nan")
        return NodeDiff(key[0], key[1], i, n_differ, fa.size, rel, compared), compared
    return None, compared

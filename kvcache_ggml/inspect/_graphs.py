"""Inspection: ggml graphs as tables (:func:`graph_table`), the cache's nodes in them (:func:`cache_nodes`), and
ggml's own DOT dump with those nodes highlighted (:func:`graph_dot`, :func:`render_svg`)."""
from __future__ import annotations

import html
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator, Sequence


from .. import ggml as G


_CACHE_NAME = re.compile(r"^cache_[kv]_l\d+$")
# ops that carry cache data on into a new tensor (the quantized K-shift: cast (a CPY op) -> rope -> cpy back)
_CACHE_FOLLOW_OPS = {G.GGMLOp.CPY, G.GGMLOp.ROPE, G.GGMLOp.SET_ROWS}


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

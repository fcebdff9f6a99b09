"""A radix tree over token ids: which cached entries hold which prefixes.

Pure bookkeeping (numpy, no ggml, no cache).  An *entry* is any hashable object (the prefix cache uses its device
and host entries, compared by identity) registered with its tokens; every node knows the entries whose tokens
start with the node's path (``holders``) and those that end exactly there (``ends``).  Edges are compressed: a node
has one child per distinct next token, and a node that no entry ends at and with a single child is merged into it.
Every entry ends at a node (an insertion splits the edge it ends in), so ``holders`` of a node are also the entries
sharing any prefix that ends inside the node's edge.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np

__all__ = ["Node", "RadixTree", "as_tokens", "common_prefix"]

_EMPTY = np.zeros(0, np.int32)


def as_tokens(tokens: Any, what: str = "tokens") -> np.ndarray:
    """int32 [n] from a sequence of token ids; ValueError for anything else."""
    if (type(tokens) is np.ndarray and tokens.dtype == np.int32 and tokens.ndim == 1 and tokens.size
            and (int(tokens[0]) if tokens.size == 1 else int(tokens.min())) >= 0):
        return tokens  # (the serving loop's case, a token or a chunk each step: no copy, one scan, none for one)
    a = np.asarray(tokens)
    if a.size == 0:
        return np.zeros(0, np.int32)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise ValueError(f"{what}: expected a 1-D sequence of token ids, got shape {a.shape} dtype {a.dtype}")
    if int(a.min()) < 0 or int(a.max()) > 2**31 - 1:
        raise ValueError(f"{what}: token ids must be in [0, 2**31), got [{int(a.min())}, {int(a.max())}]")
    return a.astype(np.int32, copy=False)


def common_prefix(a: np.ndarray, b: np.ndarray, limit: int) -> int:
    """Length of the common prefix of the int arrays ``a`` and ``b``, at most ``limit`` (one vectorised compare,
    no per-token loop)."""
    m = max(0, min(a.size, b.size, limit))
    neq = np.flatnonzero(a[:m] != b[:m])
    return int(neq[0]) if neq.size else m


def _common(edge: np.ndarray, tokens: np.ndarray, d: int, n: int) -> int:
    """Length of the common prefix of ``edge`` and ``tokens[d:n]``."""
    return common_prefix(edge, tokens[d:], n - d)


class Node:
    """One node: the tokens of the edge from its parent, its children and the entries below it."""

    __slots__ = ("edge", "children", "parent", "holders", "ends")

    def __init__(self, edge: np.ndarray, parent: "Node | None") -> None:
        self.edge = edge                           # int32 [n_edge] tokens from the parent (empty for the root)
        self.children: dict[int, Node] = {}        # first token of the child's edge -> child
        self.parent = parent                       # None for the root
        self.holders: set[Any] = set()             # entries whose tokens start with this node's path
        self.ends: set[Any] = set()                # entries whose tokens are exactly this node's path

    def depth(self) -> int:
        """Tokens from the root to the end of this node's edge."""
        d, node = 0, self
        while node is not None:
            d += node.edge.size
            node = node.parent
        return d


class RadixTree:
    """Entries indexed by their token ids; :meth:`match` finds the longest prefix any entry holds."""

    def __init__(self) -> None:
        self.root = Node(_EMPTY, None)
        self._end: dict[Any, Node] = {}   # entry -> the node its tokens end at

    def __len__(self) -> int:
        return len(self.root.holders)

    def __contains__(self, entry: Any) -> bool:
        return entry in self.root.holders

    # ------------------------------------------------------------------ updates

    def insert(self, entry: Any, tokens: np.ndarray) -> None:
        """Register ``entry`` as holding ``tokens`` (non-empty; the entry must not be in the tree)."""
        assert entry not in self.root.holders, "entry inserted twice"
        assert tokens.size > 0, "an entry without tokens holds no prefix"
        self.root.holders.add(entry)
        self._place(entry, self.root, tokens)

    def extend(self, entry: Any, tokens: np.ndarray, more: np.ndarray) -> None:
        """``entry`` held ``tokens`` and now holds ``tokens + more`` (the decode step): in place when it alone ends
        at a leaf, else placed below the node it ended at (the path above it is unchanged), else removed and
        inserted again."""
        node = self._end.get(entry)
        if node is None:
            self.insert(entry, np.concatenate([tokens, more]))
            return
        if not more.size:
            return
        if not node.children and len(node.holders) == 1:  # alone at a leaf: the edge grows
            node.edge = np.concatenate([node.edge, more])
            return
        node.ends.discard(entry)
        self._place(entry, node, more)
        if not node.ends and len(node.children) == 1:  # it went down the node's only child, which now folds in
            self._merge(node)

    def _place(self, entry: Any, node: Node, tokens: np.ndarray) -> None:
        """Register ``entry``, a holder of ``node`` already, as holding ``node``'s path + ``tokens`` (non-empty)."""
        d, n = 0, tokens.size
        while d < n:
            child = node.children.get(int(tokens[d]))
            if child is None:
                child = Node(tokens[d:].copy(), node)
                node.children[int(tokens[d])] = child
                d = n
            else:
                k = _common(child.edge, tokens, d, n)
                if k < child.edge.size:
                    child = self._split(child, k)
                d += k
            child.holders.add(entry)
            node = child
        node.ends.add(entry)
        self._end[entry] = node

    def remove(self, entry: Any, tokens: np.ndarray) -> None:
        """Unregister ``entry``, which holds ``tokens``; nodes left without entries go, single children merge."""
        path = self._path(tokens)
        assert path and entry in path[-1].ends, "entry not in the tree with these tokens"
        path[-1].ends.discard(entry)
        self.root.holders.discard(entry)
        del self._end[entry]
        for node in path:
            node.holders.discard(entry)
        for node in reversed(path):
            if not node.holders:
                del node.parent.children[int(node.edge[0])]
            elif not node.ends and len(node.children) == 1:
                self._merge(node)

    def _split(self, child: Node, k: int) -> Node:
        """Cut ``child``'s edge after k tokens; returns the new upper node."""
        parent = child.parent
        mid = Node(child.edge[:k].copy(), parent)
        mid.holders = set(child.holders)
        parent.children[int(mid.edge[0])] = mid
        child.edge = child.edge[k:].copy()
        child.parent = mid
        mid.children[int(child.edge[0])] = child
        return mid

    def _merge(self, node: Node) -> None:
        """Fold the only child of ``node`` (no entry ends at ``node``) into it."""
        (child,) = node.children.values()
        node.edge = np.concatenate([node.edge, child.edge])
        node.children = child.children
        for grandchild in node.children.values():
            grandchild.parent = node
        node.ends = child.ends
        for e in node.ends:
            self._end[e] = node

    def _path(self, tokens: np.ndarray) -> list[Node]:
        """The nodes spelling exactly ``tokens`` (empty list when the tree does not hold them)."""
        node, d, n, path = self.root, 0, tokens.size, []
        while d < n:
            child = node.children.get(int(tokens[d]))
            if child is None or child.edge.size > n - d or _common(child.edge, tokens, d, n) != child.edge.size:
                return []
            path.append(child)
            d += child.edge.size
            node = child
        return path

    # ------------------------------------------------------------------ queries

    def match(self, tokens: np.ndarray, limit: int | None = None) -> tuple[int, Node]:
        """(d, node): ``tokens[:d]`` is the longest prefix (at most ``limit`` tokens) that some entry holds, and
        ``node.holders`` are the entries holding it (the root, holding every entry, when d is 0)."""
        n = tokens.size if limit is None else min(limit, tokens.size)
        node, best, d = self.root, self.root, 0
        while d < n:
            child = node.children.get(int(tokens[d]))
            if child is None:
                break
            k = _common(child.edge, tokens, d, n)
            d += k
            best = child
            if k < child.edge.size:
                break
            node = child
        return d, best

    def ends_along(self, tokens: np.ndarray) -> list[Any]:
        """Entries whose tokens are a prefix of ``tokens`` (``tokens`` itself included), shortest first."""
        out: list[Any] = []
        node, d, n = self.root, 0, tokens.size
        while d < n:
            child = node.children.get(int(tokens[d]))
            if child is None or child.edge.size > n - d or _common(child.edge, tokens, d, n) != child.edge.size:
                break
            out.extend(child.ends)
            d += child.edge.size
            node = child
        return out

    def nodes(self) -> Iterator[tuple[Node, int]]:
        """(node, depth at the start of its edge), depth first, children in token order; the root first."""
        stack = [(self.root, 0)]
        while stack:
            node, d = stack.pop()
            yield node, d
            for tok in sorted(node.children, reverse=True):
                stack.append((node.children[tok], d + node.edge.size))

    def check(self, tokens_of: dict[Any, np.ndarray]) -> list[str]:
        """Every disagreement between the tree and ``tokens_of`` (entry -> tokens), and every broken node."""
        out = []
        if set(tokens_of) != self.root.holders:
            out.append(f"tree: holds {len(self.root.holders)} entries, expected {len(tokens_of)}")
        for e, toks in tokens_of.items():
            path = self._path(toks)
            if not path or e not in path[-1].ends or self._end.get(e) is not path[-1]:
                out.append(f"tree: entry {e!r} does not end at the node spelling its {toks.size} tokens")
        for node, _ in self.nodes():
            below = set(node.ends).union(*(c.holders for c in node.children.values()))
            if node is not self.root and below != node.holders:
                out.append(f"tree: node at depth {node.depth()} has holders {len(node.holders)}, its ends and "
                           f"children hold {len(below)}")
            if node is not self.root and (not node.holders or node.edge.size == 0):
                out.append(f"tree: empty node at depth {node.depth()}")
            if node is not self.root and not node.ends and len(node.children) == 1:
                out.append(f"tree: unmerged node at depth {node.depth()}")
            for tok, c in node.children.items():
                if c.parent is not node or int(c.edge[0]) != tok:
                    out.append(f"tree: child {tok} of the node at depth {node.depth()} is misfiled")
        return out

    def render(self, label: Callable[[Any], str], max_tokens: int = 6) -> str:
        """The tree as indented text: per node its token span, first tokens and the entries ending there."""
        lines = [f"(root) {len(self.root.holders)} entries"]
        for node, d in self.nodes():
            if node is self.root:
                continue
            indent = "  " * _level(node)
            toks = " ".join(str(t) for t in node.edge[:max_tokens].tolist())
            more = " ..." if node.edge.size > max_tokens else ""
            ends = ", ".join(sorted(label(e) for e in node.ends))
            lines.append(f"{indent}[{d}:{d + node.edge.size}] {toks}{more}  "
                         f"({len(node.holders)} below){'  <- ' + ends if ends else ''}")
        return "\n".join(lines)


def _level(node: Node) -> int:
    k = 0
    while node.parent is not None:
        k += 1
        node = node.parent
    return k

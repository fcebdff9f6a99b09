"""Count the native calls a piece of code makes through the binding layer (a test and benchmark helper).

``with NativeCalls() as nc: ...`` replaces, for the duration of the block, every C function the binding layer calls
(``kvcache_ggml.ggml.CALLS``, ctypes or compiled, which the binding layer's own helpers read at call time, and the
``G.ggml_*`` module attributes the rest of the package calls) by a counting wrapper, and counts the reads of a
``struct ggml_tensor`` through the binding layer's one accessor (``_tensor._c``: ``G.ne``, ``G.header``,
``G.to_numpy``, ...).  ``nc.calls`` maps C function name -> calls, ``nc.struct_reads`` is the count of struct
reads.  Nothing of this is in a hot path: the wrappers exist only inside the block.

Tests import it as ``from native_calls import NativeCalls`` (tests/ is on sys.path under pytest); benchmarks put
tests/ on sys.path first.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable

from kvcache_ggml import ggml as G
from kvcache_ggml.ggml import _calls, _tensor

__all__ = ["NativeCalls"]


class NativeCalls:
    """Counts C calls (by name) and tensor struct reads made inside a ``with`` block."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()   # C function name -> calls
        self.struct_reads = 0                   # struct ggml_tensor reads through the binding layer
        self._saved: dict[str, Any] = {}
        self._saved_c: Callable[..., Any] | None = None

    def total(self) -> int:
        """C calls made, all functions together."""
        return sum(self.calls.values())

    def reset(self) -> None:
        self.calls.clear()
        self.struct_reads = 0

    def _wrap(self, name: str, fn: Any) -> Callable[..., Any]:
        calls = self.calls

        def counted(*args: Any) -> Any:
            calls[name] += 1
            return fn(*args)

        counted.__name__ = name
        return counted

    def __enter__(self) -> "NativeCalls":
        table = _calls.CALLS
        self._saved = dict(table)
        for name, fn in self._saved.items():
            w = self._wrap(name, fn)
            table[name] = w
            setattr(G, name, w)
        inner = _tensor._c
        self._saved_c = inner

        def counted_c(t: Any) -> Any:
            self.struct_reads += 1
            return inner(t)

        _tensor._c = counted_c
        return self

    def __exit__(self, *exc: Any) -> None:
        table = _calls.CALLS
        for name, fn in self._saved.items():
            table[name] = fn
            setattr(G, name, fn)
        if self._saved_c is not None:
            _tensor._c = self._saved_c
        self._saved, self._saved_c = {}, None

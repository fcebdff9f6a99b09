"""A dead RPC server is an exception: the timeout of ggml's RPC connections and the check after a call.

ggml's RPC client, as pinned, aborts the process when an exchange with a server fails and waits forever on a
server that stopped answering.  ``build.py`` patches it (``RPC_PATCHES``; docs/parity.md, "A dead RPC server"):
its sockets get a send/receive timeout, the first failure shuts the socket down, and the call returns -- with
zeroed answers and a failed compute status -- after counting the failure.  This module is the Python side:

* :func:`set_rpc_timeout`: the timeout of connections made from then on (``RPC_TIMEOUT_S`` by default, set when
  the binding layer loads): a server silent that long during a call is taken for dead;
* :class:`RpcWatch`: the RPC buffers of one owner (a KV cache, a model's weights); :meth:`RpcWatch.lost` after a
  call answers, with one native call when nothing failed, which of its servers were lost;
* :class:`RpcServerLostError`: what the owner then raises, now and at every later use.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable

from ._calls import CALLS as _F
from ._lib import has
from ._types import _cstr

RPC_TIMEOUT_S = 8.0  # default send/receive timeout of an RPC connection: a server silent this long is dead
_RPC_STATUS_API = ("ggml_backend_rpc_set_timeout_ms", "ggml_backend_rpc_failure_count",
                   "ggml_backend_rpc_buffer_status", "ggml_backend_rpc_buffer_sync")
_ENDPOINT_IN_NAME = re.compile(r"\[([^\]]+)\]")  # "RPC0[127.0.0.1:50052]" -> "127.0.0.1:50052"


class RpcServerLostError(ConnectionError):
    """An RPC server stopped answering during a call (it crashed, was killed or stopped, the connection dropped, or
    it was silent past the timeout).  The data of every buffer on it is lost; ``endpoints`` names the servers."""

    def __init__(self, message: str, endpoints: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.endpoints = endpoints


_HAS_STATUS_API = all(has(n) for n in _RPC_STATUS_API)  # the table is fixed once the libraries are loaded


def rpc_status_api() -> bool:
    """True when this ggml's RPC client has build.py's patches (failures counted, not aborting)."""
    return _HAS_STATUS_API


_timeout_s = 0.0  # what the C side was last set to


def set_rpc_timeout(seconds: float) -> None:
    """The send/receive timeout of RPC connections opened from now on (a connection already open keeps its own).

    A call that waits longer than this for a server -- a stopped or hung server, or one computing a graph for
    longer -- fails, and the server is taken for lost.  0 waits forever (ggml's own behaviour: a stopped server
    then blocks the call).  ValueError outside 0..86400 s or under a millisecond."""
    global _timeout_s
    if not isinstance(seconds, (int, float)) or math.isnan(seconds) or not 0 <= seconds <= 86400:
        raise ValueError(f"RPC timeout {seconds!r}: expected 0 (none) to 86400 seconds")
    ms = round(seconds * 1000)
    if seconds and ms == 0:
        raise ValueError(f"RPC timeout {seconds!r} s is under the millisecond the sockets count in")
    if not rpc_status_api():
        raise RuntimeError("this ggml's RPC client has no timeout: rebuild with `python3 build.py` (its RPC patches)")
    _F["ggml_backend_rpc_set_timeout_ms"](ms)
    _timeout_s = ms / 1000


def rpc_timeout() -> float:
    """The timeout of new RPC connections, in seconds (0: none)."""
    return _timeout_s


def rpc_failure_count() -> int:
    """Failed exchanges with any RPC server since the process started (0 without build.py's RPC patches)."""
    return _F["ggml_backend_rpc_failure_count"]() if _HAS_STATUS_API else 0


def endpoint_of(buffer_name: str) -> str:
    """The server of an RPC buffer, from its name ("RPC0[127.0.0.1:50052]" -> "127.0.0.1:50052")."""
    m = _ENDPOINT_IN_NAME.search(buffer_name)
    return m.group(1) if m else buffer_name


@dataclass(slots=True)
class RpcWatch:
    """The RPC buffers of one owner and the failure count it last saw.  Inactive (no RPC buffer): every check is
    one attribute read."""

    buffers: tuple[tuple[int, str], ...]   # (ggml_backend_buffer_t, its server "host:port") of each RPC buffer
    seen: int                              # the process's RPC failure count at the last check

    @classmethod
    def of(cls, buffers: Iterable[int]) -> "RpcWatch":
        """A watch over those of ``buffers`` (ggml_backend_buffer_t) that live on RPC servers."""
        if not _HAS_STATUS_API:
            return cls((), 0)
        status = _F["ggml_backend_rpc_buffer_status"]
        name = _F["ggml_backend_buffer_name"]
        rpc = tuple((b, endpoint_of(_cstr(name(b)))) for b in buffers if b and status(b) >= 0)
        return cls(rpc, rpc_failure_count() if rpc else 0)

    @property
    def active(self) -> bool:
        return bool(self.buffers)

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(e for _, e in self.buffers))

    def lost(self, sync: bool = False) -> tuple[str, ...]:
        """The servers of this owner's buffers whose connection failed since the last check (empty: none).  One
        native call when no exchange failed anywhere since then.

        ``sync``: first a round trip to each server, for calls whose last commands get no answer (ggml sends
        tensor writes and graph computes without waiting): a connection cut after the client sent them is then
        found now rather than at the next call."""
        if not self.buffers:
            return ()
        if sync:
            first: dict[str, int] = {}
            for b, e in self.buffers:
                first.setdefault(e, b)
            for b in first.values():
                _F["ggml_backend_rpc_buffer_sync"](b)
        n = _F["ggml_backend_rpc_failure_count"]()
        if n == self.seen:
            return ()
        self.seen = n
        status = _F["ggml_backend_rpc_buffer_status"]
        return tuple(dict.fromkeys(e for b, e in self.buffers if status(b) == 1))


def lost_error(what: str, endpoints: tuple[str, ...], detail: str = "") -> RpcServerLostError:
    """The error of an owner whose servers ``endpoints`` were lost (``what``: "the KV cache", ...)."""
    servers = ", ".join(f"rpc://{e}" for e in endpoints)
    msg = (f"{what} lost its RPC server {servers}: the server stopped answering (crashed, killed, stopped, the "
           f"connection dropped, or silent past the {_timeout_s:g} s timeout); the data there is gone")
    return RpcServerLostError(msg + (f"; {detail}" if detail else ""), endpoints)


if _HAS_STATUS_API:
    set_rpc_timeout(RPC_TIMEOUT_S)

"""A stream's text chunks written to its socket by the engine thread, not through the event loop.

Each generated token of a streamed answer is one server-sent event.  Through the event loop it costs a wake-up of
the loop thread (which then takes the GIL from the engine thread), a task switch, the ASGI ``send`` and h11's
framing before the socket write: on two cores that is 0.2 ms of a 1.6 ms one-token step, which the engine thread
waits through.  Here the engine thread writes the chunk itself (HTTP/1.1 chunked framing, the bytes h11 writes for
the same data) with one non-blocking ``os.write``.

The pieces:

* :class:`Connections` -- the server's live connections by client address.  Its uvicorn protocol class
  (:meth:`Connections.protocol`, h11's with two hooks) registers each connection when it is made, and closes the
  connection's :class:`StreamSocket` objects when it is lost, *before* the transport closes the socket: the file
  descriptor is never written after its close, so never into another connection that reuses its number.
* :class:`StreamSocket` -- one streamed response's socket as the engine thread sees it: ``write`` under a lock
  that ``close`` also takes.  A write that does not go through whole hands the rest to the transport on the loop
  thread and ends the direct writes of that response.  ``OSError`` (the client went away) propagates: the engine
  cancels the request.
* :class:`DirectSink` -- a job's ``emit``: a text event goes to the socket while no event of the job that went
  through the loop is still unwritten (the order of the bytes is the order of the events), the end likewise at the
  engine's wake-up (below); anything else goes to the outbox as before.  A prompt read before the response's head
  is out (a short one) gives its first tokens to the loop; the later ones go direct once the loop has written
  those.

The app opens a stream's socket once the response's head and first chunk are out (nothing left in the transport's
buffer), only for HTTP/1.1 without TLS, and only on a server of one slot (``--parallel 1``), where a stream is the
only one running; it closes it when the response ends, whatever ended it.  With several slots the loop thread
writes a step's chunks, one wake-up for all, beside the engine's next compute: there the engine thread writing
each request's chunk itself (while it ran alone) gained nothing at 4 and 8 users (docs/serving.md).

The end of a response goes the same way: the last chunks (the finish reason, the usage, ``[DONE]``) and the chunked
body's last chunk (``0\r\n\r\n``), in one write.  The sink holds it until the engine's wake-up after the step
(:meth:`DirectSink.finish`, after the step's snapshot is published: a client that saw its answer end then reads
/metrics with it counted), then writes it and hands the end event to the loop, which completes the response in
h11 and uvicorn.  The last chunk uvicorn then writes is dropped by the connection's :class:`TransportTap`, which
uvicorn writes through (the protocol class passes it in place of the transport).  Through the loop, a response's
end reached the client 0.4-0.5 ms after its last token (a wake-up, a task switch, three ASGI sends).

Errors, text with logprobs and a stream whose socket did not open take the loop's path, so a response is the same
bytes either way.
"""
from __future__ import annotations

import asyncio
import os
import threading
from typing import Any, Callable

__all__ = ["Connections", "DirectSink", "LAST_CHUNK", "StreamSocket", "TransportTap", "frame"]

LAST_CHUNK = b"0\r\n\r\n"  # the last chunk of a chunked body, without trailers (what h11 writes at the end)


def frame(data: bytes) -> bytes:
    """``data`` as one chunk of HTTP/1.1 chunked transfer coding (RFC 9112 7.1), as h11 frames a body's data."""
    return b"%x\r\n%s\r\n" % (len(data), data)


class StreamSocket:
    """A streamed response's socket, written by the engine thread while the response is open (see the module)."""

    def __init__(self, fd: int, transport: asyncio.WriteTransport, loop: asyncio.AbstractEventLoop,
                 tap: TransportTap | None = None) -> None:
        self._lock = threading.Lock()       # held by write and close: the fd is never written after close()
        self._fd = fd                       # the connection's socket, -1 once closed
        self._transport = transport         # where the rest of a short write goes (on the loop thread)
        self._loop = loop
        self._tap = tap                     # what uvicorn writes through (None: no write may end the body)
        self.chunks = 0                     # chunks written whole by write(), the body's end apart

    @property
    def open(self) -> bool:
        return self._fd >= 0

    @property
    def can_end(self) -> bool:
        """Whether a write may end the response's body (:meth:`write` with ``last``)."""
        return self._tap is not None

    def write(self, data: bytes, last: bool = False) -> bool:
        """Send ``data`` (framed bytes) now; False when closed (nothing sent: the caller takes the loop's path).
        ``last``: ``data`` ends the body (it ends with :data:`LAST_CHUNK`), and the last chunk uvicorn writes
        when the app completes the response is dropped.  A short write sends the rest through the transport and
        closes this socket for later writes; ``OSError`` when the connection is gone (closed too)."""
        with self._lock:
            if self._fd < 0:
                return False
            assert not last or (self._tap is not None and data.endswith(LAST_CHUNK)), "a write that ends the body"
            try:
                n = os.write(self._fd, data)
            except BlockingIOError:
                n = 0
            except OSError:
                self._fd = -1
                raise
            if last:  # (the bytes are out or on their way: the loop completes the response after this returns)
                self._tap.drop_once(LAST_CHUNK)
            if n == len(data):
                self.chunks += not last
                return True
            self._fd = -1  # (the transport now holds bytes: everything after them goes that way too)
            self._loop.call_soon_threadsafe(self._transport.write, data[n:])
            return True

    def flushed(self) -> bool:
        """The transport holds no bytes it has not sent (the loop thread)."""
        return not self._transport.get_write_buffer_size()

    def close(self) -> None:
        """No write after this one returns (idempotent)."""
        with self._lock:
            self._fd = -1


class DirectSink:
    """A job's ``emit``: its text events to its stream's socket once the app has armed it (:meth:`arm`) and while no
    event the job queued for the loop is still unwritten; every other event to ``queue_put`` (the loop's path),
    whose writes the app reports with :meth:`delivered`.  The bytes go out in the order of the events.  An event
    whose bytes end the response (the end) is held for :meth:`finish`: written then, and handed to the loop
    either way (:attr:`ended` says whether its bytes are out)."""

    __slots__ = ("_lock", "_socket", "_encode", "_queue_put", "_hold", "_held", "_pending", "ended")

    def __init__(self, queue_put: Callable[[Any], None],
                 hold: Callable[["DirectSink"], None] | None = None) -> None:
        self._lock = threading.Lock()             # the engine thread's emit against the loop thread's arm/delivered
        self._socket: StreamSocket | None = None  # set by the loop thread once the response's head is out
        self._encode: Callable[[Any], tuple[bytes, bool] | None] | None = None  # an event's framed bytes and
        #                                           whether they end the body; None: the loop's path
        self._queue_put = queue_put               # the outbox's path
        self._hold = hold                         # registers this sink for a finish() at the engine's wake-up
        #                                           (None: an end always takes the loop's path)
        self._held: tuple[bytes, Any] | None = None  # the end's bytes and event, until finish()
        self._pending = 0                         # events queued for the loop and not yet written by it
        self.ended = False                        # the end's bytes went to the socket: the loop writes nothing

    @property
    def pending(self) -> int:
        """Events queued for the loop and not yet written by it."""
        return self._pending

    def arm(self, socket: StreamSocket, encode: Callable[[Any], tuple[bytes, bool] | None]) -> None:
        """From now on the events ``encode`` frames may go to ``socket`` (the loop thread, once)."""
        with self._lock:
            self._encode = encode
            self._socket = socket

    def delivered(self, n: int) -> None:
        """The loop thread wrote ``n`` more of the queued events to the transport, which holds nothing unsent."""
        with self._lock:
            self._pending -= n
            assert self._pending >= 0, self._pending

    def __call__(self, ev: Any) -> None:
        with self._lock:
            s = self._socket
            if s is not None and not self._pending:
                got = self._encode(ev)
                if got is not None:
                    data, last = got
                    if not last:
                        if s.write(data):
                            return
                    elif self._hold is not None and s.can_end:
                        self._held = (data, ev)
                        self._hold(self)
                        return
            self._pending += 1
        self._queue_put(ev)

    def finish(self) -> None:
        """Write the held end (the engine thread, at its wake-up after the step), then hand its event to the loop,
        which completes the response: writing nothing more when the bytes went out (:attr:`ended`), else the
        event's own chunks (a socket closed meanwhile; a connection gone, where the loop then finds it gone)."""
        with self._lock:
            assert self._held is not None, "finish() without a held end"
            (data, ev), self._held = self._held, None
            s = self._socket
            try:
                self.ended = s is not None and s.write(data, last=True)
            except OSError:
                self.ended = False
            if not self.ended:
                self._pending += 1
        self._queue_put(ev)


class TransportTap:
    """A connection's transport as uvicorn writes it: every call passes through, except the one write of exactly
    the bytes :meth:`drop_once` names (the body's last chunk, after the engine thread wrote it itself)."""

    __slots__ = ("_transport", "_drop")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._drop: bytes | None = None  # the next write equal to this is dropped (then None)

    def drop_once(self, data: bytes) -> None:
        self._drop = data

    def write(self, data: Any) -> None:
        if self._drop is not None and data == self._drop:
            self._drop = None
            return
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class Connections:
    """The server's live HTTP connections by client address: each one's transport, the tap uvicorn writes through
    and its open stream sockets."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[tuple, tuple[asyncio.Transport, TransportTap | None, set[StreamSocket]]] = {}

    def __len__(self) -> int:
        return len(self._live)

    def made(self, client: Any, transport: asyncio.Transport, tap: TransportTap | None = None) -> None:
        """A connection is made (``tap``: what uvicorn writes through; None: no direct write ends a body)."""
        if client is not None:
            with self._lock:
                self._live[tuple(client)] = (transport, tap, set())

    def lost(self, client: Any) -> None:
        """The connection is gone: its stream sockets are closed (before the transport closes the socket)."""
        if client is None:
            return
        with self._lock:
            got = self._live.pop(tuple(client), None)
        if got is not None:
            for s in list(got[2]):
                s.close()

    def open(self, scope: dict) -> StreamSocket | None:
        """The stream socket of the request ``scope``'s connection, or None where the engine thread must not write
        to it: not a connection of this registry, not HTTP/1.1 (chunked), TLS, or bytes still in the transport."""
        client = scope.get("client")
        if scope.get("http_version") != "1.1" or scope.get("scheme") != "http" or client is None:
            return None
        with self._lock:
            got = self._live.get(tuple(client))
            if got is None:
                return None
            transport, tap, streams = got
            sock = transport.get_extra_info("socket")
            if sock is None or transport.is_closing() or transport.get_write_buffer_size():
                return None
            s = StreamSocket(sock.fileno(), transport, asyncio.get_running_loop(), tap)
            streams.add(s)
            return s

    def release(self, scope: dict, s: StreamSocket) -> None:
        """The response of ``s`` ended: closed and forgotten."""
        s.close()
        with self._lock:
            got = self._live.get(tuple(scope.get("client") or ()))
            if got is not None:
                got[2].discard(s)

    def protocol(self) -> type:
        """uvicorn's h11 protocol class, registering its connections here (``uvicorn.Config(http=...)``); it
        writes through a :class:`TransportTap` of each one."""
        from uvicorn.protocols.http.h11_impl import H11Protocol

        conns = self

        class Protocol(H11Protocol):
            def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
                tap = TransportTap(transport)
                super().connection_made(tap)  # type: ignore[arg-type]
                conns.made(self.client, transport, tap)

            def connection_lost(self, exc: Exception | None) -> None:
                conns.lost(self.client)
                super().connection_lost(exc)

        return Protocol

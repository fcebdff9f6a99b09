"""A loopback proxy in front of a ggml RPC server that can cut the connection at any message (tests only).

ggml's RPC protocol (ggml-rpc.cpp): the client sends requests ``| cmd (1 byte) | size (8 bytes, LE) | payload |``;
the server answers each, except SET_TENSOR, GRAPH_COMPUTE and GRAPH_RECOMPUTE, with ``| size (8) | payload |``.
The proxy relays one request (and its answer) at a time, so it knows where every message begins, counts the
requests and, once armed, cuts both connections at the k-th request from then on: before relaying it, or after
relaying it and taking the server's answer (the client then never sees the answer).
"""
from __future__ import annotations

import socket
import struct
import threading

_NO_REPLY = frozenset({6, 10, 16})  # RPC_CMD_SET_TENSOR, RPC_CMD_GRAPH_COMPUTE, RPC_CMD_GRAPH_RECOMPUTE


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
        except OSError:
            return None
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _kill(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()


class CutProxy:
    """Listens on 127.0.0.1 (``endpoint``) and relays every client to the RPC server at ``upstream``."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._listen.getsockname()[1]}"
        self.spec = f"rpc://{self.endpoint}"
        self._lock = threading.Lock()
        self.n_requests = 0                 # requests relayed or cut, all connections, since the start
        self._cut_at: int | None = None     # the request number to cut at (None: relay everything)
        self._cut_after = False             # cut after relaying it and taking the answer (else before relaying)
        self.cut_done = threading.Event()   # set when the armed cut happened
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)
        self._thread.start()

    def arm(self, k: int, after: bool) -> None:
        """Cut at the k-th request from now on (k >= 1): before relaying it, or (``after``) once the server has
        answered it, without passing the answer on."""
        assert k >= 1
        with self._lock:
            self._cut_at = self.n_requests + k
            self._cut_after = after
            self.cut_done.clear()

    def disarm(self) -> None:
        with self._lock:
            self._cut_at = None

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listen.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._relay, args=(client, server), daemon=True).start()

    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        while True:
            head = _recv_exact(client, 9)
            payload = b"" if head is None else _recv_exact(client, struct.unpack_from("<Q", head, 1)[0])
            if head is None or payload is None:
                _kill(client, server)
                return
            with self._lock:
                self.n_requests += 1
                cut = self.n_requests == self._cut_at
                after = self._cut_after
            if cut and not after:
                self._cut(client, server)
                return
            try:
                server.sendall(head + payload)
            except OSError:
                _kill(client, server)
                return
            if head[0] not in _NO_REPLY:
                size = _recv_exact(server, 8)
                answer = None if size is None else _recv_exact(server, struct.unpack("<Q", size)[0])
                if size is None or answer is None:
                    _kill(client, server)
                    return
                if not cut:
                    try:
                        client.sendall(size + answer)
                    except OSError:
                        _kill(client, server)
                        return
            if cut:
                self._cut(client, server)
                return

    def _cut(self, client: socket.socket, server: socket.socket) -> None:
        with self._lock:
            self._cut_at = None
        self.cut_done.set()  # before the client can see the cut
        _kill(client, server)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _kill(self._listen)

    def __enter__(self) -> "CutProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

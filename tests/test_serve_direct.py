"""Streams written by the engine thread (kvcache_ggml/serve/direct.py): the framing against h11's own, the socket's
short writes and close against a real asyncio transport, the sink's order of events, the connection registry, and
a served stream through the real client (the same text as the plain answer, the chunks counted in /metrics)."""
from __future__ import annotations

import asyncio
import socket
import threading
import time
import urllib.request

import pytest

from kvcache_ggml.serve.direct import Connections, DirectSink, StreamSocket, frame

h11 = pytest.importorskip("h11")


def _h11_chunks(pieces: list[bytes]) -> bytes:
    """The bytes h11 writes for ``pieces`` as the data of a chunked HTTP/1.1 response (an independent framing)."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert isinstance(conn.next_event(), h11.Request)
    conn.send(h11.Response(status_code=200, headers=[("content-type", "text/event-stream")]))
    return b"".join(conn.send(h11.Data(data=p)) for p in pieces)


@pytest.mark.parametrize("size", [1, 9, 15, 16, 255, 256, 4097, 70000])
def test_frame_is_h11s_chunk(size):
    data = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    assert len(data) == size
    assert frame(data) == _h11_chunks([data])
    assert frame(data) == f"{size:x}".encode() + b"\r\n" + data + b"\r\n"


class _Reader(asyncio.Protocol):
    def __init__(self) -> None:
        self.got = bytearray()

    def data_received(self, data: bytes) -> None:
        self.got += data


async def _pair(sndbuf: int | None = None):
    """A connected socket pair, the first end under an asyncio transport (as uvicorn's connections are)."""
    a, b = socket.socketpair()
    if sndbuf:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sndbuf)
    transport, _ = await asyncio.get_running_loop().connect_accepted_socket(asyncio.Protocol, a)
    return transport, b


def test_stream_socket_writes_whole_chunks_and_none_after_close():
    async def main():
        transport, peer = await _pair()
        s = StreamSocket(transport.get_extra_info("socket").fileno(), transport, asyncio.get_running_loop())
        assert s.open and s.write(b"abc") and s.write(b"defg") and s.chunks == 2
        s.close()
        assert not s.open and not s.write(b"xyz") and s.chunks == 2
        peer.setblocking(False)
        got = peer.recv(100)
        transport.close()
        peer.close()
        return got

    assert asyncio.run(main()) == b"abcdefg"


def test_short_write_sends_the_rest_through_the_transport_in_order():
    """A write the socket takes only in part: the rest goes through the transport (before anything queued on the
    loop after it), and the socket takes no more direct writes."""
    async def main():
        loop = asyncio.get_running_loop()
        transport, peer = await _pair(sndbuf=4096)
        s = StreamSocket(transport.get_extra_info("socket").fileno(), transport, loop)
        big = bytes(i % 251 for i in range(1 << 20))
        order = []
        done = threading.Event()

        def engine():  # (the engine thread's side)
            assert s.write(big)
            loop.call_soon_threadsafe(lambda: (order.append("after"), transport.write(b"TAIL")))
            assert not s.write(b"never")
            done.set()

        threading.Thread(target=engine).start()
        peer_t, reader = await loop.connect_accepted_socket(_Reader, peer)
        t0 = loop.time()
        while (not done.is_set() or len(reader.got) < len(big) + 4) and loop.time() - t0 < 20:
            await asyncio.sleep(0.01)
        assert s.chunks == 0 and not s.open  # (short: not counted as a whole chunk)
        transport.close()
        peer_t.close()
        return bytes(reader.got), order

    got, order = asyncio.run(main())
    assert order == ["after"]
    assert got == bytes(i % 251 for i in range(1 << 20)) + b"TAIL"


def test_write_to_a_closed_peer_raises_and_closes():
    async def main():
        transport, peer = await _pair()
        s = StreamSocket(transport.get_extra_info("socket").fileno(), transport, asyncio.get_running_loop())
        peer.close()
        with pytest.raises(OSError):
            for _ in range(100):  # (the first writes may land in the buffer before the reset is seen)
                s.write(b"x" * 1000)
        assert not s.open and not s.write(b"y")
        transport.close()

    asyncio.run(main())


class _Sock:
    """A stand-in socket for the sink's logic: records what it was given, can be closed."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> bool:
        if self.closed:
            return False
        self.sent.append(data)
        return True


def test_sink_keeps_the_order_of_events():
    """Text goes to the socket only while every event of the job that went the loop's way has been written by it
    (delivered); an event the socket cannot take (not text, not armed yet, socket closed) goes the loop's way."""
    def run(script):
        queued, sock = [], _Sock()
        sink = DirectSink(queued.append)
        for op in script.split():
            if op == "arm":
                sink.arm(sock, lambda e: e.encode() if e.startswith("t") else None)  # ("t...": plain text)
            elif op == "close":
                sock.closed = True
            elif op.startswith("delivered"):
                sink.delivered(int(op[9:]))
            else:
                sink(op)
        return " ".join(d.decode() for d in sock.sent), " ".join(queued)

    assert run("arm t1 t2 t3") == ("t1 t2 t3", "")
    assert run("t1 arm t2 t3") == ("", "t1 t2 t3")
    assert run("t1 arm t2 delivered1 t3") == ("", "t1 t2 t3")
    assert run("t1 arm t2 delivered2 t3 t4") == ("t3 t4", "t1 t2")
    assert run("arm t1 done t2 delivered1 t3") == ("t1", "done t2 t3")
    assert run("arm t1 done t2 delivered2 t3") == ("t1 t3", "done t2")
    assert run("arm t1 l2 t3 delivered1 t4") == ("t1", "l2 t3 t4")  # (text the encoder refuses: logprobs)
    assert run("arm t1 close t2 delivered1 t3") == ("t1", "t2 t3")
    sink = DirectSink(lambda ev: None)
    with pytest.raises(AssertionError):
        sink.delivered(1)


def test_connections_open_only_where_the_engine_may_write():
    async def main():
        conns = Connections()
        transport, peer = await _pair()
        client = ("127.0.0.1", 5555)
        scope = {"client": list(client), "http_version": "1.1", "scheme": "http"}
        assert conns.open(scope) is None  # (not registered)
        conns.made(client, transport)
        assert len(conns) == 1
        for bad in ({"http_version": "1.0"}, {"scheme": "https"}, {"client": None}):
            assert conns.open({**scope, **bad}) is None
        s1, s2 = conns.open(scope), conns.open(scope)
        assert s1.open and s2.open
        conns.release(scope, s1)
        assert not s1.open and s2.open
        conns.lost(client)  # (uvicorn's connection_lost: before the transport closes the socket)
        assert not s2.open and not s2.write(b"x") and len(conns) == 0
        conns.lost(client)  # (idempotent)
        transport.close()
        peer.close()

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------- served

openai = pytest.importorskip("openai")

from serve_helpers import LiveServer, make_chat_model  # noqa: E402


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("direct") / "chat.gguf")


def _serve(path, parallel: int) -> LiveServer:
    return LiveServer(["--model", str(path), "--alias", "tiny", "--parallel", str(parallel), "-kvu", "--n-ctx",
                       "1024", "--threads", "2", "-ctk", "f32", "-ctv", "f32"])


@pytest.fixture(scope="module")
def server(model_path):
    s = _serve(model_path, 1)
    yield s
    s.close()


def _direct(server) -> int:
    text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    return int(next(line.split()[1] for line in text.splitlines()
                    if line.startswith("kvcache_stream_chunks_direct_total ")))


def _after(server, before: int) -> int:
    """The direct chunks counted once the last stream's response has ended (it is counted then)."""
    t0 = time.monotonic()
    while (n := _direct(server)) == before and time.monotonic() - t0 < 5:
        time.sleep(0.02)
    return n


def _stream_text(stream) -> str:
    out = []
    for c in stream:
        if c.choices:
            d = c.choices[0]
            out.append(d.delta.content or "" if hasattr(d, "delta") else d.text)
    return "".join(out)


KW = dict(model="tiny", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})


def test_a_one_slot_server_streams_from_the_engine_thread(server):
    cl = server.client()
    msgs = [{"role": "user", "content": "Tell me about rivers."}]
    plain = cl.chat.completions.create(messages=msgs, **KW).choices[0].message.content
    before = _direct(server)
    assert _stream_text(cl.chat.completions.create(messages=msgs, stream=True, **KW)) == plain
    n = _after(server, before)
    assert 0 < n - before <= 24
    plain = cl.completions.create(prompt="Once upon a time", **KW).choices[0].text
    assert _stream_text(cl.completions.create(prompt="Once upon a time", stream=True, **KW)) == plain
    assert 0 < _after(server, n) - n <= 24


def test_logprobs_and_queued_streams(server):
    """Text with logprobs is never written directly; two streams at once on one slot (the second waits in the
    queue): each one's text is its plain answer."""
    cl = server.client()
    before = _direct(server)
    chunks = list(cl.completions.create(prompt="The weather", stream=True, logprobs=2, **KW))
    assert sum(1 for c in chunks if c.choices and c.choices[0].logprobs) >= 23
    time.sleep(0.3)
    assert _direct(server) == before
    prompts = ["A story about a mountain", "Numbers and letters and more"]
    plain = [cl.completions.create(prompt=p, **KW).choices[0].text for p in prompts]
    got: list[str | None] = [None, None]

    def one(i: int) -> None:
        got[i] = _stream_text(server.client().completions.create(prompt=prompts[i], stream=True, **KW))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == plain
    assert _after(server, before) > before


def test_a_closed_stream_cancels_its_request(server):
    """The client closes a direct stream mid-way: the engine's next write fails and the request ends (cancelled);
    the server serves the next request."""
    cl = server.client()
    cancelled = server.engine.stats.requests_cancelled
    stream = cl.completions.create(prompt="A long one", stream=True, **{**KW, "max_tokens": 400})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    server.wait_idle()
    assert server.engine.stats.requests_cancelled == cancelled + 1
    plain = cl.completions.create(prompt="Once upon a time", **KW).choices[0].text
    assert _stream_text(cl.completions.create(prompt="Once upon a time", stream=True, **KW)) == plain


def test_several_slots_stream_through_the_loop(model_path):
    s = _serve(model_path, 2)
    try:
        cl = s.client()
        plain = cl.completions.create(prompt="Once upon a time", **KW).choices[0].text
        assert _stream_text(cl.completions.create(prompt="Once upon a time", stream=True, **KW)) == plain
        time.sleep(0.3)
        assert _direct(s) == 0
    finally:
        s.close()


def test_tokens_emitted_before_the_socket_opens_go_first(server, monkeypatch):
    """The loop thread opens the socket only after the engine has emitted several tokens (held up here): those go
    through the loop, and the engine thread writes the rest once the loop has written them; the text is whole and
    in order."""
    import kvcache_ggml.serve.app as app

    opened = app._Api.open_direct

    def late(self, p, request):
        t0 = time.monotonic()
        while p.sink.pending < 3 and time.monotonic() - t0 < 5:  # (the loop thread is held up: nothing is written)
            time.sleep(0.001)
        assert p.sink.pending >= 3
        return opened(self, p, request)

    monkeypatch.setattr(app._Api, "open_direct", late)
    cl = server.client()
    kw = {**KW, "max_tokens": 40}
    plain = cl.completions.create(prompt="Rivers and mountains", **kw).choices[0].text
    before = _direct(server)
    assert _stream_text(cl.completions.create(prompt="Rivers and mountains", stream=True, **kw)) == plain
    assert 0 < _after(server, before) - before < 40

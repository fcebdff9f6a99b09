"""Streams written by the engine thread (kvcache_ggml/serve/direct.py): the framing against h11's own, the socket's
short writes and close against a real asyncio transport, the sink's order of events, the connection registry, and
a served stream through the real client (the same text as the plain answer, the chunks counted in /metrics)."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
import urllib.request

import pytest

from kvcache_ggml.serve.direct import LAST_CHUNK, Connections, DirectSink, StreamSocket, TransportTap, frame

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
    """A stand-in socket for the sink's logic: records what it was given (an end marked "|"), can be closed."""

    can_end = True

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.closed = False

    def write(self, data: bytes, last: bool = False) -> bool:
        if self.closed:
            return False
        self.sent.append(data + b"|" * last)
        return True


def _run_sink(script: str, hold: bool = True) -> tuple[str, str]:
    """A sink driven by ``script``: "tN" text, "lN" text the encoder refuses (logprobs), "eN" an end (its bytes end
    the body), "arm", "close", "deliveredN", "wake" (the engine's wake-up: held ends finished).  What went to the
    socket, and what to the loop's queue."""
    queued, sock, held = [], _Sock(), []
    sink = DirectSink(queued.append, held.append if hold else None)
    for op in script.split():
        if op == "arm":
            sink.arm(sock, lambda e: (e.encode(), e[0] == "e") if e[0] in "te" else None)
        elif op == "close":
            sock.closed = True
        elif op.startswith("delivered"):
            sink.delivered(int(op[9:]))
        elif op == "wake":
            while held:
                held.pop(0).finish()
        else:
            sink(op)
    return " ".join(d.decode() for d in sock.sent), " ".join(queued)


def test_sink_keeps_the_order_of_events():
    """Text goes to the socket only while every event of the job that went the loop's way has been written by it
    (delivered); an event the socket cannot take (not armed yet, socket closed, refused) goes the loop's way."""
    assert _run_sink("arm t1 t2 t3") == ("t1 t2 t3", "")
    assert _run_sink("t1 arm t2 t3") == ("", "t1 t2 t3")
    assert _run_sink("t1 arm t2 delivered1 t3") == ("", "t1 t2 t3")
    assert _run_sink("t1 arm t2 delivered2 t3 t4") == ("t3 t4", "t1 t2")
    assert _run_sink("arm t1 d t2 delivered1 t3") == ("t1", "d t2 t3")  # ("d": an event the encoder refuses)
    assert _run_sink("arm t1 d t2 delivered2 t3") == ("t1 t3", "d t2")
    assert _run_sink("arm t1 l2 t3 delivered1 t4") == ("t1", "l2 t3 t4")
    assert _run_sink("arm t1 close t2 delivered1 t3") == ("t1", "t2 t3")
    sink = DirectSink(lambda ev: None)
    with pytest.raises(AssertionError):
        sink.delivered(1)


def test_sink_holds_the_end_for_the_wake_up():
    """An end is held until the engine's wake-up, then written (and marked as ending the body) and handed to the
    loop all the same, without counting as pending; it takes the loop's way (pending) where the socket cannot take
    it then, or without a wake-up to hold it for."""
    assert _run_sink("arm t1 e2") == ("t1", "")  # (held)
    assert _run_sink("arm t1 e2 wake") == ("t1 e2|", "e2")
    assert _run_sink("arm t1 e2 close wake") == ("t1", "e2")
    assert _run_sink("t1 arm t2 e3 wake") == ("", "t1 t2 e3")  # (pending: the loop writes the end)
    assert _run_sink("arm t1 e2 wake", hold=False) == ("t1", "e2")
    queued, held = [], []
    sink = DirectSink(queued.append, held.append)
    sock = _Sock()
    sink.arm(sock, lambda e: (e.encode(), e[0] == "e"))
    sink("e1")
    assert held == [sink] and not sink.ended and sink.pending == 0 and queued == []
    sink.finish()
    assert sink.ended and sink.pending == 0 and queued == ["e1"] and sock.sent == [b"e1|"]
    with pytest.raises(AssertionError):
        sink.finish()  # (nothing held)
    gone, held = [], []
    sink = DirectSink(gone.append, held.append)
    sink.arm(sock, lambda e: (e.encode(), True))
    sink("e2")
    sock.write = lambda data, last=False: (_ for _ in ()).throw(BrokenPipeError())  # (the client went away)
    held[0].finish()
    assert not sink.ended and sink.pending == 1 and gone == ["e2"]


def test_transport_tap_drops_the_named_write_once():
    got = []

    class T:
        def write(self, data):
            got.append(bytes(data))

        def get_extra_info(self, name):
            return f"info {name}"

    tap = TransportTap(T())
    tap.write(b"a")
    tap.write(LAST_CHUNK)
    tap.drop_once(LAST_CHUNK)
    tap.write(b"b")
    tap.write(b"")
    tap.write(LAST_CHUNK)
    tap.write(LAST_CHUNK)
    assert got == [b"a", LAST_CHUNK, b"b", b"", LAST_CHUNK]
    assert tap.get_extra_info("peername") == "info peername"


@pytest.mark.parametrize("short", [False, True])
def test_an_end_written_whole_or_short_drops_uvicorns_last_chunk(monkeypatch, short):
    """``write(..., last=True)`` on a real transport: the tap then drops the last chunk uvicorn writes.  A short
    write (here one that leaves exactly the last chunk) sends its rest through the transport itself, not the tap:
    the rest is not dropped."""
    import kvcache_ggml.serve.direct as direct

    if short:
        real = os.write
        monkeypatch.setattr(direct.os, "write", lambda fd, data: real(fd, data[:-len(LAST_CHUNK)]))

    async def main():
        loop = asyncio.get_running_loop()
        transport, peer = await _pair()
        tap = TransportTap(transport)
        s = StreamSocket(transport.get_extra_info("socket").fileno(), transport, loop, tap)
        assert s.can_end and not StreamSocket(-1, transport, loop).can_end
        body = frame(b"data: the end\n\n") + LAST_CHUNK
        assert s.write(body, last=True)
        assert s.open != short and s.chunks == 0  # (the end is not a text chunk)
        loop.call_soon(tap.write, LAST_CHUNK)  # (uvicorn completing the response: dropped)
        loop.call_soon(tap.write, b"NEXT")     # (the next response's bytes: written)
        peer_t, reader = await loop.connect_accepted_socket(_Reader, peer)
        t0 = loop.time()
        while len(reader.got) < len(body) + 4 and loop.time() - t0 < 10:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        transport.close()
        peer_t.close()
        return bytes(reader.got), body

    got, body = asyncio.run(main())
    assert got == body + b"NEXT"
    with pytest.raises(AssertionError):
        StreamSocket(5, None, None).write(b"x", last=True)  # (no tap)


def test_connections_open_only_where_the_engine_may_write():
    async def main():
        conns = Connections()
        transport, peer = await _pair()
        client = ("127.0.0.1", 5555)
        scope = {"client": list(client), "http_version": "1.1", "scheme": "http"}
        assert conns.open(scope) is None  # (not registered)
        conns.made(client, transport, TransportTap(transport))
        assert len(conns) == 1
        for bad in ({"http_version": "1.0"}, {"scheme": "https"}, {"client": None}):
            assert conns.open({**scope, **bad}) is None
        s1, s2 = conns.open(scope), conns.open(scope)
        assert s1.open and s2.open and s1.can_end
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


def _metric(server, name: str) -> int:
    text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith(f"kvcache_{name} ")))


def _direct(server) -> int:
    return _metric(server, "stream_chunks_direct_total")


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
    before, ends = _direct(server), _metric(server, "stream_ends_direct_total")
    assert _stream_text(cl.chat.completions.create(messages=msgs, stream=True, **KW)) == plain
    n = _after(server, before)
    assert 0 < n - before <= 24
    plain = cl.completions.create(prompt="Once upon a time", **KW).choices[0].text
    assert _stream_text(cl.completions.create(prompt="Once upon a time", stream=True, **KW)) == plain
    assert 0 < _after(server, n) - n <= 24
    assert _metric(server, "stream_ends_direct_total") == ends + 2  # (counted with the chunks, in one finally)


def _read_stream(resp) -> list:
    """A streamed response's events as http.client reads them (chunked coding undone): the JSON objects, then
    "[DONE]"; the response read to the end of its body."""
    body = resp.read().decode()
    events = body.split("\n\n")
    assert events[-1] == "" and all(e.startswith("data: ") for e in events[:-1]), body
    return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in events[:-1]]


@pytest.mark.parametrize("usage", [False, True])
def test_ends_written_by_the_engine_keep_the_connection_whole(server, usage):
    """Streams one after another on one keep-alive connection (http.client's, an independent parser of chunked
    coding): each ends with its finish reason, its usage when asked for and [DONE], once, and the next response
    follows cleanly; the requests are counted in /metrics as soon as a stream has ended."""
    import http.client

    host, port = server.url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    ends = _metric(server, "stream_ends_direct_total")
    for i in range(3):
        requests = _metric(server, "requests_total")
        body = {"model": "tiny", "prompt": f"Story number {i}", "max_tokens": 12 + i, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": usage}}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("transfer-encoding") == "chunked"
        events = _read_stream(resp)
        assert _metric(server, "requests_total") == requests + 1
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        finals = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
        assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
        if usage:
            assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 12 + i
        else:
            assert events[-2] is finals[0]
        text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
        plain = server.client().completions.create(prompt=f"Story number {i}", **{**KW, "max_tokens": 12 + i})
        assert text == plain.choices[0].text
    conn.close()
    t0 = time.monotonic()  # (counted once the loop has completed each response, after its client saw the end)
    while _metric(server, "stream_ends_direct_total") < ends + 3 and time.monotonic() - t0 < 1:
        time.sleep(0.02)
    # (an end goes the loop's way where a token the loop carried is not written yet: a slow loop, a short answer)
    assert ends + 1 <= _metric(server, "stream_ends_direct_total") <= ends + 3


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


def test_a_failed_end_leaves_uvicorns_last_chunk_alone(monkeypatch):
    """A write of the end that fails (the connection gone, or any OSError) drops nothing: the end then takes the
    loop's way, whose last chunk must reach the client."""
    import kvcache_ggml.serve.direct as direct

    def fail(fd, data):
        raise ConnectionResetError()

    monkeypatch.setattr(direct.os, "write", fail)
    got = []

    class T:
        def write(self, data):
            got.append(bytes(data))

    tap = TransportTap(T())
    s = StreamSocket(7, None, None, tap)
    queued = []
    sink = DirectSink(queued.append, lambda sk: None)
    sink.arm(s, lambda e: (frame(b"end") + LAST_CHUNK, True))
    sink("done")
    sink.finish()
    assert not sink.ended and sink.pending == 1 and queued == ["done"] and not s.open
    tap.write(LAST_CHUNK)
    assert got == [LAST_CHUNK]

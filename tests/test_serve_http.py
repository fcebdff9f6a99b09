"""The OpenAI-compatible server through the real ``openai`` client, on an ephemeral loopback port.

The model is a random 2-layer llama with GPT-2's vocabulary and a ChatML template in its GGUF
(tests/serve_helpers.py).  Its text is gibberish; what is checked is that the server gives the tokens the runtime
gives (``python -m kvcache_ggml generate`` for the same prompt, each prompt served alone), the OpenAI shapes, the
prefix cache's reuse, the release of cancelled requests' cells and every error answer.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")

from serve_helpers import LiveServer, http, make_chat_model  # noqa: E402

N_CTX = 2048


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("serve") / "chat.gguf")


@pytest.fixture(scope="module")
def server(model_path):
    # F32 K/V: logits of differently split batches agree to 1e-5 of the largest (docs/prompt-cache.md)
    s = LiveServer(["--model", str(model_path), "--alias", "tiny", "--parallel", "4", "-kvu", "--n-ctx",
                    str(N_CTX), "--threads", "2", "-ctk", "f32", "-ctv", "f32", "--max-queue", "32",
                    "--max-body-mib", "0.05"])  # small: a 413 body fits the socket buffers before the answer
    yield s
    s.close()


def complete(cl, prompt, n=8, **kw):
    return cl.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0, **kw)


# ---------------------------------------------------------------------------------------------- answers

def test_completion_plain_and_streamed_agree(server):
    cl = server.client()
    r = complete(cl, "Once upon a time", 10)
    assert r.object == "text_completion" and r.model == "tiny"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 10 and r.usage.prompt_tokens == 4
    assert r.usage.total_tokens == 14
    chunks = list(complete(cl, "Once upon a time", 10, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == r.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_chat_plain_and_streamed_agree(server):
    cl = server.client()
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]
    r = cl.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    vocab = server.svc.vocab
    rendered = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n" \
               "<|im_start|>assistant\n"
    assert r.usage.prompt_tokens == len(vocab.tokenize(rendered, add_special=True, parse_special=True))
    chunks = list(cl.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_greedy_equals_generate(server, model_path):
    """The same tokens as ``python -m kvcache_ggml generate`` (one sequence, the prompt in one batch)."""
    prompt = "The quick brown fox"
    r = complete(server.client(), prompt, 12, logprobs=1)
    p = subprocess.run([sys.executable, "-m", "kvcache_ggml", "generate", "--model", str(model_path), "--prompt",
                        prompt, "--n-predict", "12", "--n-ctx", str(N_CTX), "--threads", "2"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.rstrip("\n") == prompt + r.choices[0].text
    assert len(r.choices[0].logprobs.tokens) == 12


def test_sixteen_concurrent_clients_match_each_prompt_alone(server):
    """16 clients with overlapping prompts at once: each gets the greedy tokens of its prompt served alone, and
    logprobs within the bound for differently split batches (F32 K/V: 1e-5 of the largest logit, docs/
    prompt-cache.md; logprobs move at most twice as much as logits).  A near tie in the alone run (top-2 gap
    under the bound) ends that prompt's comparison there: either token is right."""
    cl = server.client()
    system = "You are a helpful assistant who answers questions about the weather in great detail. " * 3
    prompts = [system + f"Question {i % 5}: what is the weather like in city number {i}?" for i in range(16)]
    alone = [complete(cl, p, 8, logprobs=2) for p in prompts]
    server.drop_parked()  # the concurrent run starts from an empty cache
    together: list = [None] * 16
    errors: list = []

    def client(i):
        try:
            together[i] = complete(server.client(), prompts[i], 8, logprobs=2)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    bound = 2 * 1e-5 * 50  # logits of this model stay under 50
    compared = 0
    for a, b in zip(alone, together):
        la, lb = a.choices[0].logprobs, b.choices[0].logprobs
        for k in range(8):
            assert abs(la.token_logprobs[k] - lb.token_logprobs[k]) <= bound
            if la.tokens[k] != lb.tokens[k]:
                top = sorted(la.top_logprobs[k].values(), reverse=True)
                assert top[0] - top[1] <= 2 * bound, f"token {k}: {la.tokens[k]!r} vs {lb.tokens[k]!r}"
                break
            compared += 1
    assert compared >= 100
    assert server.engine.stats.steps > 0


def test_cached_tokens_reported_for_a_shared_prefix(server):
    cl = server.client()
    base = "In a hole in the ground there lived a hobbit, not a nasty dirty wet hole"
    n_base = len(server.svc.vocab.tokenize(base, add_special=True, parse_special=True))
    complete(cl, base, 2)
    r = complete(cl, base + " filled with the ends of worms", 2)
    assert r.usage.prompt_tokens_details.cached_tokens >= n_base - 1
    assert r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens


def test_cancelled_stream_releases_its_cells(server):
    """A client that closes its stream mid-way: the request ends at the next step; without prompt caching the cells
    return to their count before the request, with it the parked sequence holds exactly its indexed tokens."""
    cl = server.client()
    server.drop_parked()  # free sequences: the admission evicts nothing
    for cache_prompt in (False, True):
        before = server.used_cells()
        stream = cl.completions.create(model="tiny", prompt="A very different prompt about cancellation " +
                                       str(cache_prompt), max_tokens=500, temperature=0, stream=True,
                                       extra_body={"cache_prompt": cache_prompt, "ignore_eos": True})
        got = 0
        for chunk in stream:
            got += 1
            if got == 4:
                break
        stream.close()
        server.wait_idle()
        assert server.engine.stats.requests_cancelled >= 1
        parked = [e for e in server.engine.prefix.entries() if not e.active]
        if not cache_prompt:
            assert server.used_cells() == before
        else:
            newest = max(parked, key=lambda e: e.last_used)
            assert server.used_cells() - before == newest.tokens.size
            assert 4 <= newest.tokens.size < 4 + 500


def test_plain_request_is_cancelled_when_its_client_leaves_mid_generation(model_path):
    """A plain (not streamed) request whose tokens keep coming -- no max_tokens, ignore_eos and --context-shift: it
    would never end -- is cancelled within seconds of its client closing the connection, as llama-server's polling
    does.  The client's going is looked for every second even while events arrive (before, only after a second
    without one: such a request held its slot for ever)."""
    import socket

    s = LiveServer(["--model", str(model_path), "--alias", "tiny", "--parallel", "1", "--n-ctx", "256", "-t", "2",
                    "--context-shift", "--no-fa-tiles"])
    try:
        body = json.dumps({"model": "tiny", "prompt": "Once upon a time", "temperature": 0,
                           "ignore_eos": True}).encode()
        conn = socket.create_connection(("127.0.0.1", s.port))
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        t0 = time.monotonic()
        while s.engine.snapshot().stats.context_shifts < 2:  # (running, and past the context twice)
            assert time.monotonic() - t0 < 60, "the request did not run past the context"
            time.sleep(0.05)
        assert s.engine.n_running == 1
        conn.close()
        s.wait_idle(timeout=10)  # (the poll's second, then the next step)
        assert s.engine.stats.requests_cancelled == 1
        r = s.client().completions.create(model="tiny", prompt="Once upon a time", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4  # (the slot is free again)
    finally:
        s.close()


def test_tokenize_detokenize_models_health_metrics(server):
    vocab = server.svc.vocab
    toks = http(server.url + "/tokenize", {"content": "Hello world"}).json()["tokens"]
    assert toks == vocab.tokenize("Hello world", add_special=False, parse_special=True)
    assert http(server.url + "/detokenize", {"tokens": toks}).json()["content"] == "Hello world"
    assert http(server.url + "/health").json() == {"status": "ok"}
    m = http(server.url + "/metrics").text
    assert [d.id for d in server.client().models.list().data] == ["tiny"]
    values = dict(line.split(" ") for line in m.splitlines() if not line.startswith("#"))
    st = server.engine.stats
    assert int(values["kvcache_requests_total"]) <= st.requests
    assert int(values["kvcache_prompt_tokens_cached_total"]) <= st.cached_tokens
    assert int(values["kvcache_kv_cells"]) == N_CTX
    # F32 cache, flash attention, the CPU alone: warm-up measured the throwaway rows' costs (runtime/fa_tiles.py)
    assert server.engine.tiles is None or server.engine.tiles.plausible()  # (None: too busy to measure)
    assert int(values["kvcache_steps_padded_total"]) <= server.engine.prefix.stats.padded_steps
    assert int(values["kvcache_fa_tiles"]) == (server.engine.tiles is not None)
    assert 1 <= int(values["kvcache_steps_prompt_total"]) <= int(values["kvcache_steps_total"])
    assert int(values["kvcache_split_steps"]) == (server.args.parallel > 4)


# ---------------------------------------------------------------------------------------------- bad input

def error_of(resp) -> dict:
    body = resp.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]


def test_bad_requests_get_openai_errors_and_change_nothing(server):
    cl = server.client()
    ref = complete(cl, "Reference prompt for the errors", 6).choices[0].text
    if True:
        h = server
        r = http(h.url + "/v1/completions", b"{not json")
        assert r.status_code == 400 and "JSON" in error_of(r)["message"]
        r = http(h.url + "/v1/completions", {"model": "gpt-4", "prompt": "x"})
        assert r.status_code == 400 and error_of(r)["param"] == "model" and "gpt-4" in error_of(r)["message"]
        r = http(h.url + "/v1/completions", {"model": "tiny"})
        assert r.status_code == 400 and error_of(r)["param"] == "prompt"
        r = http(h.url + "/v1/chat/completions", {"model": "tiny", "messages": "hi"})
        assert r.status_code == 400 and error_of(r)["param"] == "messages"
        r = http(h.url + "/v1/completions", {"model": "tiny", "prompt": "x", "temperature": "hot"})
        assert r.status_code == 400 and error_of(r)["param"] == "temperature"
        r = http(h.url + "/v1/completions", {"model": "tiny", "prompt": "x", "stream": 1})
        assert r.status_code == 400 and error_of(r)["param"] == "stream"
        r = http(h.url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0})
        assert r.status_code == 400 and "max_tokens must be >= 1, got 0" in error_of(r)["message"]
        long = list(range(100, 100 + N_CTX + 5))
        r = http(h.url + "/v1/completions", {"model": "tiny", "prompt": long})
        msg = error_of(r)["message"]
        assert r.status_code == 400 and str(N_CTX + 5) in msg and str(N_CTX) in msg
        for path, body in [("/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b"}'),
                           ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", '
                                                    b'"content": "x\\udfff"}]}'),
                           ("/tokenize", b'{"content": "\\ud800"}'),
                           ("/v1/completions", b'{"model": "tiny", "prompt": "x", "a": ' + b"[" * 3000 + b"]" * 3000
                            + b"}")]:  # (500s before: the tokenizer's TypeError, json's RecursionError)
            r = http(h.url + path, body)
            assert r.status_code == 400 and "the body is not valid JSON" in error_of(r)["message"], (path, r.text)
        r = http(h.url + "/v1/completions", b"x" * (server.svc.max_body + 1))
        assert r.status_code == 413 and str(server.svc.max_body) in error_of(r)["message"]
    with pytest.raises(openai.BadRequestError):
        cl.completions.create(model="tiny", prompt="x", max_tokens=0)
    assert complete(cl, "Reference prompt for the errors", 6).choices[0].text == ref


def test_chat_without_template_is_400(tmp_path):
    path = make_chat_model(tmp_path / "plain.gguf", template="")
    s = LiveServer(["--model", str(path), "--alias", "plain", "--parallel", "1", "--n-ctx", "256", "-t", "2"])
    try:
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            s.client().chat.completions.create(model="plain", messages=[{"role": "user", "content": "hi"}])
    finally:
        s.close()


def test_parked_default_is_none_with_one_slot(model_path):
    """``--parked`` unset: --parallel more with -kvu and more than one slot, none with one slot or without -kvu; a
    value given is kept."""
    from kvcache_ggml.serve.cli import parse_args

    def parked(*extra):
        return parse_args(["--model", str(model_path), *extra]).parked

    assert [parked("-np", "1", "-kvu"), parked("-np", "2", "-kvu"), parked("-np", "8", "-kvu"), parked("-np", "4")] \
        == [0, 2, 8, 0]
    assert parked("-np", "1", "-kvu", "--parked", "3") == 3


def test_split_steps_flag_unset_leaves_it_to_the_slots(model_path):
    """``--split-steps`` unset passes None (the engine splits with more than 4 slots); given, on or off."""
    from kvcache_ggml.serve.cli import parse_args

    def split(*extra):
        return parse_args(["--model", str(model_path), "-np", "8", *extra]).split_steps

    assert [split(), split("--split-steps"), split("--no-split-steps")] == [None, True, False]


def test_bad_options_are_usage_errors_naming_the_value(model_path, capsys):
    """Each bad option is refused by the argument check, naming the option, the value and the limit: before, a cache
    type ggml does not know raised a traceback from the context, --max-body-mib nan one from int(), -1 started a
    server that refused every body, and one message covered four options."""
    from kvcache_ggml.serve.cli import CACHE_TYPES, parse_args

    for extra, says in [(["-ctk", "q9_0"], "argument --cache-type-k/-ctk: invalid choice: 'q9_0'"),
                        (["-ctv", "i32"], "argument --cache-type-v/-ctv: invalid choice: 'i32'"),
                        (["--max-body-mib", "nan"], "--max-body-mib must be a finite number > 0, got nan"),
                        (["--max-body-mib", "-1"], "--max-body-mib must be a finite number > 0, got -1.0"),
                        (["--timeout", "nan"], "--timeout must be a number of seconds > 0, got nan"),
                        (["--timeout", "0"], "--timeout must be a number of seconds > 0, got 0.0"),
                        (["--port", "65536"], "--port must be in [0, 65535], got 65536"),
                        (["--max-queue", "-1"], "--max-queue must be >= 0, got -1"),
                        (["--host-cache-mib", "-2"], "--host-cache-mib must be >= 0, got -2")]:
        with pytest.raises(SystemExit):
            parse_args(["--model", str(model_path), *extra])
        assert says in capsys.readouterr().err, extra
    a = parse_args(["--model", str(model_path), "-ctk", "q8_0", "-ctv", "iq4_nl", "--timeout", "inf"])
    assert (a.cache_type_k, a.cache_type_v, a.timeout) == ("q8_0", "iq4_nl", float("inf"))
    assert set(CACHE_TYPES) == {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"}


def test_api_key_and_full_queue(model_path):
    s = LiveServer(["--model", str(model_path), "--alias", "tiny", "--parallel", "1", "--max-queue", "0",
                    "--n-ctx", "1024", "-t", "2", "--api-key", "sekrit"])
    try:
        r = http(s.url + "/v1/completions", {"model": "tiny", "prompt": "x"})
        assert r.status_code == 401 and error_of(r)["type"] == "authentication_error"
        r = http(s.url + "/v1/completions", {"model": "tiny", "prompt": "x"}, {"Authorization": "Bearer sekrit-not"})
        assert r.status_code == 401
        assert http(s.url + "/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").completions.create(model="tiny", prompt="x", max_tokens=1)
        cl = s.client(api_key="sekrit")
        stream = cl.completions.create(model="tiny", prompt="hold the only slot", max_tokens=800, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))  # running: the one slot is taken, and the queue holds 0
        r = http(s.url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1},
                 {"Authorization": "Bearer sekrit"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert error_of(r)["code"] == "queue_full"
        stream.close()
        s.wait_idle()
        assert complete(cl, "x", 1).usage.completion_tokens == 1
    finally:
        s.close()


def test_serve_command_starts_and_stops_on_sigterm(model_path):
    """The CLI itself: it prints its address, answers, and exits 0 on SIGTERM."""
    p = subprocess.Popen([sys.executable, "-m", "kvcache_ggml", "serve", "--model", str(model_path), "--port", "0",
                          "--n-ctx", "256", "--parallel", "1", "-t", "1"], stderr=subprocess.PIPE, text=True)
    try:
        url = None
        t0 = time.monotonic()
        while url is None and time.monotonic() - t0 < 120:
            line = p.stderr.readline()
            if not line:
                break
            if line.startswith("listening on "):
                url = line.split()[-1]
        assert url, "no 'listening on' line"
        r = http(url + "/v1/completions", {"model": model_path.stem, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and json.loads(r.text)["usage"]["completion_tokens"] == 2
        p.terminate()
        assert p.wait(60) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()



def test_stop_string_ends_the_text_before_it(server):
    """A stop string taken from the middle of the greedy text: the answer is the text before it, finish_reason
    "stop", and no part of it reaches a stream."""
    cl = server.client()
    full = complete(cl, "Stop strings are cut here", 12).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    want = full[:full.index(stop)]
    r = complete(cl, "Stop strings are cut here", 12, stop=[stop])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = list(complete(cl, "Stop strings are cut here", 12, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want


def test_accepted_connections_get_tcp_nodelay():
    """The serve command's listening socket (cli.listen_socket) under an asyncio server, as uvicorn runs it: every
    accepted connection has TCP_NODELAY, so a response's header and body writes do not wait on a keep-alive
    client's delayed ACK (with proto 0 asyncio left Nagle on: ~40 ms a request)."""
    import asyncio
    import socket

    from kvcache_ggml.serve.cli import listen_socket

    async def main() -> list[int]:
        seen: list[int] = []
        done = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                seen.append(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()
                if len(seen) == 2:
                    done.set_result(None)

        sock = listen_socket("127.0.0.1", 0)
        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        port = sock.getsockname()[1]
        for _ in range(2):
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
        await asyncio.wait_for(done, 10)
        server.close()
        return seen

    seen = asyncio.run(main())
    assert len(seen) == 2 and all(seen), seen

"""Random clients against a live server, several at once (marked ``slow``: not in the default run).

    KVCACHE_FUZZ_SECONDS=120 .venv/bin/python -m pytest -m slow tests/test_serve_fuzz.py -q

Each client sends, for as long as it is given, completions and chats (plain or streamed, streams often closed after a
few chunks), with random ``max_tokens``, temperatures, ``cache_prompt``, ``id_slot``, ``n_cache_reuse``, ``n_keep``,
growing conversations and slot saves, restores and erases, on a small context with the host tier, chunk reuse and
the context shift on.  What must hold: no answer is a server error (5xx other than 503, or an error event in a
stream), the server answers throughout, the prefix cache's audit finds nothing once it is idle, and a greedy
request gives the same text before and after.  It found, on 2026-12-07: a host blob dropped while its own restore
made room (a TypeError in the admission), and the unified iSWA memory's K-shift moves (cells_table refused it).
"""
from __future__ import annotations

import json
import os
import random
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("openai")
from serve_helpers import LiveServer, make_chat_model  # noqa: E402

from kvcache_ggml.prefix import check  # noqa: E402

pytestmark = pytest.mark.slow

SECONDS = float(os.environ.get("KVCACHE_FUZZ_SECONDS", "60"))
WORDS = "the cat sat on a mat and then it ran off to see the big dog near a red house".split()


def post(url: str, body: dict, cut: int = 0) -> tuple[int, bytes]:
    """POST ``body``; (status, the answer's bytes, or only its first ``cut`` lines when > 0: a client gone)."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            if not cut:
                return r.status, r.read()
            return r.status, b"".join(r.readline() for _ in range(cut))
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def request(rng: random.Random, convo: list[dict]) -> tuple[str, dict, int]:
    """(path, body, lines of a stream read before the client goes, 0: all) of one random request."""
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    if rng.random() < 0.15:
        action = rng.choice(["save", "restore", "erase"])
        return f"/slots/{rng.randrange(-1, 4)}?action={action}", {"filename": rng.choice(["a.bin", "b.bin"])}, 0
    stream = rng.random() < 0.5
    body = {"model": "m", "temperature": rng.choice([0, 0.8]), "max_tokens": rng.choice([1, 4, 16, 64, 400]),
            "stream": stream, "cache_prompt": rng.random() < 0.9}
    for field, values in (("id_slot", [-1, 0, 1, 2]), ("n_cache_reuse", [0, 2, 8]), ("n_keep", [-1, 0, 1])):
        if rng.random() < 0.3:
            body[field] = rng.choice(values)
    body["ignore_eos"] = rng.random() < 0.3
    if rng.random() < 0.5:
        if rng.random() < 0.3:
            del convo[1:]
        convo.append({"role": "user", "content": words(rng.randrange(3, 60))})
        body["messages"] = convo
        path = "/v1/chat/completions"
    else:
        body["prompt"] = words(rng.randrange(1, 300))
        path = "/v1/completions"
    return path, body, rng.choice([0, 1, 3, 10]) if stream else 0


def client(url: str, seed: int, until: float, bad: list) -> None:
    rng = random.Random(seed)
    convo = [{"role": "system", "content": " ".join(rng.choice(WORDS) for _ in range(40))}]
    while time.monotonic() < until:
        path, body, cut = request(rng, convo)
        status, data = post(url + path, body, cut)
        if (status >= 500 and status != 503) or b'"server_error"' in data:
            bad.append((path, body, status, data[:300]))
        if status == 200 and path.endswith("chat/completions") and not body["stream"]:
            convo.append({"role": "assistant", "content": json.loads(data)["choices"][0]["message"]["content"]})


@pytest.mark.parametrize("extra", [["-np", "3"], ["-np", "2", "-kvu"], ["-np", "1"]], ids=["slots", "unified", "one"])
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_random_clients_get_no_server_error_and_leave_a_consistent_cache(tmp_path, arch, extra):
    if arch == "llama":
        path = make_chat_model(tmp_path / "m.gguf")
    else:
        from serve_helpers import GPT2_VOCAB

        from kvcache_ggml.runtime.gemma_maker import GemmaSpec, make_gemma_model
        path = make_gemma_model(tmp_path / "g.gguf", GemmaSpec(arch="gemma2", n_swa=16, vocab_from=str(GPT2_VOCAB),
                                                                seed=4))
    (tmp_path / "slots").mkdir()
    s = LiveServer(["--model", str(path), "--alias", "m", "-c", "1024", "--slot-save-path", str(tmp_path / "slots"),
                    "--cache-reuse", "4", "--context-shift", "-t", "2", "--host-cache-mib", "1", "--no-fa-tiles",
                    *extra])
    try:
        ref_body = {"model": "m", "prompt": "a reference prompt", "max_tokens": 12, "temperature": 0}

        def text() -> str:
            status, data = post(s.url + "/v1/completions", ref_body)
            assert status == 200, data
            return json.loads(data)["choices"][0]["text"]

        ref = text()
        bad: list = []
        until = time.monotonic() + SECONDS
        clients = [threading.Thread(target=client, args=(s.url, i, until, bad)) for i in range(4)]
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        assert bad == []
        s.wait_idle(30)
        assert check(s.engine.prefix) == []
        assert text() == ref
    finally:
        s.close()

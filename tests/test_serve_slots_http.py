"""llama-server's slot endpoints over HTTP (``GET /slots``, ``POST /slots/{id}?action=save|restore|erase``,
``--slot-save-path``), the request's ``id_slot``, and a Gemma 3 GGUF (the iSWA cache) served end to end with the
prefix cache, the slots and ``/metrics``.

Each server's replies are checked against the same prompt computed from scratch on the same server (every parked
sequence evicted first): F32 K/V, where differently split batches agree to 1e-5 of the largest logit."""
from __future__ import annotations

import pytest

pytest.importorskip("openai")

from kvcache_ggml.cache.state import read_state_file  # noqa: E402
from kvcache_ggml.runtime.gemma_maker import GemmaSpec, make_gemma_model  # noqa: E402
from serve_helpers import GPT2_VOCAB, LiveServer, http, make_chat_model  # noqa: E402


def _args(model, slot_dir, *more):
    return ["--model", str(model), "--alias", "tiny", "--parallel", "2", "-kvu", "--n-ctx", "1024", "--threads", "2",
            "-ctk", "f32", "-ctv", "f32", "--slot-save-path", str(slot_dir), *more]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("slots_http")
    (d / "slots").mkdir()
    s = LiveServer(_args(make_chat_model(d / "chat.gguf"), d / "slots"))
    s.slot_dir = d / "slots"
    yield s
    s.close()


def complete(srv, prompt, n=6, **kw):
    r = http(srv.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0,
                                           "ignore_eos": True, **kw})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def slot(srv, s, action, filename=None):
    return http(f"{srv.url}/slots/{s}?action={action}", {} if filename is None else {"filename": filename})


def state_of(srv):
    """Every sequence's state blob and the prefix index, read on the engine's thread."""
    def read(eng):
        n = eng.prefix.n_seq
        return ([eng.ctx.state_seq_get_data(s) for s in range(n)],
                {s: e.tokens.tolist() for s, e in eng.prefix.seqs.items()}, eng.ctx.kv.get_used())
    return srv.engine.call(read).result(30)


def save_erase_restore(srv, prompt, n_ext_tokens):
    """A conversation served, saved from its slot, erased, restored into the last slot and continued there with
    ``id_slot``: (the continuation, its cached_tokens, the restored token count, the same prompt from scratch)."""
    srv.drop_parked()
    complete(srv, prompt)
    slots = http(srv.url + "/slots").json()
    held = [x for x in slots if x["n_tokens"]]
    assert len(held) == 1 and not held[0]["is_processing"] and held[0]["parked"]
    s, n = held[0]["id"], held[0]["n_tokens"]
    r = slot(srv, s, "save", "conv.bin")
    assert r.status_code == 200, r.text
    body = r.json()
    path = srv.slot_dir / "conv.bin"
    assert body["id_slot"] == s and body["filename"] == "conv.bin" and body["n_saved"] == n
    assert body["n_written"] == path.stat().st_size and body["timings"]["save_ms"] >= 0
    toks = read_state_file(path).tokens.tolist()
    assert len(toks) == n
    r = slot(srv, s, "erase")
    assert r.status_code == 200 and r.json() == {"id_slot": s, "n_erased": n}
    assert state_of(srv)[2] == 0
    last = len(slots) - 1
    r = slot(srv, last, "restore", "conv.bin")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id_slot"] == last and body["n_restored"] == n and body["n_read"] == path.stat().st_size
    assert http(srv.url + "/slots").json()[last]["n_tokens"] == n
    full = toks + list(range(1000, 1000 + n_ext_tokens))
    text, cached = complete(srv, full, id_slot=last)
    srv.drop_parked()
    fresh, cached_fresh = complete(srv, full)
    assert cached_fresh == 0
    return text, cached, n, fresh


def test_slot_saved_erased_restored_and_continued(llama):
    text, cached, n, fresh = save_erase_restore(llama, "The slot file holds this conversation", 5)
    assert cached == n and text == fresh


def test_get_slots_shape(llama):
    slots = http(llama.url + "/slots").json()
    assert [x["id"] for x in slots] == [0, 1, 2, 3]  # 2 parallel + 2 parked
    assert all(x["n_ctx"] == 1024 and x["speculative"] is False and x["is_processing"] is False for x in slots)


@pytest.mark.parametrize("name", ["a/b.bin", "..", "../conv.bin", "/etc/passwd", "x\\y", "", None])
def test_bad_filenames_are_400_and_touch_nothing(llama, name):
    before = state_of(llama)
    for action in ("save", "restore"):
        r = http(f"{llama.url}/slots/0?action={action}", {"filename": name} if name is not None else {})
        assert r.status_code == 400 and r.json()["error"]["param"] == "filename", r.text
    assert state_of(llama) == before
    assert not (llama.slot_dir.parent / "b.bin").exists()


def test_bad_files_bad_slots_and_actions_are_400_and_change_nothing(llama):
    llama.drop_parked()
    complete(llama, "Something to keep in the cache")
    slot(llama, 0, "save", "good.bin")
    data = (llama.slot_dir / "good.bin").read_bytes()
    (llama.slot_dir / "cut.bin").write_bytes(data[:-7])
    (llama.slot_dir / "junk.bin").write_bytes(b"ggsq" + bytes(40))
    before = state_of(llama)
    for s, action, name, why in ((1, "restore", "cut.bin", "truncated"), (1, "restore", "junk.bin", "magic"),
                                 (1, "restore", "missing.bin", "cannot read"), (9, "restore", "good.bin", "slot id"),
                                 ("x", "erase", None, "slot id"), ("%C2%B2", "erase", None, "slot id"),
                                 (1, "bogus", None, "action")):
        r = slot(llama, s, action, name)
        assert r.status_code == 400 and why in r.json()["error"]["message"], (s, action, r.text)
    r = http(llama.url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1, "id_slot": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "id_slot"
    assert state_of(llama) == before


def test_without_slot_save_path_the_actions_are_501(tmp_path):
    srv = LiveServer(["--model", str(make_chat_model(tmp_path / "m.gguf")), "--alias", "tiny", "-np", "1",
                      "--n-ctx", "256", "--threads", "1", "--no-slots"])
    try:
        r = slot(srv, 0, "save", "a.bin")
        assert r.status_code == 501 and "--slot-save-path" in r.json()["error"]["message"]
        assert http(srv.url + "/slots").status_code == 501
    finally:
        srv.close()


def test_gemma3_served_with_prefix_cache_slots_and_metrics(tmp_path):
    """A Gemma 3 GGUF (sliding window 8, so the SWA cache is smaller than the base cache): a conversation saved,
    restored and continued reuses the restored tokens and gives the tokens of the prompt computed from scratch, as
    does a prefix longer than the window copied from another request; /metrics counts the cells through the Memory
    protocol."""
    model = make_gemma_model(tmp_path / "g3.gguf", GemmaSpec(arch="gemma3", layers=2, embd=64, heads=2, heads_kv=1,
                                                            head_dim=32, n_swa=8, ctx=2048, seed=5,
                                                            vocab_from=str(GPT2_VOCAB)))
    (tmp_path / "slots").mkdir()
    srv = LiveServer(_args(model, tmp_path / "slots"))
    srv.slot_dir = tmp_path / "slots"
    try:
        text, cached, n, fresh = save_erase_restore(srv, "A Gemma conversation that runs past its window", 12)
        assert n > 8 and cached == n and text == fresh
        head = "Two requests share this prefix, longer than the sliding window of eight tokens:"
        complete(srv, head + " one")
        text, cached = complete(srv, head + " two")  # a prefix copied from the first (seq_cp of both caches)
        srv.drop_parked()
        assert cached > 8 and (text, 0) == complete(srv, head + " two")
        srv.engine.call(lambda e: None).result(30)  # the snapshot is published after a call (a reply may come first)
        metrics = dict(line.split() for line in http(srv.url + "/metrics").text.splitlines()
                       if line and not line.startswith("#"))
        used = srv.engine.call(lambda e: (e.ctx.kv.get_used(), e.ctx.kv.get_size())).result(30)
        assert (int(metrics["kvcache_kv_cells_used"]), int(metrics["kvcache_kv_cells"])) == used
        assert used[0] > 0 and int(metrics["kvcache_prompt_tokens_cached_total"]) >= n
    finally:
        srv.close()


def test_an_action_on_a_busy_slot_waits_for_its_request(llama):
    """A save sent while the slot's request is generating answers once the request is done: it holds the whole
    reply (all its tokens but the last), not the part generated when the save arrived."""
    import json
    import threading
    import urllib.request

    llama.drop_parked()
    body = {"model": "tiny", "prompt": list(range(500, 530)), "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "id_slot": 0}
    req = urllib.request.Request(llama.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    saved, usage = {}, {}
    with urllib.request.urlopen(req, timeout=120) as stream:
        first = stream.readline()
        assert first.startswith(b"data: ")
        t = threading.Thread(target=lambda: saved.update(slot(llama, 0, "save", "busy.bin").json()))
        t.start()
        for line in stream:
            if line.startswith(b"data: {") and b'"usage"' in line:
                u = json.loads(line[6:])["usage"]
                usage.update(u or {})
        t.join(60)
    assert usage["completion_tokens"] == 200
    assert saved["n_saved"] == 30 + 199 == read_state_file(llama.slot_dir / "busy.bin").tokens.size

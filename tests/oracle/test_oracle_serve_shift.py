"""``--cache-reuse`` and ``--context-shift`` against llama.cpp's own ``llama-server`` (built by
``scripts/build_reference.sh --server``): the same token prompts to both servers, one slot each, F32 caches.

Cache reuse: the prompt tokens each server computes (llama-server's ``timings.prompt_n``, ours ``prompt_tokens -
cached_tokens``) are equal for a document and the same with passages cut out, and so are the greedy replies.
Context shift: a reply longer than the context continues on both with the same text (the same n_keep and n_discard
rule, the same K-shift).
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from llama_runner import LLAMA_SERVER

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from serve_helpers import LiveServer, http, make_chat_model  # noqa: E402

pytestmark = [pytest.mark.oracle,
              pytest.mark.skipif(not LLAMA_SERVER.exists(), reason=f"{LLAMA_SERVER} missing: build_reference.sh "
                                                                     "--server")]

COMMON = ["-c", "256", "-np", "1", "-t", "2", "-ctk", "f32", "-ctv", "f32", "-fa", "off"]


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    def __init__(self, model: Path, extra: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out = open(log, "wb")
        self.proc = subprocess.Popen([str(LLAMA_SERVER), "-m", str(model), "--alias", "tiny", "--no-webui",
                                      "--host", "127.0.0.1", "--port", str(self.port), *COMMON, *extra],
                                     stdout=self.out, stderr=subprocess.STDOUT)
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode} (log: {log})")
            try:
                if http(self.url + "/health", timeout=2).status_code == 200:
                    break
            except OSError:
                pass
            if time.monotonic() - t0 > 120:
                self.close()
                raise RuntimeError("llama-server did not start")
            time.sleep(0.2)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.out.close()


def utf8_bias(path: Path) -> dict[str, float]:
    """Ban the tokens that are not UTF-8 text on their own (both servers detokenize the same way then)."""
    from kvcache_ggml.runtime.tokenizer import Vocab
    vocab = Vocab.from_gguf(path)
    bad = {}
    for t in range(len(vocab.tokens)):
        try:
            vocab.token_to_piece(t).decode("utf-8")
        except UnicodeDecodeError:
            bad[str(t)] = -100.0
    return bad


def ask(url: str, prompt: list[int], n: int, bias: dict[str, float], **extra) -> tuple[str, int, int]:
    """(text, prompt tokens computed, completion tokens) of a greedy /v1/completions request."""
    r = http(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0,
                                       "ignore_eos": True, "logit_bias": bias, **extra}, timeout=600)
    assert r.status_code == 200, r.content[:500]
    body = r.json()
    usage = body["usage"]
    timings = body.get("timings")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    computed = int(timings["prompt_n"]) if timings else usage["prompt_tokens"] - cached
    return body["choices"][0]["text"], computed, usage["completion_tokens"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_chat_model(tmp_path_factory.mktemp("oracle_shift") / "chat.gguf")
    return path, utf8_bias(path)


def both(model, extra, log):
    ours = LiveServer(["--model", str(model), "--alias", "tiny", "--n-ctx", "256", "--parallel", "1", "-t", "2",
                       "-ctk", "f32", "-ctv", "f32", "-fa", "off", *extra])
    try:
        llama = LlamaServer(model, extra, log)
    except BaseException:
        ours.close()
        raise
    return ours, llama


def test_cache_reuse_computes_what_llama_server_computes(model, tmp_path):
    path, bias = model
    rng = np.random.default_rng(0)
    doc = [int(t) for t in rng.integers(300, 20000, 150)]
    prompts = [doc, doc[:20] + doc[40:], doc[:20] + doc[40:90] + doc[100:], doc[60:]]
    ours, llama = both(path, ["--cache-reuse", "8"], tmp_path / "llama.log")
    try:
        for p in prompts:
            o, l_ = ask(ours.url, p, 4, bias), ask(llama.url, p, 4, bias)
            assert o == l_, (len(p), o, l_)
        assert ours.engine.prefix.stats.tokens_shifted > 100
    finally:
        ours.close()
        llama.close()


@pytest.mark.parametrize("n_keep,n_discard", [(0, 0), (-1, 0), (8, 40)])
def test_context_shift_continues_as_llama_server(model, tmp_path, n_keep, n_discard):
    path, bias = model
    prompt = [int(t) for t in np.random.default_rng(1).integers(300, 20000, 40)]
    ours, llama = both(path, ["--context-shift"], tmp_path / "llama.log")
    try:
        extra = {"n_keep": n_keep, "n_discard": n_discard}
        o, l_ = ask(ours.url, prompt, 400, bias, **extra), ask(llama.url, prompt, 400, bias, **extra)
        assert o[2] == l_[2] == 400 and ours.engine.snapshot().stats.context_shifts >= 2
        assert o[0] == l_[0]
    finally:
        ours.close()
        llama.close()

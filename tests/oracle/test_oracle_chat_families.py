"""The published chat templates of Qwen2.5, Qwen3, Llama 3.2 and Phi-3.5 through llama.cpp's ``llama-server`` and ours.

The models are tests/test_chat_families.py's (scaled-down presets with their published template and a vocabulary
shaped as their own).  llama-server's ``/apply-template`` renders the conversation as the prompt written out by hand
(its BOS dropped where the vocabulary adds one, as both servers do), and a greedy chat completion on both servers has
the same prompt token count and the same reply (a ``logit_bias`` bans GPT-2's tokens that are not UTF-8 text on
their own, which llama-server's chat parser would refuse)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llama_runner import LLAMA_SERVER

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from serve_helpers import LiveServer, http  # noqa: E402
from test_chat_families import EXPECTED, KWARGS, MESSAGES, make_models  # noqa: E402

pytestmark = [pytest.mark.oracle,
              pytest.mark.skipif(not LLAMA_SERVER.exists(),
                                 reason=f"{LLAMA_SERVER} missing: bash scripts/build_reference.sh --server")]

LAYOUT = ["-c", "512", "-np", "1", "-fa", "off", "-ctk", "f32", "-ctv", "f32", "-t", "1"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("oracle_chat_families"))


def _llama_server(model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_serve import free_port, wait_ready
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([str(LLAMA_SERVER), "-m", str(model), "--alias", "m", "--no-webui", "--host",
                             "127.0.0.1", "--port", str(port), *LAYOUT], stdout=open(log, "ab"),
                            stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, url


def _chat(url: str, name: str, bias: dict) -> dict:
    r = http(url + "/v1/chat/completions", {"model": "m", "messages": MESSAGES, "max_tokens": 6, "temperature": 0,
                                            "logit_bias": bias, "chat_template_kwargs": KWARGS.get(name, {})},
             timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("name", list(EXPECTED))
def test_llama_server_renders_and_answers_as_ours(models, name, tmp_path):
    from bench_serve import partial_utf8_tokens

    from kvcache_ggml.runtime.tokenizer import Vocab
    model = models[name]
    vocab = Vocab.from_gguf(model)
    want = EXPECTED[name]
    if vocab.add_bos and want.startswith(vocab.tokens[vocab.bos]):
        want = want[len(vocab.tokens[vocab.bos]):]
    bias = partial_utf8_tokens(model) if vocab.model == "gpt2" else {}
    proc, url = _llama_server(model, tmp_path / "llama-server.log")
    ours = LiveServer(["--model", str(model), "--alias", "m", *LAYOUT])
    try:
        r = http(url + "/apply-template", {"messages": MESSAGES, "chat_template_kwargs": KWARGS.get(name, {})})
        assert r.status_code == 200, r.text
        assert r.json()["prompt"] == want
        theirs, mine = _chat(url, name, bias), _chat(ours.url, name, bias)
    finally:
        ours.close()
        proc.terminate()
        proc.wait(30)
    assert mine["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"] == len(
        vocab.tokenize(want, add_special=True, parse_special=True))
    assert mine["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"] != ""

"""Slot files interchange with llama-server (issue 37): a slot that llama.cpp's own ``llama-server`` saved restores in
ours and continues with the greedy tokens of llama-server's own restore, and the reverse.

Both servers serve one GGUF (a random 2-layer llama, or Gemma 3 with a sliding window of 8 -- the iSWA cache, whose
file holds the base cache's state, then the SWA cache's -- with GPT-2's vocabulary) with the same layout -- ``-kvu``, F16
K/V, flash attention, ``-c 1024`` -- and one ``--slot-save-path``.  The continuation prompt is the file's tokens and
a few more; each server answers it greedily in the restored slot (``id_slot``), and the texts must be equal.  Both
get a ``logit_bias`` banning GPT-2's tokens that are not UTF-8 text on their own (llama-server's text of a random
model's bytes would otherwise differ from ours in how an invalid sequence is cut)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llama_runner import LLAMA_SERVER

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from serve_helpers import GPT2_VOCAB, LiveServer, http, make_chat_model  # noqa: E402

pytestmark = [pytest.mark.oracle,
              pytest.mark.skipif(not LLAMA_SERVER.exists(),
                                 reason=f"{LLAMA_SERVER} missing: bash scripts/build_reference.sh --server")]

LAYOUT = ["-c", "1024", "-np", "2", "-kvu", "-fa", "on", "-ctk", "f16", "-ctv", "f16", "-t", "2"]


class Llama:
    """llama-server in a subprocess."""

    def __init__(self, model: Path, slot_dir: Path, log: Path) -> None:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from bench_serve import free_port, wait_ready
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log, "ab")
        self.proc = subprocess.Popen([str(LLAMA_SERVER), "-m", str(model), "--alias", "tiny", "--no-webui",
                                      "--slot-save-path", str(slot_dir), "--host", "127.0.0.1", "--port", str(port),
                                      *LAYOUT], stdout=self.log, stderr=subprocess.STDOUT)
        wait_ready(self.url, self.proc)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def servers(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("oracle_slots")
    if request.param == "llama":
        model = make_chat_model(d / "chat.gguf")
    else:
        from kvcache_ggml.runtime.gemma_maker import GemmaSpec, make_gemma_model
        model = make_gemma_model(d / "g3.gguf", GemmaSpec(arch="gemma3", layers=2, embd=64, heads=2, heads_kv=1,
                                                          head_dim=32, n_swa=8, ctx=2048, seed=5,
                                                          vocab_from=str(GPT2_VOCAB)))
    (d / "slots").mkdir()
    llama = Llama(model, d / "slots", d / "llama-server.log")
    ours = LiveServer(["--model", str(model), "--alias", "tiny", "--slot-save-path", str(d / "slots"), *LAYOUT])
    from bench_serve import partial_utf8_tokens
    bias = partial_utf8_tokens(model)
    try:
        yield llama, ours, d / "slots", bias
    finally:
        ours.close()
        llama.close()


def complete(url, prompt, bias, n=8, **kw):
    r = http(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0,
                                       "logit_bias": bias, "cache_prompt": True, **kw}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def slot(url, s, action, filename):
    r = http(f"{url}/slots/{s}?action={action}", {"filename": filename}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def continued(url, s, filename, prompt, bias):
    """Restore ``filename`` into slot ``s`` and complete ``prompt`` there: (restore's answer, completion's)."""
    return slot(url, s, "restore", filename), complete(url, prompt, bias, id_slot=s)


@pytest.mark.parametrize("saver", ["llama", "ours"])
def test_slot_file_restores_in_the_other_server_with_the_same_greedy_tokens(servers, saver):
    from kvcache_ggml.cache.state import read_state_file
    llama, ours, slot_dir, bias = servers
    src = llama if saver == "llama" else ours
    first = list(range(2000, 2040)) if saver == "llama" else list(range(3000, 3037))
    complete(src.url, first, bias, id_slot=0)
    name = f"from-{saver}.bin"
    saved = slot(src.url, 0, "save", name)
    toks = read_state_file(slot_dir / name).tokens.tolist()
    assert saved["n_saved"] == len(toks) and toks[:len(first)] == first and len(toks) > len(first)
    prompt = toks + [4000, 4001, 4002, 4003, 4004]
    r_l, c_l = continued(llama.url, 1, name, prompt, bias)
    r_o, c_o = continued(ours.url, 1, name, prompt, bias)
    assert r_l["n_restored"] == r_o["n_restored"] == len(toks)
    assert r_l["n_read"] == r_o["n_read"] == (slot_dir / name).stat().st_size
    assert c_o["usage"]["prompt_tokens_details"]["cached_tokens"] == len(toks)
    assert c_l["timings"]["prompt_n"] == 5  # llama-server computed the 5 new tokens only
    assert c_o["choices"][0]["text"] == c_l["choices"][0]["text"] != ""
    assert c_o["usage"]["completion_tokens"] == c_l["usage"]["completion_tokens"] == 8

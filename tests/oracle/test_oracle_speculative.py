"""Speculative decoding against llama.cpp's own ``llama-server`` (built by ``scripts/build_reference.sh --server``):
the same token prompts to both servers, one slot each, F32 caches, greedy.

Both servers verify drafts of the same draft model (``-md``, ``--draft-max``, ``--draft-p-min 0``: every draft as
long as allowed) -- the target itself (every draft accepted) and another random model with the same vocabulary
(most drafts rejected: the rollback runs on both) -- and ours also with prompt lookup (``--spec-ngram``); every
reply of ours is llama-server's greedy text without a draft.  llama-server's own drafted reply is that text or a
prefix of it: it adds a whole accepted run to ``n_decoded`` before sending its tokens, so a run that reaches
``max_tokens`` ends the reply at its first token (``completion_tokens`` still says ``max_tokens``); ours sends each
token of the run until the limit.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from llama_runner import LLAMA_SERVER

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_helpers import GPT2_VOCAB, LiveServer, make_chat_model  # noqa: E402
from test_oracle_serve_shift import LlamaServer, ask, utf8_bias  # noqa: E402

from kvcache_ggml.runtime.modelmaker import make_model  # noqa: E402

pytestmark = [pytest.mark.oracle,
              pytest.mark.skipif(not LLAMA_SERVER.exists(), reason=f"{LLAMA_SERVER} missing: build_reference.sh "
                                                                     "--server")]

OURS = ["--alias", "tiny", "--n-ctx", "256", "--parallel", "1", "-t", "2", "-ctk", "f32", "-ctv", "f32",
        "-fa", "off"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("oracle_spec")
    target = make_chat_model(d / "chat.gguf")
    other = make_model(d / "draft.gguf", layers=1, embd=32, heads=2, heads_kv=1, ff=64, seed=11,
                       vocab_from=str(GPT2_VOCAB))
    return target, other, utf8_bias(target)


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    doc = [int(t) for t in rng.integers(300, 20000, 40)]
    return [doc + doc[:20], [int(t) for t in rng.integers(300, 20000, 25)]]


@pytest.mark.parametrize("which", ["target", "other"])
def test_drafted_replies_are_llama_servers(models, tmp_path, which):
    target, other, bias = models
    draft = target if which == "target" else other
    flags = ["-md", str(draft), "--draft-max", "6", "--draft-p-min", "0"]
    texts = []
    for extra in ([], flags):
        llama = LlamaServer(target, extra, tmp_path / "llama.log")
        try:
            texts.append([ask(llama.url, p, 40, bias)[0] for p in prompts()])
        finally:
            llama.close()
    want, drafted = texts
    assert all(w.startswith(d) for w, d in zip(want, drafted)) and want[0] == drafted[0]
    for extra in (flags, ["--spec-ngram", "--spec-ngram-min", "1", "--draft-max", "6"]):
        ours = LiveServer(["--model", str(target), *OURS, *extra])
        try:
            got = [ask(ours.url, p, 40, bias) for p in prompts()]
            st = ours.engine.snapshot().stats
        finally:
            ours.close()
        assert [g[0] for g in got] == want and [g[2] for g in got] == [40, 40]
        assert st.drafts > 0
        if extra is flags and which == "target":  # (its draft cache is F16, the target's F32: a rare flip)
            assert st.draft_accepted >= 0.9 * st.draft_tokens
        elif extra is flags:
            assert st.draft_accepted < st.draft_tokens

"""The demo's restore check (like with like) and its text output on a model with a real vocabulary."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvcache_ggml import ggml as G
from kvcache_ggml.batch import Batch
from kvcache_ggml.demo import main as demo_main
from kvcache_ggml.runtime.restore_check import restore_check, same_sequence_state
from kvcache_ggml.runtime import Context, Model, make_model
from kvcache_ggml.runtime.modelmaker import ModelSpec
from kvcache_ggml.runtime.tokenizer import Vocab

GPT2_VOCAB = Path(__file__).parent / "data" / "vocab" / "ggml-vocab-gpt-2.gguf"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("demo") / "m.gguf",
                      ModelSpec(layers=3, embd=64, heads=4, heads_kv=2, ff=96, vocab=64, seed=9))


def _filled(m, unified=True, fa=True, tv="f16"):
    ctx = Context(m, n_ctx=256, n_seq_max=3, kv_unified=unified, flash_attn=fa, type_k="f16", type_v=tv,
                  n_threads=1, n_threads_batch=1)
    toks = np.random.default_rng(2).integers(3, 64, 20).astype(np.int32)
    ctx.decode(Batch(token=toks))
    for s in (1, 2):
        ctx.memory_seq_cp(0, s, -1, -1)
    for step in range(12):  # interleave the sequences' cells
        ctx.decode(Batch(token=np.array([5 + step, 7, 9], np.int32), seq_id=np.arange(3, dtype=np.int32),
                         logits=np.ones(3, np.int8)))
    ctx.context_shift(0, 4, 6)  # holes, and a K-shift at the next decode
    ctx.decode(Batch(token=np.array([11], np.int32), seq_id=np.zeros(1, np.int32)))
    return ctx


def _corrupt_one_k_row(ctx, dst):
    """Overwrite the K row of one of dst's cells in layer 0 with other values."""
    for s, cells in enumerate(ctx.kv.v_cells):
        idx = [i for i in range(cells.size()) if not cells.is_empty(i) and cells.seq_has(i, dst)]
        if idx:
            k = ctx.kv.layers[0].k
            row = G.nb(k)[1]
            off = idx[len(idx) // 2] * row + s * G.nb(k)[2]
            junk = np.full(row // 2, 0.5, np.float16)  # f16 K
            G.ggml_backend_tensor_set(k, junk.ctypes.data, off, row)
            return
    raise AssertionError("dst has no cells")


@pytest.mark.parametrize("unified", [True, False], ids=["unified", "streams"])
@pytest.mark.parametrize("fa,tv", [(True, "f16"), (False, "f16"), (True, "f32")])
def test_restore_check_passes_and_catches_one_corrupted_k_row(model_path, unified, fa, tv):
    with Model(model_path) as m:
        with _filled(m, unified, fa, tv) as ctx:
            hist = list(range(27))  # the file's token list (only compared with itself here)
            rc = restore_check(ctx, 0, 2, hist, 13, fa, tv)
            assert rc.same_cells and rc.same_tokens and rc.ok, rc
            assert rc.tol == rc.n_layer * rc.n_attended * (2.0 ** -11 if (fa and tv == "f16") else 2.0 ** -24)
        with _filled(m, unified, fa, tv) as ctx:
            bad = restore_check(ctx, 0, 2, hist, 13, fa, tv, corrupt=_corrupt_one_k_row)
            assert not bad.same_cells and not bad.ok


def test_same_sequence_state_compares_cells_not_ids(model_path):
    with Model(model_path) as m, _filled(m) as ctx:
        a = ctx.state_seq_get_data(0)
        blob1 = ctx.state_seq_get_data(1)
        ctx.memory_seq_rm(2, -1, -1)
        ctx.state_seq_set_data(a, 2)
        assert same_sequence_state(a, ctx.state_seq_get_data(2))   # same cells, another sequence id
        assert not same_sequence_state(a, blob1)                    # another sequence's cells


def test_demo_on_a_model_with_the_gpt2_vocabulary(tmp_path, capsys):
    """Default flags (flash attention, F16 K/V, unified cache), quantized weights, text in and out."""
    path = make_model(tmp_path / "g.gguf", ModelSpec(layers=2, embd=64, heads=2, heads_kv=1, ff=64, seed=4,
                                                     type="q8_0", vocab_from=str(GPT2_VOCAB)))
    prompt = "The llama walked into the library and"
    assert demo_main(["--model", str(path), "--threads", "1", "--n-par", "3", "--n-ctx", "256",
                      "--prompt", prompt]) == 0
    out = capsys.readouterr().out
    assert f"prompt: {len(Vocab.from_gguf(GPT2_VOCAB).tokenize(prompt))} tokens" in out
    seq_lines = [ln for ln in out.splitlines() if ln.startswith("  seq ")]
    assert len(seq_lines) == 3 and all("| '" in ln or '| "' in ln for ln in seq_lines)
    assert "cells equal seq 0's byte for byte" in out and out.rstrip().endswith("-> OK")

"""Tests of kvcache_ggml.batch: hand-worked cases from llama-batch.cpp's logic, and a hypothesis comparison with
a plain-loop transcription of llama_batch_allocr (batch_reference.RefAllocr) on random batches."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvcache_ggml.batch import LLAMA_MAX_SEQ, Batch, BatchAllocator, UBatch, read_debug_env

from batch_reference import Mem, RefAllocr, drain, split_all, summary, tag_of, ub_dict


# ================================================================================================ Batch


def test_batch_normalises_inputs():
    b = Batch(token=[1, 2, 3], pos=[5, 6, 7], seq_id=[[0], [0, 2], [1]], logits=[False, True, True])
    assert b.n_tokens == 3 and b.token.dtype == np.int32 and b.pos.dtype == np.int32
    assert b.seq_id.tolist() == [[0, -1], [0, 2], [1, -1]] and b.n_seq_id.tolist() == [1, 2, 1]
    assert b.logits.dtype == np.int8 and b.logits.tolist() == [0, 1, 1]
    b = Batch(token=np.array([4, 5], np.int64), seq_id=np.array([3, 1]))
    assert b.seq_id.tolist() == [[3], [1]] and b.n_seq_id.tolist() == [1, 1] and b.n_pos == 0
    b = Batch(token=[4, 5], seq_id=[0, [1, 2]])
    assert b.seq_id.tolist() == [[0, -1], [1, 2]]
    b = Batch(token=[4, 5], seq_id=np.array([[0, 9], [1, 2]]), n_seq_id=[1, 2])
    assert b.seq_id.tolist() == [[0, -1], [1, 2]]
    b = Batch(token=[4, 5], seq_id=np.array([[0, 9, 9], [1, 9, 9]]), n_seq_id=[1, 1])
    assert b.seq_id.tolist() == [[0], [1]]
    b = Batch(embd=np.zeros((2, 3)), pos=np.arange(8).reshape(4, 2))
    assert b.embd.dtype == np.float32 and b.pos.tolist() == list(range(8)) and b.n_pos == 4
    tok = np.array([7], np.int32)
    assert Batch(token=tok).token is tok  # referenced, not copied


@pytest.mark.parametrize("kwargs, field", [
    (dict(), "exactly one"),
    (dict(token=[1], embd=[[0.0]]), "exactly one"),
    (dict(token=[]), "n_tokens = 0"),
    (dict(token=[[1, 2]]), "token: shape"),
    (dict(token=[1.5]), "token: expected integers"),
    (dict(token=[2**31]), "does not fit int32"),
    (dict(embd=[1.0, 2.0]), "embd: shape"),
    (dict(token=[1, 2], pos=[0, 1, 2]), "pos: shape"),
    (dict(token=[1, 2], pos=np.zeros((2, 3), np.int32)), "pos: shape"),
    (dict(token=[1, 2], seq_id=[[0]]), "seq_id"),
    (dict(token=[1, 2], seq_id=[[0], []]), r"seq_id\[1\]: empty"),
    (dict(token=[1, 2], seq_id=np.zeros((2, 0), np.int32)), "seq_id: shape"),
    (dict(token=[1, 2], n_seq_id=[1, 1]), "n_seq_id given without seq_id"),
    (dict(token=[1, 2], seq_id=np.zeros((2, 2), np.int32), n_seq_id=[1, 3]), r"n_seq_id\[1\] = 3"),
    (dict(token=[1, 2], logits=[1]), "logits: shape"),
    (dict(token=[1, 2], logits=[1, 300]), "logits: values must fit int8"),
])
def test_batch_shape_errors(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Batch(**kwargs)


# ================================================================================================ init: validation


def init_err(batch, *, n_vocab=100, memory=None, n_embd=4, n_seq_max=4, output_all=False, npe=1) -> str:
    alloc = BatchAllocator(npe)
    with pytest.raises(ValueError) as ei:
        alloc.init(batch, n_vocab, memory, n_embd, n_seq_max, output_all)
    # a failed init leaves no batch behind, and the allocator is reusable
    with pytest.raises(RuntimeError):
        alloc.split_simple(8)
    assert alloc.get_n_tokens() == 0
    alloc.init(Batch(token=[1]), 100, None, 4, 1, False)
    assert alloc.split_simple(8).n_tokens == 1
    return str(ei.value)


def test_err_n_seq_max():
    msg = init_err(Batch(token=[1]), n_seq_max=LLAMA_MAX_SEQ + 1)
    assert "257" in msg and "256" in msg


def test_err_token_out_of_range():
    msg = init_err(Batch(token=[1, 5, 100, 200]), n_vocab=100)
    assert "token[2] = 100" in msg and "n_vocab=100" in msg
    msg = init_err(Batch(token=[-1]), n_vocab=100)
    assert "token[0] = -1" in msg


def test_decode_batch_tokens_at_the_vocabulary_edge():
    """A decode batch (several sequences, one token each: the fast path) takes token n_vocab - 1 and refuses
    n_vocab and -1 with the general path's message."""
    ok = BatchAllocator(1)
    ok.init(Batch(token=[5, 99, 0], seq_id=[0, 1, 2]), 100, None, 4, 4, False)
    assert ok.get_n_tokens() == 3 and ok.get_batch().token.tolist() == [5, 99, 0]
    assert "token[1] = 100" in init_err(Batch(token=[5, 100, 0], seq_id=[0, 1, 2]), n_vocab=100)
    assert "token[2] = -1" in init_err(Batch(token=[5, 7, -1], seq_id=[0, 1, 2]), n_vocab=100)


def test_err_seq_id_out_of_range():
    msg = init_err(Batch(token=[1, 2], seq_id=[[0], [0, 3]]), n_seq_max=3)
    assert "seq_id[1][1] = 3" in msg and "n_seq_max=3" in msg
    msg = init_err(Batch(token=[1, 2], seq_id=[1, -1]), n_seq_max=3)
    assert "seq_id[1][0] = -1" in msg
    # the token check comes first, as in llama.cpp
    msg = init_err(Batch(token=[1, 500], seq_id=[9, 9]), n_seq_max=3)
    assert "token[1] = 500" in msg


def test_err_not_consecutive_with_memory():
    # the memory ends sequence 0 at X = 4: the batch must start it at Y = 5
    msg = init_err(Batch(token=[1, 2], pos=[6, 7]), memory=Mem({0: (0, 4)}))
    assert "X = 4" in msg and "Y = 6" in msg and "token 0" in msg and "Y = X + 1 = 5" in msg
    # the check is per sequence: sequence 1 at X = 2 and Y = 2 fails even though sequence 0 is fine
    msg = init_err(Batch(token=[1, 2], pos=[5, 2], seq_id=[0, 1]), memory=Mem({0: (0, 4), 1: (0, 2)}))
    assert "sequence 1" in msg and "X = 2" in msg and "token 1" in msg
    # an empty sequence in the memory (-1) accepts any start
    alloc = BatchAllocator(1)
    alloc.init(Batch(token=[1, 2], pos=[7, 8], seq_id=[1, 1]), 100, Mem({0: (0, 4)}), 4, 4, False)


def test_err_not_continuous_in_batch():
    msg = init_err(Batch(token=[1, 2, 3], pos=[0, 1, 3]))
    assert "sequence 0" in msg and "not continuous" in msg and "position 2 is missing" in msg
    # repeated positions are a set: {0, 1} is continuous
    alloc = BatchAllocator(1)
    alloc.init(Batch(token=[1, 2, 3], pos=[0, 0, 1]), 100, None, 4, 4, False)
    # sequences are checked separately
    msg = init_err(Batch(token=[1, 2, 3, 4], pos=[0, 0, 1, 2], seq_id=[0, 1, 0, 1]))
    assert "sequence 1" in msg and "position 1 is missing" in msg


def test_mrope_positions_may_jump():
    # M-RoPE: no continuity inside the batch, only X < Y (tokens) or X <= Y (embeddings) with the memory
    alloc = BatchAllocator(4)
    alloc.init(Batch(token=[1, 2], pos=[0, 7]), 100, None, 4, 4, False)
    alloc.init(Batch(token=[1], pos=[9]), 100, Mem({0: (0, 5)}), 4, 4, False)
    msg = init_err(Batch(token=[1], pos=[5]), memory=Mem({0: (0, 5)}), npe=4)
    assert "X = 5" in msg and "Y = 5" in msg and "X < Y" in msg
    embd = np.zeros((1, 4), np.float32)
    alloc.init(Batch(embd=embd, pos=[5, 0, 0, 0]), 100, Mem({0: (0, 5)}), 4, 4, False)
    msg = init_err(Batch(embd=embd, pos=[4, 0, 0, 0]), memory=Mem({0: (0, 5)}), npe=4)
    assert "X = 5" in msg and "Y = 4" in msg and "X <= Y" in msg


def test_err_mrope_embd_positions():
    msg = init_err(Batch(embd=np.zeros((2, 4))), npe=4)
    assert "explicit positions" in msg
    msg = init_err(Batch(embd=np.zeros((2, 4)), pos=[0, 1]), npe=4)
    assert "n_pos_per_embd = 4" in msg
    msg = init_err(Batch(token=[1, 2], pos=[0, 1, 2, 3]), npe=4)
    assert "2 positions per token" in msg
    msg = init_err(Batch(embd=np.zeros((2, 3)), pos=[0, 1]), n_embd=4)
    assert "n_embd=4" in msg


def test_err_coupled_sequences_diverged():
    # both sequences continue at 5, but sequence 1 starts at 2 in the memory while sequence 0 starts at 0
    msg = init_err(Batch(token=[1], pos=[5], seq_id=[[0, 1]]), memory=Mem({0: (0, 4), 1: (2, 4)}))
    assert "sequence 1 is coupled to 0" in msg and "[2, 4]" in msg and "[0, 4]" in msg
    alloc = BatchAllocator(1)
    alloc.init(Batch(token=[1], pos=[5], seq_id=[[0, 1]]), 100, Mem({0: (0, 4), 1: (0, 4)}), 4, 4, False)
    alloc.init(Batch(token=[1], pos=[5], seq_id=[[0, 1]]), 100, None, 4, 4, False)  # no memory: no check


def test_decreasing_positions_as_llama_cpp():
    # llama.cpp's "decreasing" check compares with a per-sequence position that stays at -1, so it only rejects
    # positions below -1; the example of its own comment (4 5 0 1 6 2 3 over sequences 0 0 1 1 0 1 0) passes.
    msg = init_err(Batch(token=[1, 2], pos=[-3, -2]))
    assert "decreasing" in msg and "pos[0] = -3" in msg
    alloc = BatchAllocator(1)
    alloc.init(Batch(token=[1] * 7, pos=[4, 5, 0, 1, 6, 2, 3], seq_id=[0, 0, 1, 1, 0, 1, 0]), 100, None, 4, 4,
               False)
    alloc.init(Batch(token=[1], pos=[-1]), 100, None, 4, 4, False)


def test_misuse_raises_runtime_error():
    alloc = BatchAllocator(1)
    for call in (lambda: alloc.split_simple(4), lambda: alloc.split_equal(4, False), lambda: alloc.split_seq(4),
                 alloc.split_reset, alloc.get_batch):
        with pytest.raises(RuntimeError):
            call()
    assert alloc.get_n_tokens() == 0 and alloc.get_n_outputs() == 0 and alloc.get_n_used() == 0
    assert alloc.get_out_ids().tolist() == [] and alloc.seq_pos_min(0) == -1
    with pytest.raises(TypeError):
        alloc.init([1, 2], 100, None, 4, 1, False)
    with pytest.raises(ValueError):
        alloc.init(Batch(token=[1]), 100, None, 4, 0, False)
    alloc.init(Batch(token=[1]), 100, None, 4, 1, False)
    with pytest.raises(ValueError):
        alloc.split_simple(-1)
    with pytest.raises(ValueError):
        BatchAllocator(0)


# ================================================================================================ init: auto-fill


def test_autofill_positions():
    alloc = BatchAllocator(1)
    alloc.init(Batch(token=[1, 2, 3]), 100, None, 4, 1, False)
    assert alloc.get_batch().pos.tolist() == [0, 1, 2]
    assert alloc.get_batch().seq_id.tolist() == [[0], [0], [0]]
    assert alloc.get_batch().n_seq_id.tolist() == [1, 1, 1]
    alloc.init(Batch(token=[1, 2, 3]), 100, Mem({0: (0, 9)}), 4, 1, False)
    assert alloc.get_batch().pos.tolist() == [10, 11, 12]
    # per sequence, from the memory's last position + 1 (0 for an empty sequence)
    alloc.init(Batch(token=[1, 2, 3, 4, 5], seq_id=[0, 1, 0, 1, 2]), 100, Mem({0: (0, 9)}), 4, 4, False)
    assert alloc.get_batch().pos.tolist() == [10, 0, 11, 1, 0]
    assert (alloc.seq_pos_min(0), alloc.seq_pos_max(0)) == (10, 11)
    assert (alloc.seq_pos_min(1), alloc.seq_pos_max(1), alloc.seq_pos_min(3)) == (0, 1, -1)
    # a coupled token takes its first sequence's next position and moves all its sequences past it
    alloc.init(Batch(token=[1, 2, 3], seq_id=[[0, 1], [0], [1]]), 100, None, 4, 4, False)
    assert alloc.get_batch().pos.tolist() == [0, 1, 1]
    alloc.init(Batch(token=[1, 2], seq_id=[[1, 0], [0]]), 100, Mem({0: (0, 4), 1: (0, 4)}), 4, 4, False)
    assert alloc.get_batch().pos.tolist() == [5, 6]


def test_autofill_outputs(caplog):
    alloc = BatchAllocator(1)
    alloc.init(Batch(token=[1, 2, 3]), 100, None, 4, 1, False)
    assert alloc.get_batch().logits.tolist() == [0, 0, 1] and alloc.get_n_outputs() == 1
    alloc.init(Batch(token=[1, 2, 3]), 100, None, 4, 1, True)
    assert alloc.get_batch().logits.tolist() == [1, 1, 1] and alloc.get_n_outputs() == 3
    alloc.init(Batch(token=[1, 2, 3], logits=[1, 0, 0]), 100, None, 4, 1, False)
    assert alloc.get_batch().logits.tolist() == [1, 0, 0] and alloc.get_n_outputs() == 1
    with caplog.at_level(logging.WARNING, logger="kvcache_ggml.batch"):
        alloc.init(Batch(token=[1, 2, 3], logits=[1, 0, 0]), 100, None, 4, 1, True)
    assert "overriding" in caplog.text
    assert alloc.get_batch().logits.tolist() == [1, 1, 1] and alloc.get_n_outputs() == 3


# ================================================================================================ splits, by hand


def test_split_one_sequence():
    b = Batch(token=[10, 11, 12, 13, 14])  # positions 0..4, output on the last token
    for kind in ("simple", "equal", "equal_seq", "seq"):
        alloc, ubs = split_all(b, kind, 2)
        assert [u.pos.tolist() for u in ubs] == [[0, 1], [2, 3], [4]]
        if kind == "simple":  # split_simple counts every token as its own sequence set
            assert [(u.n_seqs, u.n_seq_tokens) for u in ubs] == [(2, 1), (2, 1), (1, 1)]
        else:
            assert [(u.n_seqs, u.n_seq_tokens) for u in ubs] == [(1, 2), (1, 2), (1, 1)]
        assert [u.output.tolist() for u in ubs] == [[0, 0], [0, 0], [1]]
        assert alloc.get_out_ids().tolist() == [4] and alloc.get_n_used() == 5
        assert all(u.equal_seqs() == (kind != "simple") for u in ubs)
    # n_ubatch = 0 still takes one token per ubatch
    _, ubs = split_all(b, "simple", 0)
    assert len(ubs) == 5


def test_split_interleaved_sequences():
    # tokens 0..5 over sequences 0 1 2 0 1 2, each sequence at positions 0 1
    b = Batch(token=[0, 1, 2, 3, 4, 5], seq_id=[0, 1, 2, 0, 1, 2], logits=[1] * 6)
    alloc, ubs = split_all(b, "simple", 4)
    assert summary(ubs) == [([0, 1, 2, 3], [0, 0, 0, 1], [[0], [1], [2], [0]], 4, 1),
                            ([4, 5], [1, 1], [[1], [2]], 2, 1)]
    assert alloc.get_out_ids().tolist() == [0, 1, 2, 3, 4, 5]
    # three sequence sets; two tokens each would make 6 > 4, so one round per ubatch
    alloc, ubs = split_all(b, "equal", 4)
    assert summary(ubs) == [([0, 1, 2], [0, 0, 0], [[0], [1], [2]], 3, 1),
                            ([3, 4, 5], [1, 1, 1], [[0], [1], [2]], 3, 1)]
    # n_ubatch 6: two rounds; the tokens are concatenated per sequence set
    alloc, ubs = split_all(b, "equal", 6)
    assert summary(ubs) == [([0, 3, 1, 4, 2, 5], [0, 1, 0, 1, 0, 1], [[0], [0], [1], [1], [2], [2]], 3, 2)]
    assert alloc.get_out_ids().tolist() == [0, 3, 1, 4, 2, 5]
    u = ubs[0]
    assert u.seq_id_unq.tolist() == [0, 1, 2] and u.seq_idx[:4].tolist() == [0, 1, 2, -1] and u.n_seqs_unq == 3
    # llama.cpp collects sets until there are more than n_ubatch: n_ubatch 2 gives ubatches of 3 tokens
    alloc, ubs = split_all(b, "equal", 2)
    assert summary(ubs) == [([0, 1, 2], [0, 0, 0], [[0], [1], [2]], 3, 1),
                            ([3, 4, 5], [1, 1, 1], [[0], [1], [2]], 3, 1)]
    alloc, ubs = split_all(b, "equal_seq", 8)
    assert summary(ubs) == [([0, 3, 1, 4, 2, 5], [0, 1, 0, 1, 0, 1], [[0], [0], [1], [1], [2], [2]], 3, 2)]
    alloc, ubs = split_all(b, "seq", 10)
    assert summary(ubs) == [([0, 3], [0, 1], [[0], [0]], 1, 2), ([1, 4], [0, 1], [[1], [1]], 1, 2),
                            ([2, 5], [0, 1], [[2], [2]], 1, 2)]
    assert alloc.get_out_ids().tolist() == [0, 3, 1, 4, 2, 5]


def test_split_equal_sequential():
    # sequences 1 0 2 1 0 2: the first unused token is sequence 1, then the next id (2) after it; no 3
    b = Batch(token=[0, 1, 2, 3, 4, 5], seq_id=[1, 0, 2, 1, 0, 2])
    alloc, ubs = split_all(b, "equal_seq", 4)
    assert summary(ubs) == [([0, 3, 2, 5], [0, 1, 0, 1], [[1], [1], [2], [2]], 2, 2),
                            ([1, 4], [0, 1], [[0], [0]], 1, 2)]
    assert alloc.get_out_ids().tolist() == [5]
    # sequences 0 2 1 2: sequence 2 is accepted at its second token (after 1), but contributes its first one
    b = Batch(token=[0, 1, 2, 3], seq_id=[0, 2, 1, 2])
    alloc, ubs = split_all(b, "equal_seq", 8)
    assert summary(ubs) == [([0, 2, 1], [0, 0, 0], [[0], [1], [2]], 3, 1), ([3], [1], [[2]], 1, 1)]
    # sequences 0 2 1: sequence 2's only token lies before sequence 1's, so the scan never accepts it
    b = Batch(token=[0, 1, 2], seq_id=[0, 2, 1])
    alloc, ubs = split_all(b, "equal_seq", 8)
    assert summary(ubs) == [([0, 2], [0, 0], [[0], [1]], 2, 1), ([1], [0], [[2]], 1, 1)]
    b = Batch(token=[0, 1, 2, 3], seq_id=[0, 2, 1, 2])
    # the non-sequential split takes sequence 2 at its first token
    alloc, ubs = split_all(b, "equal", 8)
    assert summary(ubs) == [([0, 1, 2], [0, 0, 0], [[0], [2], [1]], 3, 1), ([3], [1], [[2]], 1, 1)]


def test_split_coupled_sequences(caplog):
    # a prompt shared by sequences 0 and 1 (positions 0 1), then each continues alone (positions 2 3)
    b = Batch(token=[0, 1, 2, 3, 4, 5], seq_id=[[0, 1], [0, 1], [0], [1], [0], [1]], logits=[0, 0, 0, 0, 1, 1])
    alloc, ubs = split_all(b, "equal", 8)
    assert summary(ubs) == [([0, 1], [0, 1], [[0, 1], [0, 1]], 1, 2),
                            ([2, 4, 3, 5], [2, 3, 2, 3], [[0], [0], [1], [1]], 2, 2)]
    assert ubs[0].n_seqs_unq == 2 and ubs[0].seq_id_unq.tolist() == [0, 1] and ubs[0].n_seq_id.tolist() == [2, 2]
    assert ubs[1].seq_id.shape == (4, 1)
    assert alloc.get_out_ids().tolist() == [4, 5]
    # split_seq follows subsets: {0,1} -> {0,1} -> {0} -> {0}, skipping the {1} tokens
    alloc, ubs = split_all(b, "seq", 8)
    assert summary(ubs) == [([0, 1, 2, 4], [0, 1, 2, 3], [[0, 1], [0, 1], [0], [0]], 1, 4),
                            ([3, 5], [2, 3], [[1], [1]], 1, 2)]
    assert alloc.get_out_ids().tolist() == [4, 5]
    alloc, ubs = split_all(b, "simple", 4)
    assert summary(ubs) == [([0, 1, 2, 3], [0, 1, 2, 2], [[0, 1], [0, 1], [0], [1]], 4, 1),
                            ([4, 5], [3, 3], [[0], [1]], 2, 1)]
    assert ubs[0].seq_id.shape == (4, 2) and ubs[1].seq_id.shape == (2, 1)
    # the sequential split refuses coupled sequences: logged, empty ubatch, nothing used
    with caplog.at_level(logging.ERROR, logger="kvcache_ggml.batch"):
        alloc, ubs = split_all(b, "equal_seq", 8)
    assert ubs == [] and alloc.get_n_used() == 0 and "coupled" in caplog.text


def test_split_mrope_positions():
    # embeddings carry their own positions per section; tokens broadcast theirs to every section
    pos = np.array([[0, 1, 2], [10, 11, 12], [20, 21, 22], [30, 31, 32]], np.int32)
    embd = np.arange(6, dtype=np.float32).reshape(3, 2)
    alloc, ubs = split_all(Batch(embd=embd, pos=pos), "simple", 2, n_pos_per_embd=4, n_embd=2)
    assert ubs[0].pos.tolist() == [0, 1, 10, 11, 20, 21, 30, 31] and ubs[1].pos.tolist() == [2, 12, 22, 32]
    assert ubs[0].embd.tolist() == [[0, 1], [2, 3]] and ubs[0].token is None and ubs[0].is_pos_2d()
    alloc, ubs = split_all(Batch(token=[5, 6, 7]), "simple", 2, n_pos_per_embd=4)
    assert ubs[0].pos.tolist() == [0, 1] * 4 and ubs[0].n_pos == 4
    alloc, ubs = split_all(Batch(token=[5, 6]), "simple", 2, n_pos_per_embd=1)
    assert not ubs[0].is_pos_2d()


def test_ubatch_reserve():
    alloc = BatchAllocator(3)
    alloc.init(Batch(token=[1, 2]), 100, None, 4, 1, False)
    u = alloc.ubatch_reserve(4, 2)
    assert (u.n_tokens, u.n_seq_tokens, u.n_seqs, u.n_seqs_unq, u.n_pos, u.equal_seqs()) == (8, 4, 2, 2, 3, True)
    assert u.token.tolist() == [0] * 8 and u.embd is None and u.pos.shape == (24,)
    assert u.n_seq_id.tolist() == [0] * 8 and u.seq_id.shape == (8, 1) and (u.seq_id == -1).all()
    assert u.seq_id_unq.tolist() == [0, 1] and u.seq_idx[:3].tolist() == [0, 1, -1]
    assert u.output.tolist() == [0] * 8
    # the batch is dropped
    assert alloc.get_n_tokens() == 0
    with pytest.raises(RuntimeError):
        alloc.split_simple(4)


def test_split_reset_restarts():
    alloc = BatchAllocator(1)
    alloc.init(Batch(token=[1, 2, 3], logits=[1, 1, 1]), 100, None, 4, 1, False)
    assert len(drain(alloc, "simple", 2)) == 2 and alloc.get_out_ids().tolist() == [0, 1, 2]
    alloc.split_reset()
    assert alloc.get_n_used() == 0 and alloc.get_out_ids().tolist() == []
    assert len(drain(alloc, "equal", 8)) == 1 and alloc.get_n_used() == 3


def ubatch_fields(u):
    return (u.n_tokens, u.n_seq_tokens, u.n_seqs, u.n_seqs_unq, u.n_pos, u.equal_seqs(), u.token.tolist(),
            u.pos.tolist(), u.n_seq_id.tolist(), u.seq_id.tolist(), u.seq_id_unq.tolist(), u.seq_idx.tolist(),
            u.output.tolist())


@pytest.mark.parametrize("seqs, n_ubatch, whole", [
    ([3], 512, True), ([0, 5, 2], 3, True), ([0, 5, 2], 2, False),  # n_ubatch below the batch: split_simple cuts
    ([1, 1], 512, False), ([4], 0, False),  # one sequence twice; n_ubatch 0 (split_simple still takes a token)
])
def test_split_whole_is_reset_and_split_simple_of_a_decode_step(seqs, n_ubatch, whole):
    """split_whole returns what split_reset + split_simple return, and leaves the allocator as they do, for a
    decode batch the split takes whole; any other batch gets None with the allocator untouched."""
    n = len(seqs)
    b = Batch(token=np.arange(n, dtype=np.int32) + 7, pos=np.arange(n, dtype=np.int32) + 4 * (seqs[0] == seqs[-1]),
              seq_id=np.array(seqs, np.int32), logits=np.array([k % 2 for k in range(n)], np.int8))
    one, two = BatchAllocator(1), BatchAllocator(1)
    for a in (one, two):
        a.init(b, 100, None, 4, 8, False)
        a.split_simple(512)  # a split before: both calls start from a reset
    got = one.split_whole(n_ubatch)
    two.split_reset()
    want = two.split_simple(n_ubatch)
    if whole:
        assert got is not None and ubatch_fields(got) == ubatch_fields(want)
        assert (one.get_n_used(), one.get_out_ids().tolist()) == (two.get_n_used(), two.get_out_ids().tolist())
        assert one.split_simple(512).n_tokens == 0 == two.split_simple(512).n_tokens
    else:
        assert got is None and one.get_n_used() == n  # untouched: still as the earlier split left it
    assert BatchAllocator(1).split_whole(512) is None  # no batch: None (split_reset raises the error)


def test_debug_logging(monkeypatch, caplog):
    import kvcache_ggml.batch._allocator as allocator_module
    monkeypatch.setattr(allocator_module, "_DEBUG", None)  # restored afterwards: later allocators do not log
    monkeypatch.setenv("LLAMA_BATCH_DEBUG", "2")
    alloc = BatchAllocator(1)  # the first allocator reads the variable
    monkeypatch.delenv("LLAMA_BATCH_DEBUG")  # read once per process
    assert BatchAllocator(1).debug == 2 and read_debug_env() == 0 and BatchAllocator(1).debug == 0
    with caplog.at_level(logging.DEBUG, logger="kvcache_ggml.batch"):
        alloc.init(Batch(token=[1, 2], seq_id=[[0, 1], [0]]), 100, None, 4, 4, False)
        alloc.split_simple(8)
    assert "input batch info" in caplog.text and "added ubatch to split" in caplog.text
    assert "cpl = 0" in caplog.text and "seq_id = [01]" in caplog.text


# ================================================================================================ hypothesis


@st.composite
def batches(draw, *, valid: bool = True):
    """A random batch for both implementations: (kwargs for Batch, the same as lists, init arguments)."""
    npe = draw(st.sampled_from([1, 1, 4]))
    use_embd = draw(st.booleans()) if npe > 1 else draw(st.sampled_from([False, False, True]))
    n_seq_max = draw(st.integers(1, 6))
    n = draw(st.integers(1, 24))
    # sequence ids are drawn small, then relabelled: the identity, consecutive ids around a 64-bit word boundary,
    # or any distinct ids up to LLAMA_MAX_SEQ - 1
    relabel = draw(st.sampled_from(["none", "none", "word", "any"]))
    coupled = draw(st.booleans())
    use_memory = draw(st.booleans())
    same_start = draw(st.booleans())
    nxt0 = [0 if same_start else draw(st.integers(0, 3)) for _ in range(n_seq_max)]
    memory = Mem({s: (0, p - 1) for s, p in enumerate(nxt0) if p > 0}) if use_memory else None
    nxt = list(nxt0)
    seq_id, pos = [], []
    for _ in range(n):
        s = draw(st.integers(0, n_seq_max - 1))
        ids = [s]
        if coupled:
            peers = [t for t in range(n_seq_max) if t != s and nxt[t] == nxt[s]]
            ids += draw(st.lists(st.sampled_from(peers), unique=True, max_size=3)) if peers else []
            ids = draw(st.permutations(ids))
        pos.append(nxt[s])
        for t in ids:
            nxt[t] = nxt[s] + 1
        seq_id.append(list(ids))
    if relabel != "none":
        if relabel == "word":
            first = draw(st.integers(64 - n_seq_max, 64))
            labels = list(range(first, first + n_seq_max))
        else:
            labels = draw(st.lists(st.integers(0, LLAMA_MAX_SEQ - 1), min_size=n_seq_max, max_size=n_seq_max,
                                   unique=True))
        seq_id = [[labels[x] for x in r] for r in seq_id]
        if memory is not None:
            memory = Mem({labels[k]: v for k, v in memory.ranges.items()})
        n_seq_max = max(labels) + 1 if draw(st.booleans()) else LLAMA_MAX_SEQ
    if not valid:  # perturb: out-of-range values and position jumps
        n_vocab = 50
        token = [draw(st.integers(-1, 51)) for _ in range(n)]
        seq_id = [[draw(st.integers(-1, n_seq_max)) if draw(st.integers(0, 9)) == 0 else x for x in r]
                  for r in seq_id]
        pos = [p + draw(st.sampled_from([0, 0, 0, 0, 1, -1, -3])) for p in pos]
    else:
        n_vocab = 1000
        token = list(range(n))  # token i has id i: the ubatches show which tokens they hold
    give_pos = draw(st.booleans()) or (use_embd and npe > 1)
    pos_flat = None
    if give_pos:
        if use_embd and npe > 1:
            pos_flat = pos + [draw(st.integers(0, 9)) for _ in range((npe - 1) * n)]
        else:
            pos_flat = pos
    give_seq = draw(st.booleans()) or coupled or n_seq_max > 1
    logits = draw(st.one_of(st.none(), st.lists(st.sampled_from([0, 1]), min_size=n, max_size=n)))
    output_all = draw(st.booleans())
    embd = [[float(i), float(i) + 0.5] for i in range(n)] if use_embd else None
    kw = dict(token=None if use_embd else token, embd=embd, pos=pos_flat, seq_id=seq_id if give_seq else None,
              logits=logits)
    args = dict(n_vocab=n_vocab, memory=memory, n_embd=2, n_seq_max=n_seq_max, output_all=output_all)
    return npe, kw, args


def run_both(npe, kw, args):
    ref = RefAllocr(npe)
    ref_err = ref.init(kw["token"], kw["embd"], kw["pos"], kw["seq_id"], kw["logits"], args["n_vocab"],
                       args["memory"], args["n_embd"], args["n_seq_max"], args["output_all"])
    alloc = BatchAllocator(npe)
    try:
        alloc.init(Batch(**kw), args["n_vocab"], args["memory"], args["n_embd"], args["n_seq_max"],
                   args["output_all"])
        err = None
    except ValueError as e:
        err = tag_of(e)
    return ref, ref_err, alloc, err


_HYP = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_HYP
@given(batches(valid=False))
def test_init_matches_reference_on_random_input(case):
    npe, kw, args = case
    ref, ref_err, alloc, err = run_both(npe, kw, args)
    assert err == ref_err
    if err is None:
        b = alloc.get_batch()
        assert b.pos[:b.n_tokens].tolist() == ref.pos[:ref.n_tokens]
        assert b.logits.tolist() == list(ref.logits) and alloc.get_n_outputs() == ref.n_outputs
        for s in range(args["n_seq_max"]):
            assert (alloc.seq_pos_min(s), alloc.seq_pos_max(s)) == (ref.pmin(s), ref.pmax(s))


KINDS = ["simple", "equal", "equal_seq", "seq"]


def ref_split(ref: RefAllocr, kind: str, n_ubatch: int):
    if kind == "simple":
        return ref.split_simple(n_ubatch)
    if kind == "equal":
        return ref.split_equal(n_ubatch, False)
    if kind == "equal_seq":
        return ref.split_equal(n_ubatch, True)
    return ref.split_seq(n_ubatch)


@_HYP
@given(batches(), st.sampled_from(KINDS), st.integers(0, 10))
def test_splits_match_reference(case, kind, n_ubatch):
    npe, kw, args = case
    ref, ref_err, alloc, err = run_both(npe, kw, args)
    assert err == ref_err
    assume(err is None)
    n = ref.n_tokens
    got = []
    for _ in range(n + 1):
        want = ref_split(ref, kind, n_ubatch)
        ub = drain_one(alloc, kind, n_ubatch)
        if want is None:
            assert ub.n_tokens == 0
            break
        assert ub_dict(ub) == want
        got.append(ub)
    assert alloc.get_out_ids().tolist() == ref.out_ids and alloc.get_n_used() == ref.n_used
    if kind == "equal_seq" and ref.has_cpl:
        assert got == []
        return
    # every token exactly once; out_ids a permutation of the output tokens
    ids = sorted(t for u in got for t in (u.token.tolist() if u.token is not None else u.embd[:, 0].tolist()))
    assert ids == list(range(n)) and alloc.get_n_used() == n
    outputs = [i for i in range(n) if ref.logits[i]]
    assert sorted(alloc.get_out_ids().tolist()) == outputs
    for u in got:
        if kind == "simple":
            assert u.n_seqs == u.n_tokens and u.n_seq_tokens == 1
        else:
            assert u.n_tokens == u.n_seqs * u.n_seq_tokens and u.n_tokens <= max(1, n_ubatch) + 1
        if kind in ("simple", "seq"):
            assert u.n_tokens <= max(1, n_ubatch)


def drain_one(alloc: BatchAllocator, kind: str, n_ubatch: int) -> UBatch:
    if kind == "simple":
        return alloc.split_simple(n_ubatch)
    if kind == "equal":
        return alloc.split_equal(n_ubatch, False)
    if kind == "equal_seq":
        return alloc.split_equal(n_ubatch, True)
    return alloc.split_seq(n_ubatch)


@_HYP
@given(batches(), st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 6)), min_size=1, max_size=12))
def test_mixed_splits_match_reference(case, calls):
    """Different split kinds between two resets still behave as llama.cpp's."""
    npe, kw, args = case
    ref, ref_err, alloc, err = run_both(npe, kw, args)
    assume(err is None)
    for kind, n_ubatch in calls:
        want = ref_split(ref, kind, n_ubatch)
        ub = drain_one(alloc, kind, n_ubatch)
        assert (ub.n_tokens == 0) if want is None else (ub_dict(ub) == want)
        assert alloc.get_n_used() == ref.n_used and alloc.get_out_ids().tolist() == ref.out_ids

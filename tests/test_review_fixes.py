"""Edge cases where an earlier version differed from the seed or left the cache changed after an error."""
import numpy as np
import pytest

from kvcache_ggml.batch import Batch, BatchAllocator
from kvcache_ggml.cache import KVCache, MemoryStatus
from kvcache_ggml.hparams import HParams
from kvcache_ggml.inspect import check_invariants

from test_cache_bookkeeping import TinyModel, assert_same_snapshot, decode, snapshot


def test_seq_div_divisor_beyond_int32_raises_and_changes_nothing():
    kv = KVCache(TinyModel(), kv_size=16)
    decode(kv, list(range(5)), [0] * 5)
    before = snapshot(kv)
    with pytest.raises(ValueError, match="divisor"):
        kv.seq_div(0, -1, -1, 2**31)
    assert_same_snapshot(before, snapshot(kv))
    assert check_invariants(kv) == []


def test_seq_add_shift_beyond_int32_raises_and_changes_nothing():
    kv = KVCache(TinyModel(), kv_size=16)
    decode(kv, list(range(5)), [0] * 5)
    before = snapshot(kv)
    with pytest.raises(ValueError, match="int32"):
        kv.seq_add(0, -1, -1, 2**31)
    assert_same_snapshot(before, snapshot(kv))


def test_cell_at_int32_max_is_outside_every_range_as_in_the_seed():
    # the seed's pos_in is strict: p1 = -1 becomes INT32_MAX, so a cell at INT32_MAX is never matched
    for n in (5, 70):  # the few-cells path and the full-scan path
        kv = KVCache(TinyModel(), kv_size=128)
        decode(kv, list(range(n)), [0] * n)
        kv.seq_add(0, n - 1, n, 2**31 - 1 - (n - 1))
        assert kv.seq_pos_max(0) == 2**31 - 1
        kv.seq_rm(0, -1, -1)
        assert kv.v_cells[0].get_used() == 1 and kv.seq_pos_max(0) == 2**31 - 1


def test_get_n_kv_pads_like_ggml_pad():
    # GGML_PAD(x, n) = (x + n - 1) & ~(n - 1): a true multiple only for powers of two
    kv = KVCache(TinyModel(), kv_size=2304, n_pad=768)
    ctx, _ = decode(kv, list(range(770)), [0] * 770)
    assert ctx.get_n_kv() == (770 + 767) & ~767 == 1024


def test_state_save_of_a_sequence_no_stream_holds_is_empty_as_in_the_seed():
    kv = KVCache(TinyModel(), kv_size=8, n_seq_max=2, unified=False)
    decode(kv, [0, 1], [0, 0])
    blob = kv.state_save(5)
    assert blob == np.array([2, 0, 0], np.uint32).tobytes()  # n_stream, then an empty count per stream


def test_refused_k_shift_does_not_perform_the_queued_stream_copies():
    class OddRot:
        hparams = HParams.simple(n_layer=1, n_embd_head=8, n_head=2, n_head_kv=1, n_rot=3)

        def dev_layer(self, il):
            return None

    kv = KVCache(OddRot(), kv_size=8, n_seq_max=2, unified=False, type_k="f32", type_v="f32")
    decode(kv, [0, 1], [0, 0])
    kv.seq_add(0, -1, -1, 1)
    kv.seq_cp(0, 1, -1, -1)
    k1 = [kv.layers[0].k_stream[1]]
    from kvcache_ggml import _ggml as G
    G.ggml_backend_tensor_memset(kv.layers[0].k, 7, 0, G.nbytes(kv.layers[0].k) // 2)  # stream 0 differs
    before = G.to_numpy(kv.layers[0].k, copy=True)
    with pytest.raises(ValueError, match="n_rot"):
        kv.init_update().apply()
    np.testing.assert_array_equal(G.to_numpy(kv.layers[0].k, copy=True), before)
    assert kv.get_has_shift() and k1
    assert kv.sc_info.ssrc == [0] and kv.sc_info.sdst == [1]  # the copy stays queued for the next update

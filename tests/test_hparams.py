"""HParams against hand-worked values, llama.cpp's SWA rules and a C transcription of the position buckets."""
from __future__ import annotations

import itertools
import shutil
import subprocess

import gguf
import numpy as np
import pytest

from kvcache_ggml import (HParams, RopeType, SwaType, is_masked_swa, is_masked_swa_np, llama_relative_position_bucket,
                          llama_relative_position_bucket_np)
from kvcache_ggml import ggml as G


def mixed() -> HParams:
    # 4 layers, 8 query heads; kv heads 2, 4, 2, 0; k heads of 64, v heads of 32
    return HParams(n_layer=4, n_embd=512, n_embd_head_k=64, n_embd_head_v=32, n_head_arr=(8, 8, 8, 8),
                   n_head_kv_arr=(2, 4, 2, 0), n_rot=32)


def test_per_layer_widths_by_hand():
    hp = mixed()
    assert [hp.n_head_kv(il) for il in range(4)] == [2, 4, 2, 0]
    assert [hp.n_embd_k_gqa(il) for il in range(4)] == [128, 256, 128, 0]
    assert [hp.n_embd_v_gqa(il) for il in range(4)] == [64, 128, 64, 0]
    assert [hp.n_gqa(il) for il in range(4)] == [4, 2, 4, 0]
    assert hp.n_embd_k_gqa_max() == 256 and hp.n_embd_v_gqa_max() == 128
    assert hp.is_n_embd_k_gqa_variable() and hp.is_n_embd_v_gqa_variable()
    assert hp.n_head() == 8 and hp.n_head_kv() == 2


def test_simple_constructor_uniform_model():
    hp = HParams.simple(n_layer=2, n_embd_head=16, n_head=4, n_head_kv=2)
    assert (hp.n_embd, hp.n_embd_head_k, hp.n_embd_head_v, hp.n_rot) == (64, 16, 16, 16)
    assert hp.n_head_arr == (4, 4) and hp.n_head_kv_arr == (2, 2)
    assert hp.n_embd_k_gqa(1) == hp.n_embd_v_gqa(1) == hp.n_embd_v_gqa_max() == 32
    assert not hp.is_n_embd_v_gqa_variable() and not hp.is_n_embd_k_gqa_variable()
    assert hp.swa_layers == (False, False) and not hp.is_swa_any()
    assert hp.rope_type is RopeType.NORM and hp.swa_type is SwaType.NONE
    hv = HParams.simple(3, 8, 2, [1, 2, 1], n_embd_head_v=4, n_rot=4, rope_type=2, n_swa=16, swa_type=1)
    assert hv.n_embd_v_gqa(1) == 8 and hv.n_rot == 4 and hv.rope_type is RopeType.NEOX
    assert hv.swa_type is SwaType.STANDARD


def test_has_kv_and_n_layer_kv():
    hp = mixed()
    assert [hp.has_kv(il) for il in range(4)] == [True] * 4 and hp.n_layer_kv() == 4
    hp.n_layer_kv_from_start = 2
    assert [hp.has_kv(il) for il in range(4)] == [True, True, False, False] and hp.n_layer_kv() == 2
    hp.n_layer_kv_from_start = 0
    assert hp.n_layer_kv() == 0


def test_layer_index_out_of_range():
    hp = mixed()
    for method in (hp.n_head_kv, hp.n_head, hp.n_embd_k_gqa, hp.n_embd_v_gqa, hp.has_kv, hp.is_swa):
        with pytest.raises(ValueError, match=r"il=4 out of range \[0, n_layer=4\)"):
            method(4)
        with pytest.raises(ValueError, match=r"il=-1 out of range"):
            method(-1)


def test_invalid_values_are_refused():
    with pytest.raises(ValueError, match=r"n_head_kv_arr has 3 entries, expected one per layer \(n_layer=4\)"):
        HParams(n_layer=4, n_embd=8, n_embd_head_k=2, n_embd_head_v=2, n_head_arr=4, n_head_kv_arr=(1, 1, 1),
                n_rot=2)
    with pytest.raises(ValueError, match=r"n_layer=0 out of range \[1, 512\]"):
        HParams.simple(0, 8, 1, 1)
    with pytest.raises(ValueError, match=r"n_layer=513"):
        HParams.simple(513, 8, 1, 1)
    with pytest.raises(ValueError, match="n_rot=16 exceeds n_embd_head_k=8"):
        HParams.simple(1, 8, 1, 1, n_rot=16)
    with pytest.raises(ValueError, match=r"n_layer_kv_from_start=3 out of range \[-1, n_layer=2\]"):
        HParams.simple(2, 8, 1, 1, n_layer_kv_from_start=3)
    with pytest.raises(ValueError, match=r"n_head_kv_arr\[1\]=-1"):
        HParams.simple(2, 8, 1, [1, -1])
    with pytest.raises(ValueError, match="CHUNKED needs n_swa > 0"):
        HParams.simple(2, 8, 1, 1, swa_type=SwaType.CHUNKED, swa_layers=True)
    with pytest.raises(ValueError):
        HParams.simple(2, 8, 1, 1, rope_type=3)  # not a llama_rope_type


def test_swa_layers_and_pattern():
    hp = HParams.simple(4, 8, 1, 1, swa_layers=(True, False, True, False), n_swa=4, swa_type=SwaType.STANDARD)
    assert [hp.is_swa(il) for il in range(4)] == [True, False, True, False] and hp.is_swa_any()
    six = HParams.simple(6, 8, 1, 1)
    six.set_swa_pattern(3)  # every 3rd layer dense, counted from the end of each period
    assert six.swa_layers == (True, True, False, True, True, False)
    six.set_swa_pattern(2, dense_first=True)
    assert six.swa_layers == (False, True, False, True, False, True)
    six.set_swa_pattern(0)
    assert six.swa_layers == (True,) * 6
    six.set_swa_pattern(1)
    assert six.swa_layers == (False,) * 6


def test_rope_types_and_positions_per_embedding():
    assert [int(r) for r in RopeType] == [-1, 0, 2, 8, 24, 40]
    assert RopeType.NORM == G.GGML_ROPE_TYPE_NORMAL and RopeType.NEOX == G.GGML_ROPE_TYPE_NEOX
    assert RopeType.MROPE == G.GGML_ROPE_TYPE_MROPE and RopeType.IMROPE == G.GGML_ROPE_TYPE_IMROPE
    assert RopeType.VISION == G.GGML_ROPE_TYPE_VISION
    want = {RopeType.NONE: 1, RopeType.NORM: 1, RopeType.NEOX: 1, RopeType.MROPE: 4, RopeType.VISION: 1,
            RopeType.IMROPE: 4}
    for rope, n in want.items():
        assert HParams.simple(1, 8, 1, 1, rope_type=rope).n_pos_per_embd() == n
    assert [int(s) for s in SwaType] == [0, 1, 2, 3]


# (n_swa, swa_type, p0 = key position, p1 = query position, masked), worked out from llama-hparams.h
SWA_CASES = [
    # STANDARD: masked when p1 - p0 >= n_swa
    (4, SwaType.STANDARD, 6, 10, True), (4, SwaType.STANDARD, 7, 10, False), (4, SwaType.STANDARD, 10, 10, False),
    (4, SwaType.STANDARD, 11, 10, False), (4, SwaType.STANDARD, 0, 4, True), (4, SwaType.STANDARD, 1, 4, False),
    (0, SwaType.STANDARD, 5, 5, True), (1, SwaType.STANDARD, 5, 5, False), (1, SwaType.STANDARD, 4, 5, True),
    # CHUNKED: masked when p0 < floor(p1 / n_swa) * n_swa
    (4, SwaType.CHUNKED, 7, 10, True), (4, SwaType.CHUNKED, 8, 10, False), (4, SwaType.CHUNKED, 9, 10, False),
    (4, SwaType.CHUNKED, 7, 8, True), (4, SwaType.CHUNKED, 4, 7, False), (4, SwaType.CHUNKED, 3, 7, True),
    (4, SwaType.CHUNKED, 11, 10, False), (4, SwaType.CHUNKED, 0, 3, False), (1, SwaType.CHUNKED, 4, 5, True),
    # SYMMETRIC: masked when p1 - p0 < -(n_swa / 2) or > n_swa / 2 (integer halving)
    (4, SwaType.SYMMETRIC, 8, 10, False), (4, SwaType.SYMMETRIC, 7, 10, True), (4, SwaType.SYMMETRIC, 12, 10, False),
    (4, SwaType.SYMMETRIC, 13, 10, True), (5, SwaType.SYMMETRIC, 7, 10, True), (5, SwaType.SYMMETRIC, 8, 10, False),
    (1, SwaType.SYMMETRIC, 10, 10, False), (1, SwaType.SYMMETRIC, 9, 10, True),
    # NONE: never
    (4, SwaType.NONE, 0, 1000, False), (0, SwaType.NONE, 3, 3, False),
]


@pytest.mark.parametrize("n_swa,swa_type,p0,p1,masked", SWA_CASES)
def test_is_masked_swa_boundaries(n_swa, swa_type, p0, p1, masked):
    assert HParams.is_masked_swa(n_swa, swa_type, p0, p1) is masked
    assert is_masked_swa(n_swa, swa_type, p0, p1) is masked
    assert HParams.is_masked_swa_np(n_swa, swa_type, np.array([p0]), p1).tolist() == [masked]
    assert is_masked_swa_np(n_swa, swa_type, np.array([p0, p0]), np.array([p1, p1])).tolist() == [masked] * 2


def test_is_masked_swa_np_matches_scalar_on_a_grid():
    p = np.arange(41)
    for swa_type, n_swa in itertools.product(SwaType, range(1, 10)):
        got = HParams.is_masked_swa_np(n_swa, swa_type, p[None, :], p[:, None])  # [p1, p0]
        want = [[HParams.is_masked_swa(n_swa, swa_type, a, b) for a in p] for b in p]
        assert got.shape == (41, 41) and got.tolist() == want, (swa_type, n_swa)


def test_is_masked_swa_refuses_bad_input():
    with pytest.raises(ValueError, match="p0=-1"):
        HParams.is_masked_swa(4, SwaType.STANDARD, -1, 3)
    with pytest.raises(ValueError, match="positions must be >= 0"):
        HParams.is_masked_swa_np(4, SwaType.STANDARD, np.array([0, -1]), 3)
    with pytest.raises(ValueError, match="CHUNKED sliding window needs n_swa > 0, got 0"):
        HParams.is_masked_swa(0, SwaType.CHUNKED, 1, 3)


def test_relative_position_bucket_by_hand():
    # causal (bidirectional=False), 32 buckets: 16 exact, then log-spaced up to distance 128
    assert llama_relative_position_bucket(0, 5, 32, False) == 5
    assert llama_relative_position_bucket(10, 0, 32, False) == 0  # key after the query: distance 0
    assert llama_relative_position_bucket(0, 15, 32, False) == 15
    assert llama_relative_position_bucket(0, 16, 32, False) == 16  # 16 + log(1) * 16 / log(8)
    assert llama_relative_position_bucket(0, 32, 32, False) == 21  # 16 + log(2) * 16 / log(8) = 21.33
    assert llama_relative_position_bucket(0, 127, 32, False) == 31
    assert llama_relative_position_bucket(0, 10_000, 32, False) == 31  # clamped to n_buckets - 1
    # bidirectional, 32 buckets: 16 per direction, 8 exact; keys after the query use the upper half
    assert llama_relative_position_bucket(5, 0, 32, True) == 16 + 5
    assert llama_relative_position_bucket(0, 5, 32, True) == 5
    assert llama_relative_position_bucket(20, 0, 32, True) == 16 + 10  # 8 + log(2.5) * 8 / log(16) = 10.64
    with pytest.raises(ValueError, match="n_buckets=1 too small"):
        llama_relative_position_bucket(0, 1, 1, False)


C_BUCKET = r"""
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
/* llama.cpp's llama_relative_position_bucket, transcribed with the same C types */
static int32_t bucket(int32_t x, int32_t y, uint64_t n_buckets, int bidirectional) {
    const int64_t max_distance = 128;
    if (bidirectional) n_buckets >>= 1;
    const int64_t max_exact = n_buckets >> 1;
    int32_t rel = x - y;
    int32_t result = 0;
    if (bidirectional) { result += (rel > 0) * n_buckets; rel = abs(rel); }
    else { rel = -(rel < 0 ? rel : 0); }
    int32_t large = floorf(max_exact + logf(1.0 * rel / max_exact) * (n_buckets - max_exact)
                           / log(1.0 * max_distance / max_exact));
    int32_t cap = (int32_t)(n_buckets - 1);
    large = large < cap ? large : cap;
    result += rel < max_exact ? rel : large;
    return result;
}
int main(int argc, char ** argv) {
    uint64_t n_buckets = strtoull(argv[1], NULL, 10);
    int bidirectional = atoi(argv[2]);
    int x, y;
    while (scanf("%d %d", &x, &y) == 2) printf("%d\n", bucket(x, y, n_buckets, bidirectional));
    return 0;
}
"""


@pytest.fixture(scope="module")
def c_bucket(tmp_path_factory):
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.fail("no C compiler (gcc/cc) for the relative position bucket transcription")
    d = tmp_path_factory.mktemp("cbucket")
    (d / "b.c").write_text(C_BUCKET)
    subprocess.run([cc, "-O0", "-o", str(d / "b"), str(d / "b.c"), "-lm"], check=True)

    def run(x: np.ndarray, y: np.ndarray, n_buckets: int, bidirectional: bool) -> np.ndarray:
        inp = "\n".join(f"{a} {b}" for a, b in zip(x.tolist(), y.tolist())) + "\n"
        out = subprocess.run([str(d / "b"), str(n_buckets), str(int(bidirectional))], input=inp,
                             capture_output=True, text=True, check=True).stdout
        return np.array(out.split(), dtype=np.int64)
    return run


@pytest.mark.parametrize("n_buckets", [4, 8, 32, 33, 64, 320])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_relative_position_bucket_matches_c(c_bucket, n_buckets, bidirectional):
    d = np.concatenate([np.arange(-400, 401), np.arange(-5000, 5001, 37)])
    x = np.where(d > 0, d, 0) + 7
    y = np.where(d < 0, -d, 0) + 7
    want = c_bucket(x, y, n_buckets, bidirectional)
    got_np = llama_relative_position_bucket_np(x, y, n_buckets, bidirectional)
    np.testing.assert_array_equal(got_np, want)
    sample = slice(None, None, 5)
    got = [llama_relative_position_bucket(a, b, n_buckets, bidirectional) for a, b in zip(x[sample], y[sample])]
    np.testing.assert_array_equal(got, want[sample])


def write_gguf(path, arch="llama", **extra):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(3)
    w.add_context_length(2048)
    w.add_embedding_length(256)
    w.add_head_count(8)
    w.add_head_count_kv(extra.pop("head_count_kv", [2, 4, 2]))
    w.add_key_length(32)
    w.add_value_length(16)
    w.add_rope_dimension_count(24)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_token_list(["<s>", "</s>", "a", "b", "c"])
    for name, value in extra.items():
        getattr(w, f"add_{name}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_from_gguf_llama(tmp_path):
    hp = HParams.from_gguf(write_gguf(tmp_path / "m.gguf"))
    assert (hp.arch, hp.n_layer, hp.n_embd, hp.n_ctx_train) == ("llama", 3, 256, 2048)
    assert hp.n_head_arr == (8, 8, 8) and hp.n_head_kv_arr == (2, 4, 2)
    assert (hp.n_embd_head_k, hp.n_embd_head_v, hp.n_rot) == (32, 16, 24)
    assert [hp.n_embd_k_gqa(il) for il in range(3)] == [64, 128, 64]
    assert hp.n_embd_v_gqa_max() == 64 and hp.is_n_embd_v_gqa_variable()
    assert hp.rope_freq_base_train == 500000.0 and hp.rope_freq_scale_train == 1.0
    assert hp.f_norm_rms_eps == pytest.approx(1e-6) and hp.n_vocab == 5
    assert hp.rope_type is RopeType.NORM and hp.swa_type is SwaType.NONE and not hp.is_swa_any()


def test_from_gguf_sliding_window_and_overrides(tmp_path):
    path = write_gguf(tmp_path / "swa.gguf", arch="qwen2", head_count_kv=4, sliding_window=64,
                      sliding_window_pattern=[True, False, True], vocab_size=1000, rope_scaling_factor=4.0)
    hp = HParams.from_gguf(path)
    assert hp.arch == "qwen2" and hp.rope_type is RopeType.NEOX
    assert hp.n_head_kv_arr == (4, 4, 4) and not hp.is_n_embd_k_gqa_variable()
    assert (hp.n_swa, hp.swa_type, hp.swa_layers) == (64, SwaType.STANDARD, (True, False, True))
    assert hp.n_vocab == 1000 and hp.rope_freq_scale_train == 0.25
    period = HParams.from_gguf(write_gguf(tmp_path / "p.gguf", sliding_window=8, sliding_window_pattern=3))
    assert period.swa_layers == (True, True, False)
    every = HParams.from_gguf(write_gguf(tmp_path / "e.gguf", sliding_window=8))
    assert every.swa_layers == (True, True, True)
    over = HParams.from_gguf(path, n_swa=0, swa_type=SwaType.NONE, swa_layers=False)
    assert not over.is_swa_any() and over.n_swa == 0


def test_from_gguf_missing_key(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    w.add_block_count(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="GGUF key 'llama.embedding_length' is missing"):
        HParams.from_gguf(tmp_path / "bad.gguf")

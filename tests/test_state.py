"""KV-cache state: round trips, the exact layout, a golden file, every check of a restore, and a fuzz test."""
import io
import os
import struct
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvcache_ggml import _ggml as G
from kvcache_ggml.cache import state_codec as S
from kvcache_ggml._state_cli import main_inspect
from kvcache_ggml.cache import KVCache
from kvcache_ggml.hparams import HParams
from kvcache_ggml.state import (BufferWriter, BytesReader, BytesWriter, CountingWriter, FileWriter, StreamReader,
                                StreamWriter, load_seq_file, parse_state, read_state_file, save_seq_file)

from helpers import ToyModel, make_cache
from helpers import decode as decode_batch

DATA = Path(__file__).with_name("data")
REGEN = os.environ.get("KVCACHE_REGEN_GOLDEN") == "1"


MODELS = {
    "small": dict(),
    "gqa-var": dict(n_layer=3, n_head=4, n_head_kv=[1, 2, 1]),   # transposed V padded to the widest layer
    "q8": dict(n_embd_head=32),                                   # rows of whole q8_0 blocks
}

# name -> (model, cache kwargs)
CONFIGS = {
    "unified-trans-f16": ("small", dict(unified=True, v_trans=True)),
    "unified-rows-f16": ("small", dict(unified=True, v_trans=False)),
    "streams-trans-f16": ("small", dict(unified=False, v_trans=True)),
    "streams-rows-f32": ("small", dict(unified=False, v_trans=False, type_k="f32", type_v="f32")),
    "unified-rows-q8": ("q8", dict(unified=True, v_trans=False, type_k="q8_0", type_v="q8_0")),
    "unified-trans-q8k": ("q8", dict(unified=True, v_trans=True, type_k="q8_0", type_v="f16")),
    "streams-rows-q8": ("q8", dict(unified=False, v_trans=False, type_k="q8_0", type_v="q8_0")),
    "unified-trans-gqa": ("gqa-var", dict(unified=True, v_trans=True, type_v="f32")),
}


def make(cfg="unified-trans-f16", kv_size=32, n_seq_max=3, **kw):
    model, params = CONFIGS[cfg]
    return make_cache(kv_size, n_seq_max, **MODELS[model], **dict(params, **kw))


decode = partial(decode_batch, check=True)  # decode(kv, pos, seqs): a batch that must fit


def randomize_data(kv, rng):
    for layer in kv.layers:
        for t in (layer.k, layer.v):
            a = rng.integers(0, 256, G.nbytes(t), dtype=np.uint8)
            G.ggml_backend_tensor_set(t, a.ctypes.data, 0, a.size)


def fill(kv, rng, n_ops=12):
    """Random decodes (continuing each sequence), removals that leave holes and, unified, shared cells."""
    randomize_data(kv, rng)
    for _ in range(n_ops):
        s = int(rng.integers(0, kv.n_seq_max))
        r = rng.random()
        if r < 0.6:
            free = min(c.size() - c.get_used() for c in kv.v_cells)
            k = int(min(rng.integers(1, 6), free))
            if k:
                p0 = kv.seq_pos_max(s) + 1
                decode(kv, list(range(p0, p0 + k)), [s] * k)
        elif r < 0.8:
            p0 = int(rng.integers(0, 8))
            kv.seq_rm(s, p0, p0 + int(rng.integers(1, 3)))
        elif kv.n_stream == 1 and kv.n_seq_max > 1:
            d = (s + 1) % kv.n_seq_max
            kv.seq_rm(d, -1, -1)
            kv.seq_cp(s, d, 0, int(rng.integers(1, 6)))


def raw(t):
    return G.to_numpy(t, copy=not G.is_host(t)).reshape(-1).view(np.uint8)


def cell_data(kv, strm, idxs):
    """Per layer, the K rows and the V rows (or transposed V columns) of the cells ``idxs`` of stream ``strm``."""
    n = kv.get_size()
    out = []
    for layer in kv.layers:
        out.append(raw(layer.k_stream[strm]).reshape(n, -1)[idxs].copy())
    for layer in kv.layers:
        v = raw(layer.v_stream[strm])
        if kv.v_trans:
            el = G.type_size(G.ttype(layer.v))
            out.append(v.reshape(-1, n, el)[:kv.hparams.n_embd_v_gqa(layer.il)][:, idxs].copy())
        else:
            out.append(v.reshape(n, -1)[idxs].copy())
    return out


def seq_cells(kv, seq):
    """Per stream: (cells, positions, sequence bits) of the cells holding ``seq`` (every non-empty cell for -1)."""
    res = []
    for c in kv.v_cells:
        m = c.pos_array >= 0
        if seq >= 0:
            m &= c.seq_mask(seq)
        idx = np.flatnonzero(m)
        res.append((idx, c.pos_array[idx].copy(), c.seq_bits[:, idx].copy()))
    return res


def snapshot_seq(kv, seq):
    """Per stream, the cells of ``seq``, their positions and their data (a shared cell's other sequences may
    change when one of them is removed)."""
    cells = seq_cells(kv, seq)
    return [(idx, pos, cell_data(kv, s, idx)) for s, (idx, pos, _) in enumerate(cells)]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, (list, tuple)):
            assert_same(x, y)
        else:
            np.testing.assert_array_equal(x, y)


def assert_consistent(kv):
    """The derived indices of every stream agree with its arrays."""
    for c in kv.v_cells:
        used = np.flatnonzero(c.pos_array >= 0)
        assert c.get_used() == used.size
        for q in range(kv.n_seq_max):
            ps = c.pos_array[used[c.seq_mask_at(q, used)]] if used.size else np.empty(0, np.int32)
            assert c.seq_pos_min(q) == (int(ps.min()) if ps.size else -1)
            assert c.seq_pos_max(q) == (int(ps.max()) if ps.size else -1)


def assert_restored(src, dst, seq, dst_seq=None):
    """``dst`` holds the cells of ``seq`` of ``src`` (as ``dst_seq``), in order, with the same data."""
    dst_seq = seq if dst_seq is None else dst_seq
    for s, ((si, sp, sb), (di, dp, db)) in enumerate(zip(seq_cells(src, seq), seq_cells(dst, dst_seq))):
        if seq >= 0 and src.n_stream > 1:
            if s != src.seq_to_stream[seq]:
                continue
        np.testing.assert_array_equal(sp, dp)
        if seq == -1:
            np.testing.assert_array_equal(sb, db)
        assert_same(cell_data(src, s, si), cell_data(dst, s if seq == -1 else dst.seq_to_stream[dst_seq], di))


# ============================================================================================ round trips

@pytest.mark.parametrize("cfg", sorted(CONFIGS))
def test_round_trip_whole_and_each_sequence(cfg, tmp_path):
    rng = np.random.default_rng(sum(cfg.encode()))
    src = make(cfg)
    fill(src, rng, 16)
    for seq in [-1] + list(range(src.n_seq_max)):
        blob = src.state_save(seq)
        assert len(blob) == src.state_size(seq)
        dst = make(cfg)
        randomize_data(dst, rng)
        assert dst.state_load(blob, seq) == len(blob)
        assert dst.state_save(seq) == blob
        assert_restored(src, dst, seq)
        assert_consistent(dst)
        # the same bytes through every writer and reader
        bw = BytesWriter(bytearray(b"xy"))
        src.state_write(bw, seq)
        assert bytes(bw.buf[2:]) == blob and bw.n_bytes() == len(blob)
        f = io.BytesIO()
        assert src.state_write(StreamWriter(f), seq) == len(blob)
        assert f.getvalue() == blob
        path = tmp_path / "s.bin"
        with FileWriter(path) as w:
            src.state_write(w, seq)
        assert path.read_bytes() == blob
        dst2 = make(cfg)
        with open(path, "rb") as fh:
            assert dst2.state_read(StreamReader(fh), seq) == len(blob)
        assert dst2.state_save(seq) == blob


@pytest.mark.parametrize("cfg", ["unified-trans-f16", "unified-rows-q8", "streams-trans-f16"])
def test_restore_into_a_used_cache_keeps_other_sequences(cfg):
    rng = np.random.default_rng(7)
    src = make(cfg)
    fill(src, rng, 12)
    dst = make(cfg)
    fill(dst, rng, 12)
    for seq in range(src.n_seq_max):
        others = {q: snapshot_seq(dst, q) for q in range(dst.n_seq_max) if q != seq}
        dst.state_load(src.state_save(seq), seq)
        assert_restored(src, dst, seq)
        for q, snap in others.items():
            assert_same(snap, snapshot_seq(dst, q))
        assert_consistent(dst)


def test_restore_into_another_sequence():
    src = make()
    fill(src, np.random.default_rng(3), 10)
    if src.seq_pos_max(0) < 0:
        decode(src, [0, 1, 2], [0, 0, 0])
    dst = make()
    dst.state_load(src.state_save(0), 2)
    assert dst.seq_pos_max(0) == -1 and dst.seq_pos_min(2) == src.seq_pos_min(0)
    assert_restored(src, dst, 0, dst_seq=2)


def scattered_target(cfg, kv_size, rng):
    """A cache whose sequence 1 holds every other cell: sequence 0 can only land scattered."""
    dst = make(cfg, kv_size=kv_size, n_seq_max=2)
    randomize_data(dst, rng)
    decode(dst, list(range(kv_size)), [1] * kv_size)
    for p in range(1, kv_size, 2):
        dst.seq_rm(1, p, p + 1)
    return dst


@pytest.mark.parametrize("path", ["calls", "numpy-host", "numpy-device"])
@pytest.mark.parametrize("cfg", ["unified-trans-f16", "unified-rows-f16", "unified-rows-q8", "unified-trans-gqa"])
def test_scattered_destination(cfg, path, monkeypatch):
    if path != "calls":
        monkeypatch.setattr(S, "_CALL_LIMIT", 0)
    else:
        monkeypatch.setattr(S, "_CALL_LIMIT", 10**9)
    if path == "numpy-device":  # as for a device buffer: fetch, scatter, write back
        monkeypatch.setattr(S, "_is_host", lambda t: False)
    rng = np.random.default_rng(11)
    n = 24
    src = make(cfg, kv_size=64, n_seq_max=2)
    randomize_data(src, rng)
    decode(src, list(range(n)), [0] * n)
    src.seq_rm(0, 5, 9)  # two runs in the source too
    dst = scattered_target(cfg, 64, rng)
    other = snapshot_seq(dst, 1)
    blob = src.state_save(0)
    dst.state_load(blob, 0)
    idx = seq_cells(dst, 0)[0][0]
    assert idx.size == n - 4 and (np.diff(idx) > 1).any()
    assert_restored(src, dst, 0)
    assert_same(other, snapshot_seq(dst, 1))
    assert dst.state_save(0) == blob
    # writing scattered cells takes the same paths
    assert dst.state_save(-1) == make_state_copy(dst)


def make_state_copy(kv):
    """The whole state of ``kv`` through a round trip into a fresh cache of the same shape."""
    blob = kv.state_save(-1)
    other = KVCache(kv.model, kv.params)
    other.state_load(blob)
    return other.state_save(-1)


def test_whole_restore_packs_cells_and_resets_heads():
    src = make("streams-trans-f16", n_seq_max=2)
    fill(src, np.random.default_rng(5), 14)
    dst = make("streams-trans-f16", n_seq_max=2)
    fill(dst, np.random.default_rng(6), 14)
    dst.state_load(src.state_save())
    for s in range(2):
        n = int((src.v_cells[s].pos_array >= 0).sum())
        assert (dst.v_cells[s].pos_array[:n] >= 0).all() and (dst.v_cells[s].pos_array[n:] < 0).all()
        assert dst.v_heads[s] == 0
        # the rest of the data is cleared, as by the seed
        k = raw(dst.layers[0].k_stream[s]).reshape(dst.get_size(), -1)
        assert not k[n:].any()
    assert_restored(src, dst, -1)


@pytest.mark.parametrize("host", [True, False], ids=["host", "device"])
@pytest.mark.parametrize("cfg", ["unified-trans-gqa", "streams-rows-f32", "streams-trans-f16", "unified-rows-q8"])
def test_whole_restore_leaves_the_data_of_a_fresh_cache(cfg, host, monkeypatch):
    """Every byte the state does not write is zero afterwards, as after the seed's clear(true)."""
    if not host:
        monkeypatch.setattr(S, "_is_host", lambda t: False)
    src = make(cfg)
    fill(src, np.random.default_rng(21), 14)
    blob = src.state_save()
    fresh = make(cfg)
    fresh.state_load(blob)
    used = make(cfg)
    fill(used, np.random.default_rng(22), 14)
    used.state_load(blob)
    for a, b in zip(fresh.layers, used.layers):
        np.testing.assert_array_equal(raw(a.k), raw(b.k))
        np.testing.assert_array_equal(raw(a.v), raw(b.v))
    empty = make(cfg)
    fill(empty, np.random.default_rng(23), 6)
    empty.state_load(make(cfg).state_save())
    assert not any(raw(layer.k).any() or raw(layer.v).any() for layer in empty.layers)


def test_whole_restore_of_an_empty_state_empties_the_cache():
    dst = make()
    fill(dst, np.random.default_rng(1))
    dst.state_load(make().state_save())
    assert dst.v_cells[0].get_used() == 0


def test_counting_and_buffer_writers():
    kv = make()
    fill(kv, np.random.default_rng(2))
    blob = kv.state_save()
    c = CountingWriter()
    assert kv.state_write(c) == len(blob) == c.n_bytes()
    buf = bytearray(len(blob) + 3)
    w = BufferWriter(buf)
    kv.state_write(w)
    assert bytes(buf[:len(blob)]) == blob
    with pytest.raises(ValueError, match="state buffer too small"):
        kv.state_write(BufferWriter(bytearray(len(blob) - 1)))


def test_state_inside_a_larger_stream():
    kv = make("streams-trans-f16")
    fill(kv, np.random.default_rng(8))
    blob = kv.state_save(1)
    data = b"head" + blob + b"tail"
    r = BytesReader(data, 4)
    dst = make("streams-trans-f16")
    assert dst.state_read(r, 1) == len(blob) and r.remaining() == 4
    assert dst.state_save(1) == blob
    f = io.BytesIO(data)
    f.seek(4)
    dst = make("streams-trans-f16")
    assert dst.state_read(StreamReader(f), 2) == len(blob)
    assert f.read() == b"tail"
    assert (dst.seq_pos_min(2), dst.seq_pos_max(2)) == (kv.seq_pos_min(1), kv.seq_pos_max(1))


class Pipe(io.RawIOBase):
    """A non-seekable byte stream."""

    def __init__(self, data):
        self._b = io.BytesIO(data)

    def readable(self):
        return True

    def readinto(self, b):
        return self._b.readinto(b)


def test_non_seekable_stream():
    kv = make("streams-rows-f32")
    fill(kv, np.random.default_rng(4))
    blob = kv.state_save()
    dst = make("streams-rows-f32")
    r = StreamReader(Pipe(blob))
    assert dst.state_read(r) == len(blob)
    assert dst.state_save() == blob
    with pytest.raises(ValueError, match="truncated"):
        make("streams-rows-f32").state_read(StreamReader(Pipe(blob[:-1])))


@pytest.fixture(scope="module")
def rpc_server():
    if not G.rpc_available():
        pytest.skip("ggml built without RPC")
    from kvcache_ggml.backends import local_rpc_server
    with local_rpc_server(threads=1) as server:
        yield server


@pytest.mark.parametrize("call_limit", [256, 0], ids=["calls", "fetch-scatter"])
@pytest.mark.parametrize("v_trans", [True, False])
def test_state_on_an_rpc_device(rpc_server, v_trans, call_limit, monkeypatch):
    """Layer 1 on a (loopback) RPC device: no host memory, no memset; the state is the CPU cache's."""
    from kvcache_ggml.backends import PlacedModel, Placement
    monkeypatch.setattr(S, "_CALL_LIMIT", call_limit)
    pm = PlacedModel(ToyModel().hparams, Placement.per_layer(["CPU", rpc_server.spec]))
    rng = np.random.default_rng(31)
    src = make(kv_size=64, n_seq_max=2, v_trans=v_trans)
    fill(src, rng, 14)
    assert 0 < src.v_cells[0].find(0, 2**31 - 1, 0).size <= 32
    blob = src.state_save()
    dev = KVCache(pm, kv_size=64, n_seq_max=2, v_trans=v_trans, offload=True)
    assert not G.is_host(dev.layers[1].k)
    fill(dev, rng, 8)
    dev.state_load(blob)
    assert dev.state_save() == blob
    assert_restored(src, dev, -1)
    fresh = make(kv_size=64, n_seq_max=2, v_trans=v_trans)
    fresh.state_load(blob)
    for a, b in zip(fresh.layers, dev.layers):
        np.testing.assert_array_equal(raw(a.v), raw(b.v))
    # a scattered single-sequence restore next to another sequence
    dst = KVCache(pm, kv_size=64, n_seq_max=2, v_trans=v_trans, offload=True)
    randomize_data(dst, rng)
    decode(dst, list(range(64)), [1] * 64)
    for p in range(1, 64, 2):
        dst.seq_rm(1, p, p + 1)
    other = snapshot_seq(dst, 1)
    seq0 = src.state_save(0)
    dst.state_load(seq0, 0)
    assert dst.state_save(0) == seq0
    assert_restored(src, dst, 0)
    assert_same(other, snapshot_seq(dst, 1))


# ============================================================================================ exact layout

def pattern(kv):
    """Data where every byte tells its tensor and place."""
    for li, layer in enumerate(kv.layers):
        for j, t in enumerate((layer.k, layer.v)):
            a = ((np.arange(G.nbytes(t)) * 7 + 31 * li + 101 * j) % 251).astype(np.uint8)
            G.ggml_backend_tensor_set(t, a.ctypes.data, 0, a.size)


@pytest.mark.parametrize("v_trans", [True, False])
@pytest.mark.parametrize("seq", [-1, 1])
def test_layout_field_by_field(v_trans, seq):
    kv = make(kv_size=16, n_seq_max=2, v_trans=v_trans)
    pattern(kv)
    decode(kv, [0, 1, 2], [0, 0, [0, 1]])        # cell 2 shared
    decode(kv, [3, 4], [1, 1])                    # cells 3, 4
    kv.seq_rm(0, 1, 2)                            # hole at cell 1
    blob = kv.state_save(seq)
    cells = [0, 2, 3, 4] if seq == -1 else [2, 3, 4]
    recs = {0: (0, [0]), 2: (2, [0, 1]), 3: (3, [1]), 4: (4, [1])}
    exp = struct.pack("<II", 1, len(cells))
    for c in cells:
        p, q = recs[c]
        q = q if seq == -1 else [seq]
        exp += struct.pack(f"<iI{len(q)}i", p, len(q), *q)
    exp += struct.pack("<II", int(v_trans), 2)
    for layer in kv.layers:
        k = raw(layer.k_stream[0]).reshape(16, -1)
        exp += struct.pack("<iQ", 1, 16) + b"".join(k[c].tobytes() for c in cells)
    for layer in kv.layers:
        v = raw(layer.v_stream[0])
        if v_trans:
            cols = v.reshape(8, 16, 2)
            exp += struct.pack("<iII", 1, 2, 8)
            exp += b"".join(cols[j, c].tobytes() for j in range(8) for c in cells)
        else:
            exp += struct.pack("<iQ", 1, 16) + b"".join(v.reshape(16, -1)[c].tobytes() for c in cells)
    assert blob == exp
    info = parse_state(blob)
    st0 = info.streams[0]
    assert info.kind == "state" and info.nbytes == len(blob) and info.trailing == 0
    assert st0.cell_count == len(cells) and st0.v_trans is v_trans and len(st0.layers) == 2
    assert [(r.pos0, r.pos1, r.seqs) for r in st0.cell_ranges()] == (
        [(0, 0, (0,)), (2, 2, (0, 1)), (3, 4, (1,))] if seq == -1 else [(2, 4, (1,))])
    assert blob[st0.layers[1].k_offset - 12:st0.layers[1].k_offset] == struct.pack("<iQ", 1, 16)


def test_unused_sequence_and_empty_streams():
    kv = make("streams-trans-f16", n_seq_max=3)
    decode(kv, [0, 1], [1, 1])
    assert kv.state_save(0) == struct.pack("<4I", 3, 0, 0, 0)
    info = parse_state(kv.state_save(1))
    assert [s.cell_count for s in info.streams] == [0, 2, 0]


def test_state_save_of_a_sequence_no_stream_holds_is_empty_as_in_the_seed():
    kv = make("streams-trans-f16", kv_size=8, n_seq_max=2)
    decode(kv, [0, 1], [0, 0])
    blob = kv.state_save(5)
    assert blob == np.array([2, 0, 0], np.uint32).tobytes()  # n_stream, then an empty count per stream


# ============================================================================================ golden files

def golden_cache():
    kv = make("unified-trans-f16", kv_size=16, n_seq_max=3)
    pattern(kv)
    decode(kv, [0, 1, 2, 3], [0, 0, 0, 0])
    decode(kv, [0, 1], [[1, 2], [1, 2]])
    decode(kv, [2], [2])
    kv.seq_rm(0, 1, 2)
    return kv


def test_golden_files(tmp_path):
    kv = golden_cache()
    blob = kv.state_save()
    seqf = tmp_path / "seq.ggsq"
    save_seq_file(seqf, kv, 2, [5, 6, 7])
    gold_state, gold_seq = DATA / "state_golden.bin", DATA / "seq_golden.ggsq"
    if REGEN:
        DATA.mkdir(exist_ok=True)
        gold_state.write_bytes(blob)
        gold_seq.write_bytes(seqf.read_bytes())
    assert blob == gold_state.read_bytes()
    assert seqf.read_bytes() == gold_seq.read_bytes()
    assert len(blob) < 4096
    # and they load
    dst = make("unified-trans-f16", kv_size=16, n_seq_max=3)
    dst.state_load(gold_state.read_bytes())
    assert dst.state_save() == blob
    toks = load_seq_file(gold_seq, dst, 0)
    assert toks.tolist() == [5, 6, 7] and dst.seq_pos_min(0) == 0 and dst.seq_pos_max(0) == 2
    info = read_state_file(gold_seq)
    assert info.kind == "seq" and info.tokens.tolist() == [5, 6, 7] and info.offset == 24
    assert [(r.pos0, r.pos1, r.seqs) for r in info.streams[0].cell_ranges()] == [(0, 2, (2,))]


# ============================================================================================ checks on read

def blob_and_info(kv, seq=-1):
    blob = kv.state_save(seq)
    return bytearray(blob), parse_state(blob)


def put(b, off, fmt, value):
    struct.pack_into(fmt, b, off, value)
    return bytes(b)


def base_cache(**kw):
    kv = make(kv_size=16, n_seq_max=3, **kw)
    pattern(kv)
    decode(kv, [0, 1, 2], [0, 0, 0])
    decode(kv, [0, 1], [[1, 2], [1, 2]])
    return kv


def mutations(v_trans):
    """name -> (seq, function (blob, info) -> bad blob, message pattern)."""
    L0 = lambda i: i.streams[0].layers[0]  # noqa: E731
    m = {
        "n_stream": (-1, lambda b, i: put(b, 0, "<I", 2), r"n_stream is 2, expected 1"),
        "truncated-head": (-1, lambda b, i: bytes(b[:2]), r"truncated state: n_stream needs 4 bytes"),
        "truncated-cells": (-1, lambda b, i: bytes(b[:20]), r"truncated state: stream 0 cell"),
        "truncated-data": (-1, lambda b, i: bytes(b[:-1]), r"truncated state: stream 0 layer 1 V data"),
        "cell_count": (-1, lambda b, i: put(b, 4, "<I", 17), r"cell_count is 17, expected at most 16"),
        "pos": (-1, lambda b, i: put(b, 8, "<i", -3), r"stream 0 cell 0: pos is -3, expected in \[0, 2147483647\)"),
        "pos-max": (0, lambda b, i: put(b, 8, "<i", 2**31 - 1), r"pos is 2147483647, expected in \[0, 2147483647\)"),
        "n_seq_id-0": (-1, lambda b, i: put(b, 12, "<I", 0), r"stream 0 cell 0: n_seq_id is 0, expected 1\.\.3"),
        "seq_id-range": (-1, lambda b, i: put(b, 16, "<i", 3), r"stream 0 cell 0: seq_id is 3, expected in \[0, 3\)"),
        "seq_id-dup": (-1, lambda b, i: put(b, 8 + 36 + 12, "<i", 1), r"seq_id 1 is listed twice"),
        "several-seqs": (0, lambda b, i: put(b, 12, "<I", 2),
                         r"n_seq_id is 2, expected 1 \(a single-sequence restore"),
        "seq_id-neg-single": (0, lambda b, i: put(b, 16, "<i", -1), r"seq_id is -1, expected in \[0, 256\)"),
        "v_trans": (-1, lambda b, i: put(b, L0(i).k_offset - 20, "<I", int(not v_trans)),
                    rf"v_trans is {int(not v_trans)}, expected {int(v_trans)}"),
        "v_trans-2": (-1, lambda b, i: put(b, L0(i).k_offset - 20, "<I", 2), r"v_trans is 2, expected 0 or 1"),
        "n_layer": (-1, lambda b, i: put(b, L0(i).k_offset - 16, "<I", 3), r"n_layer is 3, expected 2"),
        "k_type": (-1, lambda b, i: put(b, L0(i).k_offset - 12, "<i", 0),
                   r"layer 0: k_type is 0 \(f32\), expected 1 \(f16\)"),
        "k_row_size": (-1, lambda b, i: put(b, L0(i).k_offset - 8, "<Q", 18), r"k_row_size is 18, expected 16"),
        "v_type": (-1, lambda b, i: put(b, L0(i).v_offset - (12 if v_trans else 12), "<i", 8),
                   r"v_type is 8 \(q8_0\), expected 1 \(f16\)"),
        "trailing": (-1, lambda b, i: bytes(b) + b"\0", r"followed by 1 trailing bytes"),
    }
    if v_trans:
        m["v_el_size"] = (-1, lambda b, i: put(b, L0(i).v_offset - 8, "<I", 4), r"v_el_size is 4, expected 2")
        m["n_embd_v_gqa"] = (-1, lambda b, i: put(b, L0(i).v_offset - 4, "<I", 9), r"n_embd_v_gqa is 9, expected 8")
    else:
        m["v_row_size"] = (-1, lambda b, i: put(b, L0(i).v_offset - 8, "<Q", 32), r"v_row_size is 32, expected 16")
    return m


@pytest.mark.parametrize("v_trans", [True, False])
def test_every_field_is_checked(v_trans):
    for name, (seq, mutate, pat) in mutations(v_trans).items():
        src = base_cache(v_trans=v_trans)
        blob, info = blob_and_info(src, seq)
        bad = mutate(blob, info)
        dst = base_cache(v_trans=v_trans)
        decode(dst, [2, 3], [1, 1])
        before = {q: snapshot_seq(dst, q) for q in range(3)}
        with pytest.raises(ValueError, match=pat):
            dst.state_load(bad, seq)
        if name in ("n_stream", "truncated-head"):  # rejected at the first field: nothing changed
            for q in range(3):
                assert_same(before[q], snapshot_seq(dst, q))
        elif seq == -1:
            assert dst.v_cells[0].get_used() == 0 and dst.v_heads == [0], name
            assert not raw(dst.layers[0].k).any(), name
        else:
            assert dst.seq_pos_max(seq) == -1, name
            for q in (1, 2):
                assert_same(before[q], snapshot_seq(dst, q))
        assert_consistent(dst)


def test_sequence_owned_by_another_stream():
    src = make("streams-trans-f16", kv_size=8, n_seq_max=2)
    decode(src, [0, 1], [1, 1])
    blob = bytearray(src.state_save())
    info = parse_state(blob)
    struct.pack_into("<i", blob, info.streams[1].offset + 12, 0)
    with pytest.raises(ValueError, match=r"stream 1 cell 0: seq_id 0 belongs to stream 0"):
        make("streams-trans-f16", kv_size=8, n_seq_max=2).state_load(bytes(blob))


def test_single_sequence_state_with_two_streams_is_refused():
    src = make("streams-trans-f16", kv_size=8, n_seq_max=2)
    decode(src, [0], [0])
    decode(src, [0], [1])
    dst = make("streams-trans-f16", kv_size=8, n_seq_max=2)
    decode(dst, [0, 1], [0, 0])
    with pytest.raises(ValueError, match=r"stream 1: cell_count is 1, expected 0 \(a single-sequence"):
        dst.state_load(src.state_save(), 0)
    assert dst.seq_pos_max(0) == -1


def test_no_room_for_the_sequence():
    src = make(kv_size=16, n_seq_max=2)
    decode(src, list(range(6)), [0] * 6)
    dst = make(kv_size=16, n_seq_max=2)
    decode(dst, list(range(12)), [1] * 12)
    decode(dst, [0, 1], [0, 0])
    other = snapshot_seq(dst, 1)
    with pytest.raises(ValueError, match=r"no room for the 6 cells of sequence 0 \(4 of 16 cells free\)"):
        dst.state_load(src.state_save(0), 0)
    assert dst.seq_pos_max(0) == -1
    assert_same(other, snapshot_seq(dst, 1))


def test_caller_errors_change_nothing():
    kv = base_cache()
    blob = kv.state_save(0)
    before = snapshot_seq(kv, -1)
    with pytest.raises(ValueError, match=r"seq_id 300 out of range"):
        kv.state_load(blob, 300)
    with pytest.raises(ValueError, match=r"seq_id -2 out of range"):
        kv.state_save(-2)
    assert_same(before, snapshot_seq(kv, -1))


def test_unsupported_caches():
    model = ToyModel(n_embd_head=32)
    kv = KVCache(model, kv_size=8, v_trans=True, type_v="q8_0")
    with pytest.raises(ValueError, match=r"transposed V cache of block type q8_0"):
        kv.state_save()
    hp = HParams.simple(n_layer=1, n_embd_head=8, n_head=1, n_head_kv=1, no_alloc=True)
    model.hparams = hp
    kv = KVCache(model, kv_size=8)
    assert kv.state_size() == 4 + 4
    with pytest.raises(ValueError, match=r"no_alloc"):
        kv.state_save()


def test_parse_state_checks():
    with pytest.raises(ValueError, match=r"n_stream is 0, expected 1\.\.256"):
        parse_state(struct.pack("<I", 0))
    blob = bytearray(base_cache().state_save())
    info = parse_state(blob)
    struct.pack_into("<i", blob, info.streams[0].layers[0].k_offset - 12, 99)
    with pytest.raises(ValueError, match=r"k_type is 99, expected a ggml type"):
        parse_state(blob)
    with pytest.raises(ValueError, match=r"truncated"):
        parse_state(b"")
    with pytest.raises(ValueError, match=r"truncated state: stream 0 cell_count 4294967295 needs at least"):
        parse_state(struct.pack("<II", 1, 2**32 - 1) + bytes(64))


# ============================================================================================ fuzz

FUZZ_CONFIGS = ["unified-trans-f16", "streams-rows-q8"]


def fuzz_source(cfg):
    kv = make(cfg, kv_size=24, n_seq_max=3)
    randomize_data(kv, np.random.default_rng(99))
    decode(kv, list(range(6)), [0] * 6)
    if kv.n_stream == 1:
        kv.seq_cp(0, 1, 0, 3)             # cells 0-2 shared by sequences 0 and 1
        decode(kv, [3, 4], [1, 1])
    else:
        decode(kv, list(range(5)), [1] * 5)
    decode(kv, list(range(4)), [2] * 4)
    kv.seq_rm(0, 4, 5)                    # a hole
    return kv


_FUZZ: dict = {}


def fuzz_blobs(cfg):
    if cfg not in _FUZZ:
        kv = fuzz_source(cfg)
        blobs = {seq: kv.state_save(seq) for seq in (-1, 0, 1)}
        blobs["offsets"] = {seq: sorted({0} | {f for stm in parse_state(b).streams for f in _field_offsets(stm)})
                            for seq, b in list(blobs.items())}
        _FUZZ[cfg] = blobs
    return _FUZZ[cfg]


def _field_offsets(stm):
    offs = [stm.offset]
    if stm.cell_count:
        offs += [stm.offset + 4 + 12 * i + d for i in range(min(stm.cell_count, 4)) for d in (0, 4, 8)]
        for L in stm.layers:
            offs += [L.k_offset - 12, L.k_offset - 8, L.v_offset - 12, L.v_offset - 8, L.v_offset - 4]
    return offs


mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(st.just("field"), st.integers(0, 10**6), st.sampled_from([0, 1, 2, 3, 7, 16, 24, 25, 255, 256,
                                                                          2**31 - 1, 2**31, 2**32 - 1])),
    st.tuples(st.just("cut"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("append"), st.integers(1, 16), st.just(0)),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=st.sampled_from(FUZZ_CONFIGS), seq=st.sampled_from([-1, 0, 1]), dest=st.sampled_from([0, 2]),
       muts=st.lists(mutation, min_size=1, max_size=3))
def test_fuzz_restore_is_clean(cfg, seq, dest, muts):
    """Mutated, cut or extended states: a clean ValueError or a restore, never a change to other sequences."""
    blobs = fuzz_blobs(cfg)
    b = bytearray(blobs[seq])
    for kind, a, v in muts:
        if kind == "flip" and b:
            b[a % len(b)] ^= v
        elif kind == "field" and b:
            offs = [o for o in blobs["offsets"][seq] if o + 4 <= len(b)]
            if offs:
                struct.pack_into("<I", b, offs[a % len(offs)], v)
        elif kind == "cut":
            del b[a % (len(b) + 1):]
        elif kind == "append":
            b += bytes(range(a))
    dst = make(cfg, kv_size=24, n_seq_max=3)
    randomize_data(dst, np.random.default_rng(98))
    decode(dst, [0, 1, 2, 3], [1, 1, 1, 1])
    decode(dst, [0, 1], [dest, dest])
    decode(dst, [4, 5], [1, 1])
    target = -1 if seq == -1 else dest
    before = {q: snapshot_seq(dst, q) for q in range(3)}
    try:
        dst.state_load(bytes(b), target)
    except ValueError:
        if bytes(b[:4]) != blobs[seq][:4]:      # refused at n_stream: nothing changed
            for q in range(3):
                assert_same(before[q], snapshot_seq(dst, q))
        elif target == -1:
            assert all(c.get_used() == 0 for c in dst.v_cells)
        else:
            assert dst.seq_pos_max(target) == -1
    if target >= 0:
        for q in range(3):
            if q != target:
                assert_same(before[q], snapshot_seq(dst, q))
    assert_consistent(dst)


# ============================================================================================ files and the CLI

def test_seq_files(tmp_path):
    kv = golden_cache()
    p = tmp_path / "s.ggsq"
    n = save_seq_file(p, kv, 0, np.array([1, 2, 3, 4], np.int32))
    data = p.read_bytes()
    assert n == len(data) == 16 + 12 + len(kv.state_save(0))
    assert data[:12] == struct.pack("<III", 0x67677371, 2, 4) and data[:4] == b"qsgg"
    assert data[28:] == kv.state_save(0)
    dst = make("unified-trans-f16", kv_size=16, n_seq_max=3)
    assert load_seq_file(p, dst, 1).tolist() == [1, 2, 3, 4]
    assert dst.seq_pos_min(1) == kv.seq_pos_min(0) and dst.seq_pos_max(1) == kv.seq_pos_max(0)
    with pytest.raises(ValueError, match=r"n_token is 4, expected at most 3"):
        load_seq_file(p, dst, 1, n_token_capacity=3)
    bad = tmp_path / "bad"
    bad.write_bytes(struct.pack("<I", 0x6767736E) + data[4:])
    with pytest.raises(ValueError, match=r"magic is 0x6767736e, expected 0x67677371"):
        load_seq_file(bad, dst, 1)
    bad.write_bytes(data[:4] + struct.pack("<I", 1) + data[8:])
    with pytest.raises(ValueError, match=r"sequence state file version is 1, expected 2"):
        load_seq_file(bad, dst, 1)
    bad.write_bytes(data + b"zz")
    with pytest.raises(ValueError, match=r"followed by 2 trailing bytes"):
        load_seq_file(bad, dst, 1)
    assert dst.seq_pos_max(1) == -1
    bad.write_bytes(data[:-3])
    with pytest.raises(ValueError, match=r"truncated"):
        load_seq_file(bad, dst, 1)
    empty = tmp_path / "e.ggsq"
    save_seq_file(empty, kv, 0)
    assert load_seq_file(empty, dst, 1).size == 0


def test_inspect_cli(tmp_path, capsys):
    kv = golden_cache()
    blob = tmp_path / "state.bin"
    blob.write_bytes(kv.state_save())
    assert main_inspect([str(blob)]) == 0
    out = capsys.readouterr().out
    assert "KV cache state" in out and "stream 0: 6 cells, v_trans 1, 2 layers" in out
    assert "    0: seq 0" in out and "    2-3: seq 0" in out and "    0-1: seq 1,2" in out and "    2: seq 2" in out
    assert "layers 0-1 (each): K f16 rows of 16 B" in out and "transposed, 8 channels of 2 B elements" in out
    seqf = tmp_path / "s.ggsq"
    save_seq_file(seqf, kv, 2, list(range(20)))
    assert main_inspect([str(seqf), "--json"]) == 0
    import json
    d = json.loads(capsys.readouterr().out)
    assert d["kind"] == "seq" and d["magic_text"] == "ggsq" and d["n_token"] == 20 and d["version"] == 2
    assert d["streams"][0]["cells"] == [{"pos": [0, 2], "seqs": [2], "n_cells": 3}]
    assert d["streams"][0]["layers"][0]["k_type"] == "f16"
    # a session file (llama_state_save_file): arch string, then the whole state
    sess = tmp_path / "s.ggsn"
    sess.write_bytes(struct.pack("<IIIi", 0x6767736E, 9, 1, 42) + struct.pack("<I", 5) + b"llama" + kv.state_save())
    assert main_inspect([str(sess)]) == 0
    out = capsys.readouterr().out
    assert "session file ('ggsn' version 9)" in out and "arch: llama" in out and "tokens: 1 [42]" in out
    bad = tmp_path / "bad.bin"
    bad.write_bytes(kv.state_save()[:-5])
    assert main_inspect([str(bad)]) == 1
    assert "not a valid KV cache state: truncated" in capsys.readouterr().err
    assert main_inspect([str(tmp_path / "missing")]) == 1
    assert main_inspect([]) == 2

"""KV-cache state: round trips, the exact layout and the golden files (checks and fuzzing: test_state_checks.py)."""
import io
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from kvcache_ggml import ggml as G
from kvcache_ggml.cache.state import codec as S
from kvcache_ggml.cache import KVCache
from kvcache_ggml.cache.state import (BufferWriter, BytesReader, BytesWriter, CountingWriter, FileWriter, StreamReader,
                                StreamWriter, load_seq_file, parse_state, read_state_file, save_seq_file)

from helpers import ToyModel
from state_helpers import (CONFIGS, assert_consistent, assert_restored, assert_same, decode, fill, golden_cache, make,
                           pattern, randomize_data, raw, seq_cells, snapshot_seq)

DATA = Path(__file__).with_name("data")
REGEN = os.environ.get("KVCACHE_REGEN_GOLDEN") == "1"


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

"""KV-cache state: every check of a restore, a fuzz test of restores, sequence files and the inspect CLI."""
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvcache_ggml.cache.state.cli import main_inspect
from kvcache_ggml.cache import KVCache
from kvcache_ggml.hparams import HParams
from kvcache_ggml.cache.state import BytesReader, load_seq_file, parse_state, save_seq_file

from helpers import ToyModel
from state_helpers import (assert_consistent, assert_same, decode, golden_cache, make, pattern, randomize_data, raw,
                           snapshot_seq)


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
    b = mutated(blobs, seq, muts)
    dst = fuzz_dest(cfg, dest)
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


def checked(kv, data, seq):
    """``state_check`` of a whole blob (bytes after the state refused as ``state_load`` refuses them)."""
    io = BytesReader(data)
    n = kv.state_check(io, seq)
    if io.remaining():
        raise ValueError(f"state is {io.tell()} bytes followed by {io.remaining()} trailing bytes, expected none")
    return n


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=st.sampled_from(FUZZ_CONFIGS), seq=st.sampled_from([-1, 0, 1]), dest=st.sampled_from([0, 2]),
       muts=st.lists(mutation, min_size=0, max_size=3))
def test_fuzz_state_check_refuses_what_a_restore_refuses(cfg, seq, dest, muts):
    """``state_check`` (what a server runs before it touches the cache) changes nothing, and refuses a blob exactly
    when the restore does, with the same message -- but for a restore that finds no room, which only placing the
    cells can tell; when both accept, it counts the cells the restore places."""
    b = bytes(mutated(fuzz_blobs(cfg), seq, muts))
    dst = fuzz_dest(cfg, dest)
    target = -1 if seq == -1 else dest
    before = {q: snapshot_seq(dst, q) for q in range(3)}
    try:
        n, why_check = checked(dst, b, target), None
    except ValueError as e:
        why_check = str(e)
    for q in range(3):
        assert_same(before[q], snapshot_seq(dst, q))
    try:
        dst.state_load(b, target)
        why_load = None
    except ValueError as e:
        why_load = str(e)
    if why_check is not None:
        assert why_load == why_check
    elif why_load is not None:
        assert "no room" in why_load, why_load
    else:
        placed = dst.get_used() if target == -1 else sum(len(pos) for _, pos, _ in snapshot_seq(dst, target))
        assert n == placed
    assert_consistent(dst)


def mutated(blobs, seq, muts):
    """The state ``blobs[seq]`` with the fuzz test's mutations applied."""
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
    return b


def fuzz_dest(cfg, dest):
    """The cache the fuzz tests restore into: sequence 1 and ``dest`` hold cells."""
    dst = make(cfg, kv_size=24, n_seq_max=3)
    randomize_data(dst, np.random.default_rng(98))
    decode(dst, [0, 1, 2, 3], [1, 1, 1, 1])
    decode(dst, [0, 1], [dest, dest])
    decode(dst, [4, 5], [1, 1])
    return dst


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

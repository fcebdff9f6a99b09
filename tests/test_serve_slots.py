"""Slots saved to files and restored (serve/slots.py), on the engine without HTTP: the round trip, a restored
conversation reused by the next request (``cached_tokens``), bad file names and bad files refused with every
sequence and the prefix index unchanged, a busy slot.

References are independent: each prompt decoded alone on a fresh context, greedy (F32 caches, where differently
split batches agree to 1e-5 of the largest logit); the file's header is read back with the state parser."""
from __future__ import annotations

import numpy as np
import pytest

from kvcache_ggml.batch import Batch
from kvcache_ggml.cache.state import read_state_file
from kvcache_ggml.prefix import check
from kvcache_ggml.runtime import Context, ContextParams, load_model, make_model
from kvcache_ggml.runtime.tokenizer import Vocab
from kvcache_ggml.serve.engine import Engine, EngineParams
from kvcache_ggml.serve.protocol import SamplingParams
from kvcache_ggml.serve.request import Job
from kvcache_ggml.serve.sampling import Sampler
from kvcache_ggml.serve.slots import (SlotBusy, check_filename, erase_slot, restore_slot, save_slot, slot_path,
                                      slots_info)
from kvcache_ggml.serve.text import TextStream

VOCAB = 96


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("slots")
    # head size 32 (a q8_0 cache's block); "embd": K/V rows twice as wide; "layers": one layer more
    paths = {"main": make_model(d / "m.gguf", layers=2, embd=64, heads=2, heads_kv=1, ff=128, vocab=VOCAB, seed=7),
             "embd": make_model(d / "e.gguf", layers=2, embd=128, heads=4, heads_kv=2, ff=128, vocab=VOCAB, seed=7),
             "layers": make_model(d / "l.gguf", layers=3, embd=64, heads=2, heads_kv=1, ff=128, vocab=VOCAB,
                                  seed=7)}
    ms = {k: load_model(p) for k, p in paths.items()}
    yield ms
    for m in ms.values():
        m.close()


def params(type_kv="f32"):
    return ContextParams(n_ctx=512, n_batch=512, n_ubatch=512, n_seq_max=4, kv_unified=True, type_k=type_kv,
                         type_v=type_kv, n_threads=2, n_threads_batch=2)


def alone(model, prompt, n):
    """Greedy tokens for ``prompt`` decoded alone on a fresh context."""
    with Context(model, params()) as ctx:
        logits = ctx.decode(Batch(token=np.asarray(prompt, np.int32)))[-1]
        toks = []
        for _ in range(n):
            toks.append(int(np.argmax(logits)))
            logits = ctx.decode(Batch(token=np.array(toks[-1:], np.int32)))[0]
    return toks


def prompt(n, seed):
    return np.random.default_rng(seed).integers(3, VOCAB, n).astype(np.int32)


class Sink(list):
    def __call__(self, ev):
        self.append(ev)

    @property
    def tokens(self):
        return [t for e in self if e.kind == "text" for t in e.tokens]


def run(eng, vocab, toks, n, id_slot=-1):
    """One greedy request of ``n`` tokens served to its end: (its job, its tokens)."""
    sink = Sink()
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    j = Job(np.asarray(toks, np.int32), Sampler(sp, VOCAB, [vocab.eos]), TextStream(vocab), sink, max_tokens=n,
            id_slot=id_slot)
    eng.submit(j)
    eng.run_until_idle()
    assert [e.kind for e in sink][-1] == "done"
    return j, sink.tokens


def blobs(ctx):
    return [ctx.state_seq_get_data(s) for s in range(4)]


def as_seq(blob, s):
    """A one-stream single-sequence state with its cells' sequence id set to ``s`` (u32 n_stream, u32 cell_count,
    then per cell i32 pos, u32 n_seq_id = 1, i32 seq_id)."""
    b = bytearray(blob)
    n = int.from_bytes(b[4:8], "little")
    for i in range(n):
        assert int.from_bytes(b[8 + 12 * i + 4:8 + 12 * i + 8], "little") == 1
        b[8 + 12 * i + 8:8 + 12 * i + 12] = s.to_bytes(4, "little")
    return bytes(b)


def entries(pc):
    return {s: (e.tokens.tolist(), e.active, e.clean) for s, e in pc.seqs.items()}


# ---------------------------------------------------------------------------------------------- file names

@pytest.mark.parametrize("name", ["conv.bin", "a b.bin", "slot-0", "ünïcode.bin", ".hidden"])
def test_plain_names_are_accepted(name, tmp_path):
    assert check_filename(name) == name
    assert slot_path(tmp_path, name) == tmp_path / name


@pytest.mark.parametrize("name,why", [("a/b.bin", "SOLIDUS"), ("..", "'..'"), ("../x.bin", "SOLIDUS"),
                                      ("x..y", "'..'"), ("/etc/passwd", "SOLIDUS"), ("a\\b", "REVERSE SOLIDUS"),
                                      ("", "non-empty"), ("x.", "dot"), (" x", "space"), ("a\nb", "0xa"),
                                      ("a:b", "COLON"), ("x" * 256, "255"), (None, "non-empty"), (3, "string")])
def test_bad_names_are_refused_with_the_rule(name, why, tmp_path):
    with pytest.raises(ValueError, match="filename") as err:
        slot_path(tmp_path, name)
    assert why in str(err.value)


# ---------------------------------------------------------------------------------------------- save and restore

def test_saved_conversation_restores_into_another_slot_and_is_reused(models, tmp_path):
    """A finished conversation saved, erased, restored into another sequence: its cells are the saved ones, the
    next request naming that slot reuses every restored token and continues with the tokens of the whole prompt
    decoded alone."""
    model = models["main"]
    vocab = Vocab.from_kv(model.gguf_kv)
    p, ext = prompt(40, 1), prompt(7, 2)
    with Context(model, params()) as ctx:
        eng = Engine(ctx, vocab, EngineParams(n_parallel=2))
        j, out = run(eng, vocab, p, 6)
        held = np.concatenate([p, out[:-1]])  # the last token is sampled, never decoded
        s = next(iter(eng.prefix.seqs))
        assert eng.prefix.seqs[s].tokens.tolist() == held.tolist()
        blob = ctx.state_seq_get_data(s)
        path = tmp_path / "conv.bin"
        r = save_slot(eng, s, path, "conv.bin")
        assert (r.n_tokens, r.n_bytes) == (held.size, path.stat().st_size)
        info = read_state_file(path)
        assert info.kind == "seq" and info.tokens.tolist() == held.tolist()
        assert r.to_json().keys() == {"id_slot", "filename", "n_saved", "n_written", "timings"}
        e = erase_slot(eng, s)
        assert e.n_tokens == held.size and ctx.memory_seq_pos_max(s) == -1 and s not in eng.prefix.seqs
        assert ctx.kv.get_used() == 0
        r = restore_slot(eng, 3, path, "conv.bin")
        assert (r.n_tokens, r.n_bytes) == (held.size, path.stat().st_size)
        assert r.to_json().keys() == {"id_slot", "filename", "n_restored", "n_read", "timings"}
        assert ctx.state_seq_get_data(3) == as_seq(blob, 3)
        assert eng.prefix.seqs[3].tokens.tolist() == held.tolist() and not eng.prefix.seqs[3].active
        info3 = slots_info(eng)[3]
        assert info3 == {"id": 3, "n_ctx": 512, "speculative": False, "is_processing": False,
                         "n_tokens": held.size, "parked": True}
        assert check(eng.prefix) == []
        full = np.concatenate([held, ext])
        j2, out2 = run(eng, vocab, full, 5, id_slot=3)
        assert j2.n_cached == held.size and eng.stats.computed_tokens == p.size + ext.size
        assert out2 == alone(model, full, 5)
        erase_slot(eng, 3)
        restore_slot(eng, 2, path, "conv.bin")  # again, and a request naming no slot finds it by its tokens
        j3, out3 = run(eng, vocab, full, 5)
        assert j3.n_cached == held.size and out3 == out2
        assert check(eng.prefix) == []


def test_restore_replaces_what_the_slot_held_and_an_id_slot_is_taken(models, tmp_path):
    """A restore into a sequence that holds another conversation replaces it; a request naming a slot that serves no
    request is admitted there even when its prompt matches nothing in it."""
    model = models["main"]
    vocab = Vocab.from_kv(model.gguf_kv)
    with Context(model, params()) as ctx:
        eng = Engine(ctx, vocab, EngineParams(n_parallel=2))
        ja, _ = run(eng, vocab, prompt(20, 3), 3, id_slot=2)
        assert ja.seq == -1 and 2 in eng.prefix.seqs  # (served on 2; released since)
        save_slot(eng, 2, tmp_path / "a.bin", "a.bin")
        jb, _ = run(eng, vocab, prompt(30, 4), 3, id_slot=1)
        assert set(eng.prefix.seqs) == {1, 2}
        restore_slot(eng, 1, tmp_path / "a.bin", "a.bin")
        assert ctx.state_seq_get_data(1) == as_seq(ctx.state_seq_get_data(2), 1)
        assert eng.prefix.seqs[1].tokens.tolist() == eng.prefix.seqs[2].tokens.tolist()
        assert check(eng.prefix) == []


def _bad_files(models, tmp_path, good):
    """name -> (bytes, the reason the restore must name)."""
    data = good.read_bytes()
    out = {"truncated": (data[:-10], "truncated"), "trailing": (data + b"\0" * 4, "trailing"),
           "magic": (b"XXXX" + data[4:], "magic"), "empty": (b"", "truncated")}
    bad_version = bytearray(data)
    bad_version[4] = 7
    out["version"] = (bytes(bad_version), "version")
    n_token = int.from_bytes(data[8:12], "little")
    bad_ncells = bytearray(data)
    off = 12 + 4 * n_token + 4  # after n_stream: the cell count of stream 0
    bad_ncells[off:off + 4] = (10 ** 6).to_bytes(4, "little")
    out["cell_count"] = (bytes(bad_ncells), "cell_count")
    bad_pos = bytearray(data)
    bad_pos[off + 4:off + 8] = (-5).to_bytes(4, "little", signed=True)  # the first cell's position
    out["position"] = (bytes(bad_pos), "pos")
    toks = prompt(12, 9)
    for key, why, kind in (("embd", "row_size", "f32"), ("layers", "n_layer", "f32"), ("main", "k_type", "f16"),
                           ("main", "k_type", "q8_0")):
        with Context(models[key], params(kind)) as c:
            c.decode(Batch(token=toks))
            f = tmp_path / f"{key}-{kind}.bin"
            c.state_seq_save_file(f, 0, toks)
        out[f"{key}-{kind}"] = (f.read_bytes(), why)
    return out


def test_bad_files_are_refused_and_change_nothing(models, tmp_path):
    """Corrupt, truncated and foreign files (another n_embd, n_layer or cache type), a missing file and a busy slot:
    ValueError (SlotBusy) naming the reason; every sequence's cells and the prefix index are as before."""
    model = models["main"]
    vocab = Vocab.from_kv(model.gguf_kv)
    with Context(model, params()) as ctx:
        eng = Engine(ctx, vocab, EngineParams(n_parallel=2))
        run(eng, vocab, prompt(20, 5), 3, id_slot=0)
        run(eng, vocab, prompt(25, 6), 3, id_slot=1)
        good = tmp_path / "good.bin"
        save_slot(eng, 0, good, "good.bin")
        before, index, used = blobs(ctx), entries(eng.prefix), ctx.kv.get_used()
        for name, (data, why) in _bad_files(models, tmp_path, good).items():
            f = tmp_path / f"bad-{name}.bin"
            f.write_bytes(data)
            for s in (1, 2):  # a slot holding a conversation, an empty one
                with pytest.raises(ValueError, match=why) as err:
                    restore_slot(eng, s, f, f.name)
                assert f.name in str(err.value)
                assert blobs(ctx) == before and entries(eng.prefix) == index and ctx.kv.get_used() == used, name
        with pytest.raises(ValueError, match="cannot read"):
            restore_slot(eng, 1, tmp_path / "missing.bin", "missing.bin")
        for s in (-1, 4, True, "1"):
            with pytest.raises(ValueError, match="slot id"):
                restore_slot(eng, s, good, "good.bin")
        eng.prefix.attach(prompt(5, 7), 1)  # sequence 1 now serves a request
        for act in (lambda: restore_slot(eng, 1, good, "good.bin"), lambda: save_slot(eng, 1, good, "good.bin"),
                    lambda: erase_slot(eng, 1)):
            with pytest.raises(SlotBusy, match="slot 1"):
                act()
        eng.prefix.release(1)
        assert blobs(ctx)[0] == before[0] and blobs(ctx)[2:] == before[2:]
        assert check(eng.prefix) == []


def test_gemma_iswa_files_checked_whole_before_a_restore(models, tmp_path):
    """On Gemma 3's iSWA cache the file holds the base cache's state, then the SWA cache's: a file cut in either
    part, or a llama's file, is refused with every sequence unchanged; the whole file restores both parts."""
    from kvcache_ggml.runtime.gemma_maker import GemmaSpec, make_gemma_model
    path = make_gemma_model(tmp_path / "g3.gguf", GemmaSpec(arch="gemma3", layers=2, embd=64, heads=2, heads_kv=1,
                                                           head_dim=32, n_swa=8, vocab=VOCAB, seed=3))
    with load_model(path) as model:
        vocab = Vocab.from_kv(model.gguf_kv)
        with Context(model, params()) as ctx:
            eng = Engine(ctx, vocab, EngineParams(n_parallel=2))
            run(eng, vocab, prompt(30, 11), 3, id_slot=0)
            run(eng, vocab, prompt(20, 12), 3, id_slot=1)
            good = tmp_path / "g.bin"
            save_slot(eng, 0, good, "g.bin")
            data = good.read_bytes()
            base = parse_state_end(data)
            assert base < len(data)  # the SWA cache's state follows the base cache's
            llama = tmp_path / "llama.bin"
            with Context(models["main"], params()) as c:
                c.decode(Batch(token=prompt(12, 9)))
                c.state_seq_save_file(llama, 0, prompt(12, 9))
            before, index = blobs(ctx), entries(eng.prefix)
            for name, bad, why in (("cut-base", data[:base - 3], "truncated"), ("cut-swa", data[:-3], "truncated"),
                                   ("llama", llama.read_bytes(), "n_layer")):
                f = tmp_path / f"{name}.bin"
                f.write_bytes(bad)
                with pytest.raises(ValueError, match=why):
                    restore_slot(eng, 1, f, f.name)
                assert blobs(ctx) == before and entries(eng.prefix) == index, name
            toks = eng.prefix.seqs[0].tokens.tolist()
            erase_slot(eng, 0)
            assert ctx.memory_seq_pos_max(0) == -1
            restore_slot(eng, 0, good, "g.bin")
            assert blobs(ctx) == before and eng.prefix.seqs[0].tokens.tolist() == toks
            assert check(eng.prefix) == []  # (checked in the base cache: it holds every position)


def parse_state_end(data):
    """Where the first (the base cache's) state of a sequence state file ends."""
    from kvcache_ggml.cache.state import parse_state
    return parse_state(data).offset + parse_state(data).nbytes


def test_gemma_file_without_its_first_swa_cells_restores_but_is_not_reused(tmp_path):
    """A file saved from a small SWA cache (llama-server's default) after 300 tokens lacks the SWA cells of the
    first positions: it restores, the prefix cache does not index it (its cells do not start at 0), and the next
    request computes its whole prompt, giving the tokens of that prompt decoded alone."""
    from kvcache_ggml.runtime.gemma_maker import GemmaSpec, make_gemma_model
    path = make_gemma_model(tmp_path / "g3.gguf", GemmaSpec(arch="gemma3", layers=2, embd=64, heads=2, heads_kv=1,
                                                           head_dim=32, n_swa=8, vocab=VOCAB, seed=3))
    toks = prompt(300, 13)
    with load_model(path) as model:
        small = ContextParams(n_ctx=512, n_batch=16, n_ubatch=16, n_seq_max=2, kv_unified=True, swa_full=False,
                              type_k="f32", type_v="f32", n_threads=2, n_threads_batch=2)
        with Context(model, small) as c:
            for i in range(0, toks.size, 16):
                c.decode(Batch(token=toks[i:i + 16]))
            assert c.memory_seq_pos_min(0) > 0  # the SWA cache reused the cells the window left behind
            c.state_seq_save_file(tmp_path / "short.bin", 0, toks)
        vocab = Vocab.from_kv(model.gguf_kv)
        with Context(model, params()) as ctx:
            eng = Engine(ctx, vocab, EngineParams(n_parallel=2))
            r = restore_slot(eng, 1, tmp_path / "short.bin", "short.bin")
            assert r.n_tokens == 300 and ctx.memory_seq_pos_max(1) == 299
            assert slots_info(eng)[1]["n_tokens"] == 0
            full = np.concatenate([toks, prompt(4, 14)])
            j, out = run(eng, vocab, full, 4, id_slot=1)
            assert j.n_cached == 0 and out == alone(model, full, 4)

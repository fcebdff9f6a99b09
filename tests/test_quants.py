"""Weight types: ggml's own quantization, llama.cpp's buffer-type placement (CPU_REPACK), and the logits of models
in each type against the float64 numpy forward pass of the same file (which dequantizes with gguf-py, an
independent implementation)."""
from __future__ import annotations

import collections

import numpy as np
import pytest

from kvcache_ggml import ggml as G
from kvcache_ggml.batch import Batch
from kvcache_ggml.runtime import Context, Model, Reference, make_model
from kvcache_ggml.runtime.model import cpu_device
from kvcache_ggml.runtime.modelmaker import ModelSpec

VOCAB = 64
HAS_REPACK = "CPU_REPACK" in [G.buft_name(b) for b in G.extra_bufts(cpu_device())]


@pytest.mark.parametrize("wtype", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_ggml_quantize_matches_gguf_py(wtype):
    """ggml_quantize_chunk and gguf-py's numpy quantizer give the same bytes (both are the reference rounding)."""
    import gguf
    x = np.random.default_rng(1).standard_normal((16, 128)).astype(np.float32)
    ours = G.quantize(wtype, x)
    theirs = gguf.quants.quantize(x, gguf.GGMLQuantizationType[wtype.upper()])
    assert ours.shape == theirs.shape and np.array_equal(ours, theirs)


def test_quantize_errors():
    x = np.zeros((2, 100), np.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        G.quantize("q8_0", x)
    with pytest.raises(ValueError, match="imatrix"):
        G.quantize("iq2_xxs", np.ones((2, 256), np.float32))
    with pytest.raises(ValueError, match="unknown ggml type"):
        G.quantize("q9_0", x)
    with pytest.raises(ValueError, match="cannot write q8_K"):
        G.quantize("q8_K", np.ones((2, 256), np.float32))


# ggml's repack rules on x86 (ggml-cpu/repack.cpp, ggml_repack_get_optimal_repack_type), written out: weight type
# -> (the CPU feature ggml-cpu must be built with, the row count ne[1] must be a multiple of).  Q4_0, Q4_K, IQ4_NL
# and MXFP4 repack 8x8 with AVX2, Q2_K 8x8 with AVX-512F; every other type stays in plain CPU buffers on x86.
X86_REPACK_RULES = {"q4_0": ("avx2", 8), "q4_K": ("avx2", 8), "iq4_nl": ("avx2", 8), "mxfp4": ("avx2", 8),
                    "q2_K": ("avx512", 8)}


def repacked(wtype: str, rows: int) -> bool:
    """Whether ggml puts a [*, rows] matrix of wtype into CPU_REPACK on this machine, by the rules above and the
    features ggml-cpu reports it was built with (an AVX2-only build and an AVX-512 one differ for q2_K)."""
    rule = X86_REPACK_RULES.get(wtype)
    if rule is None or not HAS_REPACK:
        return False
    feature, multiple = rule
    return bool(getattr(G, f"ggml_cpu_has_{feature}")()) and rows % multiple == 0


@pytest.mark.parametrize("wtype,tol", [("q4_0", 5e-2), ("q5_1", 5e-2), ("q2_K", 8e-2), ("q3_K", 5e-2),
                                       ("q4_K", 5e-2), ("q5_K", 5e-2), ("q6_K", 8e-2), ("iq4_nl", 5e-2),
                                       ("iq4_xs", 5e-2), ("iq2_xxs", 8e-2), ("iq3_s", 8e-2), ("tq2_0", 8e-2)])
def test_weight_types_run(tmp_path, wtype, tol):
    path = make_model(tmp_path / f"{wtype}.gguf", ModelSpec(layers=2, embd=256, heads=4, heads_kv=2, ff=256,
                                                            vocab=VOCAB, seed=2, type=wtype))
    toks = np.random.default_rng(5).integers(3, VOCAB, 10).astype(np.int32)
    with Model(path) as m, Context(m, n_ctx=256, n_threads=1, n_threads_batch=1) as ctx:
        placed = m.buffer_types()
        got = ctx.decode(Batch(token=toks, logits=np.ones(10, np.int8)))
        nxt = ctx.decode(Batch(token=toks[:1]))
    # matrices of the repacked types go to CPU_REPACK; norms and the embeddings (get_rows) never do
    names = [f"blk.{il}.{n}.weight" for il in range(2)
             for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up", "ffn_down")]
    # the rows (ne[1]) of each matrix: q/output/up 256, k/v 2 heads x 64, down 256
    rows = {"attn_q": 256, "attn_k": 128, "attn_v": 128, "attn_output": 256, "ffn_up": 256, "ffn_down": 256}
    want = collections.Counter("CPU_REPACK" if repacked(wtype, rows[n.split(".")[2]]) else "CPU" for n in names)
    assert collections.Counter(placed[n] for n in names) == want
    assert placed["token_embd.weight"] == placed["blk.0.attn_norm.weight"] == "CPU"
    ref = Reference(path)
    want_logits = ref.forward(np.append(toks, toks[0]))
    err = np.abs(np.concatenate([got, nxt]) - want_logits).max() / np.abs(want_logits).max()
    assert err < tol, f"{wtype}: max rel diff {err:.2e} vs the numpy forward pass"


def test_no_extra_bufts_means_plain_cpu(tmp_path):
    path = make_model(tmp_path / "q40.gguf", ModelSpec(layers=1, embd=64, heads=2, heads_kv=1, ff=64, vocab=VOCAB,
                                                       type="q4_0"))
    toks = np.arange(3, 9, dtype=np.int32)
    outs = []
    for extra in (True, False):
        with Model(path, use_extra_bufts=extra) as m, Context(m, n_ctx=256, n_threads=1) as ctx:
            if not extra:
                assert set(m.buffer_types().values()) == {"CPU"}
            outs.append(ctx.decode(Batch(token=toks, logits=np.ones(6, np.int8))))
    ref = Reference(path).forward(toks)
    for o in outs:
        assert np.abs(o - ref).max() / np.abs(ref).max() < 5e-2


def test_weight_type_without_cpu_kernel_is_a_clear_error(tmp_path):
    """Q8_K is an activation format: no CPU matrix kernel takes it as a weight.  The error names tensor and type."""
    import gguf
    path = tmp_path / "q8k.gguf"
    make_model(path, ModelSpec(layers=1, embd=256, heads=4, heads_kv=2, ff=256, vocab=VOCAB))
    reader = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY and len(f.types) > 1 else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.name == "blk.0.attn_q.weight":
            q = np.zeros((256, G.row_size("q8_K", 256)), np.uint8)  # an activation format: no writer in ggml
            w.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_K)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight has type q8_K.*no MUL_MAT kernel"):
        Model(tmp_path / "bad.gguf")

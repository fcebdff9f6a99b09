"""Run a script of decode / memory / state operations on llama.cpp itself (llama-cpp-python), for comparisons.

A tool of the oracle suite, the benchmarks and the scripts (not of the product package); they import it from here
(``tests/oracle`` on ``sys.path``).

Two halves:

* :func:`run_llama` (our interpreter): runs this file under the oracle's Python (``ORACLE_PY``, default
  ``/tmp/kvoracle/venv/bin/python``, which has llama-cpp-python 0.3.17) in a subprocess and returns one dict per
  operation.  llama.cpp aborts the process on a failed assertion: the list then ends early with ``{"abort": rc}``.
* ``__main__`` (the oracle's interpreter): reads the spec as JSON on stdin, creates a ``llama_context`` and prints
  one JSON line per operation.  It imports nothing from kvcache_ggml.

Spec: ``{"model": path, "params": {n_ctx, n_batch, n_ubatch, n_seq_max, kv_unified, flash_attn, type_k, type_v,
n_threads, swa_full}, "ops": [...]}`` with ops ``{"op": "decode", "tokens", "pos", "seq" (list of lists), "logits"}``
(answer: ``ret`` and ``logits`` base64 float32 rows of the output tokens, batch order), ``seq_rm/seq_cp/seq_keep/
seq_add/seq_div`` (``args``), ``pos_min/pos_max`` (``seq``), ``clear``, ``state_seq_get`` (``seq``; answer ``blob``
base64), ``state_seq_set`` (``seq``, ``blob``), ``bench`` (``prompt``, ``n_gen``, ``n_par``, ``reps``; answer
seconds, ``decode_s``: the part spent inside ``llama_decode``, and ``cpu_s``: the calling thread's CPU time of the
steps, which a busy machine skews less), ``generate`` (``prompt`` ids, ``n_predict``: llama.cpp's greedy sampler in
sequence 0; answer ``tokens``, ``text`` base64 of llama_detokenize, ``logits`` base64 float32 rows the tokens were
sampled from).  With ``"trace": true`` in params every decode answer also has ``nodes``: ``[name, ggml type, base64
data]`` of each named, contiguous, non-view node in compute order, from llama.cpp's ``cb_eval`` (compare with
:class:`~kvcache_ggml.runtime.trace.NodeTrace`); with ``"graph": true`` instead, ``graph``: ``[op, name, ggml type,
ne, nb]`` of every node the scheduler computes, data left alone (compare with
:class:`~kvcache_ggml.runtime.trace.NodeList`).

:class:`LlamaSession` keeps one such context in a runner subprocess and answers ops one at a time (a benchmark can
then alternate its runs with ours).
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# where the reference lives -- the one place that names it (tests/oracle/conftest.py, the benchmarks and the scripts
# import these): ORACLE_DIR, what scripts/build_reference.sh builds (its venv with llama-cpp-python 0.3.17, the
# kvoracle shims, tiny.gguf, bin/llama-server); ORACLE_SRC, the shims' sources (this folder: kvoracle.py,
# kv_oracle.cpp, kv_oracle_iswa.cpp, make_tiny_llama.py); BUILD_REFERENCE, the script
ORACLE_DIR = Path(os.environ.get("ORACLE_DIR", "/tmp/kvoracle"))
ORACLE_PY = Path(os.environ.get("ORACLE_PY", ORACLE_DIR / "venv" / "bin" / "python"))
ORACLE_SRC = Path(__file__).resolve().parent
BUILD_REFERENCE = ORACLE_SRC.parents[1] / "scripts" / "build_reference.sh"
LLAMA_SERVER = ORACLE_DIR / "bin" / "llama-server"

_GGML_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}


def llama_available() -> str | None:
    """None when llama-cpp-python can be run, else why not."""
    if not ORACLE_PY.exists():
        return f"{ORACLE_PY} missing: build the reference with bash {BUILD_REFERENCE}"
    return None


def run_llama(spec: dict, timeout: float = 600) -> list[dict]:
    """Run ``spec`` on llama.cpp in a subprocess; one answer dict per op (cut short by ``{"abort": rc}``)."""
    why = llama_available()
    if why:
        raise RuntimeError(why)
    p = subprocess.run([str(ORACLE_PY), str(Path(__file__).resolve())], input=json.dumps(spec),
                       capture_output=True, text=True, timeout=timeout)
    out = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or len(out) < len(spec["ops"]):
        out.append({"abort": p.returncode, "stderr": p.stderr[-3000:]})
    return out


class LlamaSession:
    """A llama.cpp context in a runner subprocess, answering one op at a time: ``with LlamaSession(model, params)
    as ls: ls.op({"op": "bench", ...})``.  RuntimeError (with the runner's stderr) if the process dies."""

    def __init__(self, model: str, params: dict, env: dict[str, str] | None = None) -> None:
        """``env``: variables added to the runner's environment (``LLAMA_GRAPH_REUSE_DISABLE``, ...)."""
        why = llama_available()
        if why:
            raise RuntimeError(why)
        self._p = subprocess.Popen([str(ORACLE_PY), str(Path(__file__).resolve()), "--session"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=None if env is None else {**os.environ, **env})
        self._send({"model": model, "params": params})
        # returns once the model and context are loaded: a caller timing its own work meanwhile (a benchmark that
        # alternates with this session) does not share the CPU with llama.cpp's start-up
        try:
            self.op({"op": "pos_max", "seq": 0})
        except BaseException:  # (a model it could not load: the runner is ended here, not left behind)
            self.close()
            raise

    def _send(self, obj: dict) -> None:
        assert self._p.stdin is not None
        self._p.stdin.write(json.dumps(obj) + "\n")
        self._p.stdin.flush()

    def op(self, op: dict) -> dict:
        """Run one op; its answer."""
        self._send(op)
        assert self._p.stdout is not None
        for line in self._p.stdout:
            if line.startswith("{"):
                ans = json.loads(line)
                if "error" in ans and ans.get("op") is None:
                    raise RuntimeError(f"llama.cpp session: {ans['error']}")
                return ans
        rc = self._p.wait()
        raise RuntimeError(f"llama.cpp session ended ({rc}): {self._p.stderr.read()[-3000:] if self._p.stderr else ''}")

    def close(self) -> None:
        if self._p.poll() is None:
            self._p.stdin.close()  # type: ignore[union-attr]
            self._p.wait(timeout=60)
        for f in (self._p.stdout, self._p.stderr):
            if f is not None:
                f.close()

    def __enter__(self) -> "LlamaSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def b64_floats(data: bytes | str, n_cols: int):
    """float32 [rows, n_cols] from the runner's base64 logits."""
    import numpy as np
    raw = base64.b64decode(data)
    return np.frombuffer(raw, np.float32).reshape(-1, n_cols)


def trace_nodes(answer: dict) -> list:
    """(name, array) per node of a decode answer of a traced run (F32 as float32, F16 as float16, else bytes)."""
    import numpy as np
    dtypes = {0: np.float32, 1: np.float16, 26: np.int32}
    return [(name, np.frombuffer(base64.b64decode(data), dtypes.get(t, np.uint8)))
            for name, t, data in answer.get("nodes", [])]


def _node_recorder(L, store: list, graph: bool = False):  # pragma: no cover - oracle side
    """A cb_eval that appends [name, type, base64 data] of each named, contiguous, non-view node to ``store``; with
    ``graph``, [op, name, type, ne, nb] of every node asked about, and no data (nothing is observed)."""
    import ctypes

    class Head(ctypes.Structure):  # the start of struct ggml_tensor
        _fields_ = [("type", ctypes.c_int32), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                    ("nb", ctypes.c_size_t * 4)]

    libdir = os.path.join(os.path.dirname(L.__file__), "lib")
    base = ctypes.CDLL(os.path.join(libdir, "libggml-base.so"))
    for fn, res, args in (("ggml_get_name", ctypes.c_char_p, [ctypes.c_void_p]),
                          ("ggml_op_desc", ctypes.c_char_p, [ctypes.c_void_p]),
                          ("ggml_nbytes", ctypes.c_size_t, [ctypes.c_void_p]),
                          ("ggml_is_contiguous", ctypes.c_bool, [ctypes.c_void_p]),
                          ("ggml_backend_tensor_get", None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                                             ctypes.c_size_t])):
        getattr(base, fn).restype, getattr(base, fn).argtypes = res, args
    views = {b"VIEW", b"RESHAPE", b"PERMUTE", b"TRANSPOSE"}

    def cb(t, ask, user):
        name = base.ggml_get_name(t) or b""
        if graph:
            h = Head.from_address(t)
            store.append([base.ggml_op_desc(t).decode(), name.decode(), h.type, list(h.ne), list(h.nb)])
            return False
        if ask:
            return (bool(name) and b"(" not in name and not name.startswith((b"leaf_", b"node_"))
                    and base.ggml_op_desc(t) not in views and base.ggml_is_contiguous(t))
        n = base.ggml_nbytes(t)
        buf = (ctypes.c_uint8 * max(n, 1))()
        base.ggml_backend_tensor_get(t, buf, 0, n)
        ttype = ctypes.c_int32.from_address(t).value  # struct ggml_tensor starts with its enum ggml_type
        store.append([name.decode(), ttype, base64.b64encode(bytes(buf)[:n]).decode()])
        return True

    return L.ggml_backend_sched_eval_callback(cb)


# ============================================================================ the oracle's side (llama_cpp)

def _main() -> int:  # pragma: no cover - runs under the oracle's interpreter
    import llama_cpp as L
    import numpy as np

    session = "--session" in sys.argv[1:]
    spec = json.loads(sys.stdin.readline() if session else sys.stdin.read())
    if not spec.get("verbose"):
        cb = L.llama_log_callback(lambda level, text, user: None)
        L.llama_log_set(cb, None)
    L.llama_backend_init()
    if spec.get("vocab_only"):
        return _vocab_main(L, spec)
    pr = spec.get("params", {})
    nodes: list = []
    model, ctx, recorder = _open(L, spec["model"], pr, nodes)
    if not ctx:
        return 1
    mem = L.llama_get_memory(ctx)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    n_seq_max = max(1, pr.get("n_seq_max", 1))

    def decode(tokens, pos, seqs, flags, copy=True):
        """llama_decode of one batch (its time added to decode.spent); (ret, float32 logits of the outputs: a copy,
        or with ``copy`` False a view of llama.cpp's logits buffer, as our Context.decode returns its own)."""
        n = len(tokens)
        b = L.llama_batch_init(n, 0, max(n_seq_max, max(len(s) for s in seqs)))
        try:
            b.n_tokens = n
            for i in range(n):
                b.token[i] = tokens[i]
                b.pos[i] = pos[i]
                b.n_seq_id[i] = len(seqs[i])
                for j, s in enumerate(seqs[i]):
                    b.seq_id[i][j] = s
                b.logits[i] = int(flags[i])
            t0 = time.perf_counter()
            ret = L.llama_decode(ctx, b)
            decode.spent += time.perf_counter() - t0
        finally:
            L.llama_batch_free(b)
        if not copy:
            n_out = sum(1 for f in flags if f)
            return ret, np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(n_out, n_vocab)) if ret == 0 else None
        rows = []
        if ret == 0:
            for i in range(n):
                if flags[i]:
                    p = L.llama_get_logits_ith(ctx, i)
                    rows.append(np.ctypeslib.as_array(p, shape=(n_vocab,)).copy())
        arr = np.asarray(rows, np.float32).reshape(-1, n_vocab)
        return ret, arr

    decode.spent = 0.0
    ops = (json.loads(line) for line in sys.stdin if line.strip()) if session else spec["ops"]
    for op in ops:
        kind = op["op"]
        ans: dict = {"op": kind}
        if kind == "decode":
            n = len(op["tokens"])
            seqs = op.get("seq") or [[0]] * n
            flags = op.get("logits") or [0] * (n - 1) + [1]
            nodes.clear()
            ret, arr = decode(op["tokens"], op["pos"], seqs, flags)
            ans.update(ret=ret, logits=base64.b64encode(arr.tobytes()).decode(), n_vocab=n_vocab)
            if pr.get("trace") or pr.get("graph"):
                ans["graph" if pr.get("graph") else "nodes"] = list(nodes)
        elif kind in _MEMORY_OPS:
            _memory_op(L, ctx, mem, op, ans)
        elif kind in _BENCH_OPS:
            ans.update(_BENCH_OPS[kind](L, mem, decode, op, n_vocab))
        elif kind == "generate":
            ans.update(_generate(L, model, ctx, decode, op))
        else:
            ans["error"] = f"unknown op {kind!r}"
        print(json.dumps(ans), flush=True)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return 0


_MEMORY_OPS = ("seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div", "pos_max", "pos_min", "clear", "state_seq_get",
               "state_seq_set")


def _memory_op(L, ctx, mem, op: dict, ans: dict) -> None:  # pragma: no cover - oracle side
    """The sequence, position and state operations."""
    import ctypes
    kind = op["op"]
    if kind in ("seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div"):
        ans["ret"] = getattr(L, "llama_memory_" + kind)(mem, *op["args"])
    elif kind == "pos_max":
        ans["ret"] = L.llama_memory_seq_pos_max(mem, op["seq"])
    elif kind == "pos_min":
        ans["ret"] = L.llama_memory_seq_pos_min(mem, op["seq"])
    elif kind == "clear":
        L.llama_memory_clear(mem, True)
    elif kind == "state_seq_get":
        size = L.llama_state_seq_get_size(ctx, op["seq"])
        buf = (ctypes.c_uint8 * max(size, 1))()
        got = L.llama_state_seq_get_data(ctx, buf, size, op["seq"])
        ans.update(size=size, blob=base64.b64encode(bytes(buf)[:got]).decode())
    else:  # state_seq_set
        raw = base64.b64decode(op["blob"])
        buf = (ctypes.c_uint8 * max(len(raw), 1)).from_buffer_copy(raw or b"\0")
        ans["ret"] = L.llama_state_seq_set_data(ctx, buf, len(raw), op["seq"])


def _open(L, path: str, pr: dict, nodes: list):  # pragma: no cover - oracle side
    """Model and context as the spec's params say; (model, ctx, cb_eval keep-alive), ctx None on failure."""
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = L.llama_model_load_from_file(path.encode(), mp)
    if not model:
        print(json.dumps({"error": "model load failed"}), flush=True)
        return None, None, None
    cp = L.llama_context_default_params()
    cp.n_ctx = pr.get("n_ctx", 512)
    cp.n_batch = pr.get("n_batch", 2048)
    cp.n_ubatch = pr.get("n_ubatch", 512)
    cp.n_seq_max = pr.get("n_seq_max", 1)
    cp.n_threads = cp.n_threads_batch = pr.get("n_threads", 1)
    cp.kv_unified = bool(pr.get("kv_unified", False))
    cp.swa_full = bool(pr.get("swa_full", True))
    cp.flash_attn_type = (L.LLAMA_FLASH_ATTN_TYPE_ENABLED if pr.get("flash_attn", True)
                          else L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    cp.type_k = _GGML_TYPE[pr.get("type_k", "f16")]
    cp.type_v = _GGML_TYPE[pr.get("type_v", "f16")]
    cp.no_perf = True
    recorder = None
    if pr.get("trace") or pr.get("graph"):
        recorder = _node_recorder(L, nodes, bool(pr.get("graph")))  # kept alive until the context is freed
        cp.cb_eval = recorder
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        print(json.dumps({"error": "context creation failed"}), flush=True)
    return model, ctx, recorder


def _vocab_main(L, spec) -> int:  # pragma: no cover - oracle side
    """A vocabulary-only model: ops ``tokenize`` (``text``, ``add_special``, ``parse_special``; answer ``tokens``)
    and ``detokenize`` (``tokens``, ``special``; answer ``text``)."""
    import ctypes
    mp = L.llama_model_default_params()
    mp.vocab_only = True
    model = L.llama_model_load_from_file(spec["model"].encode(), mp)
    if not model:
        print(json.dumps({"error": "model load failed"}), flush=True)
        return 1
    vocab = L.llama_model_get_vocab(model)
    for op in spec["ops"]:
        ans: dict = {"op": op["op"]}
        if op["op"] == "tokenize":
            raw = op["text"].encode()
            cap = len(raw) + 8
            buf = (L.llama_token * cap)()
            n = L.llama_tokenize(vocab, raw, len(raw), buf, cap, op.get("add_special", True),
                                 op.get("parse_special", False))
            ans["tokens"] = list(buf[:n]) if n >= 0 else {"error": n}
        elif op["op"] == "detokenize":
            toks = op["tokens"]
            arr = (L.llama_token * max(len(toks), 1))(*toks)
            cap = 16 * len(toks) + 16
            out = ctypes.create_string_buffer(cap)
            n = L.llama_detokenize(vocab, arr, len(toks), out, cap, False, op.get("special", False))
            ans["text"] = base64.b64encode(out.raw[:max(n, 0)]).decode()
        else:
            ans["error"] = f"unknown op {op['op']!r}"
        print(json.dumps(ans), flush=True)
    L.llama_model_free(model)
    return 0


def _generate(L, model, ctx, decode, op):  # pragma: no cover - oracle side
    """Greedy generation as llama.cpp's own sampler does it: decode ``prompt`` at positions 0.. of sequence 0, then
    sample with ``llama_sampler_init_greedy`` from the last logits and decode that token, until ``n_predict`` tokens
    or an end-of-generation token."""
    import ctypes
    vocab = L.llama_model_get_vocab(model)
    prompt = list(op["prompt"])
    smpl = L.llama_sampler_init_greedy()
    out: list[int] = []
    rows = []
    try:
        ret, arr = decode(prompt, list(range(len(prompt))), [[0]] * len(prompt), [0] * (len(prompt) - 1) + [1])
        while ret == 0:
            rows.append(arr[-1].tobytes())
            tok = L.llama_sampler_sample(smpl, ctx, -1)
            out.append(tok)
            if L.llama_vocab_is_eog(vocab, tok) or len(out) >= op["n_predict"]:
                break
            ret, arr = decode([tok], [len(prompt) + len(out) - 1], [[0]], [1])
    finally:
        L.llama_sampler_free(smpl)
    arr_t = (L.llama_token * max(len(out), 1))(*out)
    buf = ctypes.create_string_buffer(16 * len(out) + 16)
    n = L.llama_detokenize(vocab, arr_t, len(out), buf, len(buf), False, False)
    return {"ret": ret, "tokens": out, "text": base64.b64encode(buf.raw[:max(n, 0)]).decode(),
            "logits": base64.b64encode(b"".join(rows)).decode()}


def _bench_prompt(L, mem, decode, op, n_vocab):  # pragma: no cover - oracle side
    """A clear cache, then ``prompt`` decoded in sequence 0 (last token output) and copied to ``n_par``
    sequences; the prompt's seconds."""
    del n_vocab
    prompt = op["prompt"]
    L.llama_memory_clear(mem, True)
    t0 = time.perf_counter()
    ret, _ = decode(prompt, list(range(len(prompt))), [[0]] * len(prompt), [0] * (len(prompt) - 1) + [1],
                    copy=False)
    dt = time.perf_counter() - t0
    assert ret == 0, ret
    for s in range(1, op.get("n_par", 1)):
        L.llama_memory_seq_cp(mem, 0, s, -1, -1)
    return {"prompt_s": dt}


def _bench_steps(L, mem, decode, op, n_vocab):  # pragma: no cover - oracle side
    """``n`` steps after a ``bench_prompt`` of ``n_prompt`` tokens: one token per sequence, all output, the logits
    taken as a numpy view of llama.cpp's buffer (our decode returns a view of its own).  With ``alternate``, step k
    decodes sequences 0..k % n_par only (the batch's shape changes every step, as in a serving loop).  Their wall,
    llama_decode and thread CPU seconds."""
    del L, mem
    n_par, alternate = op.get("n_par", 1), op.get("alternate", False)
    pos = [op["n_prompt"]] * n_par
    t0, d0, c0 = time.perf_counter(), decode.spent, time.thread_time()
    for step in range(op["n"]):
        m = 1 + step % n_par if alternate else n_par
        toks = [(7 * step + 3 * s + 5) % n_vocab for s in range(m)]
        ret, _ = decode(toks, pos[:m], [[s] for s in range(m)], [1] * m, copy=False)
        assert ret == 0, ret
        for s in range(m):
            pos[s] += 1
    return {"gen_s": time.perf_counter() - t0, "decode_s": decode.spent - d0, "cpu_s": time.thread_time() - c0}


def _bench(L, mem, decode, op, n_vocab):  # pragma: no cover - oracle side
    """Prompt (``bench_prompt``), then ``n_gen`` steps of one token per sequence (``bench_steps``).  Best of
    ``reps`` for each."""
    best_p = best_g = best_d = best_c = float("inf")
    steps = {"n_par": op.get("n_par", 1), "n_prompt": len(op["prompt"]), "n": op["n_gen"],
             "alternate": op.get("alternate", False)}
    for _ in range(op.get("reps", 3)):
        best_p = min(best_p, _bench_prompt(L, mem, decode, op, n_vocab)["prompt_s"])
        r = _bench_steps(L, mem, decode, steps, n_vocab)
        best_c = min(best_c, r["cpu_s"])
        if r["gen_s"] < best_g:
            best_g, best_d = r["gen_s"], r["decode_s"]
    return {"prompt_s": best_p, "gen_s": best_g, "decode_s": best_d, "cpu_s": best_c}


def _bench_batches(L, mem, decode, op, n_vocab):  # pragma: no cover - oracle side
    """``reps`` times: the ``batches`` ({tokens, pos, seq, logits}, one sequence id a token) decoded in turn (their
    logits left in llama.cpp's buffer), then the ``undo`` calls of ``llama_memory_seq_rm``; the llama_decode
    seconds of each rep."""
    del n_vocab
    times = []
    for _ in range(op.get("reps", 1)):
        d0 = decode.spent
        for b in op["batches"]:
            ret, _ = decode(b["tokens"], b["pos"], [[s] for s in b["seq"]], b["logits"], copy=False)
            assert ret == 0, ret
        times.append(decode.spent - d0)
        for args in op.get("undo", []):
            L.llama_memory_seq_rm(mem, *args)
    return {"times": times}


_BENCH_OPS = {"bench": _bench, "bench_prompt": _bench_prompt, "bench_steps": _bench_steps,
              "bench_batches": _bench_batches}


if __name__ == "__main__":
    sys.exit(_main())

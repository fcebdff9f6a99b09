"""Record golden traces: random traces run on llama.cpp's own KV cache (the oracle), stored for the default suite.

    /tmp/kvoracle/venv/bin/python tests/oracle/record_golden.py          # writes tests/data/golden_traces.npz

Runs under the oracle's interpreter (``ORACLE_DIR``, default /tmp/kvoracle; ``KVORACLE_SRC``, default this folder).
Nothing here imports kvcache_ggml: the operations are generated from the oracle's own answers
(``seq_pos_max``, its cells), so the file holds llama.cpp's behaviour alone.  Each trace runs in a subprocess of
this script (``--worker``), which prints one JSON line per operation: an assert in llama.cpp aborts only that
process, and the trace then ends with the aborted operation (the replay expects kvcache_ggml to raise there and
to leave the cache unchanged).  ``tests/test_golden_traces.py`` replays the file on kvcache_ggml.

File format (``numpy.savez_compressed``; every array little-endian)
----------------------------------------------------------------------
``meta``        uint8 [*]: UTF-8 JSON::

    {"format": 1, "recorder": "tests/oracle/record_golden.py", "llama_cpp": {"version", "system_info", ...},
     "model": {"n_layer", "n_embd_head", "n_head", "n_head_kv", "n_vocab"},
     "traces": [{"name", "config", "seed", "state_seqs", "ops", "results", "n_masks", "abort"}, ...]}

  ``config``: the cache (``kv_size``, ``n_seq_max``, ``unified``, ``type_k``, ``type_v``, ``v_trans``, ``n_pad``,
  ``n_swa``, ``swa_type``).  ``ops``: one per step, ``["decode", pos, seq_ids, n_ubatch, use_pos]`` (``pos`` is
  ignored when ``use_pos`` is false: the allocator fills the positions), ``["seq_rm", s, p0, p1]``,
  ``["seq_cp", src, dst, p0, p1]``, ``["seq_keep", s]``, ``["seq_add", s, p0, p1, d]``, ``["seq_div", s, p0, p1,
  d]``, ``["clear"]``.  ``results``: per step, a decode's ``{"cells": [strm*kv_size + cell of each token, in
  ubatch order], "sizes": [tokens of each ubatch]}`` or -1 (the allocator rejected the batch) / -2 (no slot:
  failed prepare); ``seq_rm``'s bool; null for the others.  ``state_seqs``: the sequences whose state is hashed
  and whose ``seq_pos_min/max`` are recorded after each step.  ``abort``: null, or ``{"step", "rc", "stderr"}``
  when llama.cpp aborted on the last op (that op has no result and no cells).

Per step ``k`` of trace ``t`` (steps of all traces concatenated in order; ``C = n_stream * kv_size``):

``pos``, ``shift`` int32 [sum C * n_steps]: every cell's position (-1 empty) and pending shift (0 for an empty
                cell), stream-major, *as the difference from the previous step* (the first step from the empty
                cache: -1 and 0); a cumulative sum over the steps of a trace gives the values.
``seq``         uint64 [sum C * n_steps, 4]: every cell's 256 sequence bits, XOR the previous step's.
``heads``       uint32 [sum n_stream * n_steps]: the head of each stream.
``minmax``      int32 [sum len(state_seqs) * n_steps, 2]: ``seq_pos_min``, ``seq_pos_max`` of each state sequence.
``state_hash``  uint8 [sum (1 + len(state_seqs)) * n_steps, 8]: the first 8 bytes of the sha256 of
                ``state_write`` of the whole cache, then of each state sequence.
``mask_shape``  int32 [n_masks, 3]: (n_stream, n_tokens per stream, n_kv) of the kq mask of each ubatch of each
                successful decode (in step order), taken right after the ubatch's ``apply()``.
``mask_bits``   uint8 [*]: each mask, C order, ``np.packbits(value == -inf)``; every other value is +0.0.
``final_state`` uint8 [*]: the whole-cache state blob after the last recorded step of each trace, concatenated;
                ``final_len`` int64 [n_traces] their lengths.

The K/V data in every state is zero: the oracle places cells without running a graph and both caches start
cleared, so the blobs compare the cells and the layout (types, row sizes, the v_trans flag) byte for byte.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ORACLE_DIR = Path(os.environ.get("ORACLE_DIR", "/tmp/kvoracle"))
ORACLE_SRC = HERE  # kvoracle.py and kv_oracle.cpp (scripts/build_reference.sh builds the library)
OUT = ROOT / "tests" / "data" / "golden_traces.npz"
FORMAT = 1
LLAMA_MAX_SEQ = 256
HASH_BYTES = 8
NEG_INF_BITS = np.uint32(0xFF800000)

# The tiny.gguf the oracle loads (make_tiny_llama.py defaults); checked against the file's own metadata.
MODEL = dict(n_layer=2, n_embd_head=16, n_head=4, n_head_kv=2, n_vocab=64)


def _cfg(kv_size, n_seq_max, unified, type_k="f16", type_v="f16", v_trans=True, n_pad=1, n_swa=0, swa_type=0,
         **gen):
    """A cache configuration plus the generator's knobs (``gen``: see ``Gen``)."""
    return dict(cache=dict(kv_size=kv_size, n_seq_max=n_seq_max, unified=unified, type_k=type_k, type_v=type_v,
                           v_trans=v_trans, n_pad=n_pad, n_swa=n_swa, swa_type=swa_type), gen=gen)


# name -> configuration; swa_type: 1 standard, 2 chunked, 3 symmetric
CONFIGS = {
    "u1-f16-trans": _cfg(32, 1, True),
    "u4-f32-rows-pad16": _cfg(48, 4, True, "f32", "f32", v_trans=False, n_pad=16),
    "u3-q8-rows": _cfg(40, 3, True, "q8_0", "q8_0", v_trans=False),
    "u3-q8k-f16v-trans": _cfg(40, 3, True, "q8_0", "f16"),
    "u2-q4k-f32v-trans": _cfg(24, 2, True, "q4_0", "f32"),
    "u70-seqs": _cfg(64, 70, True, pool=[0, 1, 2, 62, 63, 64, 65, 69]),
    "u2-tight": _cfg(16, 2, True, p_big=0.25),
    # a long sequence cycling through a large SWA cache: the head runs far past the used cells (head reset)
    "swa-long": _cfg(64, 2, True, n_swa=4, swa_type=1, p_decode=0.8, n_tok=3, pool=[0, 1]),
    "s3-f16-trans": _cfg(24, 3, False),
    "s2-q8-rows": _cfg(16, 2, False, "q8_0", "q8_0", v_trans=False, p_big=0.1),
    "s4-f32-trans": _cfg(20, 4, False, "f32", "f32"),
    "swa-standard": _cfg(16, 2, True, n_swa=6, swa_type=1),
    "swa-chunked": _cfg(16, 2, True, n_swa=4, swa_type=2),
    "swa-symmetric": _cfg(16, 2, True, n_swa=6, swa_type=3),
    "swa-symmetric-odd": _cfg(20, 3, True, "f16", "f16", v_trans=False, n_swa=5, swa_type=3),
    "s2-swa-standard": _cfg(12, 2, False, n_swa=5, swa_type=1),
    "s3-swa-chunked": _cfg(12, 3, False, n_swa=3, swa_type=2),
    "s2-swa-symmetric": _cfg(12, 2, False, "f16", "f16", v_trans=False, n_swa=4, swa_type=3),
    "u4-512": _cfg(512, 4, True, p_big=0.15, big=(40, 300), ubatch=[1, 3, 64, 512]),
    "s2-512-swa": _cfg(512, 2, False, n_swa=7, swa_type=1, p_big=0.15, big=(40, 300), ubatch=[2, 64, 512]),
    "u2-1024-pad512": _cfg(1024, 2, True, n_pad=512, p_big=0.2, big=(100, 450), ubatch=[64, 256, 512]),
}
SEEDS = (0, 1, 2)
N_OPS = 60


# ================================================================================================ the worker

class Gen:
    """Random operations for one trace, generated from the oracle's answers (llama.cpp decides every outcome)."""

    def __init__(self, oc, cache: dict, gen: dict, rng: np.random.Generator) -> None:
        self.oc, self.c, self.rng = oc, cache, rng
        self.n_seq = cache["n_seq_max"]
        self.size = cache["kv_size"]
        self.unified = cache["unified"]
        self.pool = gen.get("pool", list(range(self.n_seq)))   # sequence ids the trace uses
        self.p_big = gen.get("p_big", 0.05)                    # chance of a long batch
        self.big = gen.get("big", (self.size // 3, self.size + self.size // 3 + 2))  # its token range
        self.ubatch = gen.get("ubatch", [1, 2, 3, 4, 7, 512])  # n_ubatch choices
        self.n_tok = gen.get("n_tok", 6)                       # most tokens of a sequence in a short batch
        self.p_decode = gen.get("p_decode", 0.5)               # chance that an operation is a decode
        # unified: a sequence id no token uses (ids up to LLAMA_MAX_SEQ - 1 are valid in seq_* calls)
        self.extra = LLAMA_MAX_SEQ - 56 if self.unified else None

    def seq(self) -> int:
        return int(self.rng.choice(self.pool))

    def decode(self) -> list:
        rng, oc = self.rng, self.oc
        seqs = rng.choice(self.pool, size=int(rng.integers(1, min(3, len(self.pool)) + 1)), replace=False).tolist()
        big = rng.random() < self.p_big
        pos, rows = [], []
        for s in seqs:
            n = int(rng.integers(*self.big)) if big else int(rng.integers(1, self.n_tok + 1))
            pmax = oc.seq_pos_max(s)
            p0 = pmax + 1
            r = rng.random()
            if r < 0.04:
                p0 += 2                                    # a gap after the memory: rejected
            elif r < 0.07 and pmax >= 1:
                p0 = pmax - 1                              # overlapping the memory: rejected
            elif r < 0.15 and pmax < 0:
                p0 = int(rng.integers(0, 20))              # an empty sequence may start anywhere
            for j in range(n):
                row = [s]
                if rng.random() < (0.12 if self.unified else 0.01):
                    o = self.seq()
                    if o != s and (rng.random() < 0.3 or oc.seq_pos_max(o) == pmax):
                        row.append(o)                      # a token shared by two sequences
                rows.append(row)
                pos.append(p0 + j)
            if rng.random() < 0.04 and n > 1:
                k = int(rng.integers(len(pos) - n, len(pos)))
                pos.append(pos[k])                         # the same position twice in one sequence
                rows.append(list(rows[k]))
            if rng.random() < 0.03:
                pos.append(p0 + n + 3)                     # a hole inside the batch: rejected
                rows.append([s])
        if rng.random() < 0.02:
            rows[int(rng.integers(0, len(rows)))] = [self.n_seq + int(rng.integers(0, 3))]  # bad sequence id
        if rng.random() < 0.3:
            perm = rng.permutation(len(pos))
            pos, rows = [pos[i] for i in perm], [rows[i] for i in perm]
        n_ubatch = int(rng.choice(self.ubatch))
        if not self.unified and min(len(pos), n_ubatch) > self.size:
            # A ubatch larger than the cache raises in kvcache_ggml before anything is placed (a deliberate
            # deviation); llama.cpp fails in prepare, and when an earlier ubatch of the batch was placed first its
            # roll-back keeps that ubatch's SWA purge and restores the heads by slot index.  Keep a too-big batch
            # of several streams to the case both agree on: its first ubatch is the one too big (one sequence).
            keep = [i for i, r in enumerate(rows) if r[0] == rows[0][0]]
            pos, rows = [pos[i] for i in keep], [[rows[i][0]] for i in keep]
        return ["decode", pos, rows, n_ubatch, bool(rng.random() < 0.8)]

    def _range(self, s: int) -> tuple[int, int]:
        rng = self.rng
        p0 = int(rng.integers(-1, max(24, self.oc.seq_pos_max(s) + 4)))
        r = rng.random()
        p1 = -1 if r < 0.4 else p0 - int(rng.integers(1, 4)) if r < 0.45 else p0 + int(rng.integers(0, 10))
        return p0, p1

    def seq_op(self) -> list[list]:
        """One sequence operation (or two: a copy is preceded by the removal that keeps it in llama.cpp's defined
        case, as tests/oracle does)."""
        rng, oc = self.rng, self.oc
        s = self.seq()
        if self.extra is not None and rng.random() < 0.04:
            s = self.extra
        p0, p1 = self._range(s)
        which = rng.choice(["seq_rm", "seq_rm_all", "seq_cp", "seq_keep", "seq_add", "seq_div", "clear"],
                           p=[0.3, 0.05, 0.22, 0.08, 0.2, 0.11, 0.04])
        if which == "seq_rm":
            return [["seq_rm", s, p0, p1]]
        if which == "seq_rm_all":
            return [["seq_rm", -1, p0, p1]]
        if which == "seq_keep":
            return [["seq_keep", s]]
        if which == "seq_add":
            return [["seq_add", s, p0, p1, int(rng.integers(-8, 9))]]
        if which == "seq_div":
            return [["seq_div", s, p0, p1, int(rng.integers(1, 4))]]
        if which == "clear":
            return [["clear"]]
        d = self.seq()
        if self.extra is not None and rng.random() < 0.05:
            d = self.extra
        if not self.unified and d != s:
            # across streams only whole sequences: -1, or the borders that still count as whole
            p0 = int(rng.choice([-1, 0]))
            p1 = int(rng.choice([-1, self.size - 1, self.size, 0]))
            return [["seq_cp", s, d, p0, p1]]
        ops = []
        if d != s:
            # llama.cpp's release build counts a copy onto a cell that already holds d twice (this library adds
            # d once, a deliberate deviation): keep to the defined case by removing d from the range first
            pos, _, seqb, _ = oc.dump()
            lo, hi = max(p0, 0), (p1 if p1 >= 0 else 2**31 - 1)
            has_d = (seqb[0, :, d >> 6] >> np.uint64(d & 63)) & np.uint64(1)
            if ((pos[0] >= lo) & (pos[0] < hi) & (has_d == 1)).any():
                ops.append(["seq_rm", d, p0, p1])
        ops.append(["seq_cp", s, d, p0, p1])
        return ops

    def aborting(self) -> list | None:
        """An operation that llama.cpp asserts on (it ends the trace), or None."""
        rng, oc = self.rng, self.oc
        n_ids = LLAMA_MAX_SEQ if self.unified else self.n_seq   # llama.cpp's seq_to_stream.size()
        choices = [["seq_rm", n_ids, -1, -1], ["seq_keep", n_ids + 3], ["seq_add", n_ids, 0, -1, 2],
                   ["seq_cp", 0, n_ids, -1, -1]]
        if not self.unified:
            choices.append(["seq_cp", 0, 1, 1, 3])              # a partial copy across streams
        live = [s for s in self.pool if oc.seq_pos_max(s) > 0]
        if live:
            choices.append(["seq_div", live[0], -1, -1, 0])       # integer division by zero
        return choices[int(rng.integers(0, len(choices)))]


def _dump(oc, state_seqs: list[int]) -> dict:
    pos, sh, seq, heads = oc.dump()
    out = dict(pos=pos.ravel().tolist(), shift=sh.ravel().tolist(), heads=heads.tolist(),
               seq=seq.reshape(-1, 4).view(np.int64).ravel().tolist())
    out["minmax"] = [[oc.seq_pos_min(s), oc.seq_pos_max(s)] for s in state_seqs]
    out["hash"] = [hashlib.sha256(oc.state(s)).hexdigest()[:2 * HASH_BYTES] for s in [-1] + state_seqs]
    return out


def _masks(oc, n_ubatches: int) -> list[dict]:
    out = []
    for k in range(n_ubatches):
        m = np.ascontiguousarray(oc.mask(k), np.float32)           # [n_stream, n_tokens per stream, n_kv]
        bits = m.view(np.uint32)
        ninf = bits == NEG_INF_BITS
        if not (ninf | (bits == 0)).all():
            bad = np.flatnonzero(~(ninf | (bits == 0)))[0]
            raise SystemExit(f"mask {k}: element {bad} is {m.ravel()[bad]!r}, expected +0.0 or -inf")
        out.append({"shape": list(m.shape), "bits": np.packbits(ninf.ravel()).tobytes().hex()})
    return out


def worker() -> None:
    """Run one trace (spec on stdin) on the oracle; one JSON line per step, then {"final": blob}."""
    spec = json.load(sys.stdin)
    sys.path.insert(0, str(ORACLE_SRC))
    import kvoracle

    c = spec["cache"]
    oc = kvoracle.OracleCache(str(ORACLE_DIR / "tiny.gguf"), c["type_k"], c["type_v"], c["v_trans"], c["unified"],
                              c["kv_size"], c["n_seq_max"], c["n_pad"], c["n_swa"], c["swa_type"])
    rng = np.random.default_rng(spec["seed"])
    gen = Gen(oc, c, spec["gen"], rng)
    state_seqs = spec["state_seqs"]
    pending: list[list] = []
    n_steps = 0
    while n_steps < spec["n_ops"]:
        if not pending:
            pending = [gen.decode()] if rng.random() < gen.p_decode else gen.seq_op()
        op = pending.pop(0)
        print(json.dumps({"try": op}), flush=True)   # an abort leaves this line as the trace's last
        name, args = op[0], op[1:]
        out = {"op": op}
        if name == "decode":
            r = oc.decode(*args)
            out["r"] = r if isinstance(r, int) else {"cells": r[0], "sizes": r[1]}
            if not isinstance(r, int):
                out["masks"] = _masks(oc, len(r[1]))
        elif name == "seq_rm":
            out["r"] = bool(oc.seq_rm(*args))
        elif name == "clear":
            oc.clear()
            out["r"] = None
        else:
            getattr(oc, name)(*args)
            out["r"] = None
        out.update(_dump(oc, state_seqs))
        print(json.dumps(out), flush=True)
        n_steps += 1
    print(json.dumps({"final": oc.state(-1).hex()}), flush=True)
    if spec["abort"]:
        op = gen.aborting()
        print(json.dumps({"try": op, "expect_abort": True}), flush=True)
        name, args = op[0], op[1:]
        getattr(oc, name)(*args)
        print(json.dumps({"survived": op}), flush=True)
    oc.close()


# ================================================================================================ the recorder

def run_trace(name: str, seed: int, n_ops: int, abort: bool) -> dict:
    cfg = CONFIGS[name]
    c = cfg["cache"]
    pool = cfg["gen"].get("pool", list(range(c["n_seq_max"])))
    state_seqs = sorted(pool) + ([LLAMA_MAX_SEQ - 56] if c["unified"] else [])
    spec = dict(cache=c, gen=cfg["gen"], seed=int(1000 * seed + sum(name.encode())), n_ops=n_ops,
                state_seqs=state_seqs, abort=abort)
    env = dict(os.environ, ORACLE_DIR=str(ORACLE_DIR), KVORACLE_SRC=str(ORACLE_SRC))
    p = subprocess.run([sys.executable, __file__, "--worker"], input=json.dumps(spec), capture_output=True,
                       text=True, env=env, timeout=1200)
    lines = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    steps = [x for x in lines if "op" in x]
    final = next((x["final"] for x in lines if "final" in x), None)
    tries = [x for x in lines if "try" in x]
    if any("survived" in x for x in lines):
        raise SystemExit(f"trace {name}/{seed}: {tries[-1]['try']} was expected to abort llama.cpp and did not")
    trace = dict(name=f"{name}/seed{seed}", config=c, seed=spec["seed"], state_seqs=state_seqs, steps=steps,
                 final=bytes.fromhex(final) if final is not None else b"", abort=None)
    if p.returncode == 0:
        if final is None or len(steps) != n_ops:
            raise SystemExit(f"trace {name}/{seed}: the worker ended cleanly after {len(steps)} steps:\n"
                             f"{p.stderr[-3000:]}")
        return trace
    if not tries or len(tries) != len(steps) + 1:
        raise SystemExit(f"trace {name}/{seed}: the worker failed (rc {p.returncode}) outside an operation:\n"
                         f"{p.stderr[-3000:]}")
    # llama.cpp aborted on the last operation tried (the epilogue's, or one it asserts on mid-trace)
    trace["abort"] = {"step": len(steps), "op": tries[-1]["try"], "rc": p.returncode,
                      "expected": bool(tries[-1].get("expect_abort")), "stderr": p.stderr.strip()[-300:]}
    return trace


def _delta(a: np.ndarray, first: int) -> np.ndarray:
    """[n_steps, C] -> differences from the previous step (the first from ``first``)."""
    prev = np.concatenate([np.full((1,) + a.shape[1:], first, a.dtype), a[:-1]])
    return a - prev


def pack(traces: list[dict], info: dict) -> dict[str, np.ndarray]:
    arrays = {k: [] for k in ("pos", "shift", "seq", "heads", "minmax", "state_hash", "mask_shape", "mask_bits",
                              "final_state", "final_len")}
    meta_traces = []
    for t in traces:
        st = t["steps"]
        pos = np.array([s["pos"] for s in st], np.int32)
        sh = np.array([s["shift"] for s in st], np.int32)
        seq = np.array([s["seq"] for s in st], np.int64).view(np.uint64).reshape(len(st), -1, 4)
        arrays["pos"].append(_delta(pos, -1).ravel())
        arrays["shift"].append(_delta(sh, 0).ravel())
        prev = np.concatenate([np.zeros_like(seq[:1]), seq[:-1]])
        arrays["seq"].append((seq ^ prev).reshape(-1, 4))
        arrays["heads"].append(np.array([s["heads"] for s in st], np.uint32).ravel())
        arrays["minmax"].append(np.array([s["minmax"] for s in st], np.int32).reshape(-1, 2))
        arrays["state_hash"].append(np.array([[bytes.fromhex(h) for h in s["hash"]] for s in st])
                                    .view(np.uint8).reshape(-1, HASH_BYTES))
        n_masks = 0
        for s in st:
            for m in s.get("masks", []):
                arrays["mask_shape"].append(np.array([m["shape"]], np.int32))
                arrays["mask_bits"].append(np.frombuffer(bytes.fromhex(m["bits"]), np.uint8))
                n_masks += 1
        arrays["final_state"].append(np.frombuffer(t["final"], np.uint8))
        arrays["final_len"].append(np.array([len(t["final"])], np.int64))
        meta_traces.append(dict(name=t["name"], config=t["config"], seed=t["seed"], state_seqs=t["state_seqs"],
                                ops=[s["op"] for s in st] + ([t["abort"]["op"]] if t["abort"] else []),
                                results=[s["r"] for s in st], n_masks=n_masks, abort=t["abort"]))
    out = {k: np.concatenate(v) if v else np.zeros(0) for k, v in arrays.items()}
    if not arrays["mask_shape"]:
        out["mask_shape"] = np.zeros((0, 3), np.int32)
    meta = dict(format=FORMAT, recorder="tests/oracle/record_golden.py", llama_cpp=info, model=MODEL,
                traces=meta_traces)
    out["meta"] = np.frombuffer(json.dumps(meta, separators=(",", ":")).encode(), np.uint8)
    return out


def llama_info() -> dict:
    """The llama.cpp the oracle runs: llama-cpp-python's version, its build's system info, the shim's hash."""
    import llama_cpp
    info = {"llama_cpp_python": llama_cpp.__version__}
    try:
        info["system_info"] = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    except Exception as e:  # noqa: BLE001 -- informative only
        info["system_info"] = f"unavailable: {e}"
    try:
        import ctypes
        base = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
        for fn in ("ggml_version", "ggml_commit"):
            f = getattr(base, fn)
            f.restype = ctypes.c_char_p
            info[fn] = f().decode()
    except (OSError, AttributeError) as e:
        info["ggml_version"] = f"unavailable: {e}"
    vendor = ORACLE_DIR / "src" / f"llama_cpp_python-{llama_cpp.__version__}" / "vendor" / "llama.cpp"
    for f in ("src/llama-kv-cache.cpp", "src/llama-kv-cells.h", "src/llama-batch.cpp"):
        if (vendor / f).exists():
            info[f"sha256 {f}"] = hashlib.sha256((vendor / f).read_bytes()).hexdigest()
    info["sha256 kv_oracle.cpp"] = hashlib.sha256((ORACLE_SRC / "kv_oracle.cpp").read_bytes()).hexdigest()
    return info


def check_model() -> None:
    import gguf
    r = gguf.GGUFReader(str(ORACLE_DIR / "tiny.gguf"))

    def field(key):
        f = r.fields[key]
        return int(f.parts[f.data[0]][0]) if key != "tokenizer.ggml.tokens" else len(f.data)

    got = dict(n_layer=field("llama.block_count"), n_head=field("llama.attention.head_count"),
               n_head_kv=field("llama.attention.head_count_kv"),
               n_embd_head=field("llama.embedding_length") // field("llama.attention.head_count"),
               n_vocab=field("tokenizer.ggml.tokens"))
    if got != MODEL:
        raise SystemExit(f"tiny.gguf has {got}, this recorder expects {MODEL}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--ops", type=int, default=N_OPS, help="operations per trace")
    ap.add_argument("--only", nargs="*", help="configuration names (default: all)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker()
        return
    for p in (ORACLE_DIR / "libkvoracle.so", ORACLE_DIR / "tiny.gguf", ORACLE_SRC / "kvoracle.py"):
        if not p.exists():
            raise SystemExit(f"oracle not built ({p} missing): run bash scripts/build_reference.sh")
    check_model()
    names = a.only or list(CONFIGS)
    traces = []
    t0 = time.perf_counter()
    for name in names:
        for seed in SEEDS:
            t = run_trace(name, seed, a.ops, abort=seed == 0)
            traces.append(t)
            print(f"{t['name']:28s} {len(t['steps']):3d} steps, "
                  f"{sum(len(s.get('masks', [])) for s in t['steps']):4d} masks"
                  f"{', aborts on ' + json.dumps(t['abort']['op']) if t['abort'] else ''}", flush=True)
    arrays = pack(traces, llama_info())
    a.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(a.out, **arrays)
    print(f"{a.out}: {len(traces)} traces, {sum(len(t['steps']) for t in traces)} steps, "
          f"{a.out.stat().st_size / 1024:.1f} KiB, {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()

"""Replays a JSON trace on llama.cpp's own llama_kv_cache_iswa (kv_oracle_iswa.cpp) and prints one JSON line per op.

Runs under the oracle's interpreter in a subprocess of the test, so that a llama.cpp abort ends this process and
not the test run.  Input (stdin): {"lib": path of the built shim, "model": GGUF path, "cache": {...}, "ops": [...]}.
Output per op: {"r": result, "base": dump, "swa": dump} with dump = {"pos", "shift", "seq", "heads"}.
Ops: ["decode", pos, seq_ids, n_ubatch, use_pos] -> {"base": cells, "swa": cells, "sizes": [...]} or -1 / -2;
["seq_rm" | "seq_cp" | "seq_keep" | "seq_add" | "seq_div" | "seq_pos_min" | "seq_pos_max", args...];
["clear"]; ["state", seq, flags] -> hex blob; ["state_rt", seq, flags] -> bytes read back (write, then read);
["time", seq, pos0, n] -> ns per one-token decode step (n steps from pos0, kept); "dump": false skips the dumps.
"""
import ctypes as C
import json
import sys

import numpy as np

P, I, U, Z = C.c_void_p, C.c_int, C.c_uint32, C.c_size_t
ip = np.ctypeslib.ndpointer(np.int32, flags="C")
up = np.ctypeslib.ndpointer(np.uint32, flags="C")
u64p = np.ctypeslib.ndpointer(np.uint64, flags="C")
GGML_TYPE = {"f32": 0, "f16": 1}


def load(path):
    lib = C.CDLL(path)
    lib.kvi_create.restype = P
    lib.kvi_create.argtypes = [C.c_char_p, I, I, I, I, I, U, U, U, U]
    lib.kvi_free.argtypes = [P]
    lib.kvi_decode.restype = I
    lib.kvi_decode.argtypes = [P, I, ip, ip, U, I, ip, ip, ip]
    for n, a in [("seq_rm", [I, I, I]), ("seq_cp", [I, I, I, I]), ("seq_keep", [I]), ("seq_add", [I, I, I, I]),
                 ("seq_div", [I, I, I, I]), ("seq_pos_min", [I]), ("seq_pos_max", [I])]:
        f = getattr(lib, "kvi_" + n)
        f.argtypes = [P] + a
        f.restype = I
    lib.kvi_clear.argtypes = [P]
    lib.kvi_n_stream.argtypes = [P]
    lib.kvi_n_stream.restype = U
    lib.kvi_size.argtypes = [P, I]
    lib.kvi_size.restype = U
    lib.kvi_dump.argtypes = [P, I, ip, ip, u64p, up]
    lib.kvi_state.restype = Z
    lib.kvi_state.argtypes = [P, I, I, C.c_char_p, Z]
    lib.kvi_state_read.restype = Z
    lib.kvi_state_read.argtypes = [P, I, I, C.c_char_p, Z]
    lib.kvi_time_steps.restype = C.c_double
    lib.kvi_time_steps.argtypes = [P, I, I, I]
    return lib


def dump(lib, h, which, n_stream):
    n = lib.kvi_size(h, which)
    pos = np.zeros(n_stream * n, np.int32)
    sh = np.zeros(n_stream * n, np.int32)
    seq = np.zeros(n_stream * n * 4, np.uint64)
    heads = np.zeros(n_stream, np.uint32)
    lib.kvi_dump(h, which, pos, sh, seq, heads)
    return {"pos": pos.reshape(n_stream, n).tolist(), "shift": sh.reshape(n_stream, n).tolist(),
            "seq": seq.reshape(n_stream, n, 4).tolist(), "heads": heads.tolist()}


def state(lib, h, seq, flags):
    n = lib.kvi_state(h, seq, flags, None, 0)
    buf = C.create_string_buffer(max(n, 1))
    lib.kvi_state(h, seq, flags, buf, n)
    return buf.raw[:n]


def decode(lib, h, pos, seq_ids, n_ubatch, use_pos):
    n = len(pos)
    sid = np.full((n, 8), -1, np.int32)
    for i, s in enumerate(seq_ids):
        sid[i, :len(s)] = s
    base, swa, sizes = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.int32)
    r = lib.kvi_decode(h, n, np.ascontiguousarray(pos, np.int32), sid.ravel(), n_ubatch, int(use_pos), base, swa,
                       sizes)
    if r < 0:
        return r
    return {"base": base.tolist(), "swa": swa.tolist(), "sizes": sizes[:r].tolist()}


def main():
    spec = json.load(sys.stdin)
    lib = load(spec["lib"])
    c = spec["cache"]
    h = lib.kvi_create(spec["model"].encode(), GGML_TYPE[c.get("type_k", "f16")], GGML_TYPE[c.get("type_v", "f16")],
                       int(c.get("v_trans", True)), int(c.get("swa_full", False)), int(c["unified"]), c["kv_size"],
                       c["n_seq_max"], c["n_ubatch"], c.get("n_pad", 1))
    assert h, "oracle: model load failed"
    n_stream = lib.kvi_n_stream(h)
    for op in spec["ops"]:
        name, args = op[0], op[1:]
        if name == "decode":
            r = decode(lib, h, *args)
        elif name == "state":
            r = state(lib, h, *args).hex()
        elif name == "state_rt":
            blob = state(lib, h, *args)
            r = lib.kvi_state_read(h, args[0], args[1], blob, len(blob))
        elif name == "time":
            r = lib.kvi_time_steps(h, *args)
        elif name == "clear":
            lib.kvi_clear(h)
            r = None
        else:
            r = getattr(lib, "kvi_" + name)(h, *args)
            r = r if name in ("seq_rm", "seq_pos_min", "seq_pos_max") else None
        out = {"r": r}
        if spec.get("dump", True):
            out.update(base=dump(lib, h, 0, n_stream), swa=dump(lib, h, 1, n_stream))
        print(json.dumps(out), flush=True)
    lib.kvi_free(h)


if __name__ == "__main__":
    main()

"""Replays a JSON trace on llama.cpp's own KV cache (tests/oracle/kvoracle.py, built by scripts/build_reference.sh) and prints one JSON line per step.

Runs under the oracle's interpreter (/tmp/kvoracle/venv/bin/python), in a subprocess of the test, so that a
llama.cpp abort ends this process and not the test run.  Input (stdin): {"cache": {...}, "model": path, "ops": [...]}.
Output per op: {"r": result, "pos": [[...]], "shift": [[...]], "seq": [[[w0..w3]...]], "heads": [...], "masks": [...]}.
"""
import json
import os
import sys

sys.path.insert(0, os.environ.get("KVORACLE_SRC", os.path.dirname(os.path.abspath(__file__))))
import kvoracle  # noqa: E402


def main():
    spec = json.load(sys.stdin)
    c = spec["cache"]
    oc = kvoracle.OracleCache(spec["model"], c.get("type_k", "f16"), c.get("type_v", "f16"), c.get("v_trans", True),
                              c["unified"], c["kv_size"], c["n_seq_max"], c.get("n_pad", 1), c.get("n_swa", 0),
                              c.get("swa_type", 0))
    want_masks = spec.get("masks", False)
    want_state = spec.get("state", False)
    for op in spec["ops"]:
        name, args = op[0], op[1:]
        out = {}
        if name == "decode":
            r = oc.decode(*args)
            if isinstance(r, int):
                out["r"] = r
            else:
                out["r"] = {"cells": r[0], "sizes": r[1]}
                if want_masks:
                    out["masks"] = [oc.mask(k).tolist() for k in range(len(r[1]))]
        elif name in ("seq_pos_min", "seq_pos_max", "seq_rm"):
            out["r"] = getattr(oc, name)(*args)
        elif name == "clear":
            oc.clear()
            out["r"] = None
        else:
            getattr(oc, name)(*args)
            out["r"] = None
        pos, sh, seq, heads = oc.dump()
        out.update(pos=pos.tolist(), shift=sh.tolist(), seq=seq.tolist(), heads=heads.tolist())
        if want_state:
            out["state"] = oc.state(-1).hex()
        print(json.dumps(out), flush=True)
    oc.close()


if __name__ == "__main__":
    main()

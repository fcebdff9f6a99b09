"""Is a sequence restored from a state file the same sequence?  :func:`restore_check` saves one sequence of a
:class:`~kvcache_ggml.runtime.context.Context` to a file, loads it into another slot and compares like with like:
the cells byte for byte (:func:`same_sequence_state`) and the next-token logits within the stated roundoff bound of
an attention sum taken in another order.  The demo's step 5 runs it; the tests damage a cell to see it fail.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..batch import Batch
from ..cache.iswa import KVCacheISWA
from ..cache.state.files import parse_state

__all__ = ["RestoreCheck", "restore_check", "same_sequence_state"]


@dataclass(slots=True)
class RestoreCheck:
    """Sequence src saved to a file and restored into dst: is dst the same sequence?"""

    same_cells: bool      # dst's state (cells in order, positions, K and V bytes) equals src's, byte for byte
    same_tokens: bool     # the file's tokens are src's
    diff: float           # max |logits(src) - logits(dst)| / max |logits(src)| for the same next token
    tol: float            # the bound on diff from the summation order alone (see restore_check)
    n_attended: int       # cells the probe attends to
    n_layer: int          # attention layers the difference goes through
    f16_sum: bool         # the attention sums V in F16 (flash attention over an F16 V), else in F32

    @property
    def ok(self) -> bool:
        return self.same_cells and self.same_tokens and self.diff <= self.tol


def restore_check(ctx: Any, src: int, dst: int, history: list[int], probe: int, flash_attn: bool, type_v: str,
                  corrupt: Any = None) -> RestoreCheck:
    """Save sequence src to a file, restore it into dst, compare like with like.

    The cells, exactly: dst's state must equal src's as it was saved, byte for byte (the same cells in the same
    order, positions, K and V rows; :func:`same_sequence_state`; the state src has afterwards may be smaller: a
    sliding-window cache reuses cells outside every window, src's too, when it places dst's).  The logits of the
    same next token in both, within a stated bound: dst's cells sit elsewhere in the cache, so the probe's own new
    cell lands at another place among them and the attention adds the same terms in another order.  With an F16 V
    and flash attention the CPU kernel accumulates V in F16 (unit roundoff u = 2^-11), otherwise in F32
    (u = 2^-24).  Reordering a sum of n terms moves it by at most about n*u of its magnitude (first order), in each
    of the n_layer attention layers, and the residual stream adds the layers' perturbations:
    tol = n_layer * n_attended * u.  That is a worst-case bound (seen: 3e-2 against 0.25 for 8 layers and 64 cells
    in F16; 0 or ~1e-7 with F32 sums); the exact part of the check is the cells.  ``corrupt(ctx, dst)`` (tests)
    may damage dst after the restore.
    """
    saved = ctx.state_seq_get_data(src)
    with tempfile.TemporaryDirectory(prefix="kvcache_restore_") as tmp:
        f = Path(tmp) / f"seq{src}.bin"
        ctx.state_seq_save_file(f, src, history)
        ctx.memory_seq_rm(dst, -1, -1)
        tokens = ctx.state_seq_load_file(f, dst)
    if corrupt is not None:
        corrupt(ctx, dst)
    same_cells = same_sequence_state(saved, ctx.state_seq_get_data(dst))
    pos = ctx.memory_seq_pos_max(src) + 1
    n_attended = pos - _full_attention_cache(ctx.kv).seq_pos_min(src) + 1
    out = ctx.decode(Batch(token=np.array([probe, probe], np.int32), pos=np.array([pos, pos], np.int32),
                           seq_id=np.array([src, dst], np.int32), logits=np.ones(2, np.int8)))
    for s in (src, dst):
        ctx.memory_seq_rm(s, pos, -1)  # undo the probe
    diff = float(np.abs(out[0] - out[1]).max() / max(np.abs(out[0]).max(), 1e-30))
    f16_sum = flash_attn and type_v != "f32"
    n_layer = ctx.model.hparams.n_layer
    tol = n_layer * n_attended * (2.0 ** -11 if f16_sum else 2.0 ** -24)
    return RestoreCheck(same_cells, tokens.tolist() == list(history), diff, tol, n_attended, n_layer, f16_sum)


def _full_attention_cache(kv: Any) -> Any:
    """The cache the full-attention layers read: the iSWA pair's base cache (whose positions of a sequence are a
    superset of the SWA cache's), else the cache itself."""
    return kv.get_base() if isinstance(kv, KVCacheISWA) else kv


def same_sequence_state(a: bytes, b: bytes) -> bool:
    """Two sequence state blobs hold the same cells: same order, positions and K/V bytes (the sequence ids and the
    stream, which a single-sequence blob also records, may differ).  A blob of a sliding-window model is the base
    cache's state followed by the SWA cache's: every cache's part is compared."""

    def content(blob: bytes) -> list:
        out, rest = [], memoryview(blob)
        while True:  # one cache's state per pass (two for the iSWA pair)
            info = parse_state(rest)
            for st, sd in zip(info.streams, info.to_dict()["streams"]):
                if not st.cell_count:
                    continue
                cells = [(c["pos"], c["n_cells"]) for c in sd["cells"]]
                data = [bytes(rest[o:o + n]) for L in st.layers
                        for o, n in ((L.k_offset, L.k_nbytes), (L.v_offset, L.v_nbytes))]
                layers = [{k: v for k, v in ld.items() if "offset" not in k} for ld in sd["layers"]]
                out.append((cells, sd["v_trans"], layers, data))
            out.append("end of a cache's state")
            if not info.trailing:
                return out
            rest = rest[len(rest) - info.trailing:]

    return content(a) == content(b)

"""Throwaway rows that let ggml's CPU flash attention compute a small step in tiles.

ggml-cpu's flash attention (``ggml_compute_forward_flash_attn_ext_f16`` in ``ggml-cpu/ops.cpp``, the same in the
ggml 0.9.5 we build and the 0.9.8 of the llama.cpp reference) has three paths over an F16 or F32 cache:

* one query row (a one-sequence decode step) over 512 cells or more: the cells split between the threads;
* ``GGML_FA_TILE_Q`` = 64 query rows or more: tiles of 64 rows by 64 cells, each a small F32 GEMM, a tile of cells
  skipped where every row of the tile masks it;
* anything else (2..63 rows): row by row, every row walking every cell it sees with one F16 dot product and one F16
  multiply-add per cell and head.

The third path costs about ten times the second per row and cell.  On the serving benchmark's model (4 layers,
n_embd 256, 2 CPU threads), 56 prompt tokens after 700 cached ones take 47.6 ms, and 64 take 6.0 ms (llama.cpp:
48.4 and 7.3 ms).  That is the usual size of a chat's next turn: the user's message and the template, after the
conversation the cache holds.

A step of 2..63 rows is therefore cheaper as a step of 64 when its rows see many cells.  The extra rows
(:meth:`FaTiles.rows` says how many) are throwaway tokens in the sequence of the step's last part, at the positions
after its tokens: the causal mask hides them from every real row, they ask for no logits, and their cells are
removed right after the decode (``PrefixCache.advance``).  The real rows get what a 64-row step of theirs computes,
the tiled kernel's result; what the cache holds afterwards is what it holds without them.

Whether the extra rows pay depends on the model and the CPU: they cost a row of every weight matrix each, and the
tiled kernel walks every cell of the cache.  :meth:`FaTiles.calibrate` asks this machine -- decodes of 16, 48 and
64 rows on an empty cache and after 512 cells, at start-up, the fastest of three interleaved rounds -- and fits

    row by row:  c + n * m + f * (cells the n rows see, summed)
    64 in tiles: c + 64 * m + t * 64 * (cells of the cache in use)

(c: a step's fixed cost; m: a row's weights; f: a row-cell of the row-by-row path; t: a row-cell of the tiled one;
the cells a row-by-row step's rows walk past without seeing are left out, and the tiled kernel is charged every
cell, skipped tiles and all: both errors speak against the extra rows).  A step takes the rows when the tiled
estimate is below half the other (``margin``), where the rows win by far or not at all: a 56-token turn after 700
cells is estimated at a sixth, a step of 8 generating tokens at twice (the benchmark's model).  A fit that cannot
describe the two kernels (:meth:`FaTiles.plausible`: a machine busy while it measured) is measured again, and after
three such the rows stay off.  Only where the path exists: the
CPU backend alone, flash attention on, K and V both F16 or both F32, no sliding-window layers, heads a multiple of
16 wide (ggml's tiled path wants a multiple of its SIMD width).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..batch import Batch

if TYPE_CHECKING:
    from .context import Context

__all__ = ["FaTiles", "TILE_Q"]

TILE_Q = 64   # ggml-cpu's GGML_FA_TILE_Q (ggml-cpu/common.h): the fewest query rows its tiled path takes


@dataclass(slots=True, frozen=True)
class FaTiles:
    """This machine's costs of a small step, fitted by :meth:`calibrate` (seconds)."""

    c: float              # a step's fixed cost
    m: float              # one row through the weights
    f: float              # one row-cell of the row-by-row attention
    t: float              # one row-cell of the tiled attention
    margin: float = 0.5   # take the rows when the tiled estimate is below margin x the row-by-row one

    @staticmethod
    def unsupported(ctx: "Context") -> str:
        """Why a context's steps never take throwaway rows ("" when they may)."""
        p, hp = ctx.params, ctx.model.hparams
        if not p.flash_attn:
            return "flash attention is off"
        if not ctx.cpu_only:
            return "a backend other than the CPU computes"
        if p.type_k != p.type_v or p.type_k not in ("f16", "f32"):
            return f"the cache is {p.type_k}/{p.type_v} (the tiled path takes F16 or F32 for both)"
        if hp.n_swa > 0:
            return "the model has sliding-window layers"
        if hp.n_embd_head_k % 16 or hp.n_embd_head_v % 16:
            return f"heads of {hp.n_embd_head_k}/{hp.n_embd_head_v} (not a multiple of 16)"
        if ctx.cparams.n_ubatch < TILE_Q:
            return f"n_ubatch {ctx.cparams.n_ubatch} < {TILE_Q}"
        return ""

    @classmethod
    def calibrate(cls, ctx: "Context", seen: int = 512, reps: int = 3, tries: int = 3) -> "FaTiles | None":
        """Time a few small steps on ``ctx``'s empty cache and fit the costs; None where the context does not qualify
        (:meth:`unsupported`), has no room for the measurement, or no fit of ``tries`` was plausible
        (:meth:`plausible`: a machine busy with other work while it measures).  Sequence 0 is used; the cache is
        cleared afterwards."""
        if cls.unsupported(ctx):
            return None
        if ctx.kv.get_used() != 0:
            raise RuntimeError("FaTiles.calibrate needs an empty cache")
        seen = min(seen, ctx.cparams.n_batch, ctx.n_ctx_seq() - 2 * TILE_Q)
        if seen < TILE_Q:
            return None
        for _ in range(tries):
            ft = cls.fit(cls.measure(ctx, seen, reps), seen)
            if ft.plausible():
                return ft
        return None

    @staticmethod
    def measure(ctx: "Context", seen: int, reps: int) -> dict[str, float]:
        """The fastest of ``reps`` rounds of each step: 16, 48 and 64 rows on an empty cache (z16, z48, z64), then
        after ``seen`` cells (a16, a48, a64); the rounds interleave, so that a busy spell of the machine falls on
        every step alike rather than on one."""
        tok = np.zeros(max(TILE_Q, seen), np.int32)
        best: dict[str, float] = {}

        def step(key: str, p0: int, n: int) -> None:
            b = Batch(token=tok[:n], pos=np.arange(p0, p0 + n, dtype=np.int32), seq_id=np.zeros(n, np.int32),
                      logits=np.r_[np.zeros(n - 1, np.int8), np.int8(1)])
            t0 = time.perf_counter()
            ctx.decode(b)
            best[key] = min(best.get(key, float("inf")), time.perf_counter() - t0)
            ctx.memory_seq_rm(0, p0, -1)

        try:
            for _ in range(reps):
                for n in (16, 48, TILE_Q):
                    step(f"z{n}", 0, n)
                ctx.decode(Batch(token=tok[:seen], pos=np.arange(seen, dtype=np.int32),
                                 seq_id=np.zeros(seen, np.int32)))
                for n in (16, 48, TILE_Q):
                    step(f"a{n}", seen, n)
                ctx.memory_seq_rm(0, 0, -1)
        finally:
            ctx.memory_clear(True)
        return best

    @classmethod
    def fit(cls, d: dict[str, float], seen: int) -> "FaTiles":
        """The costs from :meth:`measure`'s six times: the empty cache's steps give ``m`` (48 rows more) and ``c``;
        the extra time of 16 and 48 rows after ``seen`` cells gives ``f``, of 64 rows ``t``."""
        m = (d["z64"] - d["z16"]) / (TILE_Q - 16)
        c = d["z16"] - 16 * m
        f = ((d["a48"] - d["z48"]) + (d["a16"] - d["z16"])) / (48 * seen + 16 * seen)
        t = (d["a64"] - d["z64"]) / (TILE_Q * seen)
        return cls(c, m, f, t)

    def plausible(self) -> bool:
        """Whether a fit describes the two kernels: every cost positive, and a row-cell of the row-by-row path 2 to
        40 times one of the tiled path (10-15 times on an idle AVX2 CPU; a fit outside that measured something
        else, and would pad steps that lose)."""
        return min(self.c, self.m, self.t) > 0 and 2 * self.t <= self.f <= 40 * self.t

    def rows(self, sizes: Sequence[int], seen: Sequence[int], n_used: int) -> int:
        """Throwaway rows for a step whose parts have ``sizes`` tokens and whose sequences hold ``seen`` cells before
        it, in a cache with ``n_used`` cells in use: TILE_Q - (the step's rows), or 0."""
        n = int(sum(sizes))
        if not 2 <= n < TILE_Q:
            return 0
        cells = sum(k * (s + (k + 1) / 2) for k, s in zip(sizes, seen))
        by_row = self.c + n * self.m + self.f * cells
        tiled = self.c + TILE_Q * self.m + self.t * TILE_Q * (n_used + TILE_Q)
        return TILE_Q - n if tiled < self.margin * by_row else 0

    def pad(self, ctx: "Context", seqs: Sequence[int], streams: Sequence[int], sizes: Sequence[int]) -> tuple[int, int]:
        """Throwaway rows for a step on ``ctx`` whose parts have ``sizes`` tokens for sequences ``seqs`` (in
        ``streams``), each part following what its sequence holds: (:meth:`rows`, the position of the first, after the
        last part's tokens), or (0, 0) where the parts are in several streams or the last part's sequence or the
        cache has no room for them."""
        n = int(sum(sizes))
        if not 2 <= n < TILE_Q or len(set(streams)) != 1:
            return 0, 0
        seen = [ctx.memory_seq_pos_max(s) + 1 for s in seqs]
        used = ctx.kv.get_used(streams[-1])
        pad = self.rows(sizes, seen, used)
        p_pad = seen[-1] + int(sizes[-1])
        if not pad or p_pad + pad > ctx.n_ctx_seq() or ctx.kv.get_size() - used < n + pad:
            return 0, 0
        return pad, p_pad

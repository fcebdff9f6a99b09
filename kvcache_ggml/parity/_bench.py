"""Backend parity's ``--bench``: a model-sized cache timed on each backend."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .. import ggml as G
from ..backends import PlacedModel, PlacementError, local_rpc_server
from ..batch import Batch, BatchAllocator
from ..cache import KVCache
from ..hparams import HParams, RopeType
from ._config import _N_VOCAB, Target, make_target
from ._trace import _Step


# ============================================================================================== benchmarks

@dataclass(slots=True, frozen=True)
class BenchConfig:
    """A model-sized cache for timing the graph half on a backend (llama-3-8B-like attention shapes)."""

    n_layer: int = 32              # layers, all on the backend
    n_embd_head: int = 128         # head size
    n_head: int = 32               # query heads
    n_head_kv: int = 8             # K/V heads
    kv_size: int = 4096            # cells (one sequence)
    n_prompt: int = 512            # tokens of the prompt ubatch
    reps: int = 5                  # timings per figure (the best is kept)
    n_threads: int = 4             # CPU threads


@dataclass(slots=True)
class BenchRow:
    """One timing."""

    backend: str    # "cpu", "cuda", ...
    type: str       # cache type
    op: str         # what was timed
    ms: float       # best time, milliseconds
    note: str = ""  # throughput or size


def _fill_cells(kv: KVCache, n: int, start: int = 0) -> None:
    """Bookkeeping only: positions start..n-1 of sequence 0 placed as a decode would (no tensor data)."""
    ba = BatchAllocator(1)
    for p0 in range(start, n, 4096):
        k = min(4096, n - p0)
        ba.init(Batch(token=np.ones(k, np.int32), pos=np.arange(p0, p0 + k, dtype=np.int32),
                      seq_id=np.zeros((k, 1), np.int32)), _N_VOCAB, kv, kv.hparams.n_embd, kv.n_seq_max, False)
        mctx = kv.init_batch(ba, 4096)
        while True:
            mctx.apply()
            if not mctx.next():
                break


def bench(target: Target, type_: str, bc: BenchConfig = BenchConfig()) -> list[BenchRow]:
    """Time a prompt ubatch (store + attention), a decode step over a full cache, the K-shift of every cell and
    state save/load of the whole cache, on ``target``'s placement."""
    hp = HParams.simple(n_layer=bc.n_layer, n_embd_head=bc.n_embd_head, n_head=bc.n_head, n_head_kv=bc.n_head_kv,
                        n_rot=bc.n_embd_head, rope_type=RopeType.NEOX, n_vocab=_N_VOCAB)
    pm = PlacedModel(hp, target.placement)
    tname = G.type_name(G.parse_type(type_))
    rows: list[BenchRow] = []
    rng = np.random.default_rng(0)

    probe = np.empty(16, np.uint8)

    def barrier() -> None:
        # an RPC backend computes graphs asynchronously (its synchronize is a no-op): a read waits for them
        for layer in (kv.layers[0], kv.layers[-1]):
            G.ggml_backend_tensor_get(layer.k, probe.ctypes.data, 0, probe.size)

    def best(fn: Callable[[], None]) -> float:
        times = []
        for _ in range(bc.reps):
            t0 = time.perf_counter()
            fn()
            barrier()
            times.append(time.perf_counter() - t0)
        return 1e3 * min(times)

    with pm.backends(n_threads=bc.n_threads) as be, \
            KVCache(pm, offload=True, type_k=tname, type_v=tname, v_trans=G.blck_size(tname) == 1,
                    kv_size=bc.kv_size, n_seq_max=1) as kv:
        size_mib = kv.total_size() / 2**20

        def step_ms(n_tokens: int, label: str) -> None:
            ba = BatchAllocator(1)
            p0 = kv.seq_pos_max(0) + 1
            ba.init(Batch(token=np.ones(n_tokens, np.int32), pos=np.arange(p0, p0 + n_tokens, dtype=np.int32),
                          seq_id=np.zeros((n_tokens, 1), np.int32)), _N_VOCAB, kv, hp.n_embd, 1, False)
            mctx = kv.init_batch(ba, n_tokens)
            mctx.apply()

            def once() -> None:
                with G.Context.for_tensors(*_Step.room(kv)) as ctx:
                    step = _Step.build(ctx, kv, mctx, rng)
                    be.compute(step.graph, step.fill)
                    be.reset()

            once()  # warm-up: first-use allocations, kernel loading
            rows.append(BenchRow(target.name, tname, label, best(once), f"n_kv {mctx.get_n_kv()}"))

        n_prompt = min(bc.n_prompt, bc.kv_size // 2)
        step_ms(n_prompt, f"prompt ubatch ({n_prompt} tokens): store + attention, {bc.n_layer} layers")
        _fill_cells(kv, bc.kv_size - 1, kv.seq_pos_max(0) + 1)
        step_ms(1, f"decode step (1 token, full cache): store + attention, {bc.n_layer} layers")
        uctx = be.update_context(hparams=hp)

        def shift() -> None:
            kv.seq_add(0, 0, -1, 1)
            kv.init_update(uctx).apply()

        shift()
        rows.append(BenchRow(target.name, tname, f"K-shift of all {bc.kv_size} cells, {bc.n_layer} layers",
                             best(shift), f"K {kv.size_k_bytes() / 2**20:.0f} MiB"))
        blob = kv.state_save()
        ms = best(lambda: kv.state_save())
        rows.append(BenchRow(target.name, tname, "state_save (whole cache)", ms,
                             f"{len(blob) / 2**30 / (ms / 1e3):.2f} GiB/s of {size_mib:.0f} MiB"))
        ms = best(lambda: kv.state_load(blob))
        rows.append(BenchRow(target.name, tname, "state_load (whole cache)", ms,
                             f"{len(blob) / 2**30 / (ms / 1e3):.2f} GiB/s"))
    return rows


def bench_table(rows: Sequence[BenchRow]) -> str:
    lines = ["| backend | type | operation | best ms | note |", "|---|---|---|---|---|"]
    lines += [f"| {r.backend} | {r.type} | {r.op} | {r.ms:.2f} | {r.note} |" for r in rows]
    return "\n".join(lines)


def run_bench(backends: Sequence[str], types: Sequence[str], bc: BenchConfig = BenchConfig(), *,
              rpc_spec: str | None = None, log: Callable[[str], None] | None = None
              ) -> tuple[list[BenchRow], list[tuple[str, str]]]:
    """:func:`bench` on every backend (all layers on it; "cpu" is the baseline); (rows, skipped backends)."""
    say = log or (lambda s: None)
    rows: list[BenchRow] = []
    skipped: list[tuple[str, str]] = []
    with contextlib.ExitStack() as stack:
        for b in dict.fromkeys(x.strip().lower() for x in backends if x.strip()):
            try:
                spec = None
                if b == "rpc":
                    spec = rpc_spec or stack.enter_context(local_rpc_server(threads=bc.n_threads)).spec
                target = make_target(b, bc.n_layer, spec, "all")
            except PlacementError as e:
                skipped.append((b, str(e)))
                say(f"skipping {b}: {e}")
                continue
            for t in types:
                t0 = time.perf_counter()
                rows += bench(target, t, bc)
                say(f"bench {b} {t}: {time.perf_counter() - t0:.1f} s")
    return rows, skipped

"""Backend parity: replay one deterministic trace on every available backend and compare with the CPU.

``python -m kvcache_ggml parity [--backends cpu,rpc,cuda,metal,vulkan] [--types f16,q8_0]``

The trace (tokens per sequence and all K/V/Q data drawn from the seed) runs on a cache of each type in two layouts
-- one unified stream of four sequences, and three streams of one sequence each -- through the cache's own API, with
every graph computed on a scheduler over the placement's backends:

* ``write``: random K/V rows stored into the slots the cache finds (``cpy_k``/``cpy_v`` graphs); the written rows of
  every layer, read back from the backend's buffers;
* ``inputs``: every input tensor as the scheduler received it -- ``k_idxs``, ``v_idxs``, the kq mask (F32, and F16
  through the context), ``k_shift``;
* ``attn``: an attention over ``get_k``/``get_v`` with the mask, per layer, computed where the layer lives;
* ``seq_ops``: ``seq_rm``, ``seq_cp``, ``seq_keep``, ``seq_add``, ``seq_div`` -- the cells, and that no buffer changed;
* ``kshift``: every layer's K after ``update()`` applied the pending shifts (RoPE on the backend);
* ``stream_copy``: the buffers after a cross-stream ``seq_cp`` and ``update()``; the copied stream must equal its
  source bit for bit on the backend itself;
* ``state``: ``state_save`` then ``state_load`` into a fresh cache on the same placement (whole cache and one
  sequence): saving the restored cache must give the same bytes; its cells and buffers are compared with the CPU.

Errors: ``exact`` checks must match the CPU bit for bit (the reported figure is the largest absolute difference);
``nmse`` checks report the normalised mean squared error ``sum((x - ref)^2) / sum(ref^2)`` of the values
(dequantized for quantized types) and pass under the limit of :func:`tolerance`.  CPU against RPC must give 0
everywhere: the RPC server runs the same CPU code.  Each backend replays in a child process (a ggml abort fails its
row as CRASH); ``--bench`` times a model-sized cache on each backend instead.

Modules: ``_config`` (ParityConfig, tolerances, targets, Capture), ``_trace`` (the replay, in process or in a child),
``_compare`` (comparison, report, run_parity), ``_bench`` (``--bench``), ``_cli`` (main), ``runtime_check`` (the
runtime's logits on a backend against the CPU, ``python -m kvcache_ggml runtime-parity``, and the decode-step
timing table, ``step-times``).
"""
from ._bench import BenchConfig, BenchRow, bench, bench_table, run_bench
from ._cli import main
from ._compare import CheckResult, ParityReport, ParityRow, compare, crash_row, run_parity
from ._config import BACKENDS, CHECKS, Capture, Item, ParityConfig, Target, Tolerance, make_target, tolerance
from ._trace import ReplayCrash, TraceReplay, _replay_child, replay, replay_isolated

__all__ = ["CHECKS", "BACKENDS", "ParityConfig", "Tolerance", "tolerance", "Target", "make_target", "Capture",
           "replay", "TraceReplay", "CheckResult", "ParityRow", "ParityReport", "compare", "run_parity", "replay_isolated",
           "ReplayCrash", "crash_row", "BenchConfig", "BenchRow",
           "bench", "bench_table", "run_bench", "main"]

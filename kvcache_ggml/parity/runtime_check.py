"""The runtime on a backend against the CPU, and where a decode step's time goes (the GPU check's second half).

``python -m kvcache_ggml runtime-parity --backend cuda [--split all|half] [--steps N] [--models ...]``: the same
scenario runs in lockstep on two contexts -- the model on the CPU, and the model with its layers (and their cache)
on the backend: all of them, or with ``--split half`` the last half as llama.cpp's ``n_gpu_layers = n_layer/2 + 1``
places them -- and their logits are compared at every step.  Scenario: a prompt batch of three sequences (every
token an output), a fork of sequence 0 into 3 (``seq_cp``: a stream copy with per-sequence streams), greedy decoding
of all four for ``--steps`` steps (64 by default), a context shift of sequence 1 half-way (the K-shift runs on the
backend), and a whole-state save / clear / restore before the last step.  Both contexts are fed the CPU's greedy
tokens (teacher forcing), so one difference cannot derail the rest.

Configurations: flash attention with an F16 and a Q8_0 cache in per-sequence streams, mul_mat + soft_max with an
F16 cache in one unified stream, and mul_mat + soft_max with an F32 cache in one unified stream (a Q8_0 cache only
where the head size holds whole blocks: not the tiny model's 16; a quantized V cache needs flash attention, as in
llama.cpp).  Per model and configuration it reports the largest logit difference relative to the largest CPU logit,
and how often the backend's greedy token equals the CPU's.  A token may differ only where the CPU's two best logits
are closer than twice that row's largest difference (a near tie: "ambiguous").  Models (:data:`MODELS`): llama with
F32, Q8_0, Q4_0 and Q4_K weights (:func:`~kvcache_ggml.runtime.modelmaker.make_model`), a Gemma 3 with sliding-
window layers (an iSWA cache; :func:`~kvcache_ggml.runtime.gemma_maker.make_gemma_model`) and one Qwen2.5, Qwen3,
Llama 3.2 (rope factors) and Mistral each (:mod:`~kvcache_ggml.runtime.family_maker`'s presets with heads of 64),
and a Phi-4-mini (:mod:`~kvcache_ggml.runtime.phi3_maker`: fused QKV and gate/up, 48 of 64 dims rotated, LongRoPE
factors: the short ones in per-sequence streams, the long ones unified), loaded through their architecture's model
class.

``python -m kvcache_ggml step-times --backends cpu,cuda``: a Q8_0 llama decoding one token per sequence for 1 and
8 sequences; per step our host time (batch splits, cache bookkeeping, memory updates, input setting, graph build)
beside the compute phase of decode(): the graph computed on the backends (input uploads, kernel launches, the
device's work, the final synchronisation) and the logits read back.  On a GPU the compute phase is the GPU's
time plus launch overhead; what is left of a step is host work that the GPU waits for.

Both print markdown tables; the exit status is 0 when every row passes (step-times: when it ran).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from .. import ggml as G
from ..backends import PlacedModel, PlacementError, local_rpc_server
from ..batch import Batch
from ..hparams import HParams
from ..runtime.arch import load_model
from ..runtime.context import Context
from ..runtime.family_maker import PRESETS, FamilySpec, make_family_model
from ..runtime.gemma_maker import GemmaSpec, make_gemma_model
from ..runtime.model import Model
from ..runtime.modelmaker import ModelSpec, make_model
from ..runtime.phi3_maker import PHI3_PRESETS, Phi3Spec, make_phi3_model
from ._config import make_target

__all__ = ["RunConfig", "CONFIGS", "MODELS", "QUICK_MODELS", "TIMING_MODEL", "ParityRow", "Lockstep", "StepRow",
           "logit_tolerance", "placed_model", "write_model", "runtime_parity", "parity_table", "step_times",
           "steps_table", "main_parity", "main_step_times"]

# the demo's tiny model (F32 weights), llama-family models with quantized weights whose head of 64 is one that ggml's
# CUDA flash attention has kernels for (the tiny model's 16 is not: its flash attention falls back to the CPU there),
# and a Gemma 3 whose even layers slide over a window of 16 (an iSWA cache; the context shift needs swa_full, the
# runtime's default)
_LLAMA_Q = dict(layers=4, embd=512, heads=8, heads_kv=2, ff=1024, vocab=512)
MODELS: dict[str, ModelSpec | GemmaSpec | FamilySpec | Phi3Spec] = {
    "tiny f32": ModelSpec(layers=4, embd=128, heads=8, heads_kv=4, ff=256, vocab=256, seed=0),
    "llama q8_0": ModelSpec(**_LLAMA_Q, seed=1, type="q8_0"),
    "llama q4_0": ModelSpec(**_LLAMA_Q, seed=2, type="q4_0"),
    "llama q4_K": ModelSpec(**_LLAMA_Q, seed=4, type="q4_K"),
    "gemma3 f32": GemmaSpec(arch="gemma3", layers=4, embd=256, heads=4, heads_kv=2, head_dim=64, ff=512, vocab=256,
                            seed=5, n_swa=16, swa_period=2, final_softcap=0.0),
    # the family presets (runtime.family_maker) with heads of 64: Q/K/V biases, Q/K norms, llama3 rope factors
    "qwen2.5 q8_0": replace(PRESETS["qwen2.5-0.5b"], layers=4, embd=896, head_dim=64, ff=1216, vocab=256, seed=6,
                            type="q8_0"),
    "qwen3 f32": replace(PRESETS["qwen3-0.6b"], layers=4, embd=256, head_dim=64, ff=768, vocab=256, seed=7),
    "llama3.2 f16": replace(PRESETS["llama3.2-1b"], layers=4, embd=512, head_dim=64, ff=1024, vocab=256, seed=8,
                            type="f16"),
    "mistral q8_0": replace(PRESETS["mistral-7b"], layers=4, embd=512, head_dim=64, ff=1024, vocab=256, seed=9,
                            type="q8_0"),
    # phi3 (runtime.phi3_maker) with heads of 64: fused matrices, partial RoPE, LongRoPE factors
    "phi4-mini q8_0": replace(PHI3_PRESETS["phi4-mini"], layers=4, embd=384, heads=6, heads_kv=2, ff=768, seed=10,
                              type="q8_0"),
}
QUICK_MODELS = ("tiny f32", "llama q8_0")  # the default suite's RPC run: the CPU's own code, every logit equal
# the model of the timing table: small enough to make in seconds, attention shapes of a real llama (head 64, GQA 4)
TIMING_MODEL = ModelSpec(layers=8, embd=512, heads=8, heads_kv=2, ff=1536, vocab=4096, seed=3, type="q8_0")


@dataclass(slots=True, frozen=True)
class RunConfig:
    """How a context is set up for the comparison."""

    name: str          # what the table prints
    flash_attn: bool   # ggml_flash_attn_ext over a non-transposed V, else mul_mat + soft_max over a transposed V
    type_kv: str       # K and V cache type
    unified: bool      # one cache stream for all sequences, else one per sequence


CONFIGS: tuple[RunConfig, ...] = (
    RunConfig("flash attn, f16 cache, 4 streams", True, "f16", False),
    RunConfig("no flash attn, f16 cache, unified", False, "f16", True),
    RunConfig("no flash attn, f32 cache, unified", False, "f32", True),
    RunConfig("flash attn, q8_0 cache, 4 streams", True, "q8_0", False),
)
_N_SEQ = 4          # sequences of the scenario (0-2 prompted, 3 forked from 0)
_PROMPTS = (9, 17, 5)
N_GEN = 64          # greedy steps (the context shift of sequence 1 comes half-way)
_CELLS_PER_SEQ = 128  # n_ctx / n_seq_max: room for the longest prompt and N_GEN steps


def logit_tolerance(weights: str, type_kv: str, backend: str = "cuda") -> float:
    """Largest |logit difference| / max |CPU logit| that passes.

    The backend's matrix products and attention round in their own order (cuBLAS, tensor cores, flash-attention
    tiles), an F16 cache rounds K/V, and with quantized weights a GPU quantizes activations to Q8_1 blocks (or
    multiplies dequantized F16 weights) where the CPU quantizes them to Q8_0: differences then reach about one
    activation quantization step.  Vulkan multiplies in F16 wherever the device has F16 arithmetic (ggml-vulkan's
    ``matmul_f16_f16acc`` and its F16 flash attention, lavapipe included: activations rounded to F16, F16
    accumulation), which is several times the rounding of CUDA's F32-accumulating kernels; its figures were measured
    on lavapipe (docs/parity.md).  RPC runs the CPU's own code: every logit must be equal.
    """
    if backend == "rpc":
        return 0.0
    quantized = weights != "f32" or type_kv == "q8_0"
    if backend == "vulkan":
        return 1.5e-1 if quantized else 1.5e-2
    if quantized:
        return 3e-2
    return 5e-3 if type_kv == "f16" else 1e-3


# ============================================================================================== placement

@contextlib.contextmanager
def placed_model(path: Path, backend: str, threads: int, split: str = "all") -> Iterator[Model]:
    """The GGUF at ``path``, loaded by its architecture's model class, with its layers on ``backend`` ("cpu",
    "cuda", "vulkan", "rpc": a loopback server for the block, ...): all of them, or with ``split="half"`` the last
    ``n_layer // 2 + 1`` of the layers and the output as llama.cpp's n_gpu_layers places them; PlacementError when
    the backend is not built or has no device."""

    hp = HParams.from_gguf(path)
    with contextlib.ExitStack() as stack:
        spec = stack.enter_context(local_rpc_server(threads=threads)).spec if backend == "rpc" else None
        pm = PlacedModel(hp, make_target(backend, hp.n_layer, spec, split).placement)
        with load_model(path, dev_layer=pm.dev_layer, dev_output=pm.dev_output) as model:
            yield model


def write_model(folder: Path, key: str) -> Path:
    """The GGUF of MODELS[key], written into ``folder``."""
    spec = MODELS[key]
    path = folder / f"{key.replace(' ', '-')}.gguf"
    if isinstance(spec, FamilySpec):
        return make_family_model(path, spec)
    if isinstance(spec, Phi3Spec):
        return make_phi3_model(path, spec)
    return make_gemma_model(path, spec) if isinstance(spec, GemmaSpec) else make_model(path, spec)


# ============================================================================================== parity

@dataclass(slots=True)
class ParityRow:
    """One model and configuration, backend against the CPU."""

    model: str                  # key of MODELS
    config: str                 # RunConfig.name
    tolerance: float            # logit_tolerance of the row
    steps: int = 0              # decode calls compared
    rows: int = 0               # logit rows compared
    rel_err: float = 0.0        # max |logit difference| / max |CPU logit| over all rows
    agree: int = 0              # greedy tokens equal to the CPU's
    ambiguous: int = 0          # differing greedy tokens at a near tie (CPU top-2 gap < 2 * row difference)
    failures: list[str] = field(default_factory=list)  # why it fails
    seconds: float = 0.0        # wall time of both runs
    devices: str = ""           # the devices holding the backend model's weights

    @property
    def passed(self) -> bool:
        return not self.failures and self.rel_err <= self.tolerance and self.agree + self.ambiguous == self.rows


class Lockstep:
    """Two contexts fed the same batches; every logit row compared as it comes."""

    def __init__(self, ref: Context, dev: Context, row: ParityRow) -> None:
        self.ref, self.dev, self.row = ref, dev, row

    def decode(self, batch: Batch) -> np.ndarray:
        """Decode on both; the CPU's logits (float32 [n_outputs, n_vocab])."""
        want = self.ref.decode(batch)
        got = self.dev.decode(batch)
        row = self.row
        if got.shape != want.shape:
            row.failures.append(f"step {row.steps}: logits {got.shape} on the backend, {want.shape} on the CPU")
            return want
        diff = np.abs(got.astype(np.float64) - want)
        row.rel_err = max(row.rel_err, float(diff.max() / max(np.abs(want).max(), 1e-30)))
        top2 = np.sort(want, axis=1)[:, -2:]
        same = got.argmax(axis=1) == want.argmax(axis=1)
        near_tie = (top2[:, 1] - top2[:, 0]) < 2 * diff.max(axis=1)
        row.agree += int(same.sum())
        row.ambiguous += int((~same & near_tie).sum())
        row.rows += len(want)
        row.steps += 1
        return want

    def both(self, method: str, *args: object) -> None:
        getattr(self.ref, method)(*args)
        getattr(self.dev, method)(*args)

    def state_round_trip(self) -> None:
        """Each context saves its whole state, is cleared and restores it (the device's through its buffers)."""
        blobs = [c.state_get_data() for c in (self.ref, self.dev)]
        if len(blobs[0]) != len(blobs[1]):
            self.row.failures.append(f"state: {len(blobs[1])} bytes saved on the backend, {len(blobs[0])} on the CPU")
        self.both("memory_clear", True)
        for c, blob in zip((self.ref, self.dev), blobs):
            c.state_set_data(blob)


def _scenario(ls: Lockstep, vocab: int, seed: int, n_gen: int = N_GEN) -> None:
    """Prompts, a fork, greedy steps with a context shift, a state round trip (see the module docstring)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, n).astype(np.int32) for n in _PROMPTS]
    tok = np.concatenate(prompts)
    seq = np.concatenate([np.full(len(p), s, np.int32) for s, p in enumerate(prompts)])
    pos = np.concatenate([np.arange(len(p), dtype=np.int32) for p in prompts])
    logits = ls.decode(Batch(token=tok, pos=pos, seq_id=seq, logits=np.ones(len(tok), np.int8)))
    ends = np.cumsum(_PROMPTS) - 1
    last = {s: int(logits[ends[s]].argmax()) for s in range(len(prompts))}
    ls.both("memory_seq_cp", 0, 3, -1, -1)
    last[3] = last[0]
    seqs = np.arange(_N_SEQ, dtype=np.int32)
    for step in range(n_gen):
        if step == n_gen // 2:
            ls.both("context_shift", 1, 2, 4)
        if step == n_gen - 1:
            ls.state_round_trip()
        pos = np.array([ls.ref.memory_seq_pos_max(s) + 1 for s in seqs], np.int32)
        out = ls.decode(Batch(token=np.array([last[s] for s in seqs], np.int32), pos=pos, seq_id=seqs,
                              logits=np.ones(_N_SEQ, np.int8)))
        last = {int(s): int(out[i].argmax()) for i, s in enumerate(seqs)}


def _devices(model: Model) -> str:
    return ", ".join(G.ggml_backend_dev_name(d).decode() for d in model.devices())


def _context(model: Model, cfg: RunConfig, threads: int) -> Context:
    return Context(model, n_ctx=_N_SEQ * _CELLS_PER_SEQ, n_batch=256, n_ubatch=64, n_seq_max=_N_SEQ,
                   kv_unified=cfg.unified, flash_attn=cfg.flash_attn, type_k=cfg.type_kv, type_v=cfg.type_kv,
                   n_threads=threads, n_threads_batch=threads)


def runtime_parity(backend: str, folder: Path, threads: int = 1, configs: Sequence[RunConfig] = CONFIGS,
                   models: Sequence[str] = tuple(MODELS), n_gen: int = N_GEN, split: str = "all") -> list[ParityRow]:
    """Each model of ``models`` (keys of MODELS, written into ``folder``) and every configuration: ``backend``
    (all layers, or ``split="half"``) against the CPU, ``n_gen`` greedy steps each."""
    if not 2 <= n_gen <= _CELLS_PER_SEQ - max(_PROMPTS):
        raise ValueError(f"n_gen must be in [2, {_CELLS_PER_SEQ - max(_PROMPTS)}], got {n_gen}")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise ValueError(f"unknown model(s) {', '.join(unknown)}; models: {', '.join(MODELS)}")
    rows = []
    for key in models:
        spec = MODELS[key]
        path = write_model(folder, key)
        with placed_model(path, "cpu", threads) as ref_model, \
                placed_model(path, backend, threads, split) as dev_model:
            for cfg in configs:
                if spec.head_dim % G.blck_size(cfg.type_kv):  # a quantized cache needs whole blocks per head
                    continue
                row = ParityRow(key, cfg.name, logit_tolerance(spec.type, cfg.type_kv, backend),
                                devices=_devices(dev_model))
                t0 = time.perf_counter()
                try:
                    with _context(ref_model, cfg, threads) as ref, _context(dev_model, cfg, threads) as dev:
                        _scenario(Lockstep(ref, dev, row), spec.vocab, spec.seed, n_gen)
                except Exception as e:  # noqa: BLE001 -- a failed decode fails this row; the others still run
                    row.failures.append(f"after {row.steps} steps: {type(e).__name__}: {e}")
                row.seconds = time.perf_counter() - t0
                rows.append(row)
    return rows


def parity_table(backend: str, rows: Sequence[ParityRow]) -> str:
    lines = [f"| model | configuration | steps | logit rows | max rel. logit diff | tolerance | greedy tokens "
             f"equal | near ties | time | result ({backend} vs CPU) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.model} | {r.config} | {r.steps} | {r.rows} | {r.rel_err:.2e} | {r.tolerance:g} | "
                     f"{r.agree}/{r.rows} | {r.ambiguous} | {r.seconds:.1f} s | {'PASS' if r.passed else 'FAIL'} |")
    lines.append(f"\n(weights of the {backend} model on: {'; '.join(dict.fromkeys(r.devices for r in rows))})")
    for r in rows:
        lines += [f"FAIL {r.model}, {r.config}: {f}" for f in r.failures]
    return "\n".join(lines)


# ============================================================================================== step times

@dataclass(slots=True)
class StepRow:
    """Where one decode step's time goes, on one backend with ``n_seq`` sequences (one token each)."""

    backend: str          # "cpu", "cuda", ...
    n_seq: int            # sequences decoded together
    n_past: int           # tokens of each sequence in the cache after the timed steps
    step_us: float        # wall time of decode() per step
    host_us: dict[str, float]  # our host time per step by phase: batch, bookkeeping, update, inputs, build
    compute_us: float     # decode()'s compute phase per step: graph compute on the backends (input uploads,
                          # launches, the device's work, the final synchronisation) and the logits read back
    reused: str           # graphs reused / computed during the timed steps

    @property
    def host_total_us(self) -> float:
        return sum(self.host_us.values())


_HOST_PHASES = ("batch", "bookkeeping", "update", "inputs", "build")


def _time_steps(model: Model, backend: str, n_seq: int, n_prompt: int, n_gen: int, threads: int) -> StepRow:
    n_ctx = n_seq * (n_prompt + n_gen + 16)
    with Context(model, n_ctx=n_ctx, n_batch=n_seq * n_prompt, n_ubatch=512, n_seq_max=n_seq, flash_attn=True,
                 type_k="f16", type_v="f16", n_threads=threads, n_threads_batch=threads, no_perf=False) as ctx:
        rng = np.random.default_rng(n_seq)
        seqs = np.arange(n_seq, dtype=np.int32)
        tok = rng.integers(3, model.n_vocab, n_seq * n_prompt).astype(np.int32)
        ctx.decode(Batch(token=tok, pos=np.tile(np.arange(n_prompt, dtype=np.int32), n_seq),
                         seq_id=np.repeat(seqs, n_prompt), logits=np.ones(len(tok), np.int8)))
        flags = np.ones(n_seq, np.int8)

        def step(i: int) -> None:
            ctx.decode(Batch(token=rng.integers(3, model.n_vocab, n_seq).astype(np.int32),
                             pos=np.full(n_seq, n_prompt + i, np.int32), seq_id=seqs, logits=flags))

        for i in range(3):  # warm-up: the one-token graph is built, backends load their kernels
            step(i)
        ctx.times.reset()
        t0 = time.perf_counter()
        for i in range(3, 3 + n_gen):
            step(i)
        wall = time.perf_counter() - t0
        tm = ctx.times.as_dict()
        return StepRow(backend, n_seq, n_prompt + 3 + n_gen, wall / n_gen * 1e6,
                       {p: tm[p] / n_gen * 1e6 for p in _HOST_PHASES}, tm["compute"] / n_gen * 1e6,
                       f"{tm['n_graph_reused']}/{tm['n_ubatch']}")


def step_times(backends: Sequence[str], folder: Path, n_seqs: Sequence[int] = (1, 8), n_prompt: int = 128,
               n_gen: int = 32, threads: int = 1, spec: ModelSpec = TIMING_MODEL
               ) -> tuple[list[StepRow], list[tuple[str, str]]]:
    """The model ``spec`` (written into ``folder``) on each backend: (rows, skipped backends with the reason)."""
    path = make_model(folder / "timing.gguf", spec)
    rows: list[StepRow] = []
    skipped: list[tuple[str, str]] = []
    for backend in backends:
        try:
            with placed_model(path, backend, threads) as model:
                rows += [_time_steps(model, backend, n, n_prompt, n_gen, threads) for n in n_seqs]
        except PlacementError as e:
            skipped.append((backend, str(e)))
        except Exception as e:  # noqa: BLE001 -- the other backends' rows still come
            skipped.append((backend, f"failed: {type(e).__name__}: {e}"))
    return rows, skipped


def steps_table(rows: Sequence[StepRow]) -> str:
    head = " | ".join(f"{p} us" for p in _HOST_PHASES)
    lines = [f"| backend | seqs | step us | {head} | host total us | backend compute us | host share | "
             f"tokens/s | graphs reused |", "|---" * (8 + len(_HOST_PHASES)) + "|"]
    for r in rows:
        phases = " | ".join(f"{r.host_us[p]:.0f}" for p in _HOST_PHASES)
        lines.append(f"| {r.backend} | {r.n_seq} | {r.step_us:.0f} | {phases} | {r.host_total_us:.0f} | "
                     f"{r.compute_us:.0f} | {r.host_total_us / r.step_us:.0%} | {r.n_seq / r.step_us * 1e6:.0f} | "
                     f"{r.reused} |")
    return "\n".join(lines)


# ============================================================================================== command line

def _args(prog: str, doc: str, argv: list[str],
          extra: Callable[[argparse.ArgumentParser], object]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m kvcache_ggml {prog}", description=doc)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per context (default: %(default)s)")
    extra(ap)
    a = ap.parse_args(argv)
    if a.threads < 1:
        ap.error(f"--threads must be >= 1, got {a.threads}")
    logging.getLogger("kvcache_ggml.cache").setLevel(logging.ERROR)
    return a


def main_parity(argv: list[str]) -> int:
    """``runtime-parity``: the runtime on a backend against the CPU; exit 0 when every row passes."""
    def extra(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--backend", default="cuda", help="cuda, rpc, vulkan, metal, cpu (default: %(default)s)")
        ap.add_argument("--split", choices=("all", "half"), default="all",
                        help="layers on the backend: all, or the last half (n_gpu_layers = n_layer/2 + 1) with the "
                             "rest and their cache on the CPU (default: %(default)s)")
        ap.add_argument("--steps", type=int, default=N_GEN, help="greedy steps (default: %(default)s)")
        ap.add_argument("--models", default=",".join(MODELS), help="comma-separated (default: %(default)s)")
        ap.add_argument("--configs", default="", help="comma-separated indices into the configurations "
                        f"({'; '.join(f'{i}: {c.name}' for i, c in enumerate(CONFIGS))}; default: all)")

    a = _args("runtime-parity", "The runtime on a backend against the CPU: logits and greedy tokens.", argv, extra)
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvcache_rt_") as tmp:
        try:
            configs = [CONFIGS[int(i)] for i in a.configs.split(",")] if a.configs else list(CONFIGS)
            rows = runtime_parity(a.backend, Path(tmp), a.threads, configs, models, a.steps, a.split)
        except PlacementError as e:
            print(f"runtime-parity: {a.backend} cannot run: {e}", file=sys.stderr)
            return 2
        except (ValueError, IndexError) as e:
            print(f"runtime-parity: error: {e}", file=sys.stderr)
            return 2
    print(f"runtime parity, {a.backend} ({a.split} layers) against the CPU: models {', '.join(models)}; {_N_SEQ} "
          f"sequences, {a.steps} greedy steps, context shift, fork, state round trip; "
          f"{time.perf_counter() - t0:.1f} s\n")
    print(parity_table(a.backend, rows))
    return 0 if all(r.passed for r in rows) else 1


def main_step_times(argv: list[str]) -> int:
    """``step-times``: our host time per decode step beside the backend's compute time."""
    def extra(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--backends", default="cpu,cuda", help="comma-separated (default: %(default)s)")
        ap.add_argument("--n-seq", default="1,8", help="sequence counts (default: %(default)s)")
        ap.add_argument("--n-gen", type=int, default=32, help="timed steps (default: %(default)s)")
        ap.add_argument("--n-prompt", type=int, default=128, help="prompt tokens per sequence (default: "
                                                                  "%(default)s)")
        ap.add_argument("--layers", type=int, default=TIMING_MODEL.layers, help="model layers (default: "
                                                                               "%(default)s)")
        ap.add_argument("--embd", type=int, default=TIMING_MODEL.embd,
                        help="model width, a multiple of 64: heads of 64, 4 query heads per K/V head, ff 3 x embd "
                             "(default: %(default)s)")

    a = _args("step-times", "Host time per decode step beside the backend's compute time.", argv, extra)
    heads = max(1, a.embd // 64)
    spec = ModelSpec(layers=a.layers, embd=a.embd, heads=heads, heads_kv=max(1, heads // 4), ff=3 * a.embd,
                     vocab=TIMING_MODEL.vocab, seed=TIMING_MODEL.seed, type=TIMING_MODEL.type)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvcache_steps_") as tmp:
        try:
            spec.check()
            rows, skipped = step_times([b.strip() for b in a.backends.split(",") if b.strip()], Path(tmp),
                                       [int(n) for n in a.n_seq.split(",")], a.n_prompt, a.n_gen, a.threads, spec)
        except ValueError as e:
            print(f"step-times: error: {e}", file=sys.stderr)
            return 2
    print(f"step times: llama {spec.type}, {spec.layers} layers, n_embd {spec.embd}, heads {spec.heads}/"
          f"{spec.heads_kv}, ff {spec.ff}, vocab {spec.vocab}; f16 cache, flash attention; prompt {a.n_prompt} "
          f"tokens per sequence, then {a.n_gen} timed steps of one token per sequence; {a.threads} CPU "
          f"thread(s); {time.perf_counter() - t0:.1f} s\n")
    print(steps_table(rows))
    for name, reason in skipped:
        print(f"skipped {name}: {reason}")
    return 0 if rows and not skipped else 1

"""Vulkan against the CPU: the cache, the runtime and saved state on a real device backend (``-m vulkan``).

Needs the Vulkan flavour (``python3 build.py --vulkan ...``, docs/parity.md) and a Vulkan device; on a machine
without a GPU, Mesa's lavapipe (``scripts/vulkan_sw.sh``).  ggml hides CPU-type Vulkan devices unless
``GGML_VK_VISIBLE_DEVICES`` names them: conftest.py sets it to 0 when it is unset.  Without a usable device the
tests skip with the reason -- except under CI (``CI=true``), where that fails them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kvcache_ggml import ggml as G
from kvcache_ggml import parity as P
from kvcache_ggml.backends import PlacedModel, backend_status
from kvcache_ggml.batch import Batch
from kvcache_ggml.parity import TraceReplay
from kvcache_ggml.parity import Capture, ParityConfig, make_target
from kvcache_ggml.runtime import Context
from kvcache_ggml.parity.runtime_check import (CONFIGS, MODELS, logit_tolerance, main_parity, placed_model,
                                                runtime_parity, write_model)

pytestmark = pytest.mark.vulkan

ROOT = Path(__file__).resolve().parents[1]
_STATUS = backend_status("vulkan")
_WHY_NOT = ("ggml is built without Vulkan: python3 build.py --vulkan (docs/parity.md)" if not _STATUS.built
            else _STATUS.reason)


@pytest.fixture(scope="module", autouse=True)
def vulkan_device() -> str:
    """The Vulkan device's name; a skip with the reason when there is none (a failure under CI)."""
    if _WHY_NOT:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true and no Vulkan device: {_WHY_NOT}")
        pytest.skip(f"no Vulkan device: {_WHY_NOT}")
    return next(d.name for d in G.devices() if d.name.startswith("Vulkan"))


# ============================================================================================== the crash

_TWO_CACHES = textwrap.dedent("""
    from kvcache_ggml.backends import PlacedModel
    from kvcache_ggml.parity import TraceReplay
    from kvcache_ggml.parity import Capture, ParityConfig, make_target
    cfg = ParityConfig()
    pm = PlacedModel(cfg.hparams(), make_target("vulkan", cfg.n_layer).placement)
    r = TraceReplay(cfg, pm, "f16", Capture("vulkan", "f16", pm.layer_map()))
    for i in range(3):
        with r.new_cache("unified") as kv:
            r.decode(kv, "A", r.counts(1, 3, 4, 9), 1)
        with r.new_cache("streams") as kv:
            r.decode(kv, "B", r.counts(11, 3, 3, 9), 11)
    r.close()
    print("ok")
""")


def test_a_closed_cache_leaves_no_dangling_descriptor():
    """The crash of the first Vulkan runs, reduced: a unified cache decodes and is closed (its device buffer
    freed), then a per-sequence-streams cache decodes.  ggml-vulkan reuses descriptor sets whose bindings past a
    pipeline's parameter count still name the freed buffer, and lavapipe touches them: a use-after-free and a
    double free (SIGSEGV, or glibc's "malloc(): unsorted double linked list corrupted").  build.py's patch writes
    every binding on lavapipe.  In a child process with glibc's own allocator as it is (without the patch it dies
    in each of three cycles; glibc's debugging allocator, libc_malloc_debug, happens to hide this one)."""
    proc = subprocess.run([sys.executable, "-c", _TWO_CACHES], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_the_source_carries_the_lavapipe_patch():
    src = next((ROOT / "vendor" / "ggml").glob("ggml_python-*/vendor/ggml/src/ggml-vulkan/ggml-vulkan.cpp"))
    assert "kv_all_infos" in src.read_text(), f"{src} is not patched: rerun python3 build.py --vulkan"


# ============================================================================================== the cache

def test_parity_cli_on_vulkan(capsys):
    """Write, inputs, attention, seq ops, K-shift, stream copy and state on Vulkan against the CPU, for F16, Q8_0
    and F32 caches, within the harness's tolerances (each replay in a child process)."""
    assert P.main(["--backends", "cpu,vulkan", "--types", "f16,q8_0,f32", "--quiet"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| vulkan |")]
    assert len(rows) == 3 and all(r[-1].strip() == "PASS" for r in rows), out
    for r in rows:
        # what is only copied is exact: the written rows of float caches, the inputs, the seq ops' cells
        write, inputs, seq_ops = (r[i].strip() for i in (2, 3, 5))
        assert inputs == "0" and seq_ops == "0", out
        if r[1].strip() != "q8_0":
            assert write == "0", out


def _replay_cache(target: str, type_: str) -> tuple[TraceReplay, object]:
    cfg = ParityConfig()
    pm = PlacedModel(cfg.hparams(), make_target(target, cfg.n_layer).placement)
    r = TraceReplay(cfg, pm, type_, Capture(target, type_, pm.layer_map()))
    kv = r.new_cache("streams")
    r.decode(kv, "S1", r.counts(11, 3, 3, 9), 11)   # the same K/V rows on both (no K-shift)
    return r, kv


@pytest.mark.parametrize("type_", ["f16", "f32", "q8_0"])
def test_state_across_vulkan_and_cpu(type_):
    """A sequence saved from a Vulkan cache is the CPU's bytes (F16/F32: the rows are only converted, which every
    backend rounds correctly; Q8_0: within the quantizer's one-step differences), and each side loads the other's."""
    (rc, kc), (rv, kvv) = _replay_cache("cpu", type_), _replay_cache("vulkan", type_)
    try:
        for seq in (1, -1):
            cpu_blob, vk_blob = kc.state_save(seq), kvv.state_save(seq)
            assert len(cpu_blob) == len(vk_blob)
            if type_ != "q8_0":
                assert cpu_blob == vk_blob
            else:
                a, b = np.frombuffer(cpu_blob, np.uint8), np.frombuffer(vk_blob, np.uint8)
                assert np.count_nonzero(a != b) < 0.01 * a.size
            # each side restores the other's blob and saves the same bytes again
            for r, blob in ((rc, vk_blob), (rv, cpu_blob)):
                with r.new_cache("streams") as fresh:
                    fresh.state_load(blob, seq)
                    assert fresh.state_save(seq) == blob
    finally:
        for r, kv in ((rc, kc), (rv, kvv)):
            kv.close()
            r.close()


# ============================================================================================== the runtime

@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("vk_models")
    return {key: write_model(folder, key) for key in MODELS}


def _check_rows(rows, backend="vulkan"):
    assert rows
    for r in rows:
        assert r.steps == 65 and r.failures == [], r
        assert r.agree + r.ambiguous == r.rows, r   # greedy tokens equal, or a near tie by the stated rule
        assert r.rel_err <= logit_tolerance(MODELS[r.model].type, next(
            c.type_kv for c in CONFIGS if c.name == r.config), backend), r
        assert "Vulkan0" in r.devices


@pytest.mark.parametrize("model", list(MODELS))
def test_runtime_on_vulkan(tmp_path, model):
    """64 greedy steps of four sequences (fork, context shift, state round trip) with every layer on Vulkan, in
    every configuration: flash attention on and off, F16 / F32 / Q8_0 caches, unified and per-sequence streams."""
    _check_rows(runtime_parity("vulkan", tmp_path, models=(model,)))


def test_split_model_q8_0_cache_agrees_as_closely_as_f16(tmp_path):
    """Half of a Q4_0 model and its cache on Vulkan, the rest on the CPU (n_gpu_layers = n_layer/2 + 1): a Q8_0
    cache agrees with the CPU about as closely as an F16 cache does (the first Vulkan runs were off by more than the
    largest logit there)."""
    rows = runtime_parity("vulkan", tmp_path, configs=(CONFIGS[0], CONFIGS[3]), models=("llama q4_0",),
                          split="half")
    _check_rows(rows)
    f16, q8 = rows
    assert "CPU" in f16.devices and q8.rel_err <= 2 * f16.rel_err + 1e-3, (f16, q8)


@pytest.mark.parametrize("model", list(MODELS))
def test_vulkan_is_as_close_to_exact_math_as_the_cpu(models, tmp_path, model):
    """Both backends against the float64 numpy forward pass of the same file (an implementation independent of
    ggml): Vulkan's logits are no farther from it than the CPU's, up to F16 arithmetic's rounding (ggml-vulkan
    multiplies in F16 where the device has it).  With quantized weights the CPU quantizes activations to Q8_0/Q8_K
    and Vulkan multiplies dequantized weights, so Vulkan is often the closer of the two: the differences between
    them that runtime-parity's tolerances allow are the CPU's own quantization error, not a Vulkan defect.

    F16 weights: on a device with F16 arithmetic ggml-vulkan multiplies an F16 matrix by F32 activations in its
    F16-accumulating kernel (``ggml_vk_get_mul_mat_mat_pipeline``: ``f16acc`` unless the op asks for F32
    precision, which llama.cpp's llama graph does not), about ten times the CPU's error over rows of 512-1024
    (lavapipe: 0.022 against 0.0019).  That is ggml's choice, the same under llama.cpp; so for those models the
    Vulkan side runs in a child process with ``GGML_VK_DISABLE_F16=1`` (F32 accumulation), where the same bound
    checks our graph."""
    path = models[model]
    toks = np.random.default_rng(7).integers(3, MODELS[model].vocab, 24).astype(np.int32)
    err, ref = {}, None
    for backend in ("cpu", "vulkan"):
        if backend == "vulkan" and MODELS[model].type == "f16":
            got = _logits_in_child(path, toks, tmp_path, GGML_VK_DISABLE_F16="1")
        else:
            with placed_model(path, backend, 1) as m, Context(m, **_EXACT_CTX) as ctx:
                got = ctx.decode(Batch(token=toks, logits=np.ones(len(toks), np.int8))).astype(np.float64)
                if ref is None:
                    ref = reference_of(path, model, ctx.cparams.n_ctx_seq).forward(toks)
        err[backend] = np.abs(got - ref).max() / np.abs(ref).max()
    assert err["vulkan"] <= 1.5 * err["cpu"] + 5e-3, err


_EXACT_CTX = dict(n_ctx=64, flash_attn=True, type_k="f16", type_v="f16", n_threads=1, n_threads_batch=1)
_CHILD_LOGITS = textwrap.dedent("""
    import json
    import sys
    import numpy as np
    from kvcache_ggml.batch import Batch
    from kvcache_ggml.parity.runtime_check import placed_model
    from kvcache_ggml.runtime import Context
    path, toks_file, out_file, ctx_kw = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    toks = np.load(toks_file)
    with placed_model(path, "vulkan", 1) as m, Context(m, **ctx_kw) as ctx:
        np.save(out_file, ctx.decode(Batch(token=toks, logits=np.ones(len(toks), np.int8))).astype(np.float64))
""")


def _logits_in_child(path: Path, toks: np.ndarray, tmp: Path, **env: str) -> np.ndarray:
    """float64 [n_tokens, n_vocab] (numpy order): the logits of ``toks`` decoded on Vulkan in a child process with
    ``env`` added to its environment (ggml-vulkan reads its switches once, when it enumerates the devices)."""
    np.save(tmp / "toks.npy", toks)
    run = subprocess.run([sys.executable, "-c", _CHILD_LOGITS, str(path), str(tmp / "toks.npy"),
                          str(tmp / "logits.npy"), json.dumps(_EXACT_CTX)], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    return np.load(tmp / "logits.npy")


def reference_of(path, model: str, n_ctx_seq: int):
    """The float64 forward pass of MODELS[model]'s file (Phi-3's LongRoPE factors depend on the context)."""
    from kvcache_ggml.runtime.gemma_reference import GemmaReference
    from kvcache_ggml.runtime.phi3_reference import Phi3Reference
    from kvcache_ggml.runtime.reference import Reference
    if model.startswith("gemma"):
        return GemmaReference(path)
    return Phi3Reference(path, n_ctx_seq) if model.startswith("phi") else Reference(path)


def test_runtime_parity_cli(capsys):
    assert main_parity(["--backend", "vulkan", "--models", "tiny f32", "--configs", "0", "--steps", "4"]) == 0
    assert "| tiny f32 | flash attn, f16 cache, 4 streams | 5 |" in capsys.readouterr().out
    assert main_parity(["--backend", "tpu"]) == 2


_DEVICE_OPS = {"SET_ROWS", "ROPE", "FLASH_ATTN_EXT", "SOFT_MAX", "MUL_MAT"}


@pytest.mark.parametrize("flash_attn", [True, False])
def test_a_vulkan_layer_computes_on_vulkan(models, vulkan_device, flash_attn):
    """The scheduler's assignment (ggml_backend_sched_get_tensor_backend) of every node of the last graph: the
    K/V stores, RoPE, attention and matrix products of a layer placed on Vulkan ran there, not on the CPU as a
    fallback; those of a layer left on the CPU ran on the CPU."""
    with placed_model(models["llama q8_0"], "vulkan", 1, "half") as m, \
            Context(m, n_ctx=256, n_seq_max=2, flash_attn=flash_attn, type_k="f16", type_v="f16",
                    n_threads=1, n_threads_batch=1) as ctx:
        ctx.decode(Batch(token=np.arange(3, 11, dtype=np.int32), logits=np.ones(8, np.int8)))
        nodes = ctx.node_backends()
        n_layer = m.hparams.n_layer
        on_vk = {il for il in range(n_layer) if G.ggml_backend_dev_name(m.dev_layer(il)).decode() == vulkan_device}
    assert on_vk and len(on_vk) < n_layer
    seen: dict[tuple[int, str], set[str]] = {}
    for name, op, backend in nodes:
        il = _layer_of(name)
        if il is not None and op in _DEVICE_OPS:
            seen.setdefault((il, op), set()).add(backend)
    for il in range(n_layer):
        want = vulkan_device if il in on_vk else "CPU"
        ops = {op for (l, op) in seen if l == il}
        assert {"SET_ROWS", "ROPE", "MUL_MAT"} <= ops and ("FLASH_ATTN_EXT" if flash_attn else "SOFT_MAX") in ops
        for op in ops:
            assert seen[(il, op)] == {want}, (il, op, seen[(il, op)])


def _layer_of(name: str) -> int | None:
    """The layer of a node named ``what-il`` by the graph callback (or ``cache_k_l{il}`` views and stores)."""
    head, _, tail = name.partition(" ")
    for sep in ("-", "_l"):
        stem, found, num = head.rpartition(sep)
        if found and num.isdigit() and stem:
            return int(num)
    return None

"""Backend parity (kvcache_ggml.parity): the trace replayed on each available backend against the CPU.

CPU against RPC on loopback always runs (f16 and q8_0 caches, half of the layers on the RPC server) and must be
bit-exact: the server runs the same CPU code.  CUDA, Metal and Vulkan run when built and present, else are
skipped with the reason.  The harness itself is checked to notice differences (tampered captures, a different
seed, a broken copy).
"""
import dataclasses
import logging

import numpy as np
import pytest

from kvcache_ggml import ggml as G
from kvcache_ggml import parity as P
from kvcache_ggml.backends import PlacementError, backend_status, local_rpc_server

CFG = P.ParityConfig(seed=3)
TYPES = ["f16", "q8_0"]


@pytest.fixture(autouse=True)
def _quiet_cache_log():
    # the toy model's varied K/V heads make the cache warn about V padding on every construction
    logger = logging.getLogger("kvcache_ggml.cache")
    old = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(old)


@pytest.fixture(scope="module")
def rpc_server():
    if not G.rpc_available():
        pytest.skip("ggml built without RPC (python3 build.py --no-rpc)")
    with local_rpc_server(threads=1) as s:
        yield s


_REFS: dict[str, P.Capture] = {}


def reference(type_):
    if type_ not in _REFS:
        logging.getLogger("kvcache_ggml.cache").setLevel(logging.ERROR)
        _REFS[type_] = P.replay(CFG, P.make_target("cpu", CFG.n_layer), type_)
    return _REFS[type_]


def target_or_skip(name, rpc_server=None):
    try:
        return P.make_target(name, CFG.n_layer, rpc_server.spec if rpc_server else None)
    except PlacementError as e:
        pytest.skip(str(e))


# ---------------------------------------------------------------------------------------------- the parity checks

@pytest.mark.parametrize("type_", TYPES)
def test_cpu_vs_rpc_bit_exact(rpc_server, type_):
    target = target_or_skip("rpc", rpc_server)
    got = P.replay_isolated(CFG, target, type_)  # a ggml abort on the RPC path fails the test, not pytest
    assert got.layer_map == ["CPU", "CPU", rpc_server.spec, rpc_server.spec]  # half of the layers on the server
    row = P.compare(got, reference(type_))
    bad = {c: r.notes[:3] for c, r in row.checks.items() if not r.passed}
    assert row.passed, bad
    # the same CPU code on both sides: every figure is 0, every check compared something
    assert all(r.error == 0 and r.n_arrays > 0 for r in row.checks.values()), {c: r.cell() for c, r in
                                                                                row.checks.items()}


@pytest.mark.parametrize("type_", TYPES)
@pytest.mark.parametrize("backend", ["cuda", "metal", "vulkan"])
def test_cpu_vs_device(backend, type_):
    target = target_or_skip(backend)
    row = P.compare(P.replay_isolated(CFG, target, type_), reference(type_))
    assert row.passed, {c: r.notes[:3] for c, r in row.checks.items() if not r.passed}


def test_cpu_vs_cpu_deterministic():
    row = P.compare(P.replay(CFG, P.make_target("cpu", CFG.n_layer), "f16"), reference("f16"))
    assert row.passed and all(r.error == 0 for r in row.checks.values())


# ---------------------------------------------------------------------------------------------- the harness notices

def test_trace_exercises_every_check():
    ref = reference("f16")
    per = {c: [i for i in ref.items if i.check == c] for c in P.CHECKS}
    assert all(per[c] for c in P.CHECKS), {c: len(v) for c, v in per.items()}
    assert not ref.failures  # among them: the K-shift changed K, copies and state round trips are exact
    shifts = [i.data for i in ref.items if i.label.endswith("k_shift")]
    assert len(shifts) == 2 and all(np.count_nonzero(s) for s in shifts)  # both layouts shift some cells
    masks = [i.data for i in ref.items if i.label.endswith("kq_mask")]
    assert all(np.isneginf(m).any() and (m == 0).any() for m in masks)


def test_tampered_capture_fails_the_right_check():
    ref = reference("q8_0")
    got = dataclasses.replace(ref, items=[dataclasses.replace(i) for i in ref.items], failures=[])
    k = next(n for n, i in enumerate(got.items) if i.check == "kshift" and i.label.endswith("K l2"))
    data = got.items[k].data.copy()
    data.reshape(-1)[:34] ^= 0x7F  # scramble the first block
    got.items[k] = dataclasses.replace(got.items[k], data=data)
    m = next(n for n, i in enumerate(got.items) if i.label.endswith("kq_mask"))
    mask = got.items[m].data.copy()
    mask.reshape(-1)[0] = 1.0
    got.items[m] = dataclasses.replace(got.items[m], data=mask)
    got.failures.append("stream_copy: S3 K l0: stream 2 differs from its source stream 0")
    row = P.compare(got, ref)
    failed = {c for c, r in row.checks.items() if not r.passed}
    assert failed == {"kshift", "inputs", "stream_copy"}
    assert row.checks["kshift"].error > P.tolerance("kshift", "q8_0").limit
    assert "kq_mask: differs" in row.checks["inputs"].notes[0]
    assert "FAIL" in row.checks["kshift"].cell()


def test_other_seed_differs():
    other = P.replay(dataclasses.replace(CFG, seed=CFG.seed + 1), P.make_target("cpu", CFG.n_layer), "f16")
    ref = reference("f16")
    if [i.label for i in other.items] != [i.label for i in ref.items]:
        with pytest.raises(RuntimeError, match="different trace"):
            P.compare(other, ref)
    else:
        assert not P.compare(other, ref).passed


def test_tolerances():
    assert P.tolerance("write", "f16") == P.Tolerance("exact", 0.0)
    assert P.tolerance("inputs", "q8_0").metric == "exact" and P.tolerance("seq_ops", "q8_0").metric == "exact"
    assert P.tolerance("write", "q8_0").metric == "nmse"
    assert P.tolerance("kshift", "f16").metric == "nmse"
    with pytest.raises(ValueError, match="unknown check"):
        P.tolerance("nope", "f16")


# ---------------------------------------------------------------------------------------------- report and CLI

def test_run_parity_report_lists_skips(rpc_server):
    rep = P.run_parity(["rpc", "cuda", "metal", "vulkan"], ["f16"], CFG, rpc_spec=rpc_server.spec)
    table = rep.table()
    assert [r.backend for r in rep.rows][:1] == ["rpc"]
    assert rep.passed, table
    assert table.splitlines()[0].startswith("| backend | type | write |")
    for name, reason in rep.skipped:
        assert reason and f"skipped {name}: {reason}" in table
    built = {r.backend for r in rep.rows}
    assert built | {n for n, _ in rep.skipped} == {"rpc", "cuda", "metal", "vulkan"}


def test_cli(capsys):
    vulkan = backend_status("vulkan")
    runs = vulkan.built and not vulkan.reason
    # a backend named on the command line that cannot run fails the run; one that runs must pass
    assert P.main(["--backends", "cpu,vulkan", "--types", "f16", "--quiet"]) == (0 if runs else 1)
    out, err = capsys.readouterr()
    assert "| cpu | f16 | 0 | 0 | 0 | 0 | 0 | 0 | 0 |" in out and "vulkan" in out
    if not runs:
        assert "SKIPPED" in out and "named backend(s) vulkan could not run" in err
    assert P.main(["--backends", "cpu", "--types", "q3_x"]) == 2
    assert "unknown ggml type name" in capsys.readouterr().err
    assert P.main(["--backends", "tpu", "--types", "f16"]) == 2


def test_isolated_replay_reraises_placement_errors():
    from kvcache_ggml.backends import Placement, RpcServerError, free_port
    dead = P.Target("rpc", Placement.single(f"rpc://127.0.0.1:{free_port()}"), "")
    with pytest.raises(RpcServerError, match="connection refused"):
        P.replay_isolated(CFG, dead, "f16")


def test_crash_row_in_table():
    target = P.make_target("cpu", CFG.n_layer)
    rep = P.ParityReport(CFG, rows=[P.crash_row(target, "f16", [], "x: killed by SIGABRT: ops.cpp:1: fatal error")])
    table = rep.table()
    assert "| cpu | f16 | CRASH |" in table and table.count("CRASH cpu f16: x: killed by SIGABRT") == 1
    assert not rep.passed


def test_bench_small():
    bc = P.BenchConfig(n_layer=1, n_embd_head=32, n_head=2, n_head_kv=1, kv_size=256, n_prompt=16, reps=1,
                       n_threads=1)
    rows = P.bench(P.make_target("cpu", 1), "q8_0", bc)
    assert [r.op.split()[0] for r in rows] == ["prompt", "decode", "K-shift", "state_save", "state_load"]
    assert all(r.ms > 0 for r in rows) and "| cpu | q8_0 |" in P.bench_table(rows)

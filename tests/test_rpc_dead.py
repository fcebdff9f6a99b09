"""A dead RPC server is an exception (issue 29; docs/parity.md, "A dead RPC server").

A llama model with its last layers on an RPC server reached through :class:`rpc_proxy.CutProxy`, which cuts the
connection at the k-th message of a decode, a state write or a state read -- for every k of the call, before the
message is relayed and after the server answered it.  Each cut must raise RpcServerLostError within 10 seconds,
leave that context and its cache reporting the loss at their next use, and leave the sequences of the other
contexts (one all on the CPU, one on a second RPC server) with the same cells and bytes.  A server stopped with
SIGSTOP is taken for dead after the RPC timeout; a killed one at once.  The process goes on: the other contexts
decode, and a new connection to the server serves a new context with the CPU's logits.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from kvcache_ggml import ggml as G
from kvcache_ggml.backends import PlacedModel, backend_status, local_rpc_server
from kvcache_ggml.batch import Batch
from kvcache_ggml.hparams import HParams
from kvcache_ggml.parity import make_target
from kvcache_ggml.runtime import Context, load_model
from kvcache_ggml.parity.runtime_check import write_model

from rpc_proxy import CutProxy

pytestmark = pytest.mark.skipif(not backend_status("rpc").built or not G.rpc_status_api(),
                                reason="ggml built without RPC (or without build.py's RPC patches)")

DEADLINE_S = 10.0  # the bound: the call raises within this
PARAMS = dict(n_ctx=256, n_seq_max=2, n_threads=1, flash_attn=True)
PROMPT = Batch(token=np.arange(1, 9, dtype=np.int32), seq_id=np.repeat(np.arange(2, dtype=np.int32), 4),
               logits=np.ones(8, np.int8))


def one_token() -> Batch:
    return Batch(token=np.array([5], np.int32))


def two_sequences() -> Batch:
    return Batch(token=np.array([5, 7], np.int32), seq_id=np.arange(2, dtype=np.int32))


@dataclass
class World:
    path: Path              # the GGUF (the demo's tiny llama, F32 weights)
    hp: HParams
    proxy: CutProxy         # in front of server 1
    other: Any              # server 2 (LocalRpcServer), reached directly
    cpu: Context            # on the CPU only
    remote: Context         # half on server 2
    blobs: dict[str, bytes]  # "cpu" / "remote": their whole state after the prompt


@contextlib.contextmanager
def placed(path: Path, hp: HParams, spec: str | None) -> Iterator[Context]:
    """A context over the model at ``path``: all on the CPU (spec None) or its last layers on the RPC server."""
    if spec is None:
        model = load_model(path)
    else:
        pm = PlacedModel(hp, make_target("rpc", hp.n_layer, spec, "half").placement)
        model = load_model(path, dev_layer=pm.dev_layer, dev_output=pm.dev_output)
    try:
        with Context(model, **PARAMS) as ctx:
            yield ctx
    finally:
        model.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Iterator[World]:
    path = write_model(tmp_path_factory.mktemp("rpc_dead"), "tiny f32")
    hp = HParams.from_gguf(path)
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(local_rpc_server())
        other = stack.enter_context(local_rpc_server())
        proxy = stack.enter_context(CutProxy(server.endpoint))
        cpu = stack.enter_context(placed(path, hp, None))
        remote = stack.enter_context(placed(path, hp, other.spec))
        for ctx in (cpu, remote):
            ctx.decode(PROMPT)
        w = World(path, hp, proxy, other, cpu, remote, {})
        w.blobs = {"cpu": cpu.state_get_data(), "remote": remote.state_get_data()}
        assert w.blobs["cpu"] == w.blobs["remote"]  # the RPC server runs the CPU's code
        yield w


# the calls cut, each on a context through the proxy that has decoded PROMPT (and one more token for "reuse")
CALLS: dict[str, Callable[[Context, World], Any]] = {
    "decode one token (fused step)": lambda ctx, w: ctx.decode(one_token()),
    "decode one token (graph reused)": lambda ctx, w: ctx.decode(one_token()),
    "decode two sequences": lambda ctx, w: ctx.decode(two_sequences()),
    "state write, whole cache": lambda ctx, w: ctx.state_get_data(),
    "state write, one sequence": lambda ctx, w: ctx.state_seq_get_data(1),
    "state read, whole cache": lambda ctx, w: ctx.state_set_data(w.blobs["cpu"]),
    "state read, one sequence": lambda ctx, w: ctx.state_seq_set_data(w.cpu.state_seq_get_data(1), 1),
}


@contextlib.contextmanager
def victim(w: World, call: str) -> Iterator[Context]:
    """A context through the proxy, ready for ``call``."""
    w.proxy.disarm()
    with placed(w.path, w.hp, w.proxy.spec) as ctx:
        ctx.decode(PROMPT)
        if call == "decode one token (graph reused)":
            ctx.decode(one_token())  # the next one-token step reuses this graph (GRAPH_RECOMPUTE)
        yield ctx


def messages(w: World, call: str) -> int:
    """How many requests ``call`` sends to the server when nothing fails (ggml sends some without waiting for an
    answer: a round trip after the call, not counted, makes sure the proxy has seen them all)."""
    with victim(w, call) as ctx:
        n0 = w.proxy.n_requests
        CALLS[call](ctx, w)
        buf, _ = ctx.kv.rpc.buffers[0]
        assert G.ggml_backend_rpc_buffer_sync(buf)
        return w.proxy.n_requests - n0 - 1


def assert_others_unchanged(w: World) -> None:
    assert w.cpu.state_get_data() == w.blobs["cpu"]
    assert w.remote.state_get_data() == w.blobs["remote"]
    assert w.cpu.lost is None and w.remote.lost is None and w.remote.kv.lost is None


@pytest.mark.parametrize("call", list(CALLS))
def test_every_cut_point_raises_and_spares_the_others(world: World, call: str) -> None:
    w = world
    n = messages(w, call)
    assert n >= 2, f"{call}: {n} messages"
    for k in range(1, n + 1):
        for after in (False, True):
            where = f"{call}: cut at message {k} of {n} ({'after its answer' if after else 'before relaying it'})"
            with victim(w, call) as ctx:
                w.proxy.arm(k, after)
                t0 = time.monotonic()
                try:
                    CALLS[call](ctx, w)
                    raised = None
                except G.RpcServerLostError as e:
                    raised = e
                elapsed = time.monotonic() - t0
                assert raised is not None, f"{where}: no exception"
                assert w.proxy.cut_done.is_set(), where
                assert elapsed < DEADLINE_S, f"{where}: {elapsed:.1f} s"
                assert w.proxy.endpoint in raised.endpoints, where
                # the lost context and cache say so at every later use
                with pytest.raises(G.RpcServerLostError, match="lost its RPC server"):
                    ctx.decode(one_token())
                with pytest.raises(G.RpcServerLostError, match="lost its RPC server"):
                    ctx.state_seq_get_data(0)
                with pytest.raises(G.RpcServerLostError):
                    ctx.memory_seq_rm(0, -1, -1)
                assert ctx.kv.lost is not None, where
            assert_others_unchanged(w)


def test_the_process_goes_on(world: World) -> None:
    """After the cuts: the CPU context and the one on the other server decode on with equal logits, and a new
    connection through the proxy serves a new context restored from the CPU's state with the same logits."""
    w = world
    test_every_cut_point_raises_and_spares_the_others(w, "decode one token (fused step)")
    w.proxy.disarm()
    with placed(w.path, w.hp, w.proxy.spec) as fresh:
        fresh.state_set_data(w.blobs["cpu"])
        got = [c.decode(two_sequences()).copy() for c in (w.cpu, w.remote, fresh)]
    w.blobs = {"cpu": w.cpu.state_get_data(), "remote": w.remote.state_get_data()}
    np.testing.assert_array_equal(got[1], got[0])
    np.testing.assert_array_equal(got[2], got[0])
    assert w.blobs["cpu"] == w.blobs["remote"]


@contextlib.contextmanager
def own_server(path: Path, hp: HParams, timeout: float | None) -> Iterator[tuple[Any, Context]]:
    """A server of its own (to stop or kill) and a context half on it, prompted; connections made with the RPC
    timeout ``timeout`` (None: the default)."""
    before = G.rpc_timeout()
    if timeout is not None:
        G.set_rpc_timeout(timeout)
    try:
        with local_rpc_server() as server, placed(path, hp, server.spec) as ctx:
            ctx.decode(PROMPT)
            try:
                yield server, ctx
            finally:
                if server.process.poll() is None:
                    os.kill(server.process.pid, signal.SIGCONT)
    finally:
        G.set_rpc_timeout(before)


STOPPED_CALLS = ("decode one token (fused step)", "state write, whole cache", "state read, whole cache")


@pytest.mark.parametrize("call", STOPPED_CALLS)
@pytest.mark.parametrize("how", ["SIGSTOP", "SIGKILL"])
def test_a_stopped_or_killed_server_is_lost(world: World, call: str, how: str) -> None:
    w = world
    timeout = 2.0
    with own_server(w.path, w.hp, timeout) as (server, ctx):
        os.kill(server.process.pid, getattr(signal, how))
        t0 = time.monotonic()
        with pytest.raises(G.RpcServerLostError, match="lost its RPC server") as info:
            CALLS[call](ctx, w)
        elapsed = time.monotonic() - t0
        assert server.endpoint in info.value.endpoints
        if how == "SIGSTOP":
            assert timeout - 0.1 <= elapsed < timeout + 2.0
        else:
            assert elapsed < 2.0
        with pytest.raises(G.RpcServerLostError):
            ctx.decode(one_token())
    assert_others_unchanged(w)


def test_the_default_timeout_meets_the_deadline(world: World) -> None:
    """With the default RPC timeout, a decode on a stopped server raises within DEADLINE_S."""
    assert 0 < G.RPC_TIMEOUT_S < DEADLINE_S - 1
    with own_server(world.path, world.hp, None) as (server, ctx):
        os.kill(server.process.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(G.RpcServerLostError):
            ctx.decode(one_token())
        assert time.monotonic() - t0 < DEADLINE_S


def test_set_rpc_timeout_checks_its_value() -> None:
    before = G.rpc_timeout()
    try:
        for bad in (-1, float("nan"), 86401, 0.0001, "5"):
            with pytest.raises(ValueError, match="RPC timeout"):
                G.set_rpc_timeout(bad)  # type: ignore[arg-type]
            assert G.rpc_timeout() == before
        G.set_rpc_timeout(0)
        assert G.rpc_timeout() == 0
        G.set_rpc_timeout(1.5)
        assert G.rpc_timeout() == 1.5
    finally:
        G.set_rpc_timeout(before)


def test_a_cache_and_backends_without_the_runtime(world: World) -> None:
    """KVCache and Backends used directly (an embedding runtime): a graph on a killed server raises from
    Backends.compute; the cache's check marks it lost; its sizes still answer; close frees it."""
    from kvcache_ggml.cache import KVCache

    w = world
    with local_rpc_server() as server:
        pm = PlacedModel(w.hp, make_target("rpc", w.hp.n_layer, server.spec, "half").placement)
        with KVCache(pm, kv_size=64, n_seq_max=1, offload=True) as kv, pm.backends(n_threads=1) as be, \
                G.Context.for_tensors(0, 16) as gctx, G.Context.for_tensors(4) as tctx:
            assert kv.rpc.endpoints == (server.endpoint,)
            k = kv.layers[-1].k                                  # [n_embd_k_gqa, kv_size] on the server
            out = G.ggml_scale(tctx.ptr, G.ggml_cast(tctx.ptr, k, G.GGMLType.F32), 2.0)
            graph = G.Graph(gctx, 16)
            graph.expand(out)
            be.compute(graph)                                    # the server computes it
            assert kv.state_save() and kv.lost is None
            server.process.kill()
            server.process.wait()
            with pytest.raises(G.RpcServerLostError, match=server.endpoint):
                be.compute(graph)
            with pytest.raises(G.RpcServerLostError, match="the KV cache lost"):
                kv.check_rpc("a graph of the embedder")
            for call in (lambda: kv.seq_rm(0, -1, -1), lambda: kv.state_save(), lambda: kv.clear()):
                with pytest.raises(G.RpcServerLostError):
                    call()
            assert kv.get_size() == 64 and kv.total_size() > 0
    assert_others_unchanged(w)

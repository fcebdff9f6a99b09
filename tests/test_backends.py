"""Devices, placements, RPC and schedulers (kvcache_ggml.backends).

Layer assignments are checked against splits worked out by hand from llama_model::load_tensors (float32 split
points, the output layer counted in n_gpu_layers).  Every error case must raise before any memory is allocated:
the failing call is PlacedModel(...), which comes before the KVCache.  The RPC servers are loopback subprocesses.
"""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from kvcache_ggml import ggml as G
from kvcache_ggml.backends import (FAMILIES, BackendNotBuiltError, Backends, DeviceNotFoundError, PlacedModel,
                                   Placement, PlacementError, RpcServerError, assign_layers, backend_status,
                                   free_port, list_devices, local_rpc_server, main_rpc_server, parse_rpc_spec,
                                   probe_rpc, resolve_device)
from kvcache_ggml.cache import KVCache
from kvcache_ggml.hparams import HParams

pytestmark = pytest.mark.skipif(not G.rpc_available(), reason="ggml built without RPC (python3 build.py --no-rpc)")


def hparams(n_layer=4):
    return HParams.simple(n_layer=n_layer, n_embd_head=32, n_head=4, n_head_kv=2)


@pytest.fixture(scope="module")
def server():
    with local_rpc_server(threads=1) as s:
        yield s


def unbuilt_family():
    for key in ("cuda", "metal", "vulkan"):
        if not backend_status(key).built:
            return key
    pytest.skip("every optional backend is built here")


# ---------------------------------------------------------------------------------------------- devices

def test_list_devices_cpu():
    devs = list_devices()
    cpu = [d for d in devs if d.ref.kind == "cpu"]
    assert len(cpu) == 1 and cpu[0].ref.spec == "CPU" and cpu[0].ref.is_cpu
    assert cpu[0].buffer_type.name == "CPU" and cpu[0].buffer_type.is_host and cpu[0].buffer_type.alignment > 0
    assert cpu[0].memory_total > 0
    assert backend_status("cpu").built and backend_status("cpu").devices == ("CPU",)


def test_backend_status_names_the_build_flag():
    for key in ("cuda", "metal", "vulkan"):
        st = backend_status(key)
        if not st.built:
            assert FAMILIES[key].build_hint in st.reason and not st.devices
        else:
            assert st.reason == "" or "no " in st.reason
    assert backend_status("rpc").built


def test_list_devices_with_rpc(server):
    devs = list_devices(rpc=[server.spec])
    rpc = [d for d in devs if d.ref.kind == "rpc"]
    assert len(rpc) == 1
    d = rpc[0]
    assert d.ref.spec == server.spec and d.ref.endpoint == server.endpoint and not d.ref.is_cpu
    assert d.buffer_type.name.endswith(f"[{server.endpoint}]") and not d.buffer_type.is_host
    assert d.host_buffer_type is None and d.description == server.endpoint
    assert d.memory_total > 0


def test_resolve_names():
    assert resolve_device("cpu").name == "CPU" and resolve_device(" CPU ").spec == "CPU"
    with pytest.raises(DeviceNotFoundError, match="'NOPE0'.*devices: .*CPU"):
        resolve_device("NOPE0")
    with pytest.raises(DeviceNotFoundError, match="non-empty"):
        resolve_device("")


# ---------------------------------------------------------------------------------------------- assignment

@pytest.mark.parametrize("n_layer,n_dev,ngl,splits,want", [
    (4, 0, -1, None, [-1, -1, -1, -1, -1]),            # no device: everything on the CPU
    (4, 1, -1, None, [0, 0, 0, 0, 0]),                 # all layers and the output on the device
    (4, 1, 0, None, [-1, -1, -1, -1, -1]),             # n_gpu_layers 0
    (4, 1, 2, None, [-1, -1, -1, 0, 0]),               # i_gpu_start = 4 + 1 - 2 = 3: layer 3 and the output
    (4, 1, 100, None, [0, 0, 0, 0, 0]),                # more than n_layer + 1: all
    (4, 2, -1, [1, 1], [0, 0, 0, 1, 1]),               # act 5: il/5 = 0 .2 .4 | .6 .8 against split points .5 1
    (4, 2, -1, [3, 1], [0, 0, 0, 0, 1]),               # points .75 1: only .8 is past .75
    (4, 2, -1, [0, 0], [0, 0, 0, 1, 1]),               # all zero: equal weights
    (6, 2, 4, [1, 1], [-1, -1, -1, 0, 0, 1, 1]),       # start 3, act 4: 0 .25 | .5 .75
    (4, 3, -1, [0, 1, 0], [1, 1, 1, 1, 1]),            # a zero share takes nothing
])
def test_assign_layers_hand_worked(n_layer, n_dev, ngl, splits, want):
    assert assign_layers(n_layer, n_dev, ngl, splits) == want


def test_assign_layers_float32_boundaries():
    # 32 layers + output over 3 equal devices: 11/33 and 1/3 are the same float32, so layer 11 starts device 1
    # (upper_bound: the first split point strictly greater)
    got = assign_layers(32, 3, -1, [1, 1, 1])
    assert got == [0] * 11 + [1] * 11 + [2] * 11


def test_assign_layers_errors():
    with pytest.raises(PlacementError, match="n_gpu_layers"):
        assign_layers(4, 1, -2)
    with pytest.raises(PlacementError, match="2 entries for 3 devices"):
        assign_layers(4, 3, -1, [1, 1])
    with pytest.raises(PlacementError, match="finite and >= 0"):
        assign_layers(4, 2, -1, [1, -1])


@pytest.mark.parametrize("kw,match", [
    (dict(devices=("A0", "B0"), tensor_split=(1.0,)), "1 entries for 2 devices"),
    (dict(devices=("A0",), tensor_split=(float("nan"),)), "finite"),
    (dict(devices=("A0", "a0")), "listed twice"),
    (dict(devices=("CPU",)), "not an offload device"),
    (dict(devices=("A0",), n_gpu_layers=-3), "n_gpu_layers"),
])
def test_placement_validation(kw, match):
    with pytest.raises(PlacementError, match=match):
        Placement(**kw)


def test_placement_constructors():
    assert Placement.cpu() == Placement() and Placement.single("cpu") == Placement()
    assert Placement.single("CUDA0").devices == ("CUDA0",)
    p = Placement.split(["A0", "B0"], [3, 1], n_gpu_layers=5)
    assert p.tensor_split == (3.0, 1.0) and p.n_gpu_layers == 5 and "A0, B0" in p.describe()
    assert Placement.per_layer(["CPU", "X"]).layers == ("CPU", "X")


def test_placed_model_cpu():
    pm = PlacedModel(hparams(), Placement.cpu())
    assert pm.layer_map() == ["CPU"] * 4 and pm.used_devices() == [] and pm.dev_output().is_cpu
    assert pm.input_buffer_type() == G.cpu_buffer_type()
    with pytest.raises(IndexError):
        pm.dev_layer(4)
    with KVCache(pm, offload=True, kv_size=32) as kv, pm.backends(n_threads=1) as be:
        assert list(kv.memory_breakdown()) == ["CPU"]
        assert be.names() == ["CPU"] and be.sched is not None
    assert be.sched is None and be.backends == []


# ---------------------------------------------------------------------------------------------- placement on RPC

def test_half_the_layers_on_rpc(server):
    hp = hparams(4)
    pm = PlacedModel(hp, Placement.split([server.spec], n_gpu_layers=3))
    assert pm.layer_map() == ["CPU", "CPU", server.spec, server.spec]
    assert [d.spec for d in pm.used_devices()] == [server.spec]
    with KVCache(pm, offload=True, kv_size=32, type_k="q8_0", type_v="f16") as kv:
        sizes = kv.memory_breakdown()
        assert set(sizes) == {"CPU", f"RPC0[{server.endpoint}]"}
        assert sizes["CPU"] == sum(sizes.values()) // 2  # two equal layers each side
        rpc_bufs = [b for b in kv.buffers() if not b.is_host]
        assert len(rpc_bufs) == 1
        with pm.backends(n_threads=1) as be:
            assert be.names()[-1] == "CPU" and be.names()[0].startswith("RPC")
            assert be.update_context(hparams=hp).sched is be.sched


def test_per_layer_and_split(server):
    pm = PlacedModel(hparams(4), Placement.per_layer(["CPU", server.spec, "cpu", server.spec]))
    assert pm.layer_map() == ["CPU", server.spec, "CPU", server.spec] and len(pm.used_devices()) == 1
    with pytest.raises(PlacementError, match="3 layer devices for a model of 4"):
        PlacedModel(hparams(4), Placement.per_layer(["CPU", "CPU", "CPU"]))
    # all layers on the server by the default split (free memory; one device takes all)
    pm = PlacedModel(hparams(4), Placement.single(server.spec))
    assert pm.layer_map() == [server.spec] * 4


def test_rpc_probe(server):
    info = probe_rpc(server.endpoint)
    assert info.version[0] == 4 and info.n_devices == 1
    assert probe_rpc(server.endpoint, handshake=False).version is None
    assert parse_rpc_spec(f"rpc://localhost:{server.port}/0") == (server.endpoint, 0)
    with pytest.raises(DeviceNotFoundError, match="serves 1 device"):
        resolve_device(f"{server.spec}/3")


# ------------------------------------------------------------------------------------------- errors before allocating

def test_nonexistent_device_raises_before_allocation():
    with pytest.raises(DeviceNotFoundError, match="'GPU9'"):
        PlacedModel(hparams(), Placement.single("GPU9"))
    with pytest.raises(DeviceNotFoundError, match="'GPU9'"):
        PlacedModel(hparams(), Placement.per_layer(["CPU", "CPU", "GPU9", "CPU"]))


def test_unbuilt_backend_raises_before_allocation():
    key = unbuilt_family()
    fam = FAMILIES[key]
    for spec in (key, f"{fam.registry}0"):
        with pytest.raises(BackendNotBuiltError, match=f"'{key}' was not built") as e:
            PlacedModel(hparams(), Placement.single(spec))
        assert f"build.py --{key}" in str(e.value) and repr(spec) in str(e.value)


def test_dead_rpc_port_raises_before_allocation():
    port = free_port()
    with pytest.raises(RpcServerError, match=f"127.0.0.1:{port} does not answer: connection refused"):
        PlacedModel(hparams(), Placement.single(f"rpc://127.0.0.1:{port}"))


def test_stopped_server_raises_even_after_use():
    with local_rpc_server() as s:
        spec = s.spec
        PlacedModel(hparams(), Placement.single(spec))  # added to ggml in this process
    with pytest.raises(RpcServerError, match="connection refused"):
        PlacedModel(hparams(), Placement.single(spec))


def test_non_loopback_rpc_refused_without_connecting():
    with pytest.raises(RpcServerError, match="not a loopback address"):
        PlacedModel(hparams(), Placement.single("rpc://10.11.12.13:50052"))
    with pytest.raises(RpcServerError, match="IPv6"):
        parse_rpc_spec("rpc://::1:50052")
    for bad in ("rpc://127.0.0.1", "rpc://127.0.0.1:0", "rpc://127.0.0.1:70000", "rpc://127.0.0.1:5/x",
                "rpc://127.0.0.1:\u00b2", "rpc://127.0.0.1:5/\u00b2"):  # ('²': a digit to str.isdigit, not to int)
        with pytest.raises(RpcServerError, match="rpc spec|RPC spec"):
            parse_rpc_spec(bad)


class _Listener:
    """A loopback TCP listener that accepts and then stays silent, or answers garbage."""

    def __init__(self, reply: bytes | None):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        self.reply, self.conns = reply, []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            while True:
                c, _ = self.sock.accept()
                self.conns.append(c)
                if self.reply is not None:
                    c.recv(64)
                    c.sendall(self.reply)
        except OSError:
            pass

    def close(self):
        for c in self.conns:
            c.close()
        self.sock.close()


@pytest.mark.parametrize("reply,match", [(None, "did not answer the handshake within 0.3 s"),
                                         (b"\x05" + bytes(7), "not a ggml RPC server")])
def test_silent_or_foreign_server_refused(reply, match):
    # ggml's own client would abort the process on these; the probe must catch them first
    lst = _Listener(reply)
    try:
        with pytest.raises(RpcServerError, match=match):
            PlacedModel(hparams(), Placement.single(f"rpc://127.0.0.1:{lst.port}"), probe_timeout=0.3)
    finally:
        lst.close()


# ---------------------------------------------------------------------------------------------- rpc-server CLI

def test_rpc_server_refuses_remote_host(capsys):
    with pytest.raises(SystemExit) as e:
        main_rpc_server(["--host", "10.1.2.3", "--port", "50052"])
    assert e.value.code == 2 and "not a loopback address" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main_rpc_server(["--host", "0.0.0.0", "--port", "50052"])


def test_rpc_server_port_in_use(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert main_rpc_server(["--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_local_server_always_stopped():
    with pytest.raises(KeyError):
        with local_rpc_server() as s:
            proc = s.process
            assert proc.poll() is None
            raise KeyError("boom")
    assert proc.poll() is not None
    with pytest.raises(RpcServerError, match="connection refused"):
        probe_rpc(s.endpoint)


def test_local_server_dies_with_an_aborted_parent():
    code = ("import os, sys\n"
            "from kvcache_ggml.backends import local_rpc_server\n"
            "with local_rpc_server() as s:\n"
            "    print(s.process.pid, s.endpoint, flush=True)\n"
            "    os.abort()  # no finally runs\n")
    proc = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, timeout=60)
    assert proc.returncode < 0
    pid, endpoint = proc.stdout.split()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            probe_rpc(endpoint.decode(), timeout=0.5)
        except RpcServerError:
            break
        time.sleep(0.1)
    else:
        os.kill(int(pid), signal.SIGKILL)
        pytest.fail(f"the RPC server {int(pid)} outlived its aborted parent")


def test_backends_close_order():
    with Backends([], n_threads=1) as be:
        assert be.names() == ["CPU"] and be.host_buft == G.cpu_buffer_type()
    be.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        be.reset()

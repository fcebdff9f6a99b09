"""Devices, placements and schedulers: where the KV cache's layers live, and ggml's RPC backend.

* :func:`list_devices` / :func:`backend_status`: the ggml devices of the backends built into this ggml (CPU always;
  CUDA, Metal, Vulkan, RPC per ``build.py`` flags), each with its buffer type and, where the device has one, its
  host (pinned) buffer type.
* :class:`Placement`: which device holds each layer -- all on the CPU, all on one device, or layer ranges split
  over several devices with llama.cpp's ``n_gpu_layers`` / ``tensor_split`` rules (llama_model::load_tensors).
* :class:`PlacedModel`: hyper-parameters plus a resolved placement; it gives :class:`~kvcache_ggml.cache.KVCache`
  ``dev_layer(il)``, so ``KVCache(PlacedModel(hparams, placement), offload=True, ...)`` puts each layer's K/V in
  the buffer type of its device.
* :class:`Backends`: the owner of one ggml backend per used device, the CPU backend and a ``G.Sched`` over them,
  with the host buffer type of the first device for the CPU's graph inputs (as llama_context does).
* RPC: ``rpc://127.0.0.1:PORT[/DEV]`` names device DEV (default 0) of a ggml RPC server; :func:`probe_rpc` checks
  that it answers before ggml touches it (ggml aborts or crashes on a dead server); :func:`main_rpc_server` is
  ``python -m kvcache_ggml rpc-server``; :func:`local_rpc_server` runs one in a subprocess for tests.

Errors, all raised before any memory is allocated: :class:`PlacementError` (a ``ValueError``) for a bad placement,
with :class:`DeviceNotFoundError`, :class:`BackendNotBuiltError` and :class:`RpcServerError` for a device that does
not exist, a backend that was not built and an RPC server that does not answer.  ``RuntimeError`` when ggml
refuses something that passed the checks (a backend that cannot be initialised).
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import ipaddress
import math
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from . import _ggml as G

__all__ = [
    "PlacementError", "DeviceNotFoundError", "BackendNotBuiltError", "RpcServerError",
    "BufferTypeInfo", "DeviceInfo", "DeviceRef", "BackendStatus", "RpcServerInfo", "LocalRpcServer",
    "Placement", "PlacedModel", "Backends",
    "FAMILIES", "backend_status", "list_devices", "resolve_device", "assign_layers", "probe_rpc", "parse_rpc_spec",
    "local_rpc_server", "free_port", "main_rpc_server",
]

RPC_SCHEME = "rpc://"
RPC_DEFAULT_PORT = 50052  # ggml's rpc-server default
# ggml-rpc.h / ggml-rpc.cpp: the protocol version this ggml speaks and the HELLO / DEVICE_COUNT messages
_RPC_PROTO_MAJOR, _RPC_PROTO_MINOR = 4, 0
_RPC_CMD_HELLO, _RPC_CMD_DEVICE_COUNT = 14, 15
_RPC_CONN_CAPS_SIZE = 24  # transport.h
_RPC_HELLO_RSP_SIZE = 4 + _RPC_CONN_CAPS_SIZE  # major, minor, patch, padding, conn_caps


# ============================================================================================== errors

class PlacementError(ValueError):
    """A placement that cannot be used; raised before any memory is allocated."""


class DeviceNotFoundError(PlacementError):
    """A placement names a device that this ggml does not have."""


class BackendNotBuiltError(PlacementError):
    """A placement (or a parity run) asks for a backend that was not compiled into this ggml."""


class RpcServerError(PlacementError):
    """An RPC endpoint that is malformed, not loopback, or whose server does not answer."""


# ============================================================================================== backends

@dataclass(slots=True, frozen=True)
class _Family:
    """A ggml backend this project can build."""

    key: str          # lower-case name used on command lines: "cuda"
    registry: str     # ggml's registry name: "CUDA" (device names are registry + index, Metal: "MTL0")
    library: str      # the shared library that holds it: "ggml-cuda"
    build_hint: str   # how to get it built


FAMILIES: dict[str, _Family] = {
    "cpu": _Family("cpu", "CPU", "ggml-cpu", "python3 build.py"),
    "cuda": _Family("cuda", "CUDA", "ggml-cuda", "python3 build.py --cuda [--cuda-arch N]"),
    "metal": _Family("metal", "MTL", "ggml-metal", "python3 build.py --metal"),
    "vulkan": _Family("vulkan", "Vulkan", "ggml-vulkan", "python3 build.py --vulkan"),
    "rpc": _Family("rpc", "RPC", "ggml-rpc", "python3 build.py (RPC is built unless --no-rpc)"),
}


@dataclass(slots=True, frozen=True)
class BackendStatus:
    """Whether one backend family can be used here, and why not."""

    key: str                # "cpu", "cuda", "metal", "vulkan", "rpc"
    built: bool             # its registry is in this ggml
    devices: tuple[str, ...]  # names of its devices (RPC: none until a server is added)
    reason: str             # "" when usable; else why not, with the fix


def _registry_names() -> list[str]:
    return G.registries()


def _family_devices(fam: _Family) -> list[int]:
    """Device handles of a built family's registry (empty for RPC, whose devices come per server)."""
    if fam.key == "rpc":
        return []
    reg = G.ggml_backend_reg_by_name(fam.registry.encode())
    if not reg:
        return []
    return [G.ggml_backend_reg_dev_get(reg, i) for i in range(G.ggml_backend_reg_dev_count(reg))]


def _built(fam: _Family) -> bool:
    names = {n.lower() for n in _registry_names()}
    if fam.key == "rpc":
        return "rpc" in names and G.rpc_available()
    return fam.registry.lower() in names


def backend_status(key: str) -> BackendStatus:
    """Can backend ``key`` ("cpu", "cuda", "metal", "vulkan", "rpc") be used in this process?"""
    fam = _family(key)
    if not _built(fam):
        return BackendStatus(fam.key, False, (),
                             f"not built into this ggml (registries: {', '.join(_registry_names())}; "
                             f"libraries: {', '.join(G.LIBRARIES)}): rebuild with `{fam.build_hint}`")
    devs = tuple(_dev_name(d) for d in _family_devices(fam))
    if fam.key != "rpc" and not devs:
        return BackendStatus(fam.key, True, (), f"built, but ggml finds no {fam.registry} device on this machine")
    return BackendStatus(fam.key, True, devs, "")


def _family(key: str) -> _Family:
    fam = FAMILIES.get(key.strip().lower())
    if fam is None:
        raise PlacementError(f"unknown backend {key!r}; known: {', '.join(FAMILIES)}")
    return fam


# ============================================================================================== devices

@dataclass(slots=True, frozen=True)
class BufferTypeInfo:
    """A ggml buffer type (ggml_backend_buffer_type_t) and its properties."""

    ptr: int          # ggml_backend_buffer_type_t (owned by ggml, never freed)
    name: str         # "CPU", "CUDA0", "CUDA_Host", "RPC0[127.0.0.1:50052]"
    is_host: bool     # its memory can be read in place by the CPU
    alignment: int    # bytes
    max_size: int     # largest single buffer, bytes

    @classmethod
    def of(cls, buft: int) -> "BufferTypeInfo":
        return cls(buft, G.buft_name(buft), bool(G.ggml_backend_buft_is_host(buft)),
                   int(G.ggml_backend_buft_get_alignment(buft)), int(G.ggml_backend_buft_get_max_size(buft)))


@dataclass(slots=True, frozen=True)
class DeviceRef:
    """A resolved device of a placement; ``ptr`` is what KVCache's ``model.dev_layer(il)`` must give."""

    ptr: int                 # ggml_backend_dev_t (owned by its registry, never freed)
    name: str                # ggml's device name: "CPU", "CUDA0", "RPC0"
    spec: str                # the placement's name for it, normalised: "CPU", "CUDA0", "rpc://127.0.0.1:50052"
    kind: str                # backend family: "cpu", "cuda", "metal", "vulkan", "rpc", or the registry name
    endpoint: str | None = None  # "127.0.0.1:50052" for an RPC device

    @property
    def is_cpu(self) -> bool:
        return G.ggml_backend_dev_type(self.ptr) == G.DeviceType.CPU

    def buffer_type(self) -> int:
        """ggml_backend_dev_buffer_type: where this device's tensors (the KV cache) live."""
        return G.ggml_backend_dev_buffer_type(self.ptr)

    def host_buffer_type(self) -> int:
        """ggml_backend_dev_host_buffer_type (pinned host memory for transfers), 0 when the device has none."""
        return G.ggml_backend_dev_host_buffer_type(self.ptr) or 0


@dataclass(slots=True, frozen=True)
class DeviceInfo:
    """One device as :func:`list_devices` reports it."""

    ref: DeviceRef                          # handle, names, family
    description: str                        # e.g. the CPU or GPU model, or the RPC endpoint
    type: G.DeviceType                      # CPU, GPU, IGPU, ACCEL
    memory_free: int                        # bytes (0 when the device does not say)
    memory_total: int                       # bytes
    buffer_type: BufferTypeInfo             # default buffer type
    host_buffer_type: BufferTypeInfo | None  # pinned host buffer type, when the device offers one


def _dev_name(dev: int) -> str:
    return G.ggml_backend_dev_name(dev).decode("utf-8", "replace")


def _dev_kind(dev: int) -> str:
    """The family key of a device from its registry's name ("cpu", "cuda", ...; "rpc" for any RPC server)."""
    reg = G.ggml_backend_dev_backend_reg(dev)
    rname = G.ggml_backend_reg_name(reg).decode("utf-8", "replace") if reg else ""
    if rname.upper().startswith("RPC"):
        return "rpc"
    for fam in FAMILIES.values():
        if rname.lower() == fam.registry.lower():
            return fam.key
    return rname.lower() or "?"


def _ref(dev: int, spec: str | None = None, endpoint: str | None = None) -> DeviceRef:
    name = _dev_name(dev)
    kind = "rpc" if endpoint is not None else _dev_kind(dev)
    return DeviceRef(int(dev), name, spec or ("CPU" if kind == "cpu" else name), kind, endpoint)


def _device_info(ref: DeviceRef) -> DeviceInfo:
    free, total = G.dev_memory(ref.ptr)
    host = ref.host_buffer_type()
    return DeviceInfo(ref, G.ggml_backend_dev_description(ref.ptr).decode("utf-8", "replace"),
                      G.DeviceType(G.ggml_backend_dev_type(ref.ptr)), free, total, BufferTypeInfo.of(ref.buffer_type()),
                      BufferTypeInfo.of(host) if host else None)


def _registered_devices() -> list[int]:
    return [G.ggml_backend_dev_get(i) for i in range(G.ggml_backend_dev_count())]


def list_devices(rpc: Sequence[str] = ()) -> list[DeviceInfo]:
    """Every device of the built backends, then those of the RPC servers ``rpc`` ("rpc://127.0.0.1:PORT[/DEV]",
    each probed first); each with its buffer types and memory."""
    refs = [_ref(d) for d in _registered_devices()]
    seen = {r.ptr for r in refs}
    for spec in rpc:
        r = resolve_device(spec)
        if r.ptr not in seen:
            refs.append(r)
            seen.add(r.ptr)
    return [_device_info(r) for r in refs]


def resolve_device(spec: str, *, allow_remote: bool = False, probe_timeout: float = 2.0) -> DeviceRef:
    """The device named by ``spec``: "CPU", a ggml device name ("CUDA0", "MTL0", "Vulkan1"; any case), a backend
    name for its first device ("cuda", "metal", "vulkan"), or "rpc://127.0.0.1:PORT[/DEV]".

    BackendNotBuiltError when the backend is not in this ggml, DeviceNotFoundError when it has no such device,
    RpcServerError when an RPC server does not answer (or is not on the loopback without ``allow_remote``).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise DeviceNotFoundError(f"device spec must be a non-empty string, got {spec!r}")
    s = spec.strip()
    if s.lower().startswith(RPC_SCHEME):
        return _rpc_device(s, allow_remote=allow_remote, probe_timeout=probe_timeout)
    fam = FAMILIES.get(s.lower())
    if fam is not None and fam.key != "rpc":
        if not _built(fam):
            raise BackendNotBuiltError(f"device {spec!r}: backend {fam.key!r} was not built into this ggml "
                                       f"(built: {', '.join(_registry_names())}); rebuild with `{fam.build_hint}`")
        devs = _family_devices(fam)
        if not devs:
            raise DeviceNotFoundError(f"device {spec!r}: backend {fam.key!r} is built but ggml finds no "
                                      f"{fam.registry} device on this machine")
        return _ref(devs[0])
    if fam is not None:  # "rpc" alone
        raise RpcServerError(f"device {spec!r}: name an RPC server as rpc://127.0.0.1:PORT")
    for d in _registered_devices():
        if _dev_name(d).lower() == s.lower():
            return _ref(d)
    for endpoint, reg in _RPC_ADDED.items():  # "RPC0": a device of a server added in this process
        for i in range(G.ggml_backend_reg_dev_count(reg)):
            d = G.ggml_backend_reg_dev_get(reg, i)
            if _dev_name(d).lower() == s.lower():  # probed again: the server may have gone since
                return _rpc_device(_rpc_spec(endpoint, i), allow_remote=True, probe_timeout=probe_timeout)
    known = [_dev_name(d) for d in _registered_devices()]
    for fam in FAMILIES.values():
        prefix = fam.registry.lower()
        if s.lower().startswith(prefix) and s[len(prefix):].isdigit() and not _built(fam):
            raise BackendNotBuiltError(f"device {spec!r}: backend {fam.key!r} was not built into this ggml "
                                       f"(built: {', '.join(_registry_names())}); rebuild with `{fam.build_hint}`")
    raise DeviceNotFoundError(f"no ggml device {spec!r}; devices: {', '.join(known)} (and rpc://HOST:PORT for an "
                              f"RPC server)")


# ============================================================================================== RPC

@dataclass(slots=True, frozen=True)
class RpcServerInfo:
    """What :func:`probe_rpc` learnt from a server."""

    endpoint: str                            # "127.0.0.1:50052"
    version: tuple[int, int, int] | None     # its RPC protocol version (None: handshake skipped)
    n_devices: int | None                    # devices it serves (None: handshake skipped)


# endpoint -> ggml_backend_reg_t of the servers added in this process (ggml keeps them for the process's life)
_RPC_ADDED: dict[str, int] = {}


def _normalise_host(host: str) -> str:
    return "127.0.0.1" if host.lower() == "localhost" else host


def _check_host(host: str, allow_remote: bool, what: str) -> None:
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        raise RpcServerError(f"{what}: host {host!r} is not an IPv4 address (ggml's RPC takes dotted IPv4, "
                             f"e.g. 127.0.0.1)") from None
    if addr.version != 4:
        raise RpcServerError(f"{what}: host {host!r} is IPv6; ggml's RPC speaks IPv4 only (use 127.0.0.1)")
    if not addr.is_loopback and not allow_remote:
        raise RpcServerError(f"{what}: host {host} is not a loopback address; ggml's RPC has no authentication "
                             f"or encryption, so only 127.0.0.0/8 is allowed unless explicitly permitted "
                             f"(allow_remote / --allow-remote)")


def parse_rpc_spec(spec: str, allow_remote: bool = False) -> tuple[str, int]:
    """("host:port", device index) of "rpc://host:port[/dev]" (or "host:port[/dev]")."""
    s = spec.strip()
    body = s[len(RPC_SCHEME):] if s.lower().startswith(RPC_SCHEME) else s
    addr, _, dev = body.partition("/")
    host, sep, port_s = addr.rpartition(":")
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise RpcServerError(f"RPC spec {spec!r}: expected rpc://HOST:PORT[/DEVICE] with a port in 1..65535")
    if dev and not dev.isdigit():
        raise RpcServerError(f"RPC spec {spec!r}: device index {dev!r} must be a number")
    host = _normalise_host(host)
    _check_host(host, allow_remote, f"RPC spec {spec!r}")
    return f"{host}:{int(port_s)}", int(dev or 0)


def _rpc_spec(endpoint: str, index: int) -> str:
    return f"{RPC_SCHEME}{endpoint}" + (f"/{index}" if index else "")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the server closed the connection")
        buf += chunk
    return bytes(buf)


def probe_rpc(endpoint: str, timeout: float = 2.0, handshake: bool = True) -> RpcServerInfo:
    """Check that a ggml RPC server answers at endpoint ("host:port"), with Python sockets and a timeout.

    Connects; with ``handshake`` also sends HELLO and DEVICE_COUNT as ggml's client does and checks the protocol
    version.  ggml's own client aborts the process on a server that accepts but does not speak its protocol and
    crashes on one that has gone away, so this runs first.  The server serves one client at a time: while this
    process holds a connection to it, only a connect (``handshake=False``) answers.  RpcServerError on failure.
    """
    host, _, port_s = endpoint.rpartition(":")
    port = int(port_s)
    where = f"RPC server {endpoint}"
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except ConnectionRefusedError:
        raise RpcServerError(f"{where} does not answer: connection refused (nothing listens on port {port}; "
                             f"start one with `python -m kvcache_ggml rpc-server --port {port}`)") from None
    except (socket.timeout, TimeoutError):
        raise RpcServerError(f"{where} does not answer: no connection within {timeout:g} s") from None
    except OSError as e:
        raise RpcServerError(f"{where} does not answer: {e.strerror or e}") from None
    with sock:
        if not handshake:
            return RpcServerInfo(endpoint, None, None)
        try:
            sock.sendall(struct.pack("<BQ", _RPC_CMD_HELLO, _RPC_CONN_CAPS_SIZE) + bytes(_RPC_CONN_CAPS_SIZE))
            (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
            if size != _RPC_HELLO_RSP_SIZE:
                raise RpcServerError(f"{where} answered HELLO with {size} bytes, expected {_RPC_HELLO_RSP_SIZE}: "
                                     f"not a ggml RPC server of this version")
            major, minor, patch = _recv_exact(sock, _RPC_HELLO_RSP_SIZE)[:3]
            if major != _RPC_PROTO_MAJOR or minor > _RPC_PROTO_MINOR:
                raise RpcServerError(f"{where} speaks RPC protocol {major}.{minor}.{patch}; this ggml speaks "
                                     f"{_RPC_PROTO_MAJOR}.{_RPC_PROTO_MINOR}.x")
            sock.sendall(struct.pack("<BQ", _RPC_CMD_DEVICE_COUNT, 0))
            (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
            if size != 4:
                raise RpcServerError(f"{where} answered DEVICE_COUNT with {size} bytes, expected 4")
            (n_dev,) = struct.unpack("<I", _recv_exact(sock, 4))
        except (socket.timeout, TimeoutError):
            raise RpcServerError(f"{where} accepted the connection but did not answer the handshake within "
                                 f"{timeout:g} s (busy with another client? a ggml RPC server serves one client "
                                 f"at a time)") from None
        except (ConnectionError, OSError) as e:
            raise RpcServerError(f"{where} broke off the handshake: {e}") from None
    return RpcServerInfo(endpoint, (major, minor, patch), n_dev)


def _rpc_device(spec: str, *, allow_remote: bool, probe_timeout: float) -> DeviceRef:
    endpoint, index = parse_rpc_spec(spec, allow_remote)
    if not _built(FAMILIES["rpc"]):
        raise BackendNotBuiltError(f"device {spec!r}: the RPC backend was not built into this ggml; rebuild with "
                                   f"`{FAMILIES['rpc'].build_hint}`")
    known = endpoint in _RPC_ADDED
    # a server this process already uses may be busy serving this very process: then a connect is the only probe
    info = probe_rpc(endpoint, probe_timeout, handshake=not known)
    if info.n_devices is not None and not index < info.n_devices:
        raise DeviceNotFoundError(f"device {spec!r}: the RPC server at {endpoint} serves {info.n_devices} "
                                  f"device(s), no device {index}")
    reg = _RPC_ADDED.get(endpoint)
    if reg is None:
        try:
            reg = G.rpc_add_server(endpoint)
        except RuntimeError as e:
            raise RpcServerError(f"device {spec!r}: ggml could not add the RPC server: {e}") from None
        _RPC_ADDED[endpoint] = reg
    n = G.ggml_backend_reg_dev_count(reg)
    if not index < n:
        raise DeviceNotFoundError(f"device {spec!r}: the RPC server at {endpoint} serves {n} device(s), "
                                  f"no device {index}")
    return _ref(G.ggml_backend_reg_dev_get(reg, index), _rpc_spec(endpoint, index), endpoint)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class LocalRpcServer:
    """An RPC server subprocess started by :func:`local_rpc_server`."""

    port: int                        # TCP port on 127.0.0.1
    endpoint: str                    # "127.0.0.1:PORT"
    spec: str                        # "rpc://127.0.0.1:PORT", for placements
    process: subprocess.Popen        # the server process (stopped when the context exits)
    log: Any                         # its stdout and stderr (a temporary file)

    def output(self) -> str:
        """What the server printed so far."""
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")


@contextlib.contextmanager
def local_rpc_server(port: int | None = None, threads: int = 1, start_timeout: float = 30.0,
                     python: str | None = None) -> Iterator[LocalRpcServer]:
    """Start ``python -m kvcache_ggml rpc-server`` on 127.0.0.1 in a subprocess, wait until it answers the
    handshake, yield it, and always stop it (terminate, then kill) on exit -- and on Linux also when this process
    dies without running the exit (a ggml abort): the server gets SIGTERM from the kernel.

    ``port`` None picks a free port (retrying with another if it is taken meanwhile).
    """
    attempts = 1 if port is not None else 3
    for attempt in range(attempts):
        p = port if port is not None else free_port()
        log = tempfile.TemporaryFile()
        cmd = [python or sys.executable, "-m", "kvcache_ggml", "rpc-server", "--host", "127.0.0.1", "--port", str(p),
               "--threads", str(threads)]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        server = LocalRpcServer(p, f"127.0.0.1:{p}", f"{RPC_SCHEME}127.0.0.1:{p}", proc, log)
        try:
            _wait_ready(server, start_timeout)
        except BaseException as e:
            _stop(server)
            if isinstance(e, RpcServerError) and "port" in str(e) and attempt + 1 < attempts:
                continue  # the free port was taken meanwhile
            raise
        try:
            yield server
        finally:
            _stop(server)
        return


def _die_with_parent() -> None:
    """Popen preexec_fn (Linux): SIGTERM to the server when the thread that started it dies -- even by an abort
    that skips every ``finally`` -- so that no server outlives its test."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _wait_ready(server: LocalRpcServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        rc = server.process.poll()
        if rc is not None:
            out = server.output().strip()
            tail = "\n".join(out.splitlines()[-10:])
            raise RpcServerError(f"the RPC server on port {server.port} exited with code {rc} before answering:"
                                 f"\n{tail}")
        try:
            probe_rpc(server.endpoint, timeout=1.0)
            return
        except RpcServerError:
            if time.monotonic() > deadline:
                raise RpcServerError(f"the RPC server on port {server.port} did not answer within {timeout:g} s; "
                                     f"output:\n{server.output().strip()}") from None
            time.sleep(0.05)


def _stop(server: LocalRpcServer) -> None:
    proc = server.process
    try:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
    finally:
        server.log.close()


def main_rpc_server(argv: list[str]) -> int:
    """``python -m kvcache_ggml rpc-server``: serve ggml devices (the CPU by default) over ggml's RPC protocol."""
    ap = argparse.ArgumentParser(
        prog="python -m kvcache_ggml rpc-server",
        description="Serve ggml devices over ggml's RPC protocol (ggml_backend_rpc_start_server) until stopped. "
                    "The protocol has no authentication: only loopback addresses are accepted unless "
                    "--allow-remote. One client is served at a time.")
    ap.add_argument("--host", default="127.0.0.1", help="IPv4 address to listen on (default: %(default)s)")
    ap.add_argument("--port", type=int, default=RPC_DEFAULT_PORT, help="TCP port (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1),
                    help="CPU backend threads (default: %(default)s)")
    ap.add_argument("--device", action="append", default=None, metavar="NAME",
                    help="ggml device to serve, repeatable (default: CPU)")
    ap.add_argument("--cache-dir", default=None, help="ggml's local tensor cache directory (default: none)")
    ap.add_argument("--allow-remote", action="store_true",
                    help="allow a non-loopback --host (exposes the machine to anyone who can reach the port)")
    args = ap.parse_args(argv)
    host = _normalise_host(args.host)
    try:
        _check_host(host, args.allow_remote, "rpc-server")
    except RpcServerError as e:
        ap.error(str(e))
    if not 0 < args.port < 65536:
        ap.error(f"--port must be in 1..65535, got {args.port}")
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    if not _built(FAMILIES["rpc"]):
        print(f"rpc-server: error: the RPC backend was not built into this ggml; rebuild with "
              f"`{FAMILIES['rpc'].build_hint}`", file=sys.stderr)
        return 2
    devs = []
    for name in args.device or ["CPU"]:
        try:
            devs.append(G.device(name))
        except ValueError as e:
            ap.error(str(e))
    # ggml only prints "Failed to create server socket" when the port is taken: check it here first
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, args.port))
        except OSError as e:
            print(f"rpc-server: error: cannot listen on {host}:{args.port}: {e.strerror or e} (port in use?)",
                  file=sys.stderr)
            return 2
    endpoint = f"{host}:{args.port}"
    print(f"rpc-server: serving {', '.join(d.name for d in devs)} on {endpoint} with {args.threads} thread(s)",
          flush=True)
    try:
        G.rpc_start_server(endpoint, devs, args.threads, args.cache_dir)  # blocks while serving
    except KeyboardInterrupt:
        return 130
    print(f"rpc-server: error: ggml's RPC server on {endpoint} stopped (see its messages above)", file=sys.stderr)
    return 1


# ============================================================================================== placement

def assign_layers(n_layer: int, n_devices: int, n_gpu_layers: int = -1,
                  splits: Sequence[float] | None = None) -> list[int]:
    """Device index of layers 0..n_layer (index n_layer is the output layer); -1 means the CPU.

    llama_model::load_tensors: ``n_gpu_layers`` < 0 offloads all n_layer + 1 layers; the last ``n_gpu_layers``
    layers (counting the output layer) go to the devices; ``splits`` (one weight per device, None or all zero:
    equal weights) are accumulated and normalised in float32, and layer il goes to the first device whose
    cumulative share is greater than (il - i_gpu_start) / act_gpu_layers.
    """
    if n_layer < 1:
        raise PlacementError(f"n_layer must be >= 1, got {n_layer}")
    if n_gpu_layers < -1:
        raise PlacementError(f"n_gpu_layers must be >= -1 (-1: all), got {n_gpu_layers}")
    ngl = n_layer + 1 if n_gpu_layers < 0 else n_gpu_layers
    if n_devices == 0:
        return [-1] * (n_layer + 1)
    w = np.ones(n_devices, np.float32) if splits is None else np.asarray(splits, np.float32)
    if w.shape != (n_devices,):
        raise PlacementError(f"splits has {w.size} entries for {n_devices} devices")
    if not np.all(np.isfinite(w)) or (w < 0).any():
        raise PlacementError(f"splits must be finite and >= 0, got {list(map(float, w))}")
    if not w.any():
        w = np.ones(n_devices, np.float32)
    cum = np.empty(n_devices, np.float32)
    total = np.float32(0)
    for i in range(n_devices):  # float split_sum += splits[i]
        total = np.float32(total + w[i])
        cum[i] = total
    cum = (cum / total).astype(np.float32)
    i_gpu_start = max(n_layer + 1 - ngl, 0)
    act = min(ngl, n_layer + 1)
    out = []
    for il in range(n_layer + 1):
        if il < i_gpu_start or il - i_gpu_start >= act:
            out.append(-1)
            continue
        frac = np.float32(np.float32(il - i_gpu_start) / np.float32(act))
        out.append(min(int(np.searchsorted(cum, frac, side="right")), n_devices - 1))
    return out


@dataclass(slots=True, frozen=True)
class Placement:
    """Which device holds each layer, as llama.cpp's model devices, ``n_gpu_layers`` and ``tensor_split``.

    ``devices`` () keeps everything on the CPU.  Otherwise the last ``n_gpu_layers`` layers (-1: all, counting
    llama.cpp's output layer) are spread over ``devices`` in order, in shares ``tensor_split`` (one weight per
    device; () or all zero: by each device's free memory, as llama.cpp).  ``layers`` instead gives the device of
    every layer explicitly (and wins over the split).
    """

    devices: tuple[str, ...] = ()          # device specs in split order: "CUDA0", "rpc://127.0.0.1:50052", ...
    n_gpu_layers: int = -1                 # layers offloaded, the output layer counted; -1 = all
    tensor_split: tuple[float, ...] = ()   # weight per device; () = by free memory
    layers: tuple[str, ...] = ()           # explicit device spec per layer ("CPU" allowed); () = use the split

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "tensor_split", tuple(float(x) for x in self.tensor_split))
        object.__setattr__(self, "layers", tuple(self.layers))
        if self.n_gpu_layers < -1:
            raise PlacementError(f"n_gpu_layers must be >= -1 (-1: all layers), got {self.n_gpu_layers}")
        if self.tensor_split and len(self.tensor_split) != len(self.devices):
            raise PlacementError(f"tensor_split has {len(self.tensor_split)} entries for {len(self.devices)} "
                                 f"devices {list(self.devices)}")
        bad = [x for x in self.tensor_split if not math.isfinite(x) or x < 0]
        if bad:
            raise PlacementError(f"tensor_split entries must be finite and >= 0, got {list(self.tensor_split)}")
        norm = [d.strip().lower() for d in self.devices]
        dup = sorted({d for d in norm if norm.count(d) > 1})
        if dup:
            raise PlacementError(f"device listed twice in placement: {', '.join(dup)}")
        if "cpu" in norm:
            raise PlacementError("'CPU' is not an offload device: layers not offloaded stay on the CPU "
                                 "(use n_gpu_layers, or `layers` for an explicit per-layer list)")

    @classmethod
    def cpu(cls) -> "Placement":
        """Every layer on the CPU."""
        return cls()

    @classmethod
    def single(cls, device: str) -> "Placement":
        """Every layer on one device ("CPU": the same as :meth:`cpu`)."""
        return cls() if device.strip().lower() == "cpu" else cls(devices=(device,))

    @classmethod
    def split(cls, devices: Sequence[str], tensor_split: Sequence[float] = (), n_gpu_layers: int = -1) -> "Placement":
        """Layer ranges over several devices (llama.cpp's ``--tensor-split`` with ``--split-mode layer``)."""
        return cls(devices=tuple(devices), tensor_split=tuple(tensor_split), n_gpu_layers=n_gpu_layers)

    @classmethod
    def per_layer(cls, layers: Sequence[str]) -> "Placement":
        """An explicit device spec for every layer ("CPU" or any device spec)."""
        return cls(layers=tuple(layers))

    def describe(self) -> str:
        if self.layers:
            return f"per layer: {', '.join(self.layers)}"
        if not self.devices:
            return "all on CPU"
        split = f", split {list(self.tensor_split)}" if self.tensor_split else ""
        ngl = "all layers" if self.n_gpu_layers < 0 else f"{self.n_gpu_layers} layers"
        return f"{ngl} on {', '.join(self.devices)}{split}"


class PlacedModel:
    """A model as KVCache sees it (``hparams`` and ``dev_layer(il)``), from a :class:`Placement`.

    Construction resolves every device (backend built, device present, RPC server answering) and assigns every
    layer: all errors come here, before any memory is allocated.  It owns no native handle (devices belong to
    ggml's registries); :meth:`backends` creates the owner of backends and scheduler.
    """

    __slots__ = ("hparams", "placement", "devices", "layer_devices", "output_device")

    def __init__(self, hparams: Any, placement: Placement | None = None, *, allow_remote: bool = False,
                 probe_timeout: float = 2.0) -> None:
        placement = placement if placement is not None else Placement.cpu()
        n_layer = int(hparams.n_layer)
        self.hparams = hparams              # the model's hyper-parameters
        self.placement = placement          # what was asked for
        cpu = _ref(G.ggml_backend_dev_by_type(G.DeviceType.CPU))
        resolved: dict[str, DeviceRef] = {}

        def get(spec: str) -> DeviceRef:
            key = spec.strip().lower()
            if key == "cpu":
                return cpu
            if key not in resolved:
                resolved[key] = resolve_device(spec, allow_remote=allow_remote, probe_timeout=probe_timeout)
            return resolved[key]

        if placement.layers:
            if len(placement.layers) != n_layer:
                raise PlacementError(f"placement lists {len(placement.layers)} layer devices for a model of "
                                     f"{n_layer} layers")
            per = [get(s) for s in placement.layers]
            self.devices = tuple(dict.fromkeys(r for r in per if not r.is_cpu))
            self.layer_devices = tuple(per)
            self.output_device = per[-1]
            return
        devs = tuple(get(s) for s in placement.devices)
        ptrs = [d.ptr for d in devs]
        if len(set(ptrs)) != len(ptrs):
            raise PlacementError(f"placement devices {list(placement.devices)} name the same device twice")
        splits = list(placement.tensor_split) if any(placement.tensor_split) else [_free_memory(d, cpu) for d in devs]
        idx = assign_layers(n_layer, len(devs), placement.n_gpu_layers, splits if devs else None)
        per = [cpu if i < 0 else devs[i] for i in idx]
        self.devices = devs                  # resolved placement devices, in split order
        self.layer_devices = tuple(per[:n_layer])  # device of each layer
        self.output_device = per[n_layer]    # llama.cpp's output layer device (unused by the cache)

    def dev_layer(self, il: int) -> DeviceRef:
        """The device of layer il (llama_model::dev_layer); ``.ptr`` is the ggml_backend_dev_t."""
        if not 0 <= il < len(self.layer_devices):
            raise IndexError(f"layer {il} out of range [0, {len(self.layer_devices)})")
        return self.layer_devices[il]

    def dev_output(self) -> DeviceRef:
        return self.output_device

    def used_devices(self) -> list[DeviceRef]:
        """The non-CPU devices that hold at least one layer, in placement order."""
        used = {d.ptr for d in self.layer_devices}
        return [d for d in self.devices if d.ptr in used]

    def layer_map(self) -> list[str]:
        """The spec of each layer's device: ["CPU", "CPU", "rpc://127.0.0.1:50052", ...]."""
        return [d.spec for d in self.layer_devices]

    def input_buffer_type(self) -> int:
        """Where graph inputs go: the host buffer type of the first placement device that has one (pinned
        memory, as llama_context gives the CPU backend), else the CPU buffer type."""
        for d in self.devices:
            host = d.host_buffer_type()
            if host:
                return host
        return G.cpu_buffer_type()

    def backends(self, n_threads: int | None = None, graph_size: int = G.GGML_DEFAULT_GRAPH_SIZE,
                 op_offload: bool = False) -> "Backends":
        """A new :class:`Backends` over the devices holding layers plus the CPU (the caller closes it)."""
        return Backends(self.used_devices(), n_threads=n_threads, graph_size=graph_size, op_offload=op_offload,
                        host_buft=self.input_buffer_type())

    def __repr__(self) -> str:
        return f"<PlacedModel {self.hparams.n_layer} layers: {', '.join(self.layer_map())}>"


def _free_memory(dev: DeviceRef, cpu: DeviceRef) -> float:
    """llama.cpp's default split weight: the device's free memory, the host's when the device reports none."""
    free, total = G.dev_memory(dev.ptr)
    if free == 0 and total == 0:
        free, total = G.dev_memory(cpu.ptr)
    return float(free)


# ============================================================================================== backends + sched

class _Sched(G.Sched):
    """G.Sched created with explicit buffer types per backend (ggml_backend_sched_new's ``bufts``)."""

    __slots__ = ()

    def __init__(self, backends: list[G.Backend], bufts: list[int], graph_size: int, parallel: bool,
                 op_offload: bool) -> None:
        if not backends or not backends[-1].is_cpu:
            raise ValueError("a scheduler needs backends with the CPU backend last")
        if len(bufts) != len(backends):
            raise ValueError(f"{len(bufts)} buffer types for {len(backends)} backends")
        n = len(backends)
        arr = (ctypes.c_void_p * n)(*(b.ptr for b in backends))
        barr = (ctypes.c_void_p * n)(*bufts)
        super(G.Sched, self).__init__(G.ggml_backend_sched_new(arr, barr, n, graph_size, parallel, op_offload))
        self.backends = list(backends)


class Backends:
    """Owner of one ggml backend per device (in order), the CPU backend (last) and a scheduler over them.

    The CPU backend's buffer type in the scheduler is ``host_buft`` when given (the first device's pinned host
    memory, as llama_context does), so graph inputs land in memory both the CPU and the device reach quickly.
    ``close()`` frees the scheduler, then the backends.
    """

    __slots__ = ("devices", "backends", "cpu", "sched", "graph_size", "host_buft", "__weakref__")

    def __init__(self, devices: Sequence[DeviceRef] = (), *, n_threads: int | None = None,
                 graph_size: int = G.GGML_DEFAULT_GRAPH_SIZE, op_offload: bool = False,
                 host_buft: int | None = None) -> None:
        self.devices = [d for d in devices if not d.is_cpu]  # the non-CPU devices, one backend each
        self.backends: list[G.Backend] = []                # their backends, then the CPU's
        self.graph_size = int(graph_size)                  # node capacity of the scheduler
        self.host_buft = host_buft or G.cpu_buffer_type()  # buffer type of the CPU backend in the scheduler
        self.sched: G.Sched | None = None
        try:
            for d in self.devices:
                ptr = G.ggml_backend_dev_init(d.ptr, None)
                if not ptr:
                    raise RuntimeError(f"ggml could not initialise a backend for device {d.name} ({d.spec})")
                self.backends.append(G.Backend(ptr))
            self.cpu = G.Backend.cpu(n_threads)            # the CPU backend (also in self.backends, last)
            self.backends.append(self.cpu)
            bufts = [b.default_buffer_type for b in self.backends[:-1]] + [self.host_buft]
            self.sched = _Sched(self.backends, bufts, self.graph_size, False, op_offload)
        except BaseException:
            self.close()
            raise

    def names(self) -> list[str]:
        return [b.name for b in self.backends]

    def set_n_threads(self, n_threads: int) -> None:
        self.cpu.set_n_threads(n_threads)

    def update_context(self, cparams: Any = None, hparams: Any = None) -> Any:
        """An UpdateContext (for KVCache.update / the K-shift) on this scheduler; it does not own the scheduler."""
        from .cache import UpdateContext
        from .cparams import CParams
        if cparams is None:
            if hparams is None:
                raise ValueError("update_context needs cparams or hparams")
            cparams = CParams.from_hparams(hparams)
        return UpdateContext(self.sched, cparams, self.graph_size)

    def compute(self, graph: G.Graph, fill: Any = None) -> None:
        """Reset, allocate ``graph`` on the scheduler, call ``fill()`` (write the inputs), compute, synchronize.

        The graph's tensors stay allocated until the next reset/compute: read the outputs first."""
        s = self._sched()
        s.reset()
        s.alloc_graph(graph)
        if fill is not None:
            fill()
        s.compute(graph)
        G.ggml_backend_sched_synchronize(s.ptr)

    def reset(self) -> None:
        self._sched().reset()

    def _sched(self) -> G.Sched:
        if self.sched is None or self.sched.closed:
            raise ValueError("Backends is closed")
        return self.sched

    def close(self) -> None:
        """Free the scheduler, then the backends (idempotent)."""
        if self.sched is not None:
            self.sched.close()
            self.sched = None
        for b in reversed(self.backends):
            b.close()
        self.backends = []

    def __enter__(self) -> "Backends":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Backends {', '.join(self.names()) or 'closed'}>"

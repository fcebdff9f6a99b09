"""ggml's RPC backend: ``rpc://HOST:PORT[/DEV]`` specs, a probe that answers before ggml touches a server,
and a loopback server (:func:`local_rpc_server`, ``python -m kvcache_ggml rpc-server``)."""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import ipaddress
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Iterator


from .. import ggml as G
from ._devices import FAMILIES, BackendNotBuiltError, DeviceNotFoundError, DeviceRef, RpcServerError, _built, _ref


RPC_SCHEME = "rpc://"
RPC_DEFAULT_PORT = 50052  # ggml's rpc-server default
# ggml-rpc.h / ggml-rpc.cpp: the protocol version this ggml speaks and the HELLO / DEVICE_COUNT messages
_RPC_PROTO_MAJOR, _RPC_PROTO_MINOR = 4, 0
_RPC_CMD_HELLO, _RPC_CMD_DEVICE_COUNT = 14, 15
_RPC_CONN_CAPS_SIZE = 24  # transport.h
_RPC_HELLO_RSP_SIZE = 4 + _RPC_CONN_CAPS_SIZE  # major, minor, patch, padding, conn_caps


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
    # (ASCII digits: str.isdigit also takes '²', which int() refuses)
    if not sep or not host or not (port_s.isascii() and port_s.isdigit()) or not 0 < int(port_s) < 65536:
        raise RpcServerError(f"RPC spec {spec!r}: expected rpc://HOST:PORT[/DEVICE] with a port in 1..65535")
    if dev and not (dev.isascii() and dev.isdigit()):
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

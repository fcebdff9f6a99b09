"""Where the layers live: naming devices (:func:`resolve_device`, :func:`list_devices`), llama.cpp's layer
assignment (:func:`assign_layers`), :class:`Placement`, :class:`PlacedModel`, and :class:`Backends` (one ggml backend
per used device, the CPU backend and a scheduler over them)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .. import ggml as G
from ._devices import (FAMILIES, BackendNotBuiltError, DeviceInfo, DeviceNotFoundError, DeviceRef, PlacementError,
                       _built, _dev_name, _device_info, _family_devices, _ref, _registered_devices, _registry_names)
from ._rpc import _RPC_ADDED, RPC_SCHEME, RpcServerError, _rpc_device, _rpc_spec


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
            self.sched = G.Sched(self.backends, self.graph_size, False, op_offload, bufts=bufts)
        except BaseException:
            self.close()
            raise

    def names(self) -> list[str]:
        return [b.name for b in self.backends]

    def set_n_threads(self, n_threads: int) -> None:
        self.cpu.set_n_threads(n_threads)

    def update_context(self, cparams: Any = None, hparams: Any = None) -> Any:
        """An UpdateContext (for KVCache.update / the K-shift) on this scheduler; it does not own the scheduler."""
        from ..cache import UpdateContext
        from ..cparams import CParams
        if cparams is None:
            if hparams is None:
                raise ValueError("update_context needs cparams or hparams")
            cparams = CParams.from_hparams(hparams)
        return UpdateContext(self.sched, cparams, self.graph_size)

    def compute(self, graph: G.Graph, fill: Any = None) -> None:
        """Reset, allocate ``graph`` on the scheduler, call ``fill()`` (write the inputs), compute, synchronize.

        The graph's tensors stay allocated until the next reset/compute: read the outputs first.  RpcServerLostError
        when an RPC server of these backends stopped answering meanwhile (then call ``check_rpc`` of the KV caches
        on it: they mark themselves lost)."""
        s = self._sched()
        remote = [d for d in self.devices if d.endpoint]
        endpoints = [d.endpoint for d in remote]
        n0 = G.rpc_failure_count() if remote else 0
        try:
            s.reset()
            s.alloc_graph(graph)
            if fill is not None:
                fill()
            s.compute(graph)
            G.ggml_backend_sched_synchronize(s.ptr)
            for d in remote:
                # ggml sends an RPC graph without waiting (its synchronize does nothing): a round trip on the
                # same connection waits for the server to finish it, and finds a server that is gone
                G.dev_memory(d.ptr)
        except (RuntimeError, MemoryError):
            self._raise_lost(endpoints, n0)
            raise
        self._raise_lost(endpoints, n0)

    @staticmethod
    def _raise_lost(endpoints: list[str], n0: int) -> None:
        """RpcServerLostError if an exchange failed since ``n0`` and a connection to one of ``endpoints`` broke."""
        if endpoints and G.rpc_failure_count() != n0:
            dead = tuple(e for e in endpoints if G.ggml_backend_rpc_endpoint_status(e.encode()) == 1)
            if dead:
                raise G.lost_error("a graph computed by Backends", dead)

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

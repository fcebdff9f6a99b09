"""Backends and devices: the error types, the backend families built into this ggml, and what each device
offers (buffer types, memory)."""
from __future__ import annotations

from dataclasses import dataclass


from .. import ggml as G


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

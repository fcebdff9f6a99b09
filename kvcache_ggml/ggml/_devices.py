"""Versions, backend registries and devices known to ggml, and the RPC entry points when RPC is built."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from ._calls import CALLS as _F, FAST, WHY_NO_FAST
from ._lib import DEFINED_IN, GGML_PYTHON_VERSION, LIBRARIES, has
from ._owners import dev_memory
from ._rpc import rpc_status_api
from ._types import DeviceType, _cstr


@dataclass(slots=True, frozen=True)
class Device:
    ptr: int  # ggml_backend_dev_t
    name: str  # "CPU", "RPC0", "CUDA0", ...
    description: str  # e.g. the CPU model
    type: DeviceType  # CPU, GPU, IGPU, ACCEL, META
    memory_free: int  # bytes
    memory_total: int  # bytes
    registry: str  # name of the backend registry it belongs to ("CPU", "RPC", ...)


def version() -> str:
    """ggml's version string (ggml_version)."""
    return _cstr(_F["ggml_version"]())


def commit() -> str:
    return _cstr(_F["ggml_commit"]())


def registries() -> list[str]:
    """Names of the registered backends ("RPC", "CPU", ...)."""
    return [_cstr(_F["ggml_backend_reg_name"](_F["ggml_backend_reg_get"](i)))
            for i in range(_F["ggml_backend_reg_count"]())]


def _device(dev: int) -> Device:
    free, total = dev_memory(dev)
    return Device(ptr=dev, name=_cstr(_F["ggml_backend_dev_name"](dev)),
                  description=_cstr(_F["ggml_backend_dev_description"](dev)),
                  type=DeviceType(_F["ggml_backend_dev_type"](dev)), memory_free=free, memory_total=total,
                  registry=_cstr(_F["ggml_backend_reg_name"](_F["ggml_backend_dev_backend_reg"](dev))))


def devices() -> list[Device]:
    return [_device(_F["ggml_backend_dev_get"](i)) for i in range(_F["ggml_backend_dev_count"]())]


def device(name: str) -> Device:
    dev = _F["ggml_backend_dev_by_name"](name.encode())
    if not dev:
        raise ValueError(f"no ggml device named {name!r}; devices: {', '.join(d.name for d in devices())}")
    return _device(dev)


def rpc_available() -> bool:
    return has("ggml_backend_rpc_add_server")


def _need_rpc() -> None:
    if not rpc_available():
        raise RuntimeError("ggml was built without RPC: rebuild with `python3 build.py --rpc`")
    if not rpc_status_api():
        raise RuntimeError("this ggml's RPC client aborts the process when a server dies (built without "
                           "build.py's RPC patches): rebuild with `python3 build.py`")


def rpc_add_server(endpoint: str) -> int:
    """Register the RPC server at endpoint ("host:port"); returns its ggml_backend_reg_t."""
    _need_rpc()
    reg = _F["ggml_backend_rpc_add_server"](endpoint.encode())
    if not reg:
        raise RuntimeError(f"cannot add the RPC server {endpoint!r}")
    return reg


def rpc_start_server(endpoint: str, devs: list[Device], n_threads: int = 1, cache_dir: str | None = None) -> None:
    """Serve devs over RPC at endpoint; blocks for the life of the process (run it in a subprocess)."""
    _need_rpc()
    if not devs:
        raise ValueError("rpc_start_server needs at least one device")
    arr = (ctypes.c_void_p * len(devs))(*(d.ptr for d in devs))
    _F["ggml_backend_rpc_start_server"](endpoint.encode(), None if cache_dir is None else cache_dir.encode(),
                                        n_threads, len(devs), arr)


def summary_lines() -> list[str]:
    """What is built: versions, libraries, backends, devices."""
    lines = [f"ggml {version()} (commit {commit()}) through ggml-python {GGML_PYTHON_VERSION}",
             f"libraries: {', '.join(LIBRARIES)}",
             f"backends: {', '.join(registries())}"]
    for d in devices():
        gib = 2**30
        mem = f"{d.memory_free / gib:.1f}/{d.memory_total / gib:.1f} GiB free" if d.memory_total else "no memory info"
        lines.append(f"device {d.name}: {d.type.name}, {d.description}, {mem}")
    lines.append(f"binding table: {len(_F)} C functions ({sum(1 for n in DEFINED_IN if 'rpc' in n)} RPC), "
                 + (f"{len(FAST)} of them compiled (cffi)" if FAST else f"all through ctypes: {WHY_NO_FAST}"))
    return lines


# ggml_backend_buffer_type_t * (*ggml_backend_dev_get_extra_bufts_t)(ggml_backend_dev_t device)
_GetExtraBufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)


def extra_bufts(dev: int) -> list[int]:
    """The extra buffer types of a device's registry (``ggml_backend_dev_get_extra_bufts``): for the CPU, the
    repacked-weight layouts (``CPU_REPACK``, AMX, KleidiAI where built), in ggml's order of preference."""
    reg = _F["ggml_backend_dev_backend_reg"](dev)
    addr = _F["ggml_backend_reg_get_proc_address"](reg, b"ggml_backend_dev_get_extra_bufts")
    if not addr:
        return []
    arr = _GetExtraBufts(addr)(dev)
    out: list[int] = []
    i = 0
    while arr and arr[i]:
        out.append(int(arr[i]))
        i += 1
    return out


def weight_op_supported(dev: int, buft: int, wtype: int, ne: tuple[int, ...], op: str) -> bool:
    """Whether ``dev`` can run ``op`` ("MUL_MAT", "GET_ROWS", "MUL" or "ADD") on a weight of type wtype and shape ne stored
    in a buffer of type ``buft`` (llama.cpp's weight_buft_supported: a dummy op over 512 tokens and a size-0
    buffer of that type, asked with ggml_backend_dev_supports_op)."""
    from ._owners import Context
    from ._tensor import new_tensor, set_buffer
    ne4 = tuple(ne) + (1,) * (4 - len(ne))
    with Context.for_tensors(8) as ctx:
        w = new_tensor(ctx.ptr, wtype, ne4[:len(ne)], "w")
        if op == "MUL_MAT":
            b = new_tensor(ctx.ptr, 0, (ne4[0], 512, ne4[2], ne4[3]), "b")
            t = _F["ggml_mul_mat"](ctx.ptr, w, b)
        elif op == "GET_ROWS":
            t = _F["ggml_get_rows"](ctx.ptr, w, new_tensor(ctx.ptr, 26, (512,), "ids"))
        elif op == "MUL":
            t = _F["ggml_mul"](ctx.ptr, new_tensor(ctx.ptr, 0, ne4[:len(ne)], "a"), w)
        elif op == "ADD":
            t = _F["ggml_add"](ctx.ptr, new_tensor(ctx.ptr, 0, ne4[:len(ne)], "a"), w)
        else:
            raise ValueError(f"weight_op_supported: op {op!r} is not one of MUL_MAT, GET_ROWS, MUL, ADD")
        buf = _F["ggml_backend_buft_alloc_buffer"](buft, 0)
        if not buf:
            return False
        set_buffer(w, buf)
        try:
            return bool(_F["ggml_backend_dev_supports_op"](dev, t))
        finally:
            set_buffer(w, 0)
            _F["ggml_backend_buffer_free"](buf)


_LOG_KEEP: list = []  # the installed C callback (ggml keeps only its address)


def set_log_level(min_level: int = 3) -> None:
    """Print ggml's log messages of level >= min_level only (ggml_log_set; 1 debug, 2 info, 3 warn, 4 error; a
    continuation line follows its message's level).  The default prints warnings and errors, as llama.cpp's tools
    do, instead of ggml's every-message logger (e.g. CPU_REPACK's line per repacked tensor)."""
    import sys
    from ggml import ggml as _decl
    state = {"keep": False}

    def cb(level: int, text: bytes, user: int) -> None:
        if level != 5:  # GGML_LOG_LEVEL_CONT
            state["keep"] = level >= min_level
        if state["keep"] and text:
            sys.stderr.write(text.decode("utf-8", errors="replace"))

    c_cb = _decl.ggml_log_callback(cb)
    _LOG_KEEP[:] = [c_cb]
    _F["ggml_log_set"](c_cb, None)

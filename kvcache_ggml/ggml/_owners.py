"""Owners of native ggml handles: one Python object per handle, freed once by close(), `with`, or the GC.

Context (ggml_init / ggml_free), BackendBuffer (ggml_backend_buffer_free), Backend (ggml_backend_free),
Sched (ggml_backend_sched_free). Graph is a helper over a ggml_cgraph in a Context's memory; it owns nothing.
"""
from __future__ import annotations

import ctypes
import sys
from typing import Callable, Iterator

import numpy as np

from ._calls import CALLS as _F
from ._lib import EvalCallback, ggml_init_params, ggml_tensor
from ._tensor import Tensor, encode_name, new_tensor
from ._types import GGML_DEFAULT_GRAPH_SIZE, GGML_MAX_NAME, BufferUsage, DeviceType, Status, _cstr

TENSOR_ALIGNMENT = 32  # ggml-impl.h: data of CPU buffers made from a pointer must be aligned to this
_HUGE_PAGE = 2 << 20   # x86-64 / arm64 transparent huge page (PMD) size
_MADV_HUGEPAGE = 14    # <sys/mman.h> on Linux
_MADV_COLLAPSE = 25    # <sys/mman.h> on Linux >= 6.1


def _madvise(addr: int, length: int, advice: int) -> int:
    """libc madvise (Linux); its return value."""
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.restype, fn.argtypes = ctypes.c_int, (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return fn(addr, length, advice)


class _Owner:
    """Holds one native pointer (an int) and releases it exactly once."""

    __slots__ = ("_ptr", "__weakref__")
    _kind = "handle"

    def __init__(self, ptr: int | None) -> None:
        if not ptr:
            raise MemoryError(f"ggml returned NULL for a new {self._kind}")
        self._ptr: int | None = int(ptr)

    @property
    def ptr(self) -> int:
        """The native pointer; ValueError once closed."""
        if self._ptr is None:
            raise ValueError(f"{self._kind} is closed")
        return self._ptr

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def close(self) -> None:
        ptr, self._ptr = self._ptr, None
        if ptr is not None:
            self._release(ptr)

    def _release(self, ptr: int) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may already be gone
            pass

    def __repr__(self) -> str:
        state = "closed" if self._ptr is None else f"0x{self._ptr:x}"
        return f"<{type(self).__name__} {state}>"


_NAME_AT = ggml_tensor.name.offset  # offset of char name[GGML_MAX_NAME] in struct ggml_tensor
_NODE_NAMES: dict[tuple[str, int], bytes] = {}  # (name, layer) -> encoded node name and NUL (a few hundred)


class Context(_Owner):
    """A ggml_context: tensor metadata (and data unless no_alloc) in one memory pool of mem_size bytes."""

    __slots__ = ("_pool",)
    _kind = "ggml context"

    def __init__(self, mem_size: int, no_alloc: bool = False) -> None:
        if mem_size <= 0:
            raise ValueError(f"mem_size must be > 0, got {mem_size}")
        super().__init__(_F["ggml_init"](ggml_init_params(mem_size=mem_size, mem_buffer=None, no_alloc=no_alloc)))
        base = _F["ggml_get_mem_buffer"](self._ptr)
        # the pool's bytes, as (address of a name field - _NAME_AT, view): released with the context (node_namer)
        self._pool = (base - _NAME_AT, memoryview((ctypes.c_uint8 * mem_size).from_address(base)).cast("B"))

    def node_namer(self) -> Callable[..., Tensor]:
        """``cb(t, name, il=-1) -> t``: names tensor t of this context as llama.cpp's graph callback does
        (``name-il`` in layer il >= 0, else ``name``), what ``ggml_set_name`` writes, without a C call: the name's
        bytes and a NUL go straight into t's struct in the pool (a graph names a few hundred nodes per build, and a
        C call costs more than the write).  Names are encoded and checked once per (name, il) for the process.
        ValueError for a name ggml would cut, a tensor of another context, or once the context is closed."""
        start, pool = self._pool
        last = len(pool) - GGML_MAX_NAME  # the last offset a name field can start at
        names = _NODE_NAMES

        def cb(t: Tensor, name: str, il: int = -1) -> Tensor:
            raw = names.get((name, il))
            if raw is None:
                raw = names[(name, il)] = encode_name(f"{name}-{il}" if il >= 0 else name) + b"\0"
            at = t - start
            if not 0 <= at <= last:
                raise ValueError(f"tensor 0x{t:x} is not in this context's pool")
            pool[at:at + len(raw)] = raw
            return t

        return cb

    @classmethod
    def for_tensors(cls, n_tensors: int, graph_size: int = 0) -> "Context":
        """A no_alloc context with room for n_tensors tensor headers (and a graph of graph_size nodes)."""
        if n_tensors < 0 or graph_size < 0:
            raise ValueError(f"n_tensors ({n_tensors}) and graph_size ({graph_size}) must be >= 0")
        size = n_tensors * _F["ggml_tensor_overhead"]()
        if graph_size:
            size += _F["ggml_graph_overhead_custom"](graph_size, False)
        return cls(max(size, 1), no_alloc=True)

    def _release(self, ptr: int) -> None:
        self._pool[1].release()  # (a node_namer's write after close: ValueError, not a write into freed memory)
        _F["ggml_free"](ptr)

    @property
    def no_alloc(self) -> bool:
        return bool(_F["ggml_get_no_alloc"](self.ptr))

    @property
    def mem_size(self) -> int:
        return _F["ggml_get_mem_size"](self.ptr)

    @property
    def used_mem(self) -> int:
        return _F["ggml_used_mem"](self.ptr)

    def new_tensor(self, type_: str | int, ne: tuple[int, ...], name: str | None = None) -> Tensor:
        """A tensor of ne = (ne0[, ne1[, ne2[, ne3]]]) elements; MemoryError when the pool is too small."""
        return new_tensor(self.ptr, type_, ne, name)

    def tensors(self) -> Iterator[Tensor]:
        """The tensors of the context, in creation order (ggml_get_first_tensor / ggml_get_next_tensor)."""
        t = _F["ggml_get_first_tensor"](self.ptr)
        while t:
            yield t
            t = _F["ggml_get_next_tensor"](self.ptr, t)


class BackendBuffer(_Owner):
    """A ggml_backend_buffer_t. `keepalive` holds memory the buffer points into (cpu_from_array)."""

    __slots__ = ("keepalive",)
    _kind = "ggml backend buffer"

    def __init__(self, ptr: int | None, keepalive: object = None) -> None:
        super().__init__(ptr)
        self.keepalive = keepalive

    @classmethod
    def alloc(cls, buft: int, size: int) -> "BackendBuffer":
        """A buffer of size bytes of buffer type buft (ggml_backend_buft_alloc_buffer)."""
        if size < 0:
            raise ValueError(f"buffer size must be >= 0, got {size}")
        ptr = _F["ggml_backend_buft_alloc_buffer"](buft, size)
        if not ptr:
            raise MemoryError(f"cannot allocate {size} bytes in buffer type {buft_name(buft)}")
        return cls(ptr)

    @classmethod
    def cpu_from_array(cls, array: np.ndarray) -> "BackendBuffer":
        """A CPU buffer over the memory of a C-contiguous numpy array (ggml_backend_cpu_buffer_from_ptr)."""
        if not array.flags.c_contiguous or not array.flags.writeable:
            raise ValueError("cpu_from_array needs a C-contiguous, writeable array")
        if array.ctypes.data % TENSOR_ALIGNMENT:
            raise ValueError(f"array data at 0x{array.ctypes.data:x} is not aligned to {TENSOR_ALIGNMENT} bytes "
                             f"(ggml requires it); make it with aligned_zeros()")
        return cls(_F["ggml_backend_cpu_buffer_from_ptr"](array.ctypes.data, array.nbytes), keepalive=array)

    @classmethod
    def for_context(cls, ctx: Context | int, buft: int) -> "BackendBuffer":
        """One buffer of type buft holding every tensor of ctx (ggml_backend_alloc_ctx_tensors_from_buft)."""
        c = getattr(ctx, "ptr", ctx)
        size = _F["ggml_backend_alloc_ctx_tensors_from_buft_size"](c, buft)
        ptr = _F["ggml_backend_alloc_ctx_tensors_from_buft"](c, buft)
        if not ptr:
            raise MemoryError(f"cannot allocate the context's tensors ({size} bytes) in buffer type "
                              f"{buft_name(buft)} (or every tensor is already allocated or empty)")
        return cls(ptr)

    def _release(self, ptr: int) -> None:
        _F["ggml_backend_buffer_free"](ptr)
        self.keepalive = None

    @property
    def name(self) -> str:
        return _cstr(_F["ggml_backend_buffer_name"](self.ptr))

    @property
    def size(self) -> int:
        return _F["ggml_backend_buffer_get_size"](self.ptr)

    @property
    def base(self) -> int:
        return _F["ggml_backend_buffer_get_base"](self.ptr) or 0

    @property
    def is_host(self) -> bool:
        return bool(_F["ggml_backend_buffer_is_host"](self.ptr))

    @property
    def buft(self) -> int:
        return _F["ggml_backend_buffer_get_type"](self.ptr)

    @property
    def usage(self) -> BufferUsage:
        return BufferUsage(_F["ggml_backend_buffer_get_usage"](self.ptr))

    @usage.setter
    def usage(self, value: BufferUsage) -> None:
        """ggml_backend_buffer_set_usage: a model's weight buffers are WEIGHTS, so that the scheduler runs each op
        on the backend holding its weight (and never copies a weight, which a repacked one cannot be)."""
        _F["ggml_backend_buffer_set_usage"](self.ptr, int(BufferUsage(value)))

    @property
    def in_cpu_memory(self) -> bool:
        """The data are in the process's memory: a host buffer, or one of a CPU device's buffer types that lays
        data out its own way (CPU_REPACK: not "host", since its bytes are not the tensor's plain layout)."""
        if self.is_host:
            return True
        dev = _F["ggml_backend_buft_get_device"](self.buft)
        return bool(dev) and _F["ggml_backend_dev_type"](dev) == DeviceType.CPU

    def advise_huge_pages(self) -> int:
        """Back this host buffer with transparent huge pages where the kernel allows: ``madvise`` its 2 MiB-aligned
        interior MADV_HUGEPAGE (later faults and khugepaged use huge pages), then MADV_COLLAPSE (Linux >= 6.1:
        the pages already written are collapsed now).  Data stay as they are; memory a step streams through then
        takes one TLB entry per 2 MiB instead of one per 4 KiB.  Returns the bytes advised: 0 for a device buffer,
        off Linux, or when the kernel refuses (THP disabled)."""
        if not sys.platform.startswith("linux") or not self.in_cpu_memory:
            return 0
        base, size = self.base, self.size
        start, end = -(-base // _HUGE_PAGE) * _HUGE_PAGE, (base + size) // _HUGE_PAGE * _HUGE_PAGE
        if not base or end <= start or _madvise(start, end - start, _MADV_HUGEPAGE) != 0:
            return 0
        _madvise(start, end - start, _MADV_COLLAPSE)  # best effort: older kernels refuse it (EINVAL)
        return end - start

    def clear(self, value: int = 0) -> None:
        """Set every byte of the buffer to value (0..255)."""
        if not 0 <= value <= 255:
            raise ValueError(f"clear value must be a byte 0..255, got {value}")
        _F["ggml_backend_buffer_clear"](self.ptr, value)


class Backend(_Owner):
    """A ggml_backend_t (CPU, or a device's backend)."""

    __slots__ = ()
    _kind = "ggml backend"

    @classmethod
    def cpu(cls, n_threads: int | None = None) -> "Backend":
        b = cls(_F["ggml_backend_cpu_init"]())
        if n_threads is not None:
            b.set_n_threads(n_threads)
        return b

    @classmethod
    def by_name(cls, name: str) -> "Backend":
        """The backend of the device called name ("CPU", "RPC0", "CUDA0", ...)."""
        ptr = _F["ggml_backend_init_by_name"](name.encode(), None)
        if not ptr:
            names = [_cstr(_F["ggml_backend_dev_name"](_F["ggml_backend_dev_get"](i)))
                     for i in range(_F["ggml_backend_dev_count"]())]
            raise ValueError(f"no ggml device named {name!r}; devices: {', '.join(names)}")
        return cls(ptr)

    def _release(self, ptr: int) -> None:
        _F["ggml_backend_free"](ptr)

    @property
    def name(self) -> str:
        return _cstr(_F["ggml_backend_name"](self.ptr))

    @property
    def is_cpu(self) -> bool:
        return bool(_F["ggml_backend_is_cpu"](self.ptr))

    def set_n_threads(self, n_threads: int) -> None:
        if not self.is_cpu:
            raise ValueError(f"set_n_threads is for the CPU backend, not {self.name}")
        if n_threads < 1:
            raise ValueError(f"n_threads must be >= 1, got {n_threads}")
        _F["ggml_backend_cpu_set_n_threads"](self.ptr, n_threads)

    @property
    def default_buffer_type(self) -> int:
        return _F["ggml_backend_get_default_buffer_type"](self.ptr)

    def alloc_buffer(self, size: int) -> BackendBuffer:
        """A buffer of size bytes of this backend's default type (ggml_backend_alloc_buffer)."""
        if size < 0:
            raise ValueError(f"buffer size must be >= 0, got {size}")
        ptr = _F["ggml_backend_alloc_buffer"](self.ptr, size)
        if not ptr:
            raise MemoryError(f"cannot allocate {size} bytes on backend {self.name}")
        return BackendBuffer(ptr)

    def compute(self, graph: "Graph | int") -> None:
        """Compute a graph whose tensors are allocated in buffers of this backend; RuntimeError unless success."""
        status = _F["ggml_backend_graph_compute"](self.ptr, getattr(graph, "ptr", graph))
        if status != Status.SUCCESS:
            raise RuntimeError(f"ggml_backend_graph_compute on {self.name} returned {Status(status).name}")

    def synchronize(self) -> None:
        _F["ggml_backend_synchronize"](self.ptr)


class Sched(_Owner):
    """A ggml_backend_sched_t over backends (the last one must be the CPU backend)."""

    __slots__ = ("backends", "_eval_cb")
    _kind = "ggml backend scheduler"

    def __init__(self, backends: list[Backend], graph_size: int = GGML_DEFAULT_GRAPH_SIZE, parallel: bool = False,
                 op_offload: bool = False, bufts: list[int] | None = None) -> None:
        """``bufts``: the buffer type of each backend's graph memory (None: each backend's default)."""
        if not backends:
            raise ValueError("Sched needs at least one backend")
        if not backends[-1].is_cpu:
            raise ValueError(f"the last backend of a Sched must be the CPU backend, got {backends[-1].name}")
        n = len(backends)
        if bufts is not None and len(bufts) != n:
            raise ValueError(f"{len(bufts)} buffer types for {n} backends")
        arr = (ctypes.c_void_p * n)(*(b.ptr for b in backends))
        barr = None if bufts is None else (ctypes.c_void_p * n)(*bufts)
        super().__init__(_F["ggml_backend_sched_new"](arr, barr, n, graph_size, parallel, op_offload))
        self.backends = list(backends)  # the scheduler uses them until it is freed
        self._eval_cb = None            # the C callback object while one is set (ggml keeps only its address)

    def _release(self, ptr: int) -> None:
        _F["ggml_backend_sched_free"](ptr)
        self.backends = []
        self._eval_cb = None

    def set_eval_callback(self, fn: "Callable[[Tensor, bool], bool] | None") -> None:
        """Observe nodes as they are computed (ggml_backend_sched_set_eval_callback); None removes the observer.

        ``fn(t, ask)``: with ask=True, return whether node t should be observed (the scheduler then computes up to
        it); with ask=False, t has its data: return False to stop the graph there.  An exception inside fn is
        printed and stops the graph (it cannot cross the C frame).
        """
        if fn is None:
            _F["ggml_backend_sched_set_eval_callback"](self.ptr, EvalCallback(), None)
            self._eval_cb = None
            return

        def trampoline(t: Tensor, ask: bool, user_data: int) -> bool:
            try:
                return bool(fn(t, bool(ask)))
            except BaseException:  # noqa: BLE001 - report and stop, never unwind through C
                import traceback
                traceback.print_exc()
                return False

        cb = EvalCallback(trampoline)
        _F["ggml_backend_sched_set_eval_callback"](self.ptr, cb, None)
        self._eval_cb = cb

    def reset(self) -> None:
        _F["ggml_backend_sched_reset"](self.ptr)

    def alloc_graph(self, graph: "Graph") -> None:
        if not _F["ggml_backend_sched_alloc_graph"](self.ptr, graph.ptr):
            raise MemoryError("ggml_backend_sched_alloc_graph failed")

    def compute(self, graph: "Graph") -> None:
        status = _F["ggml_backend_sched_graph_compute"](self.ptr, graph.ptr)
        if status != Status.SUCCESS:
            raise RuntimeError(f"ggml_backend_sched_graph_compute returned {Status(status).name}")

    def tensor_backend(self, t: Tensor) -> int:
        """The ggml_backend_t the scheduler assigned to t (0 when none)."""
        return _F["ggml_backend_sched_get_tensor_backend"](self.ptr, t) or 0


class Graph:
    """A ggml_cgraph in the memory of a Context (freed with it)."""

    __slots__ = ("ptr", "ctx")

    def __init__(self, ctx: Context, size: int = GGML_DEFAULT_GRAPH_SIZE) -> None:
        if size < 1:
            raise ValueError(f"graph size must be >= 1, got {size}")
        room = ctx.mem_size - ctx.used_mem
        need = _F["ggml_graph_overhead_custom"](size, False)
        if need > room:
            raise MemoryError(f"a graph of {size} nodes needs {need} bytes; the context has {room} free")
        self.ctx = ctx  # keeps the memory alive
        self.ptr: int = _F["ggml_new_graph_custom"](ctx.ptr, size, False)

    def expand(self, t: Tensor) -> None:
        """ggml_build_forward_expand: add t and everything it depends on."""
        _F["ggml_build_forward_expand"](self.ptr, t)

    @property
    def n_nodes(self) -> int:
        return _F["ggml_graph_n_nodes"](self.ptr)

    def node(self, i: int) -> Tensor:
        n = self.n_nodes
        if not -n <= i < n:
            raise IndexError(f"graph node {i} out of range for {n} nodes")
        return _F["ggml_graph_node"](self.ptr, i)

    def nodes(self) -> list[Tensor]:
        return [self.node(i) for i in range(self.n_nodes)]


def aligned_zeros(shape: int | tuple[int, ...], dtype: object = np.uint8,
                  align: int = TENSOR_ALIGNMENT) -> np.ndarray:
    """A zeroed C-contiguous array whose data address is a multiple of align."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    raw = np.zeros(n + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + n].view(dt).reshape(shape)


def buft_name(buft: int) -> str:
    return _cstr(_F["ggml_backend_buft_name"](buft))


def cpu_buffer_type() -> int:
    """The CPU (host) buffer type, ggml_backend_buffer_type_t."""
    return _F["ggml_backend_cpu_buffer_type"]()


def dev_memory(dev: int) -> tuple[int, int]:
    """(free, total) bytes of device dev."""
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    _F["ggml_backend_dev_memory"](dev, ctypes.byref(free), ctypes.byref(total))
    return free.value, total.value

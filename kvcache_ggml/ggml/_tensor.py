"""Reading the fields of a `struct ggml_tensor *` and moving its data to and from numpy.

Shapes: ggml lists dimensions fastest first (`ne[0]` is the row length); numpy slowest first. `np_shape(ne)` is the
one place that turns one into the other.
"""
from __future__ import annotations

import ctypes
import math
from typing import Sequence

import numpy as np

from ._calls import CALLS as _F
from ._lib import TensorP, ggml_tensor
from ._types import _BY_VALUE
from ._types import (GGML_MAX_DIMS, GGML_MAX_NAME, GGML_MEM_ALIGN, GGML_MAX_SRC, GGMLOp, GGMLType, _cstr, is_quantized,
                     parse_type, row_size, type_name)

# numpy dtype of each element type; bf16 has no numpy dtype and comes back as its raw 16-bit patterns
_NP_DTYPES: dict[GGMLType, np.dtype] = {
    GGMLType.F32: np.dtype(np.float32), GGMLType.F16: np.dtype(np.float16), GGMLType.BF16: np.dtype(np.uint16),
    GGMLType.F64: np.dtype(np.float64), GGMLType.I8: np.dtype(np.int8), GGMLType.I16: np.dtype(np.int16),
    GGMLType.I32: np.dtype(np.int32), GGMLType.I64: np.dtype(np.int64),
}
_GGML_TYPES: dict[np.dtype, GGMLType] = {d: t for t, d in _NP_DTYPES.items() if t != GGMLType.BF16}


Tensor = int  # a `struct ggml_tensor *` as the table passes it: the struct's address (None for NULL)

_struct_at = ggml_tensor.from_address


def _c(t: Tensor) -> ctypes.Structure:
    if not t:
        raise ValueError("NULL ggml_tensor pointer")
    return _struct_at(t)


def _ptr(p: TensorP) -> Tensor | None:
    """A `struct ggml_tensor *` field of a struct (a ctypes pointer object) as a tensor handle, None for NULL."""
    return ctypes.cast(p, ctypes.c_void_p).value


def handle(obj: object, what: str) -> int:
    """The native pointer of an owner (anything with ``.ptr``) or of a raw non-NULL handle; ValueError else."""
    ptr = getattr(obj, "ptr", obj)
    if not isinstance(ptr, int) or ptr == 0:
        raise ValueError(f"expected {what} (an object with .ptr or a non-NULL handle), got {obj!r}")
    return ptr


def addr(t: Tensor | None) -> int:
    """Address of the struct ggml_tensor (0 for NULL): the handle itself, 0 for None."""
    return t or 0


def ne(t: Tensor) -> tuple[int, int, int, int]:
    """Elements per dimension, ggml order (ne0 = row length, ne1, ne2, ne3)."""
    return tuple(_c(t).ne)  # type: ignore[return-value]


def nb(t: Tensor) -> tuple[int, int, int, int]:
    """Strides in bytes, ggml order (nb0 = bytes per block, nb1 = bytes per row, ...)."""
    return tuple(_c(t).nb)  # type: ignore[return-value]


def header(t: Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...], int, int]:
    """(type, ne, nb, buffer, data) of a tensor in one read of its struct -- for per-step hot paths."""
    c = _c(t)
    return c.type, tuple(c.ne[:]), tuple(c.nb[:]), c.buffer or 0, c.data or 0  # [:] is 3x faster than iterating


_HEADER_WORDS = (ggml_tensor.data.offset + ctypes.sizeof(ctypes.c_void_p) + 7) // 8  # struct start .. data pointer


def header_words(t: Tensor) -> np.ndarray:
    """int64 [_HEADER_WORDS]: a live view (no copy) of the tensor's struct from its start through its data pointer
    -- type, buffer, ne, nb, op and its parameters, flags, sources, view, data.  While these words stay the same, so
    does all that :func:`header` reads: a per-step check compares them (one numpy call) instead of reading fields.
    The view reads the struct's memory: use it only while the tensor lives, as the pointer ``t`` itself."""
    _c(t)  # (refuses NULL)
    return np.ctypeslib.as_array((ctypes.c_int64 * _HEADER_WORDS).from_address(t))


def ttype(t: Tensor) -> GGMLType:
    v = _c(t).type
    found = _BY_VALUE.get(v)
    return GGMLType(v) if found is None else found  # (the enum call only for a value it does not know: its error)


def name(t: Tensor) -> str:
    return _cstr(_c(t).name)


def encode_name(value: str) -> bytes:
    """A tensor name's bytes, refusing names ggml would cut (at most GGML_MAX_NAME - 1 bytes)."""
    raw = value.encode()
    if len(raw) >= GGML_MAX_NAME:
        raise ValueError(f"tensor name {value!r} is {len(raw)} bytes; ggml keeps at most {GGML_MAX_NAME - 1}")
    return raw


def set_name(t: Tensor, value: str) -> Tensor:
    """ggml_set_name, refusing names ggml would cut (at most GGML_MAX_NAME - 1 bytes)."""
    return _F["ggml_set_name"](t, encode_name(value))


def data_ptr(t: Tensor) -> int:
    """Address of the tensor's first element (0 when not allocated)."""
    return _c(t).data or 0


def buffer(t: Tensor) -> int:
    """The ggml_backend_buffer_t holding the data (0 when none: context memory or not allocated)."""
    return _c(t).buffer or 0


def set_buffer(t: Tensor, buf: int) -> None:
    """Point t at backend buffer buf without data (a dummy buffer, so that a scheduler leaves t alone)."""
    _c(t).buffer = buf


def view_offs(t: Tensor) -> int:
    return _c(t).view_offs


def view_src(t: Tensor) -> Tensor | None:
    return _ptr(_c(t).view_src)


def op(t: Tensor) -> GGMLOp:
    return GGMLOp(_c(t).op)


def src(t: Tensor, i: int) -> Tensor | None:
    """Source i of the op that computes t (None when unused)."""
    if not 0 <= i < GGML_MAX_SRC:
        raise ValueError(f"source index {i} out of range [0, {GGML_MAX_SRC})")
    return _ptr(_c(t).src[i])


def nbytes(t: Tensor) -> int:
    return _F["ggml_nbytes"](t)


def nelements(t: Tensor) -> int:
    return _F["ggml_nelements"](t)


def is_contiguous(t: Tensor) -> bool:
    return bool(_F["ggml_is_contiguous"](t))


def is_host(t: Tensor) -> bool:
    """True when the data can be read in place by the CPU (host buffer, or context memory)."""
    buf = buffer(t)
    if buf:
        return bool(_F["ggml_backend_buffer_is_host"](buf))
    return data_ptr(t) != 0


def _n_dims(ne_: Sequence[int]) -> int:
    # as ggml_n_dims: trailing dimensions of 1 do not count, at least one dimension
    n = GGML_MAX_DIMS
    while n > 1 and ne_[n - 1] == 1:
        n -= 1
    return n


def np_shape(ne_: Sequence[int], ndim: int | None = None) -> tuple[int, ...]:
    """numpy shape of a ggml `ne`: reversed, trailing ggml dimensions of 1 dropped unless ndim (1..4) is given."""
    if len(ne_) != GGML_MAX_DIMS:
        raise ValueError(f"ne must have {GGML_MAX_DIMS} entries, got {len(ne_)}: {tuple(ne_)}")
    n = _n_dims(ne_) if ndim is None else ndim
    if not 1 <= n <= GGML_MAX_DIMS or any(d != 1 for d in ne_[n:]):
        raise ValueError(f"ndim {ndim} cannot hold ne {tuple(ne_)} (1 <= ndim <= {GGML_MAX_DIMS}, "
                         f"dimensions past ndim must be 1)")
    return tuple(int(d) for d in reversed(ne_[:n]))


def np_dtype(t: str | int) -> np.dtype:
    """numpy dtype of one element of type t; uint8 for quantized types (their data are raw bytes rows)."""
    tt = parse_type(t)
    if is_quantized(tt):
        return np.dtype(np.uint8)
    if tt not in _NP_DTYPES:
        raise ValueError(f"no numpy dtype for ggml type {type_name(tt)}")
    return _NP_DTYPES[tt]


def _layout(t: Tensor, ndim: int | None) -> tuple[np.dtype, tuple[int, ...], tuple[int, ...], int]:
    """(dtype, numpy shape, numpy strides, bytes spanned) of t; quantized rows are counted in bytes."""
    tt = ttype(t)
    ne_, nb_ = list(ne(t)), list(nb(t))
    if is_quantized(tt):
        ne_[0], nb_[0] = row_size(tt, ne_[0]), 1
    shape = np_shape(ne_, ndim)
    strides = tuple(reversed(nb_[:len(shape)]))
    return np_dtype(tt), shape, strides, nbytes(t)


def to_numpy(t: Tensor, copy: bool = False, ndim: int | None = None) -> np.ndarray:
    """The tensor's data as a numpy array of shape np_shape(ne) (strides from nb).

    copy=False: a view of host memory (valid while the buffer or context lives); refused for device buffers.
    copy=True: a copy, from any buffer (ggml_backend_tensor_get for device buffers).
    Quantized types come back as raw bytes rows: uint8, shape [..., row_size(type, ne0)]; bf16 as uint16 bits.
    """
    dtype, shape, strides, span = _layout(t, ndim)
    if nelements(t) == 0:
        return np.zeros(shape, dtype)
    data = data_ptr(t)
    if not data:
        raise ValueError(f"tensor {name(t)!r} has no data: allocate it in a buffer or an allocating context first")
    if is_host(t):
        raw = (ctypes.c_uint8 * span).from_address(data)
        view = np.ndarray(shape, dtype, buffer=raw, strides=strides)
        return view.copy() if copy else view
    if not copy:
        raise ValueError(f"tensor {name(t)!r} lives in a device buffer; use to_numpy(t, copy=True)")
    raw_copy = np.empty(span, np.uint8)
    _F["ggml_backend_tensor_get"](t, raw_copy.ctypes.data, 0, span)
    return np.ndarray(shape, dtype, buffer=raw_copy, strides=strides).copy()


def get_into(t: Tensor, out: np.ndarray) -> None:
    """Copy the data of contiguous tensor t, from any buffer, into ``out``: a C-contiguous, writable numpy array of
    exactly ``nbytes(t)`` bytes (ggml_backend_tensor_get: one native call, no allocation)."""
    if not is_contiguous(t):
        raise ValueError(f"tensor {name(t)!r} is not contiguous; get_into copies whole tensors")
    n = nbytes(t)
    if not out.flags.c_contiguous or not out.flags.writeable or out.nbytes != n:
        raise ValueError(f"get_into needs a C-contiguous, writable array of {n} bytes for tensor {name(t)!r}, got "
                         f"{out.nbytes} bytes{'' if out.flags.c_contiguous else ', not contiguous'}")
    _F["ggml_backend_tensor_get"](t, out.ctypes.data, 0, n)


def host_bytes(t: Tensor, offset: int, size: int) -> np.ndarray | None:
    """Bytes ``[offset, offset + size)`` of a host tensor's data as a writable uint8 view (None for a device
    buffer): no copy, valid while the tensor's buffer lives."""
    if not is_host(t):
        return None
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(data_ptr(t) + offset))


def host_flat(t: Tensor) -> np.ndarray | None:
    """A 1-D view of a dense, scalar-typed host tensor's elements (what ``to_numpy(t).reshape(-1)`` gives such a
    tensor, from one read of its struct); None for a tensor without elements or data, or in a device buffer.  Any
    other tensor (quantized, no numpy dtype, strided) is left to :func:`to_numpy`."""
    c = _c(t)
    tt, ne_, nb_, buf, data = c.type, c.ne[:], c.nb[:], c.buffer, c.data
    n = ne_[0] * ne_[1] * ne_[2] * ne_[3]
    if not n or not data or (buf and not _F["ggml_backend_buffer_is_host"](buf)):
        return None
    dtype = _NP_DTYPES.get(_BY_VALUE.get(tt))
    if dtype is None or nb_[0] != dtype.itemsize or nb_[1] != nb_[0] * ne_[0] or nb_[2] != nb_[1] * ne_[1] \
            or nb_[3] != nb_[2] * ne_[2]:
        return to_numpy(t).reshape(-1)
    return np.ndarray((n,), dtype, buffer=(ctypes.c_uint8 * (n * dtype.itemsize)).from_address(data))


_PyBytes_FromStringAndSize = ctypes.pythonapi.PyBytes_FromStringAndSize
_PyBytes_FromStringAndSize.restype = ctypes.py_object
_PyBytes_FromStringAndSize.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)


def new_bytes(n: int) -> tuple[bytes, np.ndarray]:
    """A new ``bytes`` of ``n`` (>= 2) bytes and a writable view of its memory, to fill before anyone sees it.

    (CPython: ``PyBytes_FromStringAndSize(NULL, n)`` -- the C API's way to build a bytes object in place; sizes 0
    and 1 would return shared singletons.)
    """
    if n < 2:
        raise ValueError(f"new_bytes() needs n >= 2, got {n}")
    out = _PyBytes_FromStringAndSize(None, n)
    ptr = ctypes.cast(ctypes.c_char_p(out), ctypes.c_void_p).value
    return out, np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr))


def _checked_array(t: Tensor, array: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    dtype, shape, _, _ = _layout(t, None)
    a = np.asarray(array)
    if a.dtype != dtype:
        if not np.can_cast(a.dtype, dtype, casting="same_kind"):
            raise ValueError(f"cannot store {a.dtype} data in {type_name(ttype(t))} tensor {name(t)!r} "
                             f"(numpy dtype {dtype})")
        a = a.astype(dtype)
    if tuple(d for d in a.shape if d != 1) != tuple(d for d in shape if d != 1):
        raise ValueError(f"array of shape {a.shape} does not fit tensor {name(t)!r} of numpy shape {shape} "
                         f"(ne {ne(t)})")
    return a, shape


def set_tensor(t: Tensor, array: np.ndarray) -> None:
    """Write array (numpy shape np_shape(ne), up to dimensions of 1) into the tensor's data."""
    a, shape = _checked_array(t, array)
    if not data_ptr(t):
        raise ValueError(f"tensor {name(t)!r} has no data: allocate it in a buffer or an allocating context first")
    if is_host(t):
        to_numpy(t)[...] = a.reshape(shape)
        return
    if not is_contiguous(t):
        raise ValueError(f"tensor {name(t)!r} is a non-contiguous view in a device buffer; write its source")
    c = np.ascontiguousarray(a)
    _F["ggml_backend_tensor_set"](t, c.ctypes.data, 0, c.nbytes)


_NEW_TENSOR = ("ggml_new_tensor_1d", "ggml_new_tensor_2d", "ggml_new_tensor_3d", "ggml_new_tensor_4d")


_TENSOR_SIZE = ctypes.sizeof(TensorP._type_)                              # sizeof(struct ggml_tensor)
_OBJECT_SIZE = _F["ggml_tensor_overhead"]() - _TENSOR_SIZE                # ggml's object header (ggml_tensor_overhead)


def _context_room(ctx: int, type_: GGMLType, ne_: tuple[int, ...]) -> None:
    # ggml_new_tensor aborts the process when the context is full; check first (ggml.c: ggml_new_object)
    data = 0 if _F["ggml_get_no_alloc"](ctx) else row_size(type_, ne_[0]) * math.prod(ne_[1:])
    tensor_and_data = _TENSOR_SIZE + data
    needed = _OBJECT_SIZE + (tensor_and_data + GGML_MEM_ALIGN - 1) // GGML_MEM_ALIGN * GGML_MEM_ALIGN
    free = _F["ggml_get_mem_size"](ctx) - _F["ggml_used_mem"](ctx)
    if needed > free:
        raise MemoryError(f"ggml context has {free} bytes free; a {type_name(type_)} tensor of ne {ne_} needs "
                          f"{needed}")


def new_tensor(ctx: int, type_: str | int, ne_: Sequence[int], name_: str | None = None) -> Tensor:
    """A new tensor in context ctx (a ggml_context pointer or a Context) with ne_ = (ne0[, ne1[, ne2[, ne3]]])."""
    ctx = getattr(ctx, "ptr", ctx)
    tt = parse_type(type_)
    dims = tuple(map(int, ne_))
    if not 1 <= len(dims) <= GGML_MAX_DIMS or min(dims) < 0:
        raise ValueError(f"ne {dims}: need 1..{GGML_MAX_DIMS} dimensions, each >= 0")
    row_size(tt, dims[0])  # ne0 must be a whole number of blocks
    _context_room(ctx, tt, dims)
    t = _F[_NEW_TENSOR[len(dims) - 1]](ctx, tt, *dims)
    if name_ is not None:
        set_name(t, name_)
    return t


def from_numpy(ctx: int, array: np.ndarray, name_: str | None = None, type_: str | int | None = None) -> Tensor:
    """A new tensor in an allocating context holding a copy of array (ne = reversed array shape)."""
    a = np.asarray(array)
    if type_ is None:
        if a.dtype not in _GGML_TYPES:
            raise ValueError(f"no ggml type for numpy dtype {a.dtype}; valid: "
                             f"{', '.join(str(d) for d in _GGML_TYPES)} (or pass type_)")
        type_ = _GGML_TYPES[a.dtype]
    if a.ndim > GGML_MAX_DIMS:
        raise ValueError(f"array has {a.ndim} dimensions; ggml has at most {GGML_MAX_DIMS}")
    if _F["ggml_get_no_alloc"](getattr(ctx, "ptr", ctx)):
        raise ValueError("from_numpy needs an allocating context (no_alloc=False); with no_alloc, create the "
                         "tensor with new_tensor, allocate it in a buffer, then call set_tensor")
    ne_ = tuple(reversed(a.shape)) or (1,)
    if is_quantized(parse_type(type_)):
        raise ValueError("from_numpy makes element tensors; quantized data: new_tensor then set_tensor")
    t = new_tensor(ctx, type_, ne_, name_)
    set_tensor(t, a)
    return t

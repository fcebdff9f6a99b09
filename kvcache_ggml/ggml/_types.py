"""ggml's enums (tensor types, ops, statuses, device types) read from the library, and type arithmetic."""
from __future__ import annotations

import ctypes
from enum import IntEnum

import numpy as np

from ._calls import CALLS as _F
from ._lib import _decl

GGML_MAX_DIMS: int = _decl.GGML_MAX_DIMS  # 4
GGML_MAX_SRC: int = _decl.GGML_MAX_SRC  # 10
GGML_MAX_NAME: int = _decl.GGML_MAX_NAME  # 64, including the terminating NUL
GGML_MEM_ALIGN: int = _decl.GGML_MEM_ALIGN  # 16 on 64-bit hosts
GGML_DEFAULT_GRAPH_SIZE: int = _decl.GGML_DEFAULT_GRAPH_SIZE  # 2048
GGML_TYPE_COUNT: int = _decl.GGML_TYPE_COUNT
GGML_OP_COUNT: int = _decl.GGML_OP_COUNT
GGML_ROPE_TYPE_NORMAL: int = _decl.GGML_ROPE_TYPE_NORMAL
GGML_ROPE_TYPE_NEOX: int = _decl.GGML_ROPE_TYPE_NEOX
GGML_ROPE_TYPE_MROPE: int = _decl.GGML_ROPE_TYPE_MROPE
GGML_ROPE_TYPE_VISION: int = _decl.GGML_ROPE_TYPE_VISION
GGML_ROPE_TYPE_IMROPE: int = _decl.GGML_ROPE_TYPE_IMROPE


def _cstr(b: bytes | None) -> str:
    return "" if b is None else b.decode("utf-8", "replace")


def _type_members() -> dict[str, int]:
    # removed types keep a slot with block size 0 ("DEPRECATED", "... REMOVED ...")
    return {_cstr(_F["ggml_type_name"](t)).upper(): t
            for t in range(GGML_TYPE_COUNT) if _F["ggml_blck_size"](t) > 0}


GGMLType = IntEnum("GGMLType", _type_members(), module=__name__)  # enum ggml_type: F32=0, F16=1, ..., Q8_0=8
GGMLType.__doc__ = "enum ggml_type, members named after ggml_type_name() upper-cased (F32, F16, Q8_0, Q4_K, BF16, ...)"

GGMLOp = IntEnum("GGMLOp", {_cstr(_F["ggml_op_name"](i)): i for i in range(GGML_OP_COUNT)}, module=__name__)
GGMLOp.__doc__ = "enum ggml_op, members named after ggml_op_name() (NONE, DUP, ADD, ..., SET_ROWS, ROPE, ...)"


class Status(IntEnum):
    """enum ggml_status"""
    ALLOC_FAILED = _decl.GGML_STATUS_ALLOC_FAILED
    FAILED = _decl.GGML_STATUS_FAILED
    SUCCESS = _decl.GGML_STATUS_SUCCESS
    ABORTED = _decl.GGML_STATUS_ABORTED


class BufferUsage(IntEnum):
    """enum ggml_backend_buffer_usage: what a buffer holds, which the scheduler reads (WEIGHTS: an op using a
    weight runs on the weight's backend)"""
    ANY = _decl.GGML_BACKEND_BUFFER_USAGE_ANY
    WEIGHTS = _decl.GGML_BACKEND_BUFFER_USAGE_WEIGHTS
    COMPUTE = _decl.GGML_BACKEND_BUFFER_USAGE_COMPUTE


class DeviceType(IntEnum):
    """enum ggml_backend_dev_type"""
    CPU = _decl.GGML_BACKEND_DEVICE_TYPE_CPU
    GPU = _decl.GGML_BACKEND_DEVICE_TYPE_GPU
    IGPU = _decl.GGML_BACKEND_DEVICE_TYPE_IGPU
    ACCEL = _decl.GGML_BACKEND_DEVICE_TYPE_ACCEL
    META = _decl.GGML_BACKEND_DEVICE_TYPE_META


_BY_NAME: dict[str, GGMLType] = {t.name.lower(): t for t in GGMLType}
# per usable type, read once from the library: the member, its block size and its bytes per block (graph building
# asks for these dozens of times; an enum call or a C call each time cost more than the lookups)
_BY_VALUE: dict[int, GGMLType] = {int(t): t for t in GGMLType}
_BLCK: dict[int, int] = {int(t): _F["ggml_blck_size"](t) for t in GGMLType}
_TSIZE: dict[int, int] = {int(t): _F["ggml_type_size"](t) for t in GGMLType}
_QUANTIZED: dict[int, bool] = {int(t): bool(_F["ggml_is_quantized"](t)) for t in GGMLType}


def type_names() -> list[str]:
    """ggml's names of the usable tensor types, in enum order ("f32", "f16", "q4_0", ..., "q2_K", ...)."""
    return [type_name(t) for t in GGMLType]


def type_name(t: int) -> str:
    """ggml_type_name(t): "f32", "q8_0", "q4_K", ..."""
    return _cstr(_F["ggml_type_name"](parse_type(t)))


def parse_type(t: str | int) -> GGMLType:
    """A GGMLType from a name (case-insensitive: "f16", "Q8_0", "q4_k") or an enum value."""
    if type(t) is int or type(t) is GGMLType:  # (the common case: one lookup)
        found = _BY_VALUE.get(t)
        if found is not None:
            return found
    if isinstance(t, str):
        found = _BY_NAME.get(t.strip().lower())
        if found is None:
            raise ValueError(f"unknown ggml type name {t!r}; valid names: {', '.join(type_names())}")
        return found
    try:
        return GGMLType(int(t))
    except ValueError:
        raise ValueError(f"invalid ggml type value {t!r}; valid values: "
                         f"{', '.join(f'{m.value} ({m.name})' for m in GGMLType)}") from None


def type_size(t: str | int) -> int:
    """Bytes per block of type t (ggml_type_size): 4 for f32, 34 for q8_0."""
    return _TSIZE[parse_type(t)]


def blck_size(t: str | int) -> int:
    """Elements per block of type t (ggml_blck_size): 1 for f32, 32 for q8_0."""
    return _BLCK[parse_type(t)]


def is_quantized(t: str | int) -> bool:
    return _QUANTIZED[parse_type(t)]


def row_size(t: str | int, n: int) -> int:
    """Bytes of n elements of type t (ggml_row_size); n must be a multiple of the block size."""
    tt = t if type(t) is GGMLType else parse_type(t)  # (a member, as graph building passes: no call)
    blck = _BLCK[tt]
    if n < 0 or n % blck:
        raise ValueError(f"row of {n} elements of type {type_name(tt)}: must be >= 0 and a multiple of the "
                         f"block size {blck}")
    return _TSIZE[tt] * n // blck  # (ggml_row_size's arithmetic)


def op_name(op: int) -> str:
    """ggml_op_name(op): "SET_ROWS", "ROPE", ..."""
    if not 0 <= int(op) < GGML_OP_COUNT:
        raise ValueError(f"ggml op {op} out of range [0, {GGML_OP_COUNT})")
    return _cstr(_F["ggml_op_name"](int(op)))


# the types ggml_quantize_chunk writes (any other aborts the process)
QUANTIZABLE = ("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K",
               "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m", "iq4_nl", "iq4_xs", "tq1_0",
               "tq2_0", "mxfp4")


def quantize(t: str | int, x: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Rows of x (float32 [n_rows, n_per_row]) in ggml type t with ggml's own ``ggml_quantize_chunk``.

    Returns uint8 [n_rows, row_size(t, n_per_row)].  ``imatrix`` (float32 [n_per_row], importance per column) is
    required by the types ``ggml_quantize_requires_imatrix`` names (IQ1/IQ2 families); ValueError without it, or
    when n_per_row is not a whole number of blocks.  The result is checked with ``ggml_validate_row_data``.
    """
    tt = parse_type(t)
    if type_name(tt) not in QUANTIZABLE:
        raise ValueError(f"ggml_quantize_chunk cannot write {type_name(tt)} (it writes {', '.join(QUANTIZABLE)})")
    x = np.ascontiguousarray(x, np.float32)
    if x.ndim != 2:
        raise ValueError(f"quantize needs a 2-D array [n_rows, n_per_row], got shape {x.shape}")
    n_rows, n_per_row = x.shape
    if n_per_row % blck_size(tt):
        raise ValueError(f"{type_name(tt)} rows need a multiple of {blck_size(tt)} values, got {n_per_row}")
    if imatrix is None and _F["ggml_quantize_requires_imatrix"](int(tt)):
        raise ValueError(f"{type_name(tt)} needs an importance matrix (imatrix) to quantize")
    qw = None
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, np.float32)
        if imatrix.shape != (n_per_row,):
            raise ValueError(f"imatrix must have shape ({n_per_row},), got {imatrix.shape}")
        qw = imatrix.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    out = np.zeros((n_rows, row_size(tt, n_per_row)), np.uint8)
    n = _F["ggml_quantize_chunk"](int(tt), x.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.ctypes.data, 0,
                                  n_rows, n_per_row, qw)
    if n != out.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {n} bytes for {type_name(tt)}, expected {out.nbytes}")
    if not _F["ggml_validate_row_data"](int(tt), out.ctypes.data, out.nbytes):
        raise ValueError(f"{type_name(tt)} data from ggml_quantize_chunk does not validate (NaN or inf input?)")
    return out


def cpu_can_use(t: str | int, op: str) -> bool:
    """Whether ggml's CPU backend has a kernel for weight type t in op "MUL_MAT" (a vec_dot in its type traits),
    "GET_ROWS" (a to_float), "MUL" or "ADD" (F32 only).  ``ggml_backend_dev_supports_op`` of the CPU says yes to
    every type, and a weight type without a kernel crashes the compute: Model checks this first."""
    tt = int(parse_type(t))
    if op in ("MUL", "ADD"):
        return tt == int(GGMLType.F32)
    if op == "MUL_MAT":
        return bool(ctypes.cast(_F["ggml_get_type_traits_cpu"](tt).contents.vec_dot, ctypes.c_void_p).value)
    if op == "GET_ROWS":
        if tt in (int(GGMLType.F32), int(GGMLType.F16), int(GGMLType.BF16), int(GGMLType.I32)):
            return True
        return bool(ctypes.cast(_F["ggml_get_type_traits"](tt).contents.to_float, ctypes.c_void_p).value)
    raise ValueError(f"cpu_can_use: op {op!r} is not one of MUL_MAT, GET_ROWS, MUL, ADD")

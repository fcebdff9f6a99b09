"""The ggml shared libraries (built and loaded by ggml-python) and the table of C functions this project calls.

ggml-python (`import ggml`) loads libggml and its backend libraries and declares every C function with ctypes.
This module does not reuse those function objects: for every name in the table it takes a fresh function object
from the library (`CDLL[name]`), copies ggml-python's `argtypes`/`restype`, and replaces the declarations that
ggml-python gets wrong (`REDECLARED`). ggml-python's own objects stay as they are.

Tensor and graph pointers (`struct ggml_tensor *`, `struct ggml_cgraph *`) are declared `void *` (`HANDLE_TYPES`):
they cross as Python ints (None for NULL), as every other handle does.  ggml-python declares them as ctypes pointer
objects, and each such return value is an object to allocate and each argument one to check: a graph of a few
hundred nodes took about 0.8 us more per op call and 0.5 us more per ggml_set_name that way.

`_calls.py` makes of it what the package calls (`CALLS`): the table, with the graph builders' functions replaced by
compiled cffi wrappers (`_fastcalls.py`) where `build.py` built them.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import ggml as ggml_python  # the package: `ggml.<name>` are ggml-python's declarations
from ggml import ggml as _decl  # the module holding the declarations, structs and constants

ggml_tensor = _decl.ggml_tensor  # struct ggml_tensor (ctypes.Structure)
ggml_init_params = _decl.ggml_init_params  # struct ggml_init_params
TensorP = ctypes.POINTER(ggml_tensor)  # struct ggml_tensor * as ggml-python declares it (struct fields, callbacks)
CgraphP = ctypes.POINTER(_decl.ggml_cgraph)  # struct ggml_cgraph * (opaque) as ggml-python declares it
# bool (*ggml_backend_sched_eval_callback)(struct ggml_tensor * t, bool ask, void * user_data), the tensor as an int
EvalCallback = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)

GGML_PYTHON_VERSION: str = ggml_python.__version__
LIB_DIR = Path(ggml_python.__file__).resolve().parent / "lib"

# libraries in symbol-lookup order (a library before those depending on it, so the first hit defines the
# symbol); ggml-python has already loaded them (these are the same handles)
_LIB_ORDER = ("ggml-base", "ggml-cpu", "ggml-rpc", "ggml-cuda", "ggml-metal", "ggml-vulkan", "ggml-blas", "ggml")


def _load_libraries() -> dict[str, ctypes.CDLL]:
    libs: dict[str, ctypes.CDLL] = {}
    for name in _LIB_ORDER:
        for fname in (f"lib{name}.so", f"lib{name}.dylib", f"{name}.dll"):
            path = LIB_DIR / fname
            if path.exists():
                libs[name] = ctypes.CDLL(str(path))
                break
    for required in ("ggml-base", "ggml", "ggml-cpu"):
        if required not in libs:
            raise ImportError(f"ggml-python {GGML_PYTHON_VERSION} has no lib{required} in {LIB_DIR}: "
                              f"rebuild with `python3 build.py`")
    return libs


LIBRARIES: dict[str, ctypes.CDLL] = _load_libraries()  # "ggml-base" -> CDLL, ...

# The C functions the project uses, by header. All must be exported by the libraries.
REQUIRED: tuple[str, ...] = (
    # ggml.h: context, tensors, ops, graphs
    "ggml_version", "ggml_commit", "ggml_time_init", "ggml_time_us",
    "ggml_init", "ggml_free", "ggml_reset", "ggml_used_mem", "ggml_get_mem_size", "ggml_get_mem_buffer",
    "ggml_get_no_alloc",
    "ggml_set_no_alloc", "ggml_tensor_overhead", "ggml_graph_overhead", "ggml_graph_overhead_custom",
    "ggml_new_tensor_1d", "ggml_new_tensor_2d", "ggml_new_tensor_3d", "ggml_new_tensor_4d", "ggml_dup_tensor",
    "ggml_view_tensor", "ggml_view_1d", "ggml_view_2d", "ggml_view_3d", "ggml_view_4d",
    "ggml_reshape_1d", "ggml_reshape_2d", "ggml_reshape_3d", "ggml_reshape_4d", "ggml_permute", "ggml_transpose",
    "ggml_cont", "ggml_cont_2d", "ggml_cont_3d", "ggml_set_rows", "ggml_get_rows", "ggml_pad", "ggml_cast",
    "ggml_cpy", "ggml_rope_ext", "ggml_rope_ext_inplace", "ggml_add", "ggml_mul", "ggml_scale", "ggml_mul_mat",
    "ggml_soft_max_ext",
    # ggml.h: ops of the llama runtime's decoder graph (kvcache_ggml/runtime/graph.py)
    "ggml_rms_norm", "ggml_swiglu_split", "ggml_flash_attn_ext", "ggml_flash_attn_ext_set_prec",
    "ggml_mul_mat_set_prec",
    # ggml.h: ops of the Gemma graph (kvcache_ggml/runtime/gemma.py)
    "ggml_geglu_split", "ggml_tanh",
    # ggml.h: the fused gate/up SwiGLU of the Phi-3 graph (kvcache_ggml/runtime/phi3.py)
    "ggml_swiglu",
    "ggml_set_input", "ggml_set_output", "ggml_set_name", "ggml_get_name", "ggml_get_first_tensor",
    "ggml_get_next_tensor", "ggml_get_tensor",
    "ggml_nbytes", "ggml_nelements", "ggml_nrows", "ggml_row_size", "ggml_type_size", "ggml_blck_size",
    "ggml_type_name", "ggml_is_quantized", "ggml_is_contiguous", "ggml_n_dims", "ggml_get_data",
    "ggml_element_size",
    "ggml_new_graph", "ggml_new_graph_custom", "ggml_build_forward_expand", "ggml_graph_n_nodes",
    "ggml_graph_node", "ggml_graph_size", "ggml_graph_dump_dot", "ggml_graph_get_tensor",
    "ggml_op_name", "ggml_op_symbol", "ggml_op_desc",
    # ggml-backend.h: buffer types and buffers
    "ggml_backend_cpu_buffer_type", "ggml_backend_alloc_buffer", "ggml_backend_cpu_buffer_from_ptr",
    "ggml_backend_buft_name", "ggml_backend_buft_alloc_buffer", "ggml_backend_buft_is_host",
    "ggml_backend_buft_get_alignment", "ggml_backend_buft_get_max_size", "ggml_backend_buft_get_alloc_size",
    "ggml_backend_buft_get_device",
    "ggml_backend_buffer_name", "ggml_backend_buffer_get_size", "ggml_backend_buffer_get_base",
    "ggml_backend_buffer_clear", "ggml_backend_buffer_free", "ggml_backend_buffer_is_host",
    "ggml_backend_buffer_set_usage", "ggml_backend_buffer_get_usage",
    "ggml_backend_buffer_get_type", "ggml_backend_buffer_get_alignment",
    # ggml-alloc.h
    "ggml_backend_alloc_ctx_tensors_from_buft", "ggml_backend_alloc_ctx_tensors_from_buft_size",
    "ggml_backend_alloc_ctx_tensors",
    # ggml-backend.h: tensor data
    "ggml_backend_tensor_set", "ggml_backend_tensor_get", "ggml_backend_tensor_copy", "ggml_backend_tensor_memset",
    # ggml-backend.h / ggml-cpu.h: backends
    "ggml_backend_cpu_init", "ggml_backend_is_cpu", "ggml_backend_free", "ggml_backend_name",
    "ggml_backend_cpu_set_n_threads", "ggml_backend_graph_compute", "ggml_backend_synchronize",
    "ggml_backend_get_default_buffer_type", "ggml_backend_get_device", "ggml_backend_supports_op",
    # ggml-backend.h: scheduler
    "ggml_backend_sched_new", "ggml_backend_sched_free", "ggml_backend_sched_reset",
    "ggml_backend_sched_alloc_graph", "ggml_backend_sched_graph_compute", "ggml_backend_sched_get_tensor_backend",
    "ggml_backend_sched_set_eval_callback", "ggml_backend_sched_synchronize",
    # ggml-backend.h: devices and registries
    "ggml_backend_dev_count", "ggml_backend_dev_get", "ggml_backend_dev_name", "ggml_backend_dev_description",
    "ggml_backend_dev_type", "ggml_backend_dev_buffer_type", "ggml_backend_dev_host_buffer_type",
    "ggml_backend_dev_memory", "ggml_backend_dev_init", "ggml_backend_dev_by_name", "ggml_backend_dev_by_type",
    "ggml_backend_dev_backend_reg", "ggml_backend_init_by_name", "ggml_backend_init_by_type",
    "ggml_backend_init_best",
    "ggml_backend_reg_count", "ggml_backend_reg_get", "ggml_backend_reg_name", "ggml_backend_reg_by_name",
    "ggml_backend_reg_dev_count", "ggml_backend_reg_dev_get", "ggml_backend_reg_get_proc_address",
    "ggml_backend_dev_supports_op",
    # ggml-cpu.h: what the CPU backend was built with (llama.cpp builds it with llamafile's sgemm)
    "ggml_cpu_has_llamafile", "ggml_cpu_has_avx2", "ggml_cpu_has_avx512",
    # ggml.h: quantization (the model maker)
    "ggml_quantize_chunk", "ggml_quantize_requires_imatrix", "ggml_quantize_init", "ggml_validate_row_data",
    # ggml.h / ggml-cpu.h: type traits (which weight types have CPU kernels)
    "ggml_get_type_traits", "ggml_get_type_traits_cpu",
    # ggml.h: the log sink
    "ggml_log_set",
)
# Present only when the library that defines them is built (RPC: `build.py --rpc`, the default; Vulkan:
# `build.py --vulkan`).
OPTIONAL: tuple[str, ...] = (
    "ggml_backend_load_all",
    "ggml_backend_rpc_init", "ggml_backend_is_rpc", "ggml_backend_rpc_buffer_type",
    "ggml_backend_rpc_get_device_memory", "ggml_backend_rpc_start_server", "ggml_backend_rpc_reg",
    "ggml_backend_rpc_add_server",
    # build.py's RPC patches (a dead server is an exception): the failure count, buffer status, the timeout
    "ggml_backend_rpc_set_timeout_ms", "ggml_backend_rpc_failure_count", "ggml_backend_rpc_buffer_status",
    "ggml_backend_rpc_endpoint_status", "ggml_backend_rpc_buffer_sync",
    "ggml_backend_vk_buffer_type", "ggml_backend_vk_host_buffer_type",
)

# Functions that exist only in ggml as build.py patches it (ggml-python declares none of them): their declarations
# are in REDECLARED, checked against the patched headers
PATCHED: tuple[str, ...] = ("ggml_backend_rpc_set_timeout_ms", "ggml_backend_rpc_failure_count",
                            "ggml_backend_rpc_buffer_status", "ggml_backend_rpc_endpoint_status",
                            "ggml_backend_rpc_buffer_sync")

_vp, _sz = ctypes.c_void_p, ctypes.c_size_t
# (restype, argtypes) from the C headers, for functions ggml-python 0.0.45 declares wrongly: a typing.NewType
# as restype makes ctypes read a C int, cutting the returned 64-bit pointer to 32 bits.
REDECLARED: dict[str, tuple[object, tuple[object, ...]]] = {
    # ggml_backend_buffer_type_t ggml_backend_cpu_buffer_type(void)
    "ggml_backend_cpu_buffer_type": (_vp, ()),
    # ggml_backend_buffer_t ggml_backend_alloc_buffer(ggml_backend_t backend, size_t size)
    "ggml_backend_alloc_buffer": (_vp, (_vp, _sz)),
    # ggml_backend_buffer_t ggml_backend_cpu_buffer_from_ptr(void * ptr, size_t size)
    "ggml_backend_cpu_buffer_from_ptr": (_vp, (_vp, _sz)),
    # ggml_backend_t ggml_backend_sched_get_tensor_backend(ggml_backend_sched_t sched, struct ggml_tensor * node)
    "ggml_backend_sched_get_tensor_backend": (_vp, (_vp, TensorP)),
    # ggml-rpc.h as build.py patches it (ggml-python does not declare these):
    # void ggml_backend_rpc_set_timeout_ms(uint32_t ms)
    "ggml_backend_rpc_set_timeout_ms": (None, (ctypes.c_uint32,)),
    # uint64_t ggml_backend_rpc_failure_count(void)
    "ggml_backend_rpc_failure_count": (ctypes.c_uint64, ()),
    # int ggml_backend_rpc_buffer_status(ggml_backend_buffer_t buffer)
    "ggml_backend_rpc_buffer_status": (ctypes.c_int, (_vp,)),
    # int ggml_backend_rpc_endpoint_status(const char * endpoint)
    "ggml_backend_rpc_endpoint_status": (ctypes.c_int, (ctypes.c_char_p,)),
    # bool ggml_backend_rpc_buffer_sync(ggml_backend_buffer_t buffer)
    "ggml_backend_rpc_buffer_sync": (ctypes.c_bool, (_vp,)),
    # ggml-vulkan.h: ggml_backend_buffer_type_t ggml_backend_vk_buffer_type(size_t dev_num)
    "ggml_backend_vk_buffer_type": (_vp, (_sz,)),
    # ggml-vulkan.h: ggml_backend_buffer_type_t ggml_backend_vk_host_buffer_type(void)
    "ggml_backend_vk_host_buffer_type": (_vp, ()),
}

_CTYPES_BASES = (ctypes._SimpleCData, ctypes._Pointer, ctypes.Structure, ctypes.Union, ctypes.Array,
                 ctypes._CFuncPtr)


def is_ctypes_type(t: object) -> bool:
    """True for None (void) and ctypes data types; False for anything ctypes would call on a C int."""
    return t is None or (isinstance(t, type) and issubclass(t, _CTYPES_BASES))


def _lookup(name: str) -> tuple[str, ctypes._CFuncPtr] | None:
    for lib_name, lib in LIBRARIES.items():
        try:
            return lib_name, lib[name]  # __getitem__ makes a new function object each time
        except AttributeError:
            continue
    return None


# ggml-python's declarations of tensor / graph pointers and of the eval callback -> what the table uses instead
HANDLE_TYPES: dict[object, object] = {TensorP: _vp, CgraphP: _vp,
                                      _decl.ggml_backend_sched_eval_callback: EvalCallback}


def _declare(name: str, fn: ctypes._CFuncPtr) -> None:
    if name in REDECLARED:
        restype, argtypes = REDECLARED[name]
    else:
        upstream = getattr(_decl, name, None)
        if upstream is None:
            raise ImportError(f"ggml-python {GGML_PYTHON_VERSION} does not declare {name}: add it to REDECLARED")
        restype, argtypes = upstream.restype, tuple(upstream.argtypes or ())
    restype = HANDLE_TYPES.get(restype, restype)
    argtypes = tuple(HANDLE_TYPES.get(a, a) for a in argtypes)
    bad = [f"restype {restype!r}"] if not is_ctypes_type(restype) else []
    bad += [f"argument {i} {a!r}" for i, a in enumerate(argtypes) if not is_ctypes_type(a)]
    if bad:
        raise ImportError(f"ggml-python {GGML_PYTHON_VERSION} declares {name} with non-ctypes "
                          f"{', '.join(bad)}: re-declare it in REDECLARED")
    fn.restype = restype
    fn.argtypes = list(argtypes)


def _build_table() -> tuple[dict[str, ctypes._CFuncPtr], dict[str, str]]:
    functions: dict[str, ctypes._CFuncPtr] = {}
    defined_in: dict[str, str] = {}
    missing = []
    for name in REQUIRED + OPTIONAL:
        found = _lookup(name)
        if found is None:
            if name in REQUIRED:
                missing.append(name)
            continue
        defined_in[name], fn = found
        _declare(name, fn)
        functions[name] = fn
    if missing:
        raise ImportError(f"the ggml libraries in {LIB_DIR} do not export {', '.join(missing)}")
    return functions, defined_in


FUNCTIONS, DEFINED_IN = _build_table()  # name -> ctypes function; name -> library it was found in


def has(name: str) -> bool:
    """True when the C function `name` is in the table (optional ones depend on the build flags)."""
    return name in FUNCTIONS

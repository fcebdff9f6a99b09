"""The binding layer: the only part of kvcache_ggml that touches ctypes.

Other modules do `from kvcache_ggml import ggml as G` and then:
- call C functions of the table by their C names: `G.ggml_view_4d(ctx.ptr, t, ...)`, `G.ggml_set_rows(...)`
  (`G.FUNCTIONS` is the table: name -> ctypes function, declared with the right types; `G.CALLS` the functions
  called, the graph builders' compiled with cffi where build.py could: `_fastcalls.py`);
- read tensors with the helpers: `G.ne(t)`, `G.nb(t)`, `G.ttype(t)`, `G.name(t)`, `G.to_numpy(t)`, ...;
- convert quantized rows to float32 with `G.dequantize(raw, type_)` (ggml's own CPU kernels);
- own native handles with `G.Context`, `G.BackendBuffer`, `G.Backend`, `G.Sched` (close() / `with`); `G.Graph`.

Handles are ints (contexts, buffers, buffer types, backends, devices, tensors, graphs; None for NULL): the table
declares every pointer `void *` (`G.Tensor` names the tensors' kind in annotations).
"""
from ._calls import CALLS, FAST, WHY_NO_FAST
from ._lib import (DEFINED_IN, FUNCTIONS, GGML_PYTHON_VERSION, LIBRARIES, OPTIONAL, PATCHED, REDECLARED, REQUIRED,
                   CgraphP, EvalCallback, TensorP, ggml_init_params, ggml_tensor, has, is_ctypes_type)
from ._types import (GGML_DEFAULT_GRAPH_SIZE, GGML_MAX_DIMS, GGML_MAX_NAME, GGML_MAX_SRC, GGML_MEM_ALIGN,
                     GGML_OP_COUNT, GGML_ROPE_TYPE_IMROPE, GGML_ROPE_TYPE_MROPE, GGML_ROPE_TYPE_NEOX,
                     GGML_ROPE_TYPE_NORMAL, GGML_ROPE_TYPE_VISION, GGML_TYPE_COUNT, BufferUsage, DeviceType, GGMLOp, GGMLType,
                     Status, blck_size, cpu_can_use, is_quantized, op_name, parse_type, quantize, row_size, type_name,
                     type_names, type_size)
from ._tensor import (Tensor, addr, buffer, data_ptr, from_numpy, get_into, handle, header, header_words, host_bytes,
                      host_flat, is_contiguous, is_host, name, nb, nbytes, ne, nelements, new_bytes, new_tensor,
                      np_dtype, np_shape, op, set_buffer, set_name, set_tensor, src, to_numpy, ttype, view_offs,
                      view_src)
from ._owners import (TENSOR_ALIGNMENT, Backend, BackendBuffer, Context, Graph, Sched, aligned_zeros, buft_name,
                      cpu_buffer_type, dev_memory)
from ._convert import dequantize
from ._rpc import (RPC_TIMEOUT_S, RpcServerLostError, RpcWatch, lost_error, rpc_failure_count, rpc_status_api,
                   rpc_timeout, set_rpc_timeout)
from ._devices import (Device, commit, device, devices, extra_bufts, registries, rpc_add_server, rpc_available,
                       rpc_start_server, set_log_level, summary_lines, version, weight_op_supported)

globals().update(CALLS)  # every C function of the table as a module attribute (compiled where built): G.ggml_add

__all__ = sorted(FUNCTIONS) + [
    "CALLS", "DEFINED_IN", "FAST", "FUNCTIONS", "GGML_PYTHON_VERSION", "LIBRARIES", "OPTIONAL", "PATCHED", "REDECLARED",
    "REQUIRED", "WHY_NO_FAST", "CgraphP",
    "EvalCallback", "TensorP", "ggml_init_params", "ggml_tensor", "has", "is_ctypes_type",
    "GGML_DEFAULT_GRAPH_SIZE", "GGML_MAX_DIMS", "GGML_MAX_NAME", "GGML_MAX_SRC", "GGML_MEM_ALIGN", "GGML_OP_COUNT",
    "GGML_ROPE_TYPE_IMROPE", "GGML_ROPE_TYPE_MROPE", "GGML_ROPE_TYPE_NEOX", "GGML_ROPE_TYPE_NORMAL",
    "GGML_ROPE_TYPE_VISION", "GGML_TYPE_COUNT", "BufferUsage", "DeviceType", "GGMLOp", "GGMLType", "Status", "blck_size",
    "cpu_can_use", "is_quantized", "op_name", "parse_type", "quantize", "row_size", "type_name", "type_names",
    "type_size",
    "Tensor", "addr", "buffer", "data_ptr", "from_numpy", "get_into", "handle", "header", "header_words", "host_bytes",
    "host_flat", "is_contiguous", "is_host", "name", "nb", "nbytes", "ne", "nelements", "new_bytes", "new_tensor",
    "np_dtype", "np_shape", "op", "set_buffer", "set_name", "set_tensor", "src", "to_numpy", "ttype", "view_offs",
    "view_src",
    "TENSOR_ALIGNMENT", "Backend", "BackendBuffer", "Context", "Graph", "Sched", "aligned_zeros", "buft_name",
    "cpu_buffer_type", "dev_memory",
    "Device", "commit", "device", "devices", "extra_bufts", "registries", "weight_op_supported", "rpc_add_server",
    "rpc_available", "rpc_start_server", "set_log_level", "summary_lines", "version", "dequantize",
    "RPC_TIMEOUT_S", "RpcServerLostError", "RpcWatch", "lost_error", "rpc_failure_count", "rpc_status_api",
    "rpc_timeout", "set_rpc_timeout",
]

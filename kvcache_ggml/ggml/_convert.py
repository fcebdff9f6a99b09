"""Conversions through ggml's own CPU kernels: quantized rows to float32 (``ggml_cast`` on the CPU backend)."""
from __future__ import annotations

import numpy as np

from ._calls import CALLS as _F
from ._owners import Backend, Context, Graph
from ._tensor import to_numpy
from ._types import GGMLType, blck_size, type_size


def dequantize(raw: np.ndarray, type_: int) -> np.ndarray:
    """float32 values [..., ne0] of raw quantized rows (uint8 [..., row_bytes] of ``type_``, as ``to_numpy``
    returns them), converted by ggml on the CPU."""
    rb = raw.shape[-1]
    n_rows = raw.size // rb
    ne0 = rb // type_size(type_) * blck_size(type_)
    mem = 2 * _F["ggml_tensor_overhead"]() + raw.size + 4 * n_rows * ne0 + _F["ggml_graph_overhead_custom"](8, False)
    with Context(mem + 4096) as ctx, Backend.cpu(1) as cpu:
        t = ctx.new_tensor(type_, (ne0, n_rows))  # [ne0, n_rows]
        to_numpy(t)[...] = raw.reshape(n_rows, rb)
        out = _F["ggml_cast"](ctx.ptr, t, GGMLType.F32)  # [ne0, n_rows]
        g = Graph(ctx, 8)
        g.expand(out)
        cpu.compute(g)
        return to_numpy(out, copy=True).reshape(*raw.shape[:-1], ne0)

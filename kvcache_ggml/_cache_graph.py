"""Tensor half of KVCache (interim: allocation and K-shift land with the graph issue)."""
from __future__ import annotations


class GraphMixin:
    def _init_tensors(self) -> None:
        self.layers = []
        self.map_layer_ids = {}

    def _clear_buffers(self) -> None:
        pass

    def update(self, lctx, do_shift, sc_info) -> bool:
        if do_shift:
            for c in self.v_cells:
                c.reset_shift()
        return False

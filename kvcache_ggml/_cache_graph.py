"""Tensor half of KVCache (interim: allocation and K-shift land with the graph issue)."""
from __future__ import annotations


class GraphMixin:
    def update(self, lctx, do_shift, sc_info) -> bool:
        if do_shift:
            for c in self.v_cells:
                c.reset_shift()
        return False

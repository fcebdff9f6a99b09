"""Text renderings of a stream's cells: the seed's debug dump, also used by the demo and the notebooks."""
from __future__ import annotations

import numpy as np

from .cells.kvcells import KVCells

__all__ = ["cell_map_text", "cell_pos_text"]

def cell_map_text(cells: KVCells) -> str:
    """One character per cell: '.' empty, the sequence id when one, 'M' when several; 256 cells a line."""
    pos = cells.pos_array
    out = []
    for start in range(0, cells.size(), 256):
        idx = np.arange(start, min(start + 256, cells.size()))
        occ = idx[pos[idx] >= 0]
        chars = np.full(idx.size, ".", dtype=object)
        if occ.size:
            cnt = cells.seq_count_many(occ)
            seq = cells.seq_get_many(occ)
            chars[occ - start] = np.where(cnt == 1, seq.astype(str), "M")
        out.append("".join(chars.tolist()) + (" *" if idx.size == 256 else ""))
    return "\n".join(out)


def cell_pos_text(cells: KVCells) -> str:
    """The position of each cell in a 5-wide column ('.' when empty), 64 cells a line."""
    pos = cells.pos_array
    words = [(str(p) if p >= 0 else ".").ljust(5) for p in pos.tolist()]
    lines = []
    for start in range(0, len(words), 64):
        chunk = words[start:start + 64]
        line = ""
        for k, w in enumerate(chunk):
            line += w + (" *" if (start + k) % 256 == 255 else "")
        lines.append(line)
    return "\n".join(lines)

"""``python -m kvcache_ggml inspect FILE [--json]``: describe a saved KV-cache state without a cache.

FILE is a bare state blob (``state_save``, ``llama_state_seq_get_data``), a sequence state file ('ggsq',
``llama_state_seq_save_file``) or a session file ('ggsn', ``llama_state_save_file``); the first bytes tell which.
Exit status: 0, 1 when the file cannot be read or is not a valid state, 2 on a usage error.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from .files import read_state_file
from .format import LayerState, StateInfo, magic_text, type_text

__all__ = ["main_inspect", "format_info"]

_MAX_RANGES = 100   # cell ranges listed per stream in the text output (all of them with --json)
_MAX_TOKENS = 16    # tokens listed in the text output


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:.2f} {unit} ({n} B)"
    return f"{n} B"


def _span(a: int, b: int) -> str:
    return str(a) if a == b else f"{a}-{b}"


def _layer_text(L: LayerState) -> str:
    k = f"K {type_text(L.k_type)} rows of {L.k_row_size} B"
    if L.v_row_size is not None:
        v = f"V {type_text(L.v_type)} rows of {L.v_row_size} B"
    else:
        v = f"V {type_text(L.v_type)} transposed, {L.n_embd_v_gqa} channels of {L.v_el_size} B elements"
    return f"{k}, {_size(L.k_nbytes)} | {v}, {_size(L.v_nbytes)}"


def format_info(info: StateInfo, name: str = "state") -> str:
    """The text report of ``inspect``."""
    out = []
    if info.kind == "state":
        out.append(f"{name}: KV cache state, {_size(info.size)}")
    else:
        what = "sequence state file" if info.kind == "seq" else "session file"
        out.append(f"{name}: {what} ('{magic_text(info.magic)}' version {info.version}), {_size(info.size)}")
        toks = info.tokens.tolist()
        shown = ", ".join(str(t) for t in toks[:_MAX_TOKENS]) + (", ..." if len(toks) > _MAX_TOKENS else "")
        out.append(f"tokens: {len(toks)} [{shown}]")
        if info.arch is not None:
            out.append(f"arch: {info.arch}")
    out.append(f"state: {_size(info.nbytes)} at offset {info.offset}, {info.n_stream} stream"
               f"{'s' if info.n_stream != 1 else ''}")
    for st in info.streams:
        if st.cell_count == 0:
            out.append(f"stream {st.index}: no cells")
            continue
        out.append(f"stream {st.index}: {st.cell_count} cells, v_trans {int(st.v_trans)}, {len(st.layers)} layers, "
                   f"{_size(st.nbytes)}")
        ranges = st.cell_ranges()
        out.append("  cells (positions: sequences):")
        for r in ranges[:_MAX_RANGES]:
            seqs = ",".join(str(q) for q in r.seqs)
            out.append(f"    {_span(r.pos0, r.pos1)}: seq {seqs}"
                       + (f" ({r.n_cells} cells)" if r.n_cells != r.pos1 - r.pos0 + 1 else ""))
        if len(ranges) > _MAX_RANGES:
            out.append(f"    ... {len(ranges) - _MAX_RANGES} more ranges (--json lists them all)")
        out.append("  layers:")
        groups: list[tuple[int, int, str]] = []
        for L in st.layers:
            text = _layer_text(L)
            if groups and groups[-1][2] == text:
                groups[-1] = (groups[-1][0], L.index, text)
            else:
                groups.append((L.index, L.index, text))
        for a, b, text in groups:
            label = f"layer {a}" if a == b else f"layers {a}-{b} (each)"
            out.append(f"    {label}: {text}")
    if info.trailing:
        out.append(f"warning: {info.trailing} bytes after the state")
    return "\n".join(out)


def main_inspect(argv: Sequence[str] | None = None) -> int:
    """``inspect FILE [--json]``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m kvcache_ggml inspect",
        description="Describe a KV-cache state: a state blob, a sequence state file ('ggsq') or a session file "
                    "('ggsn'): streams, cells as position ranges with their sequences, layers, types and sizes.")
    parser.add_argument("file", help="the state file")
    parser.add_argument("--json", action="store_true", help="print a JSON description (every cell range)")
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as e:
        return int(e.code or 0) if isinstance(e.code, int) or e.code is None else 2
    try:
        info = read_state_file(args.file)
    except OSError as e:
        print(f"inspect: error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"inspect: error: {args.file} is not a valid KV cache state: {e}", file=sys.stderr)
        return 1
    text = (json.dumps(dict(info.to_dict(), file=str(args.file)), indent=1) if args.json
            else format_info(info, str(args.file)))
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `inspect FILE | head`: the reader has gone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0

"""Backend parity: comparing captures with the CPU's, the report table, and :func:`run_parity`."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .. import ggml as G
from ..backends import BackendNotBuiltError, PlacementError, backend_status, local_rpc_server
from ._config import BACKENDS, CHECKS, Capture, Item, ParityConfig, Target, _layers_label, make_target, tolerance
from ._trace import ReplayCrash, replay, replay_isolated


def _values(item: Item) -> np.ndarray:
    t = G.GGMLType(item.type)
    if G.is_quantized(t):
        return G.dequantize(item.data, t).astype(np.float64)
    if t == G.GGMLType.BF16:
        return (item.data.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return item.data.astype(np.float64)


# ============================================================================================== comparison

@dataclass(slots=True)
class CheckResult:
    """One check of one backend and type."""

    metric: str          # "exact" or "nmse" (of the arrays compared by the tolerance's metric)
    error: float         # largest figure over the compared arrays (nan: nothing compared)
    limit: float         # tolerance
    passed: bool         # error within the limit, every exact array equal, no self-consistency failure
    n_arrays: int        # arrays compared
    notes: list[str] = field(default_factory=list)  # what failed

    def cell(self) -> str:
        if self.n_arrays == 0:
            return "-" if self.passed else "CRASH"
        fig = "0" if self.error == 0 else f"{self.error:.1e}"
        return fig if self.passed else f"FAIL {fig}"


@dataclass(slots=True)
class ParityRow:
    """A backend and type against the CPU."""

    backend: str                          # "rpc", "cuda", ...
    type: str                             # cache type
    placement: str                        # where the layers were
    checks: dict[str, CheckResult]        # check -> result
    seconds: float                        # replay time on the backend

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks.values())


def _item_error(a: Item, b: Item) -> tuple[float, bool]:
    """(figure, equal bits) of backend item a against CPU item b."""
    if a.data.shape != b.data.shape or a.data.dtype != b.data.dtype:
        return math.inf, False
    same = a.data.tobytes() == b.data.tobytes()
    if a.metric == "exact":
        if same:
            return 0.0, True
        x, y = _values(a), _values(b)
        both = (x == y) | (np.isnan(x) & np.isnan(y))
        with np.errstate(invalid="ignore"):  # -inf - -inf where the masks agree
            d = np.abs(np.where(both, 0.0, x - y))
        return float(np.nan_to_num(d, nan=math.inf).max()), False
    if same:
        return 0.0, True
    x, y = _values(a), _values(b)
    den = float(np.sum(y * y))
    num = float(np.sum((x - y) ** 2))
    return (num / den if den > 0 else (0.0 if num == 0 else math.inf)), False


def crash_row(target: Target, type_: str, layer_map: list[str], message: str) -> ParityRow:
    """The row of a backend whose replay died: every check failed, with the reason."""
    checks = {c: CheckResult(tolerance(c, type_).metric, math.nan, tolerance(c, type_).limit, False, 0, [message])
              for c in CHECKS}
    return ParityRow(target.name, type_, _layers_label(layer_map) if layer_map else target.placement.describe(),
                     checks, 0.0)


def compare(got: Capture, ref: Capture) -> ParityRow:
    """Every check of a backend's capture against the CPU's."""
    if [(i.check, i.label) for i in got.items] != [(i.check, i.label) for i in ref.items]:
        raise RuntimeError(f"the {got.target} replay recorded a different trace than the CPU's "
                           f"({len(got.items)} vs {len(ref.items)} arrays)")
    results: dict[str, CheckResult] = {}
    for check in CHECKS:
        tol = tolerance(check, got.type)
        pairs = [(a, b) for a, b in zip(got.items, ref.items) if a.check == check]
        res = CheckResult(tol.metric, 0.0 if pairs else math.nan, tol.limit, True, len(pairs))
        for a, b in pairs:
            err, same = _item_error(a, b)
            if a.metric == "exact":
                if not same:
                    res.passed = False
                    res.notes.append(f"{a.label}: differs (max |diff| {err:.3g})")
                if tol.metric == "exact":
                    res.error = max(res.error, err)
            else:
                res.error = max(res.error, err)
                if not err <= tol.limit:
                    res.passed = False
                    res.notes.append(f"{a.label}: nmse {err:.3g} > {tol.limit:g}")
        for f in got.failures:
            if f.startswith(check + ":"):
                res.passed = False
                res.notes.append(f)
        results[check] = res
    return ParityRow(got.target, got.type, _layers_label(got.layer_map), results, got.seconds)


@dataclass(slots=True)
class ParityReport:
    """Rows (backend x type) and the backends skipped, with the reason."""

    config: ParityConfig                                          # the trace
    rows: list[ParityRow] = field(default_factory=list)           # compared backends
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (backend, reason)
    reference_seconds: dict[str, float] = field(default_factory=dict)  # type -> CPU replay time

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)

    def table(self) -> str:
        """backend x check -> max error, as a Markdown table, then the skipped backends and the failures."""
        head = ["backend", "type", *CHECKS, "time", "result"]
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        for r in self.rows:
            crashed = all(c.n_arrays == 0 and not c.passed for c in r.checks.values())
            cells = [r.backend, r.type, *(r.checks[c].cell() for c in CHECKS),
                     "-" if crashed else f"{r.seconds:.1f} s", "CRASH" if crashed else "PASS" if r.passed else "FAIL"]
            lines.append("| " + " | ".join(cells) + " |")
        for name, reason in self.skipped:
            lines.append("| " + " | ".join([name, "-", *("skip" for _ in CHECKS), "-", "SKIPPED"]) + " |")
        out = ["\n".join(lines), ""]
        placements = sorted({(r.backend, r.placement) for r in self.rows if r.placement})
        out += [f"placement {b}: {p}" for b, p in placements]
        out += [f"skipped {name}: {reason}" for name, reason in self.skipped]
        types = sorted({r.type for r in self.rows})
        out.append("tolerances: " + "; ".join(f"{t}: {_tolerance_text(t)}" for t in types))
        for r in self.rows:
            notes = {n for c in CHECKS for n in r.checks[c].notes}
            if len(notes) == 1 and all(r.checks[c].notes for c in CHECKS):  # one cause for all: a crash
                out.append(f"CRASH {r.backend} {r.type}: {notes.pop()}")
                continue
            for c in CHECKS:
                for n in r.checks[c].notes[:5]:
                    out.append(f"FAIL {r.backend} {r.type} {c}: {n}")
        return "\n".join(out)


def _tolerance_text(type_: str) -> str:
    parts = []
    for c in CHECKS:
        tol = tolerance(c, type_)
        parts.append(f"{c} exact" if tol.metric == "exact" else f"{c} nmse <= {tol.limit:g}")
    return ", ".join(parts)


def _check_types(types: Sequence[str], cfg: ParityConfig) -> list[str]:
    out = []
    for t in types:
        tt = G.parse_type(t.strip())  # ValueError naming the valid ones
        if cfg.n_embd_head % G.blck_size(tt):
            raise ValueError(f"cache type {t!r}: its block of {G.blck_size(tt)} elements does not divide the head "
                             f"size {cfg.n_embd_head}")
        out.append(G.type_name(tt))
    return out


def run_parity(backends: Sequence[str], types: Sequence[str], cfg: ParityConfig = ParityConfig(), *,
               rpc_spec: str | None = None, split: str = "auto", isolate: bool = True,
               log: Callable[[str], None] | None = None) -> ParityReport:
    """Compare every backend of ``backends`` with the CPU on caches of ``types``.

    "rpc" uses the server ``rpc_spec`` ("rpc://127.0.0.1:PORT"), or starts a loopback one for the run.  "cpu"
    replays the CPU against itself (a determinism check).  Backends that cannot run are reported as skipped.
    ``isolate``: each backend replays in a child process (:func:`replay_isolated`); a crash fails its row.
    """
    say = log or (lambda s: None)
    types = _check_types(types, cfg)
    report = ParityReport(cfg)
    names = [b.strip().lower() for b in backends if b.strip()]
    for b in names:
        if b not in BACKENDS:
            raise ValueError(f"unknown backend {b!r}; known: {', '.join(BACKENDS)}")
    with contextlib.ExitStack() as stack:
        targets: list[Target] = []
        for b in dict.fromkeys(names):
            try:
                spec = None
                if b == "rpc":
                    st = backend_status("rpc")
                    if not st.built:
                        raise BackendNotBuiltError(f"rpc: {st.reason}")
                    if rpc_spec is None:
                        server = stack.enter_context(local_rpc_server(threads=cfg.n_threads))
                        say(f"started a loopback RPC server at {server.spec}")
                        spec = server.spec
                    else:
                        spec = rpc_spec
                targets.append(make_target(b, cfg.n_layer, spec, split))
            except PlacementError as e:
                reason = str(e).partition(": ")[2] if str(e).startswith(b + ":") else str(e)
                report.skipped.append((b, reason))
                say(f"skipping {b}: {reason}")
        for t in types:
            cpu = make_target("cpu", cfg.n_layer)
            try:
                ref = replay_isolated(cfg, cpu, t) if isolate else replay(cfg, cpu, t)
            except ReplayCrash as e:
                say(f"cpu {t}: the reference replay crashed: {e}")
                report.rows += [crash_row(target, t, [], f"the CPU reference crashed: {e}") for target in targets]
                continue
            report.reference_seconds[t] = ref.seconds
            say(f"cpu {t}: reference replay, {len(ref.items)} arrays in {ref.seconds:.1f} s")
            for target in targets:
                try:
                    got = replay_isolated(cfg, target, t) if isolate else replay(cfg, target, t)
                    row = compare(got, ref)
                except PlacementError as e:
                    report.skipped.append((target.name, str(e)))
                    say(f"skipping {target.name}: {e}")
                    continue
                except ReplayCrash as e:
                    row = crash_row(target, t, [], str(e))
                    say(f"{target.name} {t}: CRASH: {e}")
                    report.rows.append(row)
                    continue
                report.rows.append(row)
                say(f"{target.name} {t}: {'PASS' if row.passed else 'FAIL'} in {got.seconds:.1f} s")
    # a backend skipped at resolve time is listed once even with several types
    seen: set[str] = set()
    report.skipped = [(b, r) for b, r in report.skipped if not (b in seen or seen.add(b))]
    return report

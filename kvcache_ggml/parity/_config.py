"""Backend parity: the configuration (model, trace seed, tolerances), the targets (where the layers go) and
the capture of one replay."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import ggml as G
from ..backends import BackendNotBuiltError, Placement, PlacementError, backend_status
from ..hparams import HParams, RopeType


CHECKS: tuple[str, ...] = ("write", "inputs", "attn", "seq_ops", "kshift", "stream_copy", "state")
BACKENDS: tuple[str, ...] = ("cpu", "rpc", "cuda", "metal", "vulkan")
_N_VOCAB = 32


# ============================================================================================== configuration

@dataclass(slots=True, frozen=True)
class ParityConfig:
    """The model and trace every backend replays."""

    seed: int = 0                                  # the whole trace (positions, sequences, data) follows from it
    n_layer: int = 4                               # layers of the toy model
    n_embd_head: int = 32                          # head size of K and V (a q8_0 block)
    n_head: int = 4                                # query heads
    n_head_kv: tuple[int, ...] = (2, 1, 2, 2)      # K/V heads per layer (varied: exercises the V padding)
    kv_size_unified: int = 64                      # cells of the unified cache (one stream, 4 sequences)
    kv_size_streams: int = 32                      # cells per stream of the multi-stream cache (3 streams)
    n_ubatch: int = 8                              # tokens per ubatch
    n_threads: int = 1                             # CPU threads of every scheduler
    rope_freq_base: float = 10000.0                # RoPE base of the K-shift

    def hparams(self) -> HParams:
        return HParams.simple(n_layer=self.n_layer, n_embd_head=self.n_embd_head, n_head=self.n_head,
                              n_head_kv=self.n_head_kv, n_rot=self.n_embd_head, rope_type=RopeType.NEOX,
                              rope_freq_base_train=self.rope_freq_base, n_vocab=_N_VOCAB)


@dataclass(slots=True, frozen=True)
class Tolerance:
    """How one check compares a backend with the CPU."""

    metric: str   # "exact" (bits equal; figure = max |difference|) or "nmse" (figure = normalised MSE)
    limit: float  # largest figure that passes (0 for exact)


def tolerance(check: str, type_: str | int) -> Tolerance:
    """Per check and cache type: copies, cells and inputs exact; RoPE, attention and quantized data by NMSE.

    F32 -> F16/BF16 conversion is correctly rounded on every backend, so written rows of float caches are exact;
    quantizers may round a value differently (q8_0: one step is 1/127 of a block's maximum), hence the NMSE.
    """
    q = G.is_quantized(type_)
    if check in ("inputs", "seq_ops"):
        return Tolerance("exact", 0.0)
    if check == "write":
        return Tolerance("nmse", 1e-4) if q else Tolerance("exact", 0.0)
    if check in ("kshift", "stream_copy", "state", "attn"):
        return Tolerance("nmse", 1e-4 if q else 1e-5)
    raise ValueError(f"unknown check {check!r}; checks: {', '.join(CHECKS)}")


# ============================================================================================== targets

@dataclass(slots=True, frozen=True)
class Target:
    """A backend to compare with the CPU, as a placement of the toy model's layers."""

    name: str              # "cpu", "rpc", "cuda", ...
    placement: Placement   # where the layers go
    label: str             # what the table prints: "layers 2-3 on rpc://127.0.0.1:PORT"


def _layers_label(layer_map: list[str]) -> str:
    groups: list[tuple[int, int, str]] = []
    for il, spec in enumerate(layer_map):
        if groups and groups[-1][2] == spec:
            groups[-1] = (groups[-1][0], il, spec)
        else:
            groups.append((il, il, spec))
    return ", ".join(f"{'layer' if a == b else 'layers'} {a if a == b else f'{a}-{b}'} on {s}"
                     for a, b, s in groups)


def make_target(name: str, n_layer: int, rpc_spec: str | None = None, split: str = "auto") -> Target:
    """The placement for backend ``name``: "cpu" all on the CPU; "rpc" (needs ``rpc_spec``) and the GPUs either
    half of the layers (the last ones, llama.cpp's n_gpu_layers) or all of them (``split`` "half"/"all"; "auto":
    half for RPC, all for GPUs).  BackendNotBuiltError / DeviceNotFoundError when the backend cannot be used."""
    key = name.strip().lower()
    if key not in BACKENDS:
        raise PlacementError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
    if key == "cpu":
        return Target("cpu", Placement.cpu(), "all on CPU")
    st = backend_status(key)
    if not st.built:
        raise BackendNotBuiltError(f"{key}: {st.reason}")
    if key == "rpc":
        if rpc_spec is None:
            raise PlacementError("rpc: no server given (rpc_spec)")
        device = rpc_spec
    else:
        if st.reason:
            raise PlacementError(f"{key}: {st.reason}")
        device = key
    half = split == "half" or (split == "auto" and key == "rpc")
    placement = (Placement.split([device], n_gpu_layers=n_layer // 2 + 1) if half else Placement.single(device))
    return Target(key, placement, "")


# ============================================================================================== capture

@dataclass(slots=True)
class Item:
    """One recorded array of a replay."""

    check: str          # which check compares it
    label: str          # where it comes from: "A.ub0 k_idxs", "kshift K l2", ...
    type: int           # ggml type of the data (raw quantized rows for quantized types)
    data: np.ndarray    # the data as read back from the backend
    metric: str         # "exact" or "nmse"


@dataclass(slots=True)
class Capture:
    """Everything one replay recorded, in trace order."""

    target: str                                         # backend name
    type: str                                           # cache type
    layer_map: list[str] = field(default_factory=list)  # device spec of each layer
    items: list[Item] = field(default_factory=list)     # recorded arrays
    failures: list[str] = field(default_factory=list)   # self-consistency failures (check: what)
    seconds: float = 0.0                                # replay time

    def add(self, check: str, label: str, type_: int, data: np.ndarray, metric: str | None = None) -> None:
        m = metric or tolerance(check, self.type).metric
        self.items.append(Item(check, label, int(type_), np.array(data, copy=True), m))

    def fail(self, check: str, what: str) -> None:
        self.failures.append(f"{check}: {what}")

"""Devices, placements and schedulers: where the KV cache's layers live, and ggml's RPC backend.

* :func:`list_devices` / :func:`backend_status`: the ggml devices of the backends built into this ggml (CPU always;
  CUDA, Metal, Vulkan, RPC per ``build.py`` flags), each with its buffer type and, where the device has one, its
  host (pinned) buffer type.
* :class:`Placement`: which device holds each layer -- all on the CPU, all on one device, or layer ranges split
  over several devices with llama.cpp's ``n_gpu_layers`` / ``tensor_split`` rules (llama_model::load_tensors).
* :class:`PlacedModel`: hyper-parameters plus a resolved placement; it gives :class:`~kvcache_ggml.cache.KVCache`
  ``dev_layer(il)``, so ``KVCache(PlacedModel(hparams, placement), offload=True, ...)`` puts each layer's K/V in
  the buffer type of its device.
* :class:`Backends`: the owner of one ggml backend per used device, the CPU backend and a ``G.Sched`` over them,
  with the host buffer type of the first device for the CPU's graph inputs (as llama_context does).
* RPC: ``rpc://127.0.0.1:PORT[/DEV]`` names device DEV (default 0) of a ggml RPC server; :func:`probe_rpc` checks
  that it answers before ggml touches it (ggml aborts or crashes on a dead server); :func:`main_rpc_server` is
  ``python -m kvcache_ggml rpc-server``; :func:`local_rpc_server` runs one in a subprocess for tests.

Errors, all raised before any memory is allocated: :class:`PlacementError` (a ``ValueError``) for a bad placement,
with :class:`DeviceNotFoundError`, :class:`BackendNotBuiltError` and :class:`RpcServerError` for a device that does
not exist, a backend that was not built and an RPC server that does not answer.  ``RuntimeError`` when ggml
refuses something that passed the checks (a backend that cannot be initialised).

Modules: ``_devices`` (errors, backend families, device info), ``_rpc`` (RPC specs, probe, loopback server),
``_placement`` (device names, layer assignment, Placement, PlacedModel, Backends).
"""
from ._devices import (FAMILIES, BackendNotBuiltError, BackendStatus, BufferTypeInfo, DeviceInfo, DeviceNotFoundError,
                       DeviceRef, PlacementError, RpcServerError, backend_status)
from ._placement import Backends, PlacedModel, Placement, assign_layers, list_devices, resolve_device
from ._rpc import (RPC_DEFAULT_PORT, RPC_SCHEME, LocalRpcServer, RpcServerInfo, free_port, local_rpc_server,
                   main_rpc_server, parse_rpc_spec, probe_rpc)

__all__ = [
    "PlacementError", "DeviceNotFoundError", "BackendNotBuiltError", "RpcServerError",
    "BufferTypeInfo", "DeviceInfo", "DeviceRef", "BackendStatus", "RpcServerInfo", "LocalRpcServer",
    "Placement", "PlacedModel", "Backends",
    "FAMILIES", "backend_status", "list_devices", "resolve_device", "assign_layers", "probe_rpc", "parse_rpc_spec",
    "local_rpc_server", "free_port", "main_rpc_server",
]

"""A llama-family GGUF model loaded into ggml backend buffers: llama.cpp's ``llama_model`` for arch ``llama``.

Weights are read with the ``gguf`` package and copied into one backend buffer per buffer type: the token
embeddings on the CPU (llama.cpp's input layer), layer ``il`` on ``dev_layer(il)``, the output norm and head on
``dev_output()``.  Both hooks default to the CPU device; another module (a backends/placement module) passes its
own to put layers elsewhere.  As llama.cpp (``make_cpu_buft_list`` / ``select_weight_buft``), a weight on the CPU
goes to the first of the CPU's extra buffer types (``CPU_REPACK``: Q4_0, Q4_K, IQ4_NL ... in repacked layouts with
their own matrix kernels) whose device supports the op that uses it, else to the plain CPU buffer type; a weight no
buffer type can serve is a ValueError naming the tensor, its type and the op.  The object is what
:class:`~kvcache_ggml.cache.KVCache` expects of a model:
``hparams``, ``dev_layer(il)`` and ``get_rope_freq_base/scale/factors(cparams, il)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .. import ggml as G
from .._gguf import GGUFFile, read_kv
from ..cache.kvcache import KVCache
from ..cache.types import KVCacheParams
from ..cparams import layer_rope_freq
from ..hparams import HParams, RopeType, SwaType
from . import graph as _llama
from .arch import ArchRuntime, runtime_for

__all__ = ["Model", "LayerWeights", "cpu_device", "RUNTIME"]

_SUPPORTED_ARCHS = ("llama",)
_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                  "ffn_down")
# the op that uses each weight (llama.cpp's LLM_TENSOR_INFOS); None: no op check (plain buffer type)
_OP_OF = {"token_embd": "GET_ROWS", "attn_norm": "MUL", "ffn_norm": "MUL", "output_norm": "MUL", "rope_freqs": None,
          "attn_q_norm": "MUL", "attn_k_norm": "MUL", "rope_factors_long": None, "rope_factors_short": None}
_DUP_SEP = "@"   # NAME@il: the copy of a layer-duplicated tensor for the device whose first layer is il
# the optional per-layer tensors of llama.cpp's llama loader that the graph uses (the Q/K/V biases)
_QKV_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias")


def cpu_device() -> int:
    """The CPU's ggml_backend_dev_t."""
    dev = G.ggml_backend_dev_by_type(int(G.DeviceType.CPU))
    if not dev:
        raise RuntimeError("ggml has no CPU device")
    return dev


def _dev_ptr(dev: Any) -> int:
    return G.handle(dev, "a ggml device from a device hook")


@dataclass(slots=True)
class LayerWeights:
    """The tensors of one transformer block (ggml ``ne`` order)."""

    attn_norm: Any    # F32 [n_embd]
    wq: Any           # [n_embd, n_embd_head_k*n_head]
    wk: Any           # [n_embd, n_embd_k_gqa]
    wv: Any           # [n_embd, n_embd_v_gqa]
    wo: Any           # [n_embd_head_v*n_head, n_embd]
    ffn_norm: Any     # F32 [n_embd]
    ffn_gate: Any     # [n_embd, n_ff]
    ffn_up: Any       # [n_embd, n_ff]
    ffn_down: Any     # [n_ff, n_embd]
    bq: Any = None            # F32 [n_embd_head_k*n_head] bias of Q (Qwen2; llama's optional one) or None
    bk: Any = None            # F32 [n_embd_k_gqa] bias of K or None
    bv: Any = None            # F32 [n_embd_v_gqa] bias of V or None
    attn_q_norm: Any = None   # F32 [n_embd_head_k] RMS norm weight of every Q head (Qwen3) or None
    attn_k_norm: Any = None   # F32 [n_embd_head_k] RMS norm weight of every K head (Qwen3) or None


@dataclass(slots=True)
class _Placement:
    """One buffer type's tensors: a no_alloc context and, once loaded, the buffer holding their data."""

    buft: int                          # ggml_backend_buffer_type_t
    names: list[str]                   # GGUF tensor names placed here
    ctx: G.Context | None = None       # tensor metadata
    buf: G.BackendBuffer | None = None  # tensor data


class Model:
    """Weights and hyper-parameters of a llama GGUF, owned until :meth:`close` (or the ``with`` block ends)."""

    ARCHS: tuple[str, ...] = _SUPPORTED_ARCHS   # general.architecture values this class loads
    ROPE_TYPE = RopeType.NORM                  # the RoPE those architectures use
    ROPE_SCALINGS: tuple[str, ...] = ("none", "linear", "yarn")  # {arch}.rope.scaling.type values it computes
    SLIDING_WINDOW = False                     # llama.cpp reads {arch}.attention.sliding_window for the arch
    PARTIAL_ROPE = False                       # RoPE may rotate fewer dims than a head has (n_rot < head size)
    NAMES_ATTN_OUT = True                      # the graph names the attention's output "attn_out" (as llama's)

    def __new__(cls, path: str | PathLike, **kwargs: Any) -> "Model":
        """``Model(path)`` opens every supported architecture, as llama_model_load_from_file does: it makes the
        model class of the file's ``general.architecture`` (a :class:`~kvcache_ggml.runtime.gemma.GemmaModel` for a
        Gemma GGUF, a subclass of Model).  A subclass called by name loads its own architectures only."""
        del kwargs
        if cls is Model and Path(path).is_file():
            sub = runtime_for(str(read_kv(path).get("general.architecture"))).model_class
            if sub is not Model:
                return super().__new__(sub)
        return super().__new__(cls)

    def __init__(self, path: str | PathLike, *, dev_layer: Callable[[int], Any] | None = None,
                 dev_output: Callable[[], Any] | None = None, use_extra_bufts: bool = True) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"model file {str(self.path)!r} does not exist")
        self.hparams: HParams = HParams.from_gguf(self.path)
        hp = self.hparams
        if hp.arch not in self.ARCHS:
            raise ValueError(f"{self.path}: architecture {hp.arch!r} is not supported (supported: "
                             f"{', '.join(self.ARCHS)})")
        if hp.rope_type != self.ROPE_TYPE:
            raise ValueError(f"{self.path}: rope type {hp.rope_type.name}, expected {self.ROPE_TYPE.name} for "
                             f"arch {hp.arch}")
        if hp.n_embd_head_k != hp.n_embd_head_v or (hp.n_rot != hp.n_embd_head_k and not self.PARTIAL_ROPE):
            raise ValueError(f"{self.path}: {hp.arch} needs n_embd_head_k == n_embd_head_v == n_rot, got "
                             f"{hp.n_embd_head_k}, {hp.n_embd_head_v}, {hp.n_rot}")
        self._dev_layer_hook = dev_layer
        self._dev_output_hook = dev_output
        self._cpu_dev = cpu_device()
        # llama.cpp's CPU buffer-type list: the extra (repacked) types first, the plain CPU type last
        self._cpu_bufts = ((G.extra_bufts(self._cpu_dev) if use_extra_bufts else [])
                           + [G.ggml_backend_dev_buffer_type(self._cpu_dev)])
        self._placements: list[_Placement] = []
        self.tensors: dict[str, Any] = {}        # GGUF name -> tensor handle in a backend buffer
        self.layers: list[LayerWeights] = []
        self.tok_embd: Any = None                # [n_embd, n_vocab]
        self.output_norm: Any = None             # F32 [n_embd]
        self.output: Any = None                  # [n_embd, n_vocab] (token_embd when tied)
        self.rope_freqs: Any = None              # F32 [n_rot/2] frequency factors, or None
        self._layer_copies: dict[str, list[Any]] = {}  # duplicated tensor -> its copy for each layer
        self._copy_suffix: list[str] = []        # per layer: "" (layer 0's device) or "@il" of its device's copy

        reader = GGUFFile(self.path)
        self._check_rope_and_window(reader.kv)
        self.gguf_kv: dict[str, Any] = reader.kv                 # every key/value of the file (the tokenizer's)
        self.name = reader.kv.get("general.name", self.path.stem)
        self.vocab: list[str] = list(reader.kv.get("tokenizer.ggml.tokens", []))
        self.bos_token_id = int(reader.kv.get("tokenizer.ggml.bos_token_id", -1))
        self.eos_token_id = int(reader.kv.get("tokenizer.ggml.eos_token_id", -1))
        try:
            self._load(reader)
        except BaseException:
            self.close()
            raise
        self.n_vocab = G.ne(self.output)[1]
        if hp.n_vocab and hp.n_vocab != self.n_vocab:
            raise ValueError(f"{self.path}: the output has {self.n_vocab} rows but the vocabulary {hp.n_vocab} "
                             "tokens")
        hp.n_vocab = self.n_vocab

    def layer_tensors(self) -> tuple[str, ...]:
        """The per-layer tensors every layer of the architecture has (``blk.{il}.NAME.weight``)."""
        return _LAYER_TENSORS

    def optional_tensors(self) -> tuple[str, ...]:
        """Tensors outside the layers loaded when the file has them."""
        return ("output.weight", "rope_freqs.weight")

    def extra_layer_tensors(self) -> tuple[str, ...]:
        """Per-layer tensors beyond llama's that a subclass's architecture loads (``blk.{il}.NAME.weight``)."""
        return ()

    def optional_layer_tensors(self) -> tuple[str, ...]:
        """Per-layer tensors loaded when the file has them (``blk.{il}.NAME``, suffix included): llama.cpp's
        llama loader takes Q/K/V biases (Qwen2's are always there)."""
        return _QKV_BIASES

    def _check_rope_and_window(self, kv: dict[str, Any]) -> None:
        """As llama.cpp's loader: a RoPE scaling type the graph does not compute is a ValueError (the context's
        parameters apply the others: CParams.from_hparams); an architecture whose loader ignores the sliding window
        has none."""
        hp = self.hparams
        scaling = str(kv.get(f"{hp.arch}.rope.scaling.type", "linear"))
        if scaling not in self.ROPE_SCALINGS:
            raise ValueError(f"{self.path}: rope scaling type {scaling!r} is not supported for arch {hp.arch} "
                             f"(supported: {', '.join(self.ROPE_SCALINGS)})")
        if not self.SLIDING_WINDOW and hp.n_swa:
            hp.n_swa, hp.swa_type, hp.swa_layers = 0, SwaType.NONE, (False,) * hp.n_layer

    # ------------------------------------------------------------------ the KVCache's model interface

    def dev_layer(self, il: int) -> int:
        """The ggml_backend_dev_t holding layer il (the CPU unless a hook says otherwise)."""
        if not 0 <= il < self.hparams.n_layer:
            raise ValueError(f"layer index il={il} out of range [0, n_layer={self.hparams.n_layer})")
        return self._cpu_dev if self._dev_layer_hook is None else _dev_ptr(self._dev_layer_hook(il))

    def dev_output(self) -> int:
        """The ggml_backend_dev_t holding the output norm and head."""
        return self._cpu_dev if self._dev_output_hook is None else _dev_ptr(self._dev_output_hook())

    def get_rope_freq_base(self, cparams: Any, il: int) -> float:
        return layer_rope_freq(self.hparams, cparams, il)[0]

    def get_rope_freq_scale(self, cparams: Any, il: int) -> float:
        return layer_rope_freq(self.hparams, cparams, il)[1]

    def get_rope_factors(self, cparams: Any, il: int) -> Any:
        """The ``rope_freqs`` tensor (llama 3 frequency factors) on layer il's device, or None."""
        del cparams
        return self.layer_copy("rope_freqs.weight", il)

    def layer_duplicated_tensors(self) -> tuple[str, ...]:
        """Tensors outside the blocks that every layer's graph reads, loaded once per device holding layers (as
        llama.cpp creates them per layer, TENSOR_DUPLICATED, in the layer's buffer type): a layer's op then never
        reads another device's weight (which would move the op there)."""
        return ("rope_freqs.weight",)

    def layer_copy(self, name: str, il: int) -> Any:
        """The copy of duplicated tensor ``name`` on layer il's device (None when the file lacks the tensor)."""
        copies = self._layer_copies.get(name)
        return None if copies is None else copies[il]

    def buffers(self) -> list[G.BackendBuffer]:
        """The backend buffers holding the weights, one per buffer type used."""
        return [pl.buf for pl in self._placements if pl.buf is not None]

    def devices(self) -> list[int]:
        """Distinct devices holding weights, in first-use order (the CPU included when it holds any)."""
        seen: list[int] = []
        for pl in self._placements:
            dev = G.ggml_backend_buft_get_device(pl.buft) or self._cpu_dev
            if dev not in seen:
                seen.append(dev)
        return seen

    def buffer_types(self) -> dict[str, str]:
        """GGUF tensor name -> name of the buffer type holding it ("CPU", "CPU_REPACK", ...)."""
        return {name: G.buft_name(pl.buft) for pl in self._placements for name in pl.names}

    # ------------------------------------------------------------------ sizes

    def n_params(self) -> int:
        return sum(G.nelements(t) for t in self.tensors.values())

    def size_bytes(self) -> int:
        return sum(pl.buf.size for pl in self._placements if pl.buf is not None)

    # ------------------------------------------------------------------ loading

    def _buft_of(self, name: str, wtype: int, ne: tuple[int, ...]) -> int:
        """The buffer type of weight ``name``: the first of its device's list that supports the op using it
        (llama.cpp's lists: a GPU's own buffer type, then the CPU list; the CPU list is the extra types, then the
        plain CPU type)."""
        if name.startswith("blk."):
            dev = self.dev_layer(int(name.split(".")[1]))
        elif _DUP_SEP in name or name in self.layer_duplicated_tensors():  # a layer's copy (layer 0's: no suffix)
            dev = self.dev_layer(int(name.split(_DUP_SEP)[1]) if _DUP_SEP in name else 0)
        elif name in ("output_norm.weight", "output.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
            dev = self.dev_output()
        else:
            dev = self._cpu_dev  # token_embd: the input layer stays on the host, as llama.cpp
        cands = [(self._cpu_dev, b) for b in self._cpu_bufts]
        if G.ggml_backend_dev_type(dev) != G.DeviceType.CPU:
            cands.insert(0, (dev, G.ggml_backend_dev_buffer_type(dev)))
        # a bias is always added (llama.cpp's create_tensor: suffix "bias" -> GGML_OP_ADD)
        op = "ADD" if name.endswith(".bias") else _OP_OF.get(name.split(_DUP_SEP)[0].split(".")[-2], "MUL_MAT")
        if op is None:
            return cands[0][1] if len(cands) > len(self._cpu_bufts) else cands[-1][1]
        for d, buft in cands:
            # the CPU says yes to every type: a type without a CPU kernel would crash the compute
            cpu_ok = d != self._cpu_dev or G.cpu_can_use(wtype, op)
            if cpu_ok and G.weight_op_supported(d, buft, wtype, ne, op):
                return buft
        raise ValueError(f"{self.path}: tensor {name} has type {G.type_name(wtype)}, which no buffer type can use "
                         f"for {op} (tried {', '.join(G.buft_name(b) for _, b in cands)}; ggml's CPU backend has "
                         f"{'a' if G.cpu_can_use(wtype, op) else 'no'} {op} kernel for it)")

    def _load(self, reader: Any) -> None:
        hp = self.hparams
        by_name = reader.tensors
        need = ["token_embd.weight", "output_norm.weight"]
        need += [f"blk.{il}.{n}.weight" for il in range(hp.n_layer)
                 for n in self.layer_tensors() + self.extra_layer_tensors()]
        missing = [n for n in need if n not in by_name]
        if missing:
            raise ValueError(f"{self.path}: missing tensors {', '.join(missing[:6])}"
                             f"{' ...' if len(missing) > 6 else ''}")
        optional = [f"blk.{il}.{n}" for il in range(hp.n_layer) for n in self.optional_layer_tensors()]
        names = need + [n for n in list(self.optional_tensors()) + optional if n in by_name]
        unused = [n for n in by_name if n.endswith(".bias") and n not in names]  # e.g. Qwen2's output.bias
        if unused:
            raise ValueError(f"{self.path}: tensor {unused[0]} is not supported for arch {hp.arch}")
        names += self._plan_layer_copies([n for n in self.layer_duplicated_tensors() if n in names])

        plan: dict[int, _Placement] = {}
        for name in names:
            rt = by_name[name.split(_DUP_SEP)[0]]
            wtype = _checked_type(self.path, name, rt)
            buft = self._buft_of(name, wtype, rt.ne)
            plan.setdefault(buft, _Placement(buft, [])).names.append(name)
        self._placements = list(plan.values())
        for pl in self._placements:
            pl.ctx = G.Context.for_tensors(len(pl.names))
            for name in pl.names:
                rt = by_name[name.split(_DUP_SEP)[0]]
                # GGUF stores dims in ne order; a layer's copy has the tensor's name, as llama.cpp's
                self.tensors[name] = pl.ctx.new_tensor(rt.type, rt.ne, name.split(_DUP_SEP)[0])
            # a repacking buffer type rearranges the data in ggml_backend_tensor_set
            pl.buf = G.BackendBuffer.for_context(pl.ctx, pl.buft)
            # as llama.cpp's load_tensors: the scheduler keeps each op that uses a weight on the weight's backend
            # (without it, an op next to another backend's layers may be moved there and its weight copied over --
            # from CPU_REPACK, whose buffers cannot be read back, a NULL call)
            pl.buf.usage = G.BufferUsage.WEIGHTS
            for name in pl.names:
                t = self.tensors[name]
                _upload(t, reader.data(name.split(_DUP_SEP)[0], G.nbytes(t)), name)
            # the weights in huge pages: llama.cpp maps the file, whose page cache the kernel may hold in large
            # folios; our copies are anonymous memory, in 4 KiB pages unless advised (docs/performance.md)
            pl.buf.advise_huge_pages()

        t = self.tensors
        self.tok_embd = t["token_embd.weight"]
        self.output_norm = t["output_norm.weight"]
        self.output = t.get("output.weight", self.tok_embd)
        self.rope_freqs = t.get("rope_freqs.weight")
        self._layer_copies = {n: [t[n + self._copy_suffix[il]] for il in range(hp.n_layer)]
                              for n in self.layer_duplicated_tensors() if n in t}
        self._bind_layers()
        self._check_shapes()

    def _plan_layer_copies(self, names: list[str]) -> list[str]:
        """The extra copies of the duplicated tensors ``names``: one per device holding layers beyond layer 0's,
        named NAME@il after the first layer il on that device (self._copy_suffix: each layer's suffix)."""
        first: dict[int, int] = {}                       # device -> its first layer
        self._copy_suffix = []
        for il in range(self.hparams.n_layer):
            il0 = first.setdefault(self.dev_layer(il), il)
            self._copy_suffix.append("" if il0 == 0 else f"{_DUP_SEP}{il0}")
        return [n + sfx for n in names for sfx in dict.fromkeys(self._copy_suffix) if sfx]

    def _bind_layers(self) -> None:
        """self.layers from the loaded tensors (one object per layer, what the architecture's graph reads)."""
        t = self.tensors
        for il in range(self.hparams.n_layer):
            b = f"blk.{il}."
            w = [t[f"{b}{n}.weight"] for n in _LAYER_TENSORS]
            self.layers.append(LayerWeights(*w, *(t.get(b + n) for n in _QKV_BIASES + (
                "attn_q_norm.weight", "attn_k_norm.weight"))))

    def _check_shapes(self) -> None:
        hp = self.hparams
        n_embd = hp.n_embd
        n_vocab = G.ne(self.tok_embd)[1]
        want = {"token_embd.weight": (n_embd, n_vocab), "output_norm.weight": (n_embd,)}
        if self.output is not self.tok_embd:
            want["output.weight"] = (n_embd, n_vocab)
        for il in range(hp.n_layer):
            b = f"blk.{il}."
            n_ff = G.ne(self.layers[il].ffn_up)[1]
            want.update({b + "attn_norm.weight": (n_embd,), b + "ffn_norm.weight": (n_embd,),
                         b + "attn_q.weight": (n_embd, hp.n_embd_head_k * hp.n_head(il)),
                         b + "attn_k.weight": (n_embd, hp.n_embd_k_gqa(il)),
                         b + "attn_v.weight": (n_embd, hp.n_embd_v_gqa(il)),
                         b + "attn_output.weight": (hp.n_embd_head_v * hp.n_head(il), n_embd),
                         b + "ffn_gate.weight": (n_embd, n_ff), b + "ffn_up.weight": (n_embd, n_ff),
                         b + "ffn_down.weight": (n_ff, n_embd)})
            for name, n in (("attn_q.bias", hp.n_embd_head_k * hp.n_head(il)), ("attn_k.bias", hp.n_embd_k_gqa(il)),
                            ("attn_v.bias", hp.n_embd_v_gqa(il)), ("attn_q_norm.weight", hp.n_embd_head_k),
                            ("attn_k_norm.weight", hp.n_embd_head_k)):
                if b + name in self.tensors:
                    want[b + name] = (n,)
        if self.rope_freqs is not None:
            want["rope_freqs.weight"] = (hp.n_rot // 2,)
        for name, ne in want.items():
            have = G.ne(self.tensors[name])[:len(ne)]
            if have != ne or any(d != 1 for d in G.ne(self.tensors[name])[len(ne):]):
                raise ValueError(f"{self.path}: tensor {name} has ne {G.ne(self.tensors[name])}, expected {ne}")

    # ------------------------------------------------------------------ ownership

    def close(self) -> None:
        """Free the weight buffers and contexts (idempotent); the model is unusable afterwards."""
        for pl in self._placements:
            if pl.buf is not None:
                pl.buf.close()
            if pl.ctx is not None:
                pl.ctx.close()
        self._placements = []
        self.tensors = {}
        self.layers = []
        self.tok_embd = self.output = self.output_norm = self.rope_freqs = None
        self._layer_copies = {}

    @property
    def closed(self) -> bool:
        return not self._placements

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        hp = self.hparams
        return (f"<Model {self.name!r} {hp.arch}: {hp.n_layer} layers, n_embd {hp.n_embd}, "
                f"{hp.n_head(0)}/{hp.n_head_kv(0)} heads, n_vocab {hp.n_vocab}{' closed' if self.closed else ''}>")


def _checked_type(path: Path, name: str, rt: Any) -> int:
    """The ggml type id of GGUF tensor rt; ValueError naming the tensor when this ggml cannot store that type."""
    t = rt.type
    if t not in G.GGMLType._value2member_map_ or G.blck_size(t) <= 0:
        raise ValueError(f"{path}: tensor {name} has ggml type id {t}, which this ggml ({G.version()}) cannot "
                         "store")
    return t


def _upload(t: Any, data: np.ndarray, name: str) -> None:
    """Copy a GGUF tensor's raw data into ggml tensor t (any buffer)."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    n = G.nbytes(t)
    if raw.nbytes != n:
        raise ValueError(f"tensor {name}: the file holds {raw.nbytes} bytes, ggml expects {n} "
                         f"({G.type_name(G.ttype(t))} ne {G.ne(t)})")
    G.ggml_backend_tensor_set(t, raw.ctypes.data, 0, n)


def _plain_memory(model: Any, params: KVCacheParams, n_ubatch: int, swa_full: bool) -> KVCache:
    del n_ubatch, swa_full
    return KVCache(model, params)


# how the runtime serves llama (kvcache_ggml.runtime.arch's registry): one KVCache, the graph of graph.py
RUNTIME = ArchRuntime(Model, _plain_memory, _llama.graph_capacity, _llama.graph_key, _llama.build_decoder,
                      _llama.set_inputs, fused=True)

"""``python -m kvcache_ggml make-model OUT.gguf``: a random-weight llama GGUF that llama.cpp also loads.

The file has the llama architecture's keys and tensors (``token_embd``, per layer ``attn_norm``, ``attn_q/k/v``,
``attn_output``, ``ffn_norm``, ``ffn_gate/up/down``, then ``output_norm`` and ``output``) and either a minimal SPM
vocabulary (``<unk>``, ``<s>``, ``</s>``, then plain pieces ``t0``, ``t1``, ...) or the tokenizer of another GGUF
(``vocab_from``: every ``tokenizer.*`` key of, say, llama.cpp's ``ggml-vocab-gpt-2.gguf``; the vocabulary size is
then that tokenizer's).  Norm weights stay F32; the matrices take any ggml type the CPU can store (F32, F16, BF16,
Q4_0 ... Q8_0, Q2_K ... Q6_K, the IQ and TQ types, MXFP4), quantized by ggml's own ``ggml_quantize_chunk`` (an
all-ones importance matrix for the types that need one); the embeddings and the output can take another type.
Nothing is downloaded: every weight comes from a seeded numpy generator, or, for a trained llama, from the arrays
given (``weights=`` / ``--weights NPZ``: GGUF tensor names -> numpy [rows, cols], each checked against the spec;
``scripts/train_tiny_llama.py`` writes such a file).  ``--arch gemma2|gemma3`` writes a Gemma model instead
(:mod:`~kvcache_ggml.runtime.gemma_maker`, the same storage and vocabulary options); ``--preset NAME`` a scaled-down
Qwen2.5, Qwen3, Llama 3.2 or Mistral (:mod:`~kvcache_ggml.runtime.family_maker`) or Phi-3 / Phi-3.5 / Phi-4-mini
(:mod:`~kvcache_ggml.runtime.phi3_maker`).
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .maker_common import WEIGHT_TYPES, _add_common_keys, _add_matrix, _checked_spec, check_spec

__all__ = ["ModelSpec", "make_model", "main", "WEIGHT_TYPES", "check_spec"]


@dataclass(slots=True)
class ModelSpec:
    """Shape and storage of the model to write."""

    layers: int = 2          # transformer blocks
    embd: int = 64           # embedding width (n_embd)
    heads: int = 4           # query heads; the head size is embd / heads
    heads_kv: int = 2        # key/value heads (grouped-query attention when < heads)
    ff: int = 128            # feed-forward width (n_ff)
    vocab: int = 64          # vocabulary size, >= 4 (three special tokens + pieces)
    seed: int = 0            # numpy seed of the weights
    ctx: int = 4096          # llama.context_length (the training context)
    type: str = "f32"        # ggml type of the matrices (WEIGHT_TYPES; norms are always f32)
    embd_type: str = ""      # ggml type of token_embd and output ("" = type)
    vocab_from: str = ""     # a GGUF whose tokenizer.* keys to copy ("" = the minimal SPM vocabulary of `vocab`)
    rope_freq_base: float = 10000.0  # llama.rope.freq_base
    rms_eps: float = 1e-5    # llama.attention.layer_norm_rms_epsilon
    tied: bool = False       # no output.weight: the head is token_embd (llama.cpp's tied embeddings)
    chat_template: str = ""  # tokenizer.chat_template, a jinja2 template ("" = none)

    def check(self) -> None:
        """ValueError naming the first value out of its range."""
        check_spec(self, ("layers", "embd", "heads", "heads_kv", "ff", "ctx"), ("embd", "ff"))
        if self.embd % self.heads:
            raise ValueError(f"embd {self.embd} must be a multiple of heads {self.heads}")
        if (self.embd // self.heads) % 2:
            raise ValueError(f"the head size embd/heads = {self.embd // self.heads} must be even (RoPE pairs)")

    @property
    def head_dim(self) -> int:
        return self.embd // self.heads


def _tensor_plan(spec: ModelSpec, n_vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape) of every tensor in file order: numpy [rows, cols] = ggml ne [cols, rows]; the norm
    weights are [n_embd]."""
    e, n_kv = spec.embd, spec.head_dim * spec.heads_kv
    plan: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (n_vocab, e))]
    for il in range(spec.layers):
        b = f"blk.{il}."
        plan += [(b + "attn_norm.weight", (e,)), (b + "attn_q.weight", (e, e)), (b + "attn_k.weight", (n_kv, e)),
                 (b + "attn_v.weight", (n_kv, e)), (b + "attn_output.weight", (e, e)), (b + "ffn_norm.weight", (e,)),
                 (b + "ffn_gate.weight", (spec.ff, e)), (b + "ffn_up.weight", (spec.ff, e)),
                 (b + "ffn_down.weight", (e, spec.ff))]
    plan.append(("output_norm.weight", (e,)))
    if not spec.tied:
        plan.append(("output.weight", (n_vocab, e)))
    return plan


def _random_weights(plan: list[tuple[str, tuple[int, ...]]], seed: int) -> list[np.ndarray]:
    """Seeded weights in plan order: unit-variance embeddings (the first RMS norm sees O(1) values), matrices of
    std 1.6/sqrt(fan_in) (activations stay O(1) through the blocks), norm weights 1 + 0.1 N(0, 1)."""
    rng = np.random.default_rng(seed)
    out = []
    for name, shape in plan:
        if len(shape) == 1:
            out.append((1.0 + 0.1 * rng.standard_normal(shape[0])).astype(np.float32))
        elif name == "token_embd.weight":
            out.append(rng.standard_normal(shape))
        else:
            out.append(rng.standard_normal(shape) * (1.6 / math.sqrt(shape[1])))
    return out


def _given_weights(plan: list[tuple[str, tuple[int, ...]]], weights) -> list[np.ndarray]:
    """The arrays of ``weights`` (name -> array) in plan order; ValueError naming a missing, extra, misshapen or
    non-finite tensor."""
    extra = sorted(set(weights) - {name for name, _ in plan})
    if extra:
        raise ValueError(f"weights: {len(extra)} tensor(s) the model does not have, e.g. {extra[0]!r}")
    out = []
    for name, shape in plan:
        if name not in weights:
            raise ValueError(f"weights: {name} is missing")
        w = np.asarray(weights[name])
        if w.shape != shape:
            raise ValueError(f"weights: {name} has shape {w.shape}, the model needs {shape} "
                             "(numpy [rows, cols] = ggml ne [cols, rows])")
        if not np.isfinite(w).all():
            raise ValueError(f"weights: {name} has non-finite values")
        out.append(w.astype(np.float32))
    return out


def make_model(path: str | Path, spec: ModelSpec | None = None, *, weights=None, **kwargs) -> Path:
    """Write the model described by ``spec`` (or by keyword arguments of :class:`ModelSpec`) to ``path``.

    ``weights``: None for seeded random weights, or a mapping GGUF tensor name -> float array (numpy [rows, cols]
    = ggml ne [cols, rows], e.g. ``np.load(npz)``) holding exactly the tensors of the spec, each of its shape (a
    trained model: ``scripts/train_tiny_llama.py``); they are stored as ``spec.type`` / ``embd_type`` all the same.
    """
    import gguf

    spec = _checked_spec(ModelSpec, spec, kwargs)
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), "llama")
    try:
        n_vocab = _add_common_keys(writer, gguf, spec, "llama")
        writer.add_rope_dimension_count(spec.head_dim)
        if spec.chat_template:
            writer.add_chat_template(spec.chat_template)
        plan = _tensor_plan(spec, n_vocab)
        arrays = _random_weights(plan, spec.seed) if weights is None else _given_weights(plan, weights)
        for (name, _), w in zip(plan, arrays):
            if w.ndim == 1:
                writer.add_tensor(name, w.astype(np.float32))
            else:
                wtype = (spec.embd_type or spec.type) if name in ("token_embd.weight", "output.weight") else spec.type
                _add_matrix(writer, gguf, name, w, wtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path


def main(argv: list[str]) -> int:
    d = ModelSpec()
    ap = argparse.ArgumentParser(prog="python -m kvcache_ggml make-model",
                                 description="Write a random-weight llama (or Gemma) GGUF that llama.cpp also loads.")
    ap.add_argument("out", help="output .gguf path")
    ap.add_argument("--layers", type=int, default=d.layers, help="transformer blocks (default %(default)s)")
    ap.add_argument("--embd", type=int, default=d.embd, help="embedding width (default %(default)s)")
    ap.add_argument("--heads", type=int, default=d.heads, help="query heads (default %(default)s)")
    ap.add_argument("--heads-kv", type=int, default=d.heads_kv, help="key/value heads (default %(default)s)")
    ap.add_argument("--ff", type=int, default=d.ff, help="feed-forward width (default %(default)s)")
    ap.add_argument("--vocab", type=int, default=d.vocab, help="vocabulary size (default %(default)s)")
    ap.add_argument("--seed", type=int, default=d.seed, help="weight seed (default %(default)s)")
    ap.add_argument("--ctx", type=int, default=d.ctx, help="training context length (default %(default)s)")
    ap.add_argument("--type", choices=WEIGHT_TYPES, default=d.type, help="matrix storage (default %(default)s)")
    ap.add_argument("--embd-type", choices=WEIGHT_TYPES, help="token_embd/output storage (default: --type)")
    ap.add_argument("--vocab-from", default="", metavar="GGUF",
                    help="copy the tokenizer of this GGUF (e.g. llama.cpp's ggml-vocab-gpt-2.gguf); --vocab is ignored")
    ap.add_argument("--tied", action="store_true", help="no output.weight: the head reuses token_embd")
    ap.add_argument("--weights", type=Path, metavar="NPZ",
                    help="llama: take the weights from this .npz (GGUF tensor names -> numpy [rows, cols] arrays) "
                         "instead of random ones; --layers, --embd, --ff, --vocab and --tied follow its shapes")
    ap.add_argument("--arch", choices=("llama", "gemma2", "gemma3"), default="llama",
                    help="architecture (default %(default)s); gemma: head size embd/heads, every other layer slides")
    ap.add_argument("--n-swa", type=int, default=16, help="gemma: sliding window (default %(default)s)")
    ap.add_argument("--preset", help="a scaled-down published model of runtime.family_maker.PRESETS (qwen2.5-0.5b, "
                    "qwen3-0.6b, llama3.2-1b, mistral-7b) or runtime.phi3_maker.PHI3_PRESETS (phi3-mini-4k, "
                    "phi3.5-mini, phi4-mini); of the options only --seed, --type, --embd-type, --vocab-from apply")
    a = ap.parse_args(argv)
    if a.preset:
        return _main_preset(ap, a)
    weights = None
    if a.weights is not None:
        if a.arch != "llama":
            ap.error("--weights: llama only")
        weights = dict(np.load(a.weights))
        try:
            _shape_from_weights(a, weights)
        except (KeyError, IndexError) as e:
            ap.error(f"--weights {a.weights}: no llama tensors ({e})")
    spec = ModelSpec(layers=a.layers, embd=a.embd, heads=a.heads, heads_kv=a.heads_kv, ff=a.ff, vocab=a.vocab,
                     seed=a.seed, ctx=a.ctx, type=a.type, tied=a.tied, embd_type=a.embd_type or "",
                     vocab_from=a.vocab_from)
    try:
        if a.arch != "llama":
            from .gemma_maker import GemmaSpec, make_gemma_model
            out = make_gemma_model(a.out, GemmaSpec(
                arch=a.arch, layers=a.layers, embd=a.embd, heads=a.heads, heads_kv=a.heads_kv,
                head_dim=spec.head_dim, ff=a.ff, vocab=a.vocab, seed=a.seed, ctx=a.ctx, type=a.type, n_swa=a.n_swa,
                tied=a.tied or a.arch == "gemma2", embd_type=spec.embd_type, vocab_from=spec.vocab_from))
        else:
            out = make_model(a.out, spec, weights=weights)
    except ValueError as e:
        ap.error(str(e))
    print(out)
    return 0


def _main_preset(ap: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    """make-model --preset NAME: family_maker's or phi3_maker's preset with the storage, seed and vocabulary options
    applied."""
    from .family_maker import PRESETS, make_family_model
    from .phi3_maker import PHI3_PRESETS, make_phi3_model
    if a.preset not in PRESETS and a.preset not in PHI3_PRESETS:
        ap.error(f"preset {a.preset!r} is not one of {', '.join(list(PRESETS) + list(PHI3_PRESETS))}")
    make = make_phi3_model if a.preset in PHI3_PRESETS else make_family_model
    try:
        out = make(a.out, a.preset, seed=a.seed, type=a.type, embd_type=a.embd_type or "", vocab_from=a.vocab_from)
    except ValueError as e:
        ap.error(str(e))
    print(out)
    return 0


def _shape_from_weights(a: argparse.Namespace, weights: dict) -> None:
    """Set a's layers, embd, ff, vocab and tied from the shapes of explicit weights (heads stay as given)."""
    a.vocab, a.embd = weights["token_embd.weight"].shape
    a.layers = sum(1 for k in weights if k.startswith("blk.") and k.endswith(".attn_q.weight"))
    a.ff = weights["blk.0.ffn_up.weight"].shape[0]
    a.tied = a.tied or "output.weight" not in weights

#!/usr/bin/env python3
"""Train a tiny llama on English text offline with PyTorch (CPU) and export it as a GGUF with the GPT-2 vocabulary.

A real, trained model for ``python -m kvcache_ggml generate`` on a machine without a model hub: the corpus is the
prose of the Python standard library's docstrings (every paragraph of every module, class and function docstring
that reads as text: no doctests, no indented blocks, at least 90 % letters and spaces), tokenized with llama.cpp's
GPT-2 vocabulary (``tests/data/vocab/ggml-vocab-gpt-2.gguf``, through ``kvcache_ggml.runtime.tokenizer.Vocab``).

The model is exactly what llama.cpp's ``llama`` architecture computes, so the GGUF needs no conversion:

* RMSNorm (eps 1e-5) before attention and before the SwiGLU feed-forward, a final RMSNorm, tied embeddings
  (no ``output.weight``), no biases, attention scale 1/sqrt(head_dim);
* RoPE in llama.cpp's NORM mode (``LLAMA_ROPE_TYPE_NORM``, what the llama architecture uses): dims (2i, 2i+1) of
  each head rotated together by pos * 10000^(-2i/head_dim).  HuggingFace's llama rotates (i, i + head_dim/2)
  instead, which is why convert_hf_to_gguf.py permutes the rows of Q and K; a model *trained* with NORM RoPE is
  stored as is, with no permutation.
* Weights in the GGUF layout: a torch ``Linear(in, out).weight`` is [out, in] = ggml ne [in, out], as llama.cpp
  reads ``attn_q.weight`` etc.

Only the tokens that occur in the corpus (about 9 800 of 50 257) get trained embedding rows; the GGUF carries the
full vocabulary and the other rows are zero, so their logits are exactly 0.  Training uses the loss of that
exported model over the full vocabulary: the softmax over the used tokens plus one column log(n_unused), the
n_unused tokens of logit 0.  So the model learns to put its predictions above 0 and greedy decoding never picks an
unused token where the trained one is likely.

Run it with a PyTorch venv kept outside the project (torch is no dependency of kvcache_ggml), with the repository
on the path for the tokenizer, and the project's own Python for the export (``make-model --weights``):

    python3 -m venv /tmp/trainvenv && /tmp/trainvenv/bin/pip install torch numpy tokenizers   # a CPU torch
    PYTHONPATH=. nice -n 19 /tmp/trainvenv/bin/python scripts/train_tiny_llama.py --out /tmp/tinyllama \\
        --kv-python .venv/bin/python
    PYTHONPATH=. .venv/bin/python scripts/check_tiny_llama.py --dir /tmp/tinyllama      # export and llama.cpp checks

Writes to ``--out``: ``corpus.txt`` (the text), ``weights.npz`` (GGUF tensor names -> float32 arrays in numpy
[rows, cols] = ggml ne [cols, rows] order), ``probe.npz`` (``tokens``: a tokenized probe text,
``logits``: float64 [n_tokens, 50257] of the trained model on them, to check the export against), ``hparams.json``,
``train.log``, and, with ``--kv-python``, ``tiny-llama-f32.gguf`` and ``tiny-llama-q8_0.gguf`` (Q8_0 by ggml's own
quantize; about 30 and 9 MiB, kept out of the repository).  ``--export-only`` redoes the export from an existing
``weights.npz``.

Training is seeded (one thread by default: the machine is shared).  The learning rate warms up for 100 steps, then
follows a cosine down to a tenth over ``--steps`` steps or ``--max-minutes`` minutes, whichever ends first; only the
step-bound run is bit-reproducible (on the same torch and CPU).  docs/text.md has the run behind its transcript
(defaults: 4 layers, n_embd 128, 4 heads, n_ff 384, context 128; 35 minutes, 1341 steps, train loss 3.48).
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
VOCAB = REPO / "tests" / "data" / "vocab" / "ggml-vocab-gpt-2.gguf"
PROBE = "Return the number of items in the list. If the file cannot be opened, raise an OSError."


def stdlib_corpus(root: Path) -> str:
    """The prose paragraphs of the docstrings under ``root`` (tests, idlelib, lib2to3, site-packages skipped),
    one per line, each paragraph once, files in sorted order."""
    skip = ("/test", "site-packages", "idlelib", "lib2to3")
    seen: set[str] = set()
    out: list[str] = []
    for f in sorted(root.rglob("*.py")):
        if any(s in str(f) for s in skip):
            continue
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for para in (ast.get_docstring(node) or "").split("\n\n"):
                if ">>>" in para or para.startswith(" ") or "\n " in para:
                    continue
                p = " ".join(para.split())
                if len(p) < 30 or p in seen or sum(c.isalpha() or c == " " for c in p) < 0.9 * len(p):
                    continue
                seen.add(p)
                out.append(p)
    return "\n".join(out)


def build_model(torch, hp: dict, n_used: int):
    """The llama of ``hp`` (layers, embd, heads, ff, ctx) over ``n_used`` embedding rows, as a torch Module."""
    nn, F = torch.nn, torch.nn.functional
    d_head = hp["embd"] // hp["heads"]
    inv = 10000.0 ** (-torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)     # [d_head/2]
    theta = torch.arange(hp["ctx"], dtype=torch.float64)[:, None] * inv[None, :]   # [ctx, d_head/2]

    def rope_norm(x):  # x [batch, heads, T, d_head]: pairs (2i, 2i+1) rotated, llama.cpp's NORM mode
        t = x.shape[2]
        cos, sin = theta[:t].cos().to(x.dtype), theta[:t].sin().to(x.dtype)
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hp["embd"]))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            e, ff = hp["embd"], hp["ff"]
            self.attn_norm, self.ffn_norm = RMSNorm(), RMSNorm()
            self.q, self.k, self.v, self.o = (nn.Linear(e, e, bias=False) for _ in range(4))
            self.gate, self.up = nn.Linear(e, ff, bias=False), nn.Linear(e, ff, bias=False)
            self.down = nn.Linear(ff, e, bias=False)

        def forward(self, x):
            b, t, e = x.shape
            h = self.attn_norm(x)
            q, k, v = (m(h).view(b, t, hp["heads"], d_head).transpose(1, 2) for m in (self.q, self.k, self.v))
            a = F.scaled_dot_product_attention(rope_norm(q), rope_norm(k), v, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, t, e))
            h = self.ffn_norm(x)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.embd = nn.Embedding(n_used, hp["embd"])
            nn.init.normal_(self.embd.weight, std=0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(hp["layers"]))
            self.norm = RMSNorm()

        def forward(self, idx):  # idx [batch, T] of used-token indices -> logits [batch, T, n_used]
            x = self.embd(idx)
            for blk in self.blocks:
                x = blk(x)
            return self.norm(x) @ self.embd.weight.T

    return Llama()


def full_vocab_loss(torch, logits, target, n_unused: int):
    """Cross-entropy of the exported model: the used tokens' logits plus the n_unused tokens of logit 0."""
    extra = torch.full(logits.shape[:-1] + (1,), math.log(n_unused), dtype=logits.dtype)
    return torch.nn.functional.cross_entropy(torch.cat((logits, extra), -1).flatten(0, -2), target.flatten())


def gguf_weights(model, used: np.ndarray, n_vocab: int, hp: dict) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 numpy array (numpy [rows, cols] = ggml ne [cols, rows])."""
    sd = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}
    embd = np.zeros((n_vocab, hp["embd"]))
    embd[used] = sd["embd.weight"]
    w = {"token_embd.weight": embd, "output_norm.weight": sd["norm.weight"]}
    names = {"attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight", "attn_q.weight":
             "q.weight", "attn_k.weight": "k.weight", "attn_v.weight": "v.weight", "attn_output.weight":
             "o.weight", "ffn_gate.weight": "gate.weight", "ffn_up.weight": "up.weight", "ffn_down.weight":
             "down.weight"}
    for il in range(hp["layers"]):
        for gname, tname in names.items():
            w[f"blk.{il}.{gname}"] = sd[f"blocks.{il}.{tname}"]
    return {k: v.astype(np.float32) for k, v in w.items()}


def train(torch, a, ids: np.ndarray, used: np.ndarray, n_vocab: int, hp: dict, log) -> dict[str, np.ndarray]:
    """Train the model on ``ids`` (token ids); returns the GGUF weights and writes probe.npz."""
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    remap = np.full(n_vocab, -1, np.int64)
    remap[used] = np.arange(len(used))
    data = torch.from_numpy(remap[ids])
    n_val = len(ids) // 50                                        # the last 2 %: held out, for an honest loss
    train_data, val_data = data[:-n_val], data[-n_val:]
    model = build_model(torch, hp, len(used))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    n_unused = n_vocab - len(used)
    t0, avg = time.time(), None

    def batch(src, starts):
        x = torch.stack([src[s:s + hp["ctx"] + 1] for s in starts])
        return x[:, :-1], x[:, 1:]

    step = 0
    while True:
        # the cosine schedule runs on steps, or on wall time when --max-minutes comes first (then not bit-reproducible)
        progress = max(step / a.steps, (time.time() - t0) / (a.max_minutes * 60))
        if progress >= 1.0:
            break
        lr = a.lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch(train_data, rng.integers(0, len(train_data) - hp["ctx"] - 1, a.batch))
        loss = full_vocab_loss(torch, model(x), y, n_unused)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        avg = loss.item() if avg is None else 0.98 * avg + 0.02 * loss.item()
        if step % 100 == 0:
            log(f"step {step} loss {avg:.3f} lr {lr:.2e} {time.time() - t0:.0f} s")
        step += 1
    with torch.no_grad():
        model.eval()
        starts = range(0, len(val_data) - hp["ctx"] - 1, hp["ctx"])
        x, y = batch(val_data, starts)
        val = full_vocab_loss(torch, model(x), y, n_unused).item()
        log(f"done: {step} steps in {time.time() - t0:.0f} s, train loss (EMA) {avg:.3f}, held-out loss "
            f"{val:.3f} over {x.numel()} tokens")
    return gguf_weights(model, used, n_vocab, hp)


def probe_logits(torch, hp: dict, w: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    """float64 [n_tokens, n_vocab]: the exported weights (all rows) run by the torch model in float64."""
    n_vocab = w["token_embd.weight"].shape[0]
    model = build_model(torch, hp, n_vocab).double()
    sd = {"embd.weight": w["token_embd.weight"], "norm.weight": w["output_norm.weight"]}
    for k, v in w.items():
        if k.startswith("blk."):
            il, gname = k.split(".", 2)[1:]
            tname = {"attn_q.weight": "q.weight", "attn_k.weight": "k.weight", "attn_v.weight": "v.weight",
                     "attn_output.weight": "o.weight", "ffn_gate.weight": "gate.weight", "ffn_up.weight":
                     "up.weight", "ffn_down.weight": "down.weight"}.get(gname, gname)
            sd[f"blocks.{il}.{tname}"] = v
    model.load_state_dict({k: torch.from_numpy(np.asarray(v, np.float64)) for k, v in sd.items()})
    with torch.no_grad():
        return model(torch.tensor([tokens]))[0].numpy()


def export(a, out: Path, hp: dict, log) -> None:
    """make-model --weights through the project's Python: an F32 and a Q8_0 GGUF."""
    for wtype in ("f32", "q8_0"):
        path = out / f"tiny-llama-{wtype}.gguf"
        cmd = [a.kv_python, "-m", "kvcache_ggml", "make-model", str(path), "--weights", str(out / "weights.npz"),
               "--heads", str(hp["heads"]), "--heads-kv", str(hp["heads"]), "--ctx", str(hp["ctx"]),
               "--vocab-from", str(VOCAB), "--tied", "--type", wtype]
        env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
        subprocess.run(cmd, check=True, env=env)
        log(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")


def run(a: argparse.Namespace, log) -> None:
    """Corpus, training, weights.npz and probe.npz (unless --export-only), then the export (with --kv-python)."""
    hp = {k: getattr(a, k) for k in ("layers", "embd", "heads", "ff", "ctx")}
    if not a.export_only:
        import torch
        sys.path.insert(0, str(REPO))
        from kvcache_ggml.runtime.tokenizer import Vocab

        torch.set_num_threads(a.threads)
        vocab = Vocab.from_gguf(VOCAB)
        text = stdlib_corpus(a.stdlib)
        (a.out / "corpus.txt").write_text(text)
        ids = np.array(vocab.tokenize(text, add_special=False), np.int64)
        used = np.unique(ids)
        log(f"corpus: {len(text)} characters, {len(ids)} tokens, {len(used)} distinct of {vocab.n_tokens}; "
            f"model {json.dumps(hp)}, batch {a.batch}, {a.steps} steps, lr {a.lr}, seed {a.seed}")
        w = train(torch, a, ids, used, vocab.n_tokens, hp, log)
        np.savez(a.out / "weights.npz", **w)
        (a.out / "hparams.json").write_text(json.dumps(hp))
        tokens = vocab.tokenize(PROBE, add_special=False)
        np.savez(a.out / "probe.npz", tokens=np.array(tokens, np.int32), logits=probe_logits(torch, hp, w, tokens))
    if a.kv_python:
        export(a, a.out, json.loads((a.out / "hparams.json").read_text()), log)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/tinyllama"), help="output folder (default %(default)s)")
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                    help="the Python standard library whose docstrings are the corpus (default %(default)s)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ff", type=int, default=384)
    ap.add_argument("--ctx", type=int, default=128, help="training context; the GGUF's context_length")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--max-minutes", type=float, default=35.0,
                    help="stop after this long; the learning-rate schedule then follows the time")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kv-python", default="", help="the project's Python, to export the GGUFs with make-model")
    ap.add_argument("--export-only", action="store_true", help="export an existing weights.npz")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    with open(a.out / "train.log", "a") as logf:
        def log(msg: str) -> None:
            print(msg, flush=True)
            logf.write(msg + "\n")
            logf.flush()

        run(a, log)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

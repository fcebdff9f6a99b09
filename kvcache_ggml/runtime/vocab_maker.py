"""A byte-level BPE vocabulary relabelled as another model's: what the tests use in place of Qwen2's and Llama 3's
vocabularies, which are not downloaded.

:func:`relabel_vocab` copies a GGUF vocabulary (say llama.cpp's ``ggml-vocab-gpt-2.gguf``: its pieces and merges),
sets ``tokenizer.ggml.pre`` to the pre-tokenizer named (``qwen2``: one digit per piece, ``llama-bpe`` and ``gpt-4o``:
up to three, their letter/punctuation/newline rules) and appends the target model's special tokens as CONTROL tokens, with its
BOS/EOS and ``add_bos_token`` as the published GGUF has them (:data:`SPECIALS`).  llama.cpp loads the result
(``vocab_only``), so the same text can be tokenized by both and the ids compared; the model makers copy it into a
random model with ``vocab_from``.
"""
from __future__ import annotations

from dataclasses import dataclass
from os import PathLike
from pathlib import Path

__all__ = ["VocabLabel", "SPECIALS", "relabel_vocab"]


@dataclass(frozen=True, slots=True)
class VocabLabel:
    """What a published vocabulary adds on top of the pieces and merges."""

    pre: str                       # tokenizer.ggml.pre
    special: tuple[str, ...]       # CONTROL tokens (appended unless the source already has that text)
    bos: str                       # text of the BOS token
    eos: str                       # text of the EOS token
    add_bos: bool                  # tokenizer.ggml.add_bos_token


# pre-tokenizer name -> the published vocabulary's special tokens (Qwen2.5-Instruct, Llama 3.2 Instruct, Phi-4-mini)
SPECIALS: dict[str, VocabLabel] = {
    "qwen2": VocabLabel("qwen2", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|endoftext|>", "<|im_end|>",
                        False),
    "llama-bpe": VocabLabel("llama-bpe", ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                          "<|end_header_id|>", "<|eot_id|>"), "<|begin_of_text|>", "<|eot_id|>",
                            True),
    # Phi-4-mini-instruct: <|endoftext|> is BOS and EOS, no BOS added
    "gpt-4o": VocabLabel("gpt-4o", ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
                         "<|endoftext|>", "<|endoftext|>", False),
}
_REPLACED = ("tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
             "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token",
             "tokenizer.ggml.add_eos_token", "tokenizer.ggml.padding_token_id", "tokenizer.chat_template")


def relabel_vocab(src: str | PathLike, dst: str | PathLike, pre: str) -> Path:
    """Write a copy of the byte-level BPE vocabulary ``src`` as ``pre``'s (a key of :data:`SPECIALS`) to ``dst``."""
    import gguf

    from .._gguf import GGUFFile
    from .maker_common import _copy_kv

    if pre not in SPECIALS:
        raise ValueError(f"pre-tokenizer {pre!r} is not one of {', '.join(SPECIALS)}")
    label = SPECIALS[pre]
    f = GGUFFile(src)
    if f.kv.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"{src}: not a byte-level BPE vocabulary (tokenizer.ggml.model != 'gpt2')")
    tokens = list(f.kv["tokenizer.ggml.tokens"])
    types = list(f.kv["tokenizer.ggml.token_type"])
    for text in label.special:
        if text not in tokens:
            tokens.append(text)
            types.append(int(gguf.TokenType.CONTROL))
        else:
            types[tokens.index(text)] = int(gguf.TokenType.CONTROL)
    w = gguf.GGUFWriter(str(dst), str(f.kv["general.architecture"]))
    try:
        for key in f.kv:
            if key.startswith("GGUF.") or key == "general.architecture" or key in _REPLACED:
                continue
            _copy_kv(w, gguf, f, key)
        w.add_tokenizer_pre(label.pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_bos_token_id(tokens.index(label.bos))
        w.add_eos_token_id(tokens.index(label.eos))
        w.add_add_bos_token(label.add_bos)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    return Path(dst)

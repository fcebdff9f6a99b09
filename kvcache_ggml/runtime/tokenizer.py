"""Text to token ids and back from a GGUF's own vocabulary: llama.cpp's ``llama_vocab`` for BPE and SPM models.

:meth:`Vocab.from_gguf` reads the ``tokenizer.ggml.*`` keys (``model``: ``gpt2`` = byte-level BPE, ``llama`` =
SentencePiece; ``pre``: the BPE pre-tokenizer; ``tokens``, ``token_type``, ``scores``, ``merges``, the special ids
and the ``add_*`` flags).  Encoding runs on the HuggingFace ``tokenizers`` library: a BPE model built from the
vocabulary and merges, behind the split expressions llama.cpp uses for that pre-tokenizer (byte-level BPE), or with
merges derived from the SentencePiece scores and byte fallback (SPM: llama.cpp merges the adjacent pair whose merged
piece scores highest, which is BPE with merges ranked by that score).  What ``tokenizers`` does not do is done here
as llama.cpp does it: special tokens are cut out of the text first (``parse_special``; user-defined ones always),
SPM adds the space prefix to each text fragment that follows a special token or starts the text, BOS/EOS are added
per the vocabulary's flags.  The ids of the 256 most recent text pieces between special tokens are kept: a chat's
history, tokenized again at every turn, encodes only its new messages.  Decoding maps each id to its bytes
(:meth:`Vocab.token_to_piece`, byte-level or ``<0xXX>`` byte pieces, ``▁`` as space) so that a stream of ids can be
printed as it comes.
"""
from __future__ import annotations

import codecs
import functools
from array import array
from dataclasses import dataclass, field
from enum import IntEnum
from os import PathLike
from typing import Any, Iterable

__all__ = ["Vocab", "TokenType", "StreamDecoder"]

# llama.cpp's split expressions per tokenizer.ggml.pre (llama-vocab.cpp), applied one after the other
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# gpt-4o (Phi-4-mini, Llama 4): llama.cpp's rewrite of the tokenizer.json expression, whose letter classes it follows
# ([^a-z] / [^A-Z] among letters, so a non-ASCII lowercase letter counts as both cases)
_GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]"
          r"|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]"
          r"|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    # pre -> (expressions, ignore_merges, clean_spaces)
    "gpt-2": ((_GPT2,), False, True), "phi-2": ((_GPT2,), False, True),
    "llama-bpe": ((_LLAMA3,), True, True), "llama3": ((_LLAMA3,), True, True), "llama-v3": ((_LLAMA3,), True, True),
    "smollm": ((r"\p{N}", _GPT2), False, False), "starcoder": ((r"\p{N}", _GPT2), False, True),
    "refact": ((r"\p{N}", _GPT2), False, True), "qwen2": ((_QWEN2,), False, False),
    "default": ((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"), False, True),
    "gpt-4o": ((_GPT4O,), False, False), "llama4": ((_GPT4O,), False, False),
}


class TokenType(IntEnum):
    """tokenizer.ggml.token_type values (llama.cpp's llama_token_type)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (byte-level BPE pieces are strings of these)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_KEY = 3                  # Vocab._special_groups: special tokens grouped by their first characters
_CACHED_FRAGMENTS = 256  # text fragments whose ids Vocab keeps (least recently used dropped first) ...
_CACHED_CHARS = 32768     # ... each of at most this many characters (and as many ids as its UTF-8 has bytes)


@dataclass(slots=True)
class Vocab:
    """A GGUF vocabulary with llama.cpp's tokenize / detokenize."""

    model: str                    # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str                      # tokenizer.ggml.pre ("default" when absent)
    tokens: list[str]             # piece text per id
    types: list[int]              # TokenType per id
    scores: list[float]           # SPM scores per id (empty for BPE)
    merges: list[str]             # BPE merges "a b" in rank order (empty for SPM)
    bos: int = -1                 # BOS id (-1: none)
    eos: int = -1                 # EOS id (-1: none)
    unk: int = -1                 # unknown-piece id (-1: none)
    add_bos: bool = False         # tokenize(add_special=True) starts with BOS
    add_eos: bool = False         # tokenize(add_special=True) ends with EOS
    add_space_prefix: bool = True  # SPM: a space before the text and after each special token
    rstrip: frozenset[int] = frozenset()  # special ids that eat the whitespace after them (Phi-3's, RSTRIP)
    _tk: Any = field(default=None, repr=False)               # the tokenizers.Tokenizer
    _pieces: list[bytes] = field(default_factory=list, repr=False)  # bytes of each id's text
    _special: list[tuple[str, int, bool]] = field(default_factory=list, repr=False)  # (text, id, control/unk)
    # _special's indices by the first _KEY characters of their text: one search of the text rules out a group
    # (Llama 3's 248 reserved tokens share "<|r")
    _special_groups: dict[str, list[int]] = field(default_factory=dict, repr=False)
    _clean_spaces: bool = True    # llama_detokenize's clean-up of spaces before punctuation
    # the ids of recent text fragments (a conversation's history is tokenized again at every turn): a thread-safe
    # functools.lru_cache over _encode, for fragments of at most _CACHED_CHARS characters
    _encode_cached: Any = field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_gguf(cls, path: str | PathLike) -> "Vocab":
        """The vocabulary of a GGUF file."""
        from .._gguf import GGUFFile
        return cls.from_kv(GGUFFile(path).kv, str(path))

    @classmethod
    def from_kv(cls, kv: dict[str, Any], path: str = "<gguf>") -> "Vocab":
        """The vocabulary of a GGUF's key/values (``Model.gguf_kv``)."""

        def get(key: str, default: Any) -> Any:
            return kv.get("tokenizer.ggml." + key, default)

        model = get("model", "")
        tokens = list(get("tokens", []))
        if model not in ("gpt2", "llama") or not tokens:
            raise ValueError(f"{path}: tokenizer model {model!r} with {len(tokens)} tokens is not supported "
                             "(supported: gpt2 byte-level BPE, llama SentencePiece)")
        types = list(get("token_type", [int(TokenType.NORMAL)] * len(tokens)))
        is_spm = model == "llama"
        v = cls(model=model, pre=str(get("pre", "default")), tokens=tokens, types=[int(t) for t in types],
                scores=[float(s) for s in get("scores", [])], merges=list(get("merges", [])),
                bos=int(get("bos_token_id", 1 if is_spm else 11)), eos=int(get("eos_token_id", 2 if is_spm else 11)),
                unk=int(get("unknown_token_id", 0 if is_spm else -1)),
                add_bos=bool(get("add_bos_token", is_spm)), add_eos=bool(get("add_eos_token", False)),
                add_space_prefix=is_spm and bool(get("add_space_prefix", True)))
        if v.pre in ("llama-bpe", "llama3", "llama-v3") and "tokenizer.ggml.add_bos_token" not in kv:
            v.add_bos = True  # llama.cpp's default for these pre-tokenizers
        name = str(kv.get("general.name", "")).lower()
        if "phi-3" in name or "phi3" in name:
            # llama.cpp's per-model token attributes: Phi-3's special tokens (and </s>) strip the whitespace that
            # follows them, except <unk>, <s> and <|endoftext|>
            special = (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)
            v.rstrip = frozenset(i for i, t in enumerate(tokens) if (v.types[i] in special or t == "</s>")
                                 and t not in ("<unk>", "<s>", "<|endoftext|>"))
        v.build_tokenizer()
        return v

    def build_tokenizer(self) -> None:
        try:
            from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
        except ImportError:
            raise ImportError("text in and out needs the 'tokenizers' package: pip install 'kvcache_ggml[text]' "
                              "(python3 build.py installs it)") from None
        n = len(self.tokens)
        self._special = sorted(((self.tokens[i], i, self.types[i] in (TokenType.CONTROL, TokenType.UNKNOWN))
                                for i in range(n) if self.types[i] in (TokenType.CONTROL, TokenType.USER_DEFINED,
                                                                       TokenType.UNKNOWN)),
                               key=lambda s: -len(s[0].encode()))
        self._special_groups = {}
        for k, (s_text, _, _) in enumerate(self._special):
            if s_text:
                self._special_groups.setdefault(s_text[:_KEY], []).append(k)
        vocab = {t: i for i, t in enumerate(self.tokens)}
        if self.model == "gpt2":
            if self.pre not in _PRE:
                raise ValueError(f"BPE pre-tokenizer {self.pre!r} is not supported (supported: {', '.join(_PRE)})")
            exprs, ignore_merges, self._clean_spaces = _PRE[self.pre]
            merges = [tuple(m.split(" ", 1)) for m in self.merges]
            tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(e), behavior="isolated") for e in exprs]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            u2b = {c: b for b, c in _bytes_to_unicode().items()}
            self._pieces = [t.encode() if self.types[i] in (TokenType.CONTROL, TokenType.USER_DEFINED)
                            else bytes(u2b.get(ch, 0) for ch in t) for i, t in enumerate(self.tokens)]
        else:
            tk = Tokenizer(models.BPE(vocab=vocab, merges=self._spm_merges(vocab), byte_fallback=True,
                                      unk_token=self.tokens[self.unk] if self.unk >= 0 else None, fuse_unk=True))
            tk.normalizer = normalizers.Replace(" ", "▁")
            self._clean_spaces = False
            self._pieces = [self._spm_piece(i) for i in range(n)]
        tk.decoder = decoders.ByteLevel() if self.model == "gpt2" else None
        self._tk = tk
        self._encode_cached = functools.lru_cache(maxsize=_CACHED_FRAGMENTS)(self._encode)

    def _encode(self, text: str) -> array:
        """The ids of one text fragment (no special token in it), as int32; ``ValueError`` for a string holding a
        lone surrogate (no UTF-8 text does: ``tokenizers`` raises a bare ``TypeError`` for it)."""
        try:
            return array("i", self._tk.encode(text, add_special_tokens=False).ids)
        except TypeError:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"the text holds a lone surrogate {text[e.start]!r}, which no Unicode text "
                                 f"does") from None
            raise

    def _spm_merges(self, vocab: dict[str, int]) -> list[tuple[str, str]]:
        """Every split of a normal piece into two pieces of the vocabulary, best score of the merged piece first."""
        ranked = []
        for i, t in enumerate(self.tokens):
            if self.types[i] != TokenType.NORMAL or len(t) < 2:
                continue
            for k in range(1, len(t)):
                a, b = t[:k], t[k:]
                ia, ib = vocab.get(a), vocab.get(b)
                if ia is not None and ib is not None:
                    ranked.append((-self.scores[i] if self.scores else i, ia, ib, a, b))
        ranked.sort()
        return [(a, b) for _, _, _, a, b in ranked]

    def _spm_piece(self, i: int) -> bytes:
        t, ty = self.tokens[i], self.types[i]
        if ty == TokenType.BYTE and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            return bytes([int(t[3:5], 16)])
        if ty in (TokenType.CONTROL, TokenType.UNKNOWN):
            return t.encode()
        return t.replace("▁", " ").encode()

    # ------------------------------------------------------------------ tokenize

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def _fragments(self, text: str, parse_special: bool) -> list[str | int]:
        """text cut at special tokens (llama.cpp's tokenizer_st_partition): raw strings and special ids."""
        frags: list[str | int] = [text] if text else []
        special = self._special
        # the special tokens in the text, in their order (every fragment is a piece of the text: a token or a group
        # not found in it is in none of them)
        present = sorted(k for key, group in self._special_groups.items() if key in text
                         for k in group if special[k][0] in text)
        for s_text, s_id, control in (special[k] for k in present):
            if control and not parse_special:
                continue
            out: list[str | int] = []
            for f in frags:
                if not isinstance(f, str) or s_text not in f:
                    out.append(f)
                    continue
                parts = f.split(s_text)
                for j, p in enumerate(parts):
                    if j:
                        out.append(s_id)
                        if s_id in self.rstrip:
                            p = p.lstrip(" \t\n\v\f\r")  # C isspace, as tokenizer_st_partition strips
                    if p:
                        out.append(p)
            frags = out
        return frags

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """llama_tokenize: ids of text, with BOS/EOS when add_special and the vocabulary asks for them."""
        out: list[int] = []
        if add_special and self.add_bos and self.bos >= 0:
            out.append(self.bos)
        prev_special = True
        for f in self._fragments(text, parse_special):
            if isinstance(f, int):
                out.append(f)
                prev_special = True
                continue
            if self.model == "llama" and self.add_space_prefix and prev_special:
                f = " " + f
            out.extend(self._encode_cached(f) if len(f) <= _CACHED_CHARS else self._encode(f))
            prev_special = False
        if add_special and self.add_eos and self.eos >= 0:
            out.append(self.eos)
        return out

    # ------------------------------------------------------------------ detokenize

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """llama_token_to_piece: the bytes of one id (control tokens only with special=True)."""
        if not 0 <= token < len(self.tokens):
            raise ValueError(f"token id {token} out of range [0, {len(self.tokens)})")
        ty = self.types[token]
        if ty == TokenType.UNUSED or (not special and ty in (TokenType.CONTROL, TokenType.UNKNOWN)):
            return b""
        return self._pieces[token]

    def detokenize(self, tokens: Iterable[int], special: bool = False) -> str:
        """llama_detokenize (remove_special=False): the text of ids, as llama.cpp renders it (the first piece
        loses one leading space when the vocabulary adds a space prefix)."""
        pieces = [self.token_to_piece(t, special) for t in tokens]
        if pieces and self.add_space_prefix and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]
        raw = b"".join(pieces)
        if self._clean_spaces:
            raw = _clean_up_spaces(raw)
        return raw.decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        """End of generation: EOS (or an id llama.cpp would also stop at: the CONTROL ``<|endoftext|>``, Phi-3's
        ``<|end|>``, Llama 3's ``<|eot_id|>`` / ``<|eom_id|>`` / ``<|end_of_text|>`` ...)."""
        return token == self.eos or (0 <= token < len(self.tokens) and self.tokens[token] in
                                     ("<|endoftext|>", "<|eot_id|>", "<|im_end|>", "</s>", "<|end|>", "<|eom_id|>",
                                      "<|end_of_text|>"))


def _clean_up_spaces(b: bytes) -> bytes:
    """llama_detokenize's three clean_spaces passes, byte by byte: drop the space of " ?", " !", " .", " ,"; turn
    " ' " into "'"; drop the space of " 's", " 'm", " 're", " 've" (not of " 't", " 'd", " 'll")."""
    out = bytearray(b[:1])
    for i in range(1, len(b)):
        if b[i - 1:i] == b" " and b[i:i + 1] in (b"?", b"!", b".", b","):
            out.pop()
        out.append(b[i])
    b, out = bytes(out), bytearray(out[:1])
    i = 1
    while i < len(b):
        if b[i:i + 1] == b"'" and i + 1 < len(b) and b[i - 1:i] == b" " and b[i + 1:i + 2] == b" ":
            out.pop()
            out.append(b[i])
            i += 2  # the next space goes too
            continue
        out.append(b[i])
        i += 1
    b, out = bytes(out), bytearray(out[:1])
    for i in range(1, len(b)):
        if b[i - 1:i] == b" " and b[i:i + 1] == b"'" and i + 1 < len(b):
            if b[i + 1:i + 2] in (b"s", b"m") or (i + 2 < len(b) and b[i + 1:i + 3] in (b"re", b"ve")):
                out.pop()
        out.append(b[i])
    return bytes(out)


class StreamDecoder:
    """Turns ids into text as they come: bytes of a multi-byte character wait for the rest of it."""

    def __init__(self, vocab: Vocab, skip_leading_space: bool | None = None) -> None:
        self.vocab = vocab
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = vocab.add_space_prefix if skip_leading_space is None else skip_leading_space

    def push(self, token: int) -> str:
        piece = self.vocab.token_to_piece(token)
        if self._first:
            self._first = False
            if piece.startswith(b" "):
                piece = piece[1:]
        return self._dec.decode(piece)

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)

"""Shared by the batch tests: a toy memory, ubatch helpers, and RefAllocr -- llama_batch_allocr transcribed statement
by statement with plain Python containers, the reference test_batch.py's hypothesis test compares the allocator
with."""
from __future__ import annotations

import re

import numpy as np

from kvcache_ggml.batch import LLAMA_MAX_SEQ, Batch, BatchAllocator, UBatch


# ================================================================================================ helpers


class Mem:
    """A memory module stub: per sequence (min, max) positions, (-1, -1) when empty."""

    def __init__(self, ranges: dict[int, tuple[int, int]] | None = None):
        self.ranges = dict(ranges or {})

    def seq_pos_min(self, s: int) -> int:
        return self.ranges.get(s, (-1, -1))[0]

    def seq_pos_max(self, s: int) -> int:
        return self.ranges.get(s, (-1, -1))[1]


def ub_dict(ub: UBatch) -> dict:
    """A UBatch as plain Python values, sequence ids trimmed to n_seq_id."""
    assert ub.seq_id.ndim == 2 and ub.seq_id.shape[0] == ub.n_tokens and ub.seq_id.shape[1] >= 1
    assert ub.pos.dtype == np.int32 and ub.n_seq_id.dtype == np.int32 and ub.seq_id.dtype == np.int32
    assert ub.seq_id_unq.dtype == np.int32 and ub.seq_idx.dtype == np.int32 and ub.output.dtype == np.int8
    assert ub.seq_idx.shape == (LLAMA_MAX_SEQ,) and ub.pos.shape == (ub.n_pos * ub.n_tokens,)
    for i in range(ub.n_tokens):
        assert (ub.seq_id[i, ub.n_seq_id[i]:] == -1).all()  # padding
    return dict(
        n_tokens=ub.n_tokens, n_seq_tokens=ub.n_seq_tokens, n_seqs=ub.n_seqs, n_seqs_unq=ub.n_seqs_unq,
        equal=bool(ub.b_equal_seqs),
        token=None if ub.token is None else ub.token.tolist(),
        embd=None if ub.embd is None else ub.embd.tolist(),
        pos=ub.pos.tolist(), n_seq_id=ub.n_seq_id.tolist(),
        seq_id=[ub.seq_id[i, :ub.n_seq_id[i]].tolist() for i in range(ub.n_tokens)],
        seq_id_unq=ub.seq_id_unq.tolist(), seq_idx=ub.seq_idx.tolist(), output=ub.output.tolist())


def drain(alloc: BatchAllocator, kind: str, n_ubatch: int, limit: int = 1000) -> list[UBatch]:
    out = []
    for _ in range(limit):
        if kind == "simple":
            ub = alloc.split_simple(n_ubatch)
        elif kind == "equal":
            ub = alloc.split_equal(n_ubatch, False)
        elif kind == "equal_seq":
            ub = alloc.split_equal(n_ubatch, True)
        else:
            ub = alloc.split_seq(n_ubatch)
        if ub.n_tokens == 0:
            return out
        out.append(ub)
    raise AssertionError("split did not terminate")


def split_all(batch: Batch, kind: str, n_ubatch: int, *, memory=None, n_seq_max: int = 8, output_all=False,
              n_pos_per_embd: int = 1, n_embd: int = 4):
    alloc = BatchAllocator(n_pos_per_embd)
    alloc.init(batch, 1000, memory, n_embd, n_seq_max, output_all)
    ubs = drain(alloc, kind, n_ubatch)
    return alloc, ubs


def summary(ubs: list[UBatch]) -> list[tuple]:
    """(token ids, positions, sequence ids, n_seqs, n_seq_tokens) per ubatch."""
    return [(u.token.tolist(), u.pos.tolist(), [u.seq_id[i, :u.n_seq_id[i]].tolist() for i in range(u.n_tokens)],
             u.n_seqs, u.n_seq_tokens) for u in ubs]


# ================================================================================================ reference


class RefAllocr:
    """llama_batch_allocr, transcribed statement by statement with Python lists, sets and dicts.

    init() returns None on success or a tag naming the failed check."""

    def __init__(self, n_pos_per_embd: int):
        self.n_pos_per_embd = n_pos_per_embd

    def init(self, token, embd, pos, seq_id, logits, n_vocab, memory, n_embd, n_seq_max, output_all):
        n = len(token) if token is not None else len(embd)
        self.token, self.embd, self.n_tokens = token, embd, n
        self.n_embd, self.n_seq_max = n_embd, n_seq_max
        self.n_outputs = 0
        self.seq_pos = [set() for _ in range(LLAMA_MAX_SEQ)]
        self.seq_cpl = [[False] * LLAMA_MAX_SEQ for _ in range(LLAMA_MAX_SEQ)]
        self.seq_set = []
        self.seq_set_map = {}
        if n_seq_max > LLAMA_MAX_SEQ:
            return "n_seq_max"
        if token is not None:
            for i in range(n):
                if token[i] < 0 or token[i] >= n_vocab:
                    return "token"
        if seq_id is not None:
            for i in range(n):
                for s in range(len(seq_id[i])):
                    if seq_id[i][s] < 0 or seq_id[i][s] >= n_seq_max:
                        return "seq_id"
        if seq_id is None:
            seq_id = [[0] for _ in range(n)]
        n_seq_id = [len(r) for r in seq_id]
        if pos is None:
            p0 = [0] * LLAMA_MAX_SEQ
            for s in range(n_seq_max):
                p0[s] = 0 if memory is None else memory.seq_pos_max(s) + 1
            pos = [0] * n
            for i in range(n):
                pos[i] = p0[seq_id[i][0]]
                for s in range(n_seq_id[i]):
                    p0[seq_id[i][s]] = pos[i] + 1
        if logits is None:
            logits = [1] * n if output_all else [0] * (n - 1) + [1]
        elif output_all:
            if any(v == 0 for v in logits):
                logits = [1] * n
        self.pos, self.seq_id, self.n_seq_id, self.logits = pos, seq_id, n_seq_id, logits
        for i in range(n):
            self.n_outputs += logits[i] != 0
        self.has_cpl = False
        for i in range(n):
            s0 = seq_id[i][0]
            for s in range(n_seq_id[i]):
                s1 = seq_id[i][s]
                self.seq_pos[s1].add(pos[i])
                if s > 0:
                    self.seq_cpl[s1][s0] = True
                    self.has_cpl = True
        for i in range(n):
            cur = frozenset(seq_id[i])
            self.seq_set.append(cur)
            self.seq_set_map.setdefault(cur, []).append(i)

        def pmin(s):
            return min(self.seq_pos[s]) if self.seq_pos[s] else -1

        def pmax(s):
            return max(self.seq_pos[s]) if self.seq_pos[s] else -1

        self.pmin, self.pmax = pmin, pmax
        if self.n_pos_per_embd > 1:
            for s in range(n_seq_max):
                if not self.seq_pos[s]:
                    continue
                p0 = memory.seq_pos_max(s) if memory is not None else -1
                if token is not None:
                    if p0 >= 0 and p0 >= pmin(s):
                        return "mem_pos"
                else:
                    if p0 >= 0 and p0 > pmin(s):
                        return "mem_pos"
        else:
            for s in range(n_seq_max):
                if not self.seq_pos[s]:
                    continue
                p0 = memory.seq_pos_max(s) if memory is not None else -1
                if p0 >= 0 and pmin(s) != p0 + 1:
                    return "mem_pos"
                if pmax(s) - pmin(s) + 1 > len(self.seq_pos[s]):
                    return "not_continuous"
        if memory is not None:
            for s0 in range(n_seq_max):
                for s1 in range(n_seq_max):
                    if self.seq_cpl[s0][s1]:
                        if (memory.seq_pos_min(s0) != memory.seq_pos_min(s1)
                                or memory.seq_pos_max(s0) != memory.seq_pos_max(s1)):
                            return "coupled"
        all_seqs = frozenset(range(LLAMA_MAX_SEQ))
        cur_seq_set = [all_seqs] * LLAMA_MAX_SEQ
        cur_seq_pos = [-1] * LLAMA_MAX_SEQ
        for i in range(n):
            for s in range(n_seq_id[i]):
                sid = seq_id[i][s]
                cur_seq_set[sid] = cur_seq_set[sid] & self.seq_set[i]
                if not cur_seq_set[sid]:
                    return "incompatible"
                if pos[i] < cur_seq_pos[sid]:
                    return "decreasing"
        self.split_reset()
        return None

    def split_reset(self):
        self.out_ids = []
        self.n_used = 0
        self.used = [False] * self.n_tokens

    def split_simple(self, n_ubatch):
        cur_idx = 0
        while cur_idx < len(self.used) and self.used[cur_idx]:
            cur_idx += 1
        if cur_idx >= len(self.used):
            return None
        idxs = []
        while True:
            idxs.append(cur_idx)
            self.used[cur_idx] = True
            self.n_used += 1
            cur_idx += 1
            if cur_idx >= len(self.used):
                break
            if len(idxs) >= n_ubatch:
                break
        return self.ubatch_add(idxs, len(idxs), False)

    def split_equal(self, n_ubatch, sequential):
        if sequential and self.has_cpl:
            return None
        cur_seq_set = []
        last_seq_id = -1
        for i in range(self.n_tokens):
            if self.used[i]:
                continue
            add = True
            for s in range(len(cur_seq_set)):
                if cur_seq_set[s] & self.seq_set[i]:
                    add = False
                    break
            if sequential:
                add = add and (not cur_seq_set or self.seq_id[i][0] == last_seq_id + 1)
            if add:
                cur_seq_set.append(self.seq_set[i])
                last_seq_id = self.seq_id[i][0]
                if len(cur_seq_set) > n_ubatch:
                    break
        n_seqs = len(cur_seq_set)
        if n_seqs == 0:
            return None
        cur_idx = [0] * n_seqs
        for s in range(n_seqs):
            while self.used[self.seq_set_map[cur_seq_set[s]][cur_idx[s]]]:
                cur_idx[s] += 1
        idxs_per_seq = [[] for _ in range(n_seqs)]
        while True:
            can_expand = True
            for s in range(n_seqs):
                if cur_idx[s] >= len(self.seq_set_map[cur_seq_set[s]]):
                    can_expand = False
                    break
            if not can_expand:
                break
            for s in range(n_seqs):
                idx = self.seq_set_map[cur_seq_set[s]][cur_idx[s]]
                idxs_per_seq[s].append(idx)
                self.used[idx] = True
                self.n_used += 1
                cur_idx[s] += 1
            if (len(idxs_per_seq[0]) + 1) * n_seqs > n_ubatch:
                break
        idxs = []
        for s in range(n_seqs):
            idxs.extend(idxs_per_seq[s])
        return self.ubatch_add(idxs, n_seqs, True)

    def split_seq(self, n_ubatch):
        cur_idx = 0
        while cur_idx < len(self.used) and self.used[cur_idx]:
            cur_idx += 1
        if cur_idx >= len(self.used):
            return None
        cur_seq_set = self.seq_set[cur_idx]
        idxs = []
        while True:
            idxs.append(cur_idx)
            self.used[cur_idx] = True
            self.n_used += 1
            if len(idxs) >= n_ubatch:
                break
            while True:
                cur_idx += 1
                if not (cur_idx < self.n_tokens
                        and (self.used[cur_idx] or (cur_seq_set & self.seq_set[cur_idx]) != self.seq_set[cur_idx])):
                    break
            if cur_idx == self.n_tokens:
                break
            cur_seq_set = self.seq_set[cur_idx]
        return self.ubatch_add(idxs, 1, True)

    def ubatch_add(self, idxs, n_seqs, equal_seqs):
        n_tokens = len(idxs)
        npe = self.n_pos_per_embd
        pos = [0] * (n_tokens * npe)
        token, embd, n_seq_id, seq_id, output = [], [], [], [], []
        seq_set_unq = set()
        for i in range(n_tokens):
            if self.token is not None:
                token.append(self.token[idxs[i]])
            if self.embd is not None:
                embd.append(list(self.embd[idxs[i]]))
            for j in range(npe):
                src_off = 0 if self.token is not None else j * self.n_tokens
                pos[j * n_tokens + i] = self.pos[src_off + idxs[i]]
            n_seq_id.append(self.n_seq_id[idxs[i]])
            output.append(self.logits[idxs[i]])
            seq_id.append(list(self.seq_id[idxs[i]]))
            seq_set_unq.update(self.seq_id[idxs[i]])
            if output[i]:
                self.out_ids.append(idxs[i])
        seq_id_unq, seq_idx = [], [-1] * LLAMA_MAX_SEQ
        for s in range(self.n_seq_max):
            if s in seq_set_unq:
                seq_idx[s] = len(seq_id_unq)
                seq_id_unq.append(s)
        return dict(n_tokens=n_tokens, n_seq_tokens=n_tokens // n_seqs, n_seqs=n_seqs, n_seqs_unq=len(seq_id_unq),
                    equal=equal_seqs, token=token if self.token is not None else None,
                    embd=embd if self.embd is not None else None, pos=pos, n_seq_id=n_seq_id, seq_id=seq_id,
                    seq_id_unq=seq_id_unq, seq_idx=seq_idx, output=output)


_TAGS = [("n_seq_max", r"n_seq_max = \d+ > LLAMA_MAX_SEQ"), ("token", r"invalid token\["),
         ("seq_id", r"invalid seq_id\["), ("mem_pos", r"inconsistent positions"),
         ("not_continuous", r"not continuous"), ("coupled", r"is coupled to"), ("decreasing", r"decreasing")]


def tag_of(err: ValueError) -> str:
    for tag, rx in _TAGS:
        if re.search(rx, str(err)):
            return tag
    raise AssertionError(f"unclassified error: {err}")

"""A brute-force model of llama_kv_cache bookkeeping, written independently of kvcache_ggml.

Plain Python lists, one loop per cell as in the seed; every derived value (used cells, per-sequence min/max) is
recomputed from scratch on each query.  Slow and obviously right: the reference the tests compare against.
"""
from __future__ import annotations

INT_MAX = 2**31 - 1
MAX_SEQ = 256


class Cell:
    __slots__ = ("pos", "shift", "seqs", "ext")

    def __init__(self):
        self.pos, self.shift, self.seqs, self.ext = -1, 0, set(), (0, 0)

    def clear(self, ext=True):
        self.pos, self.shift, self.seqs = -1, 0, set()
        if ext:
            self.ext = (0, 0)

    def copy(self):
        c = Cell()
        c.pos, c.shift, c.seqs, c.ext = self.pos, self.shift, set(self.seqs), self.ext
        return c


def masked_swa(n_swa, swa_type, p0, p1):
    if swa_type == 1:
        return p1 - p0 >= n_swa
    if swa_type == 2:
        return p0 < (p1 // n_swa) * n_swa
    if swa_type == 3:
        half = n_swa // 2
        return p1 - p0 < -half or p1 - p0 > half
    return False


class ModelCache:
    def __init__(self, kv_size, n_seq_max, unified, n_swa=0, swa_type=0):
        self.size = kv_size
        self.n_stream = 1 if unified else n_seq_max
        self.n_seq_max = n_seq_max
        self.n_swa, self.swa_type = n_swa, swa_type
        self.cells = [[Cell() for _ in range(kv_size)] for _ in range(self.n_stream)]
        self.heads = [0] * self.n_stream
        self.has_shift = [False] * self.n_stream
        self.n_seq_ids = MAX_SEQ if self.n_stream == 1 else self.n_stream

    def stream(self, s):
        return 0 if self.n_stream == 1 else s

    # --- derived values, from scratch
    def pos_min(self, strm, s):
        ps = [c.pos for c in self.cells[strm] if s in c.seqs]
        return min(ps) if ps else -1

    def pos_max(self, strm, s):
        ps = [c.pos for c in self.cells[strm] if s in c.seqs]
        return max(ps) if ps else -1

    def seq_pos_min(self, s):
        return self.pos_min(self.stream(s), s)

    def seq_pos_max(self, s):
        return self.pos_max(self.stream(s), s)

    def used(self, strm):
        return sum(c.pos != -1 for c in self.cells[strm])

    def used_max_p1(self, strm):
        u = [i for i, c in enumerate(self.cells[strm]) if c.pos != -1]
        return u[-1] + 1 if u else 0

    # --- sequence operations
    @staticmethod
    def clamp(p0, p1):
        return max(p0, 0), (INT_MAX if p1 < 0 else p1)

    def seq_rm(self, s, p0, p1):
        p0, p1 = self.clamp(p0, p1)
        streams = [self.stream(s)] if s >= 0 else range(self.n_stream)
        for strm in streams:
            new_head = None
            for i, c in enumerate(self.cells[strm]):
                if c.pos == -1 or not (p0 <= c.pos < p1):
                    continue
                if s >= 0:
                    if s not in c.seqs:
                        continue
                    c.seqs.discard(s)
                    if c.seqs:
                        continue
                c.clear()
                if new_head is None:
                    new_head = i
            if new_head is not None and new_head < self.heads[strm]:
                self.heads[strm] = new_head

    def seq_cp(self, a, b, p0, p1):
        s0, s1 = self.stream(a), self.stream(b)
        if s0 == s1:
            if a == b:
                return
            p0, p1 = self.clamp(p0, p1)
            for c in self.cells[s0]:
                if c.pos != -1 and p0 <= c.pos < p1 and a in c.seqs:
                    c.seqs.add(b)
            return
        self.cells[s1] = [Cell() for _ in range(self.size)]
        self.has_shift[s1] = False
        for i, c in enumerate(self.cells[s0]):
            if a in c.seqs:
                d = self.cells[s1][i]
                d.pos, d.shift, d.seqs, d.ext = c.pos, c.shift, {b}, c.ext
                if c.shift:
                    self.has_shift[s1] = True
        self.heads[s1] = self.heads[s0]

    def seq_keep(self, s):
        strm = self.stream(s)
        new_head = None
        for i, c in enumerate(self.cells[strm]):
            if c.pos == -1:
                continue
            if s in c.seqs:
                c.seqs = {s}
            else:
                c.clear()
                if new_head is None:
                    new_head = i
        if new_head is not None and new_head < self.heads[strm]:
            self.heads[strm] = new_head

    def seq_add(self, s, p0, p1, d):
        if d == 0:
            return
        p0, p1 = self.clamp(p0, p1)
        if p0 == p1:
            return
        strm = self.stream(s)
        new_head = None
        for i, c in enumerate(self.cells[strm]):
            if c.pos != -1 and p0 <= c.pos < p1 and s in c.seqs:
                c.pos += d
                c.shift += d
                self.has_shift[strm] = True
                if c.pos < 0:
                    c.clear(ext=False)
                    if new_head is None:
                        new_head = i
        self.heads[strm] = new_head if new_head is not None else 0

    def seq_div(self, s, p0, p1, d):
        if d == 1:
            return
        p0, p1 = self.clamp(p0, p1)
        if p0 == p1:
            return
        strm = self.stream(s)
        for c in self.cells[strm]:
            if c.pos != -1 and p0 <= c.pos < p1 and s in c.seqs:
                old = c.pos
                c.pos = old // d
                c.shift += old - c.pos
                self.has_shift[strm] = True

    def reset_shift(self):
        for strm in range(self.n_stream):
            self.has_shift[strm] = False
            for c in self.cells[strm]:
                c.shift = 0

    # --- placement
    def usable(self, strm, i):
        c = self.cells[strm][i]
        if c.pos == -1:
            return True
        if len(c.seqs) == 1:
            (q,) = c.seqs
            return masked_swa(self.n_swa, self.swa_type, c.pos, self.pos_max(strm, q) + 1)
        return False

    def find_slot(self, ub):
        """ub: dict(n_tokens, pos (list), seq_ids (list of lists), seq_id_unq (list)). None when no slot."""
        n_tokens, n_seqs = ub["n_tokens"], 1
        if self.n_stream > 1:
            n_seqs = len(ub["seq_id_unq"])
            n_tokens //= n_seqs
        res = []
        for s in range(n_seqs):
            q = ub["seq_id_unq"][s]
            strm = self.stream(q)
            head = self.heads[strm]
            if head > self.used(strm) + 2 * n_tokens:
                head = 0
            if n_tokens > self.size:
                return None
            got, tested = [], 0
            while len(got) < n_tokens and tested < self.size:
                if head >= self.size:
                    head = 0
                if self.usable(strm, head):
                    got.append(head)
                head += 1
                tested += 1
            if len(got) < n_tokens:
                return None
            res.append((strm, got))
        return res

    def apply(self, slot, ub):
        nt = ub["n_tokens"]
        rm_max = {}
        k = 0
        for strm, idxs in slot:
            for idx in idxs:
                c = self.cells[strm][idx]
                if c.pos != -1:
                    (q,) = c.seqs
                    rm_max[q] = max(rm_max.get(q, -1), c.pos)
                    c.clear()
                c.pos = ub["pos"][k]
                if ub.get("n_pos", 1) >= 3:
                    c.ext = (ub["pos"][k + 2 * nt], ub["pos"][k + nt])
                c.seqs = set(ub["seq_ids"][k])
                k += 1
        for q in sorted(rm_max):
            pmin = self.seq_pos_min(q)
            if pmin <= rm_max[q]:
                self.seq_rm(q, pmin, rm_max[q] + 1)
        for strm, idxs in slot:
            self.heads[strm] = idxs[-1] + 1

    def prepare(self, ubs):
        res, states = [], []
        for ub in ubs:
            slot = self.find_slot(ub)
            if slot is None:
                res = None
                break
            res.append(slot)
            states.append((slot, list(self.heads), [[self.cells[st][i].copy() for i in idxs] for st, idxs in slot]))
            self.apply(slot, ub)
        for slot, heads, cells in reversed(states):
            for s, (st, idxs) in enumerate(slot):
                for i, c in zip(idxs, cells[s]):
                    # the seed's cell copies carry no shift: a restored cell keeps the one it has now
                    c.shift = self.cells[st][i].shift
                    self.cells[st][i] = c
                self.heads[st] = heads[s]
        return res

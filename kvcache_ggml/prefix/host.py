"""The host tier: evicted sequences kept as llama.cpp state blobs in RAM, and optionally on disk, under budgets.

A blob is what ``llama_state_seq_get_data`` returns for the sequence (``KVCache.state_save(seq_id)``): restoring it
with ``state_load`` gives back the same cells' K/V.  RAM holds at most ``budget`` bytes (blob plus 4 bytes per
token); a blob that does not fit makes room by moving the policy's victims to disk (when a directory is given,
within ``disk_budget``) or dropping them.  The byte counts never exceed the budgets: a blob larger than a budget is
not kept there at all.

Disk files are llama.cpp *sequence state files* (``llama_state_seq_save_file``: ``u32 magic 'ggsq', u32 version 2,
u32 n_token, i32 token[n_token]``, then the blob), so llama.cpp can load them too; they are named ``NNNNNNNN.ggsq``
after the entry's key and deleted when the entry goes or the tier is closed.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
import numpy as np

from ..cache.state.format import STATE_SEQ_MAGIC, STATE_SEQ_VERSION
from .policy import Candidate, EvictionPolicy, LRUPolicy, Retention, effective_priority
from .stats import PrefixStats

__all__ = ["HostParams", "HostEntry", "HostTier"]

_FILE_HDR = struct.Struct("<III")   # magic, version, n_token


@dataclass(slots=True)
class HostParams:
    """Budgets of the host tier."""

    budget: int = 0                                # bytes of blobs kept in RAM; 0: no host tier
    disk_dir: str | os.PathLike | None = None      # spill RAM victims to files here; None: drop them
    disk_budget: int = 0                           # bytes of files kept in disk_dir

    def check(self) -> None:
        if self.budget < 0 or self.disk_budget < 0:
            raise ValueError(f"host budgets must be >= 0 bytes, got budget={self.budget}, "
                             f"disk_budget={self.disk_budget}")
        if self.disk_dir is not None and not Path(self.disk_dir).is_dir():
            raise ValueError(f"disk_dir {str(self.disk_dir)!r} is not a directory")

    def enabled(self) -> bool:
        return self.budget > 0 or (self.disk_dir is not None and self.disk_budget > 0)


@dataclass(slots=True, eq=False)
class HostEntry:
    """One saved sequence: its tokens and its state blob, in RAM or in a file."""

    key: int                   # serial number (names the file)
    tokens: np.ndarray         # int32 [n] the tokens at positions 0..n-1 of the saved sequence
    nbytes: int                # bytes the budgets count: the blob plus 4 per token
    blob: bytes | None         # the state blob while in RAM, else None
    path: Path | None          # the sequence state file while on disk, else None
    last_used: int             # tick of the save or the last restore
    retention: Retention       # priority of the sequence it came from
    since: float               # clock time the retention started

    def where(self) -> str:
        return "ram" if self.blob is not None else "disk"

    def __repr__(self) -> str:
        return f"<HostEntry #{self.key} {self.tokens.size} tokens, {self.nbytes} B in {self.where()}>"


class HostTier:
    """Blobs in RAM and on disk, each under its byte budget; victims chosen by the policy."""

    def __init__(self, params: HostParams, stats: PrefixStats, policy: EvictionPolicy | None = None) -> None:
        params.check()
        self.params = params
        self.stats = stats
        self.policy = policy or LRUPolicy()
        self.ram: list[HostEntry] = []     # entries whose blob is in RAM
        self.disk: list[HostEntry] = []    # entries whose blob is in a file
        self._next_key = 0

    def entries(self) -> list[HostEntry]:
        return self.ram + self.disk

    def put(self, tokens: np.ndarray, blob: bytes, tick: int, retention: Retention, since: float,
            now: float) -> tuple[HostEntry | None, list[HostEntry]]:
        """Keep ``blob`` (the state of a sequence holding ``tokens``): (its entry or None when no budget can
        hold it, the entries dropped for good to make room)."""
        e = HostEntry(self._next_key, tokens.copy(), len(blob) + 4 * tokens.size, blob, None, tick, retention,
                      since)
        self._next_key += 1
        dropped: list[HostEntry] = []
        if e.nbytes <= self.params.budget:
            while self.stats.host_bytes + e.nbytes > self.params.budget:
                dropped += self._spill(self._victim(self.ram, now), now)
            self.ram.append(e)
            self._count_ram(e.nbytes)
            return e, dropped
        if self._disk_fits(e.nbytes):
            dropped += self._to_disk(e, now)
            return e, dropped
        self.stats.host_rejected += 1
        return None, dropped

    def drop(self, e: HostEntry) -> None:
        """Forget ``e`` (its file deleted)."""
        if e.blob is not None:
            self.ram.remove(e)
            self._count_ram(-e.nbytes)
            e.blob = None
        elif e.path is not None:
            self.disk.remove(e)
            self.stats.disk_bytes -= e.nbytes
            e.path.unlink(missing_ok=True)
            e.path = None
        self.stats.host_drops += 1

    def close(self) -> None:
        """Delete every file and forget every blob."""
        for e in list(self.entries()):
            self.drop(e)

    # ------------------------------------------------------------------ internals

    def _victim(self, pool: list[HostEntry], now: float) -> HostEntry:
        cands = [Candidate(e, e.tokens.size, e.nbytes, e.last_used,
                           effective_priority(e.retention.priority, e.since, e.retention.duration, now))
                 for e in pool]
        return self.policy(cands).entry

    def _count_ram(self, delta: int) -> None:
        self.stats.host_bytes += delta
        self.stats.host_bytes_peak = max(self.stats.host_bytes_peak, self.stats.host_bytes)

    def _disk_fits(self, nbytes: int) -> bool:
        return self.params.disk_dir is not None and nbytes <= self.params.disk_budget

    def _spill(self, e: HostEntry, now: float) -> list[HostEntry]:
        """Move ``e`` out of RAM: to disk when it fits there, else drop it; the entries dropped for good."""
        if not self._disk_fits(e.nbytes):
            self.drop(e)
            return [e]
        self.ram.remove(e)
        self._count_ram(-e.nbytes)
        return self._to_disk(e, now)

    def _to_disk(self, e: HostEntry, now: float) -> list[HostEntry]:
        dropped = []
        while self.stats.disk_bytes + e.nbytes > self.params.disk_budget:
            v = self._victim(self.disk, now)
            self.drop(v)
            dropped.append(v)
        path = Path(self.params.disk_dir) / f"{e.key:08d}.ggsq"
        with open(path, "wb") as f:
            f.write(_FILE_HDR.pack(STATE_SEQ_MAGIC, STATE_SEQ_VERSION, e.tokens.size))
            f.write(e.tokens.astype("<i4").tobytes())
            f.write(e.blob)
        e.blob, e.path = None, path
        self.disk.append(e)
        self.stats.disk_bytes += e.nbytes
        self.stats.disk_writes += 1
        return dropped

    def check(self) -> list[str]:
        """Budgets, byte counts and files, recomputed."""
        out = []
        ram = sum(e.nbytes for e in self.ram)
        disk = sum(e.nbytes for e in self.disk)
        if ram != self.stats.host_bytes or ram > self.params.budget:
            out.append(f"host: {ram} B in RAM (counted {self.stats.host_bytes}), budget {self.params.budget}")
        if disk != self.stats.disk_bytes or disk > max(self.params.disk_budget, 0):
            out.append(f"host: {disk} B on disk (counted {self.stats.disk_bytes}), budget {self.params.disk_budget}")
        for e in self.ram:
            if e.blob is None or e.path is not None or e.nbytes != len(e.blob) + 4 * e.tokens.size:
                out.append(f"host: RAM entry {e!r} is inconsistent")
        for e in self.disk:
            if e.blob is not None or e.path is None or not e.path.is_file():
                out.append(f"host: disk entry {e!r} has no file")
            elif e.path.stat().st_size != e.nbytes + _FILE_HDR.size:
                out.append(f"host: file {e.path} is {e.path.stat().st_size} B, expected {e.nbytes + _FILE_HDR.size}")
        return out

    def __repr__(self) -> str:
        return (f"<HostTier {len(self.ram)} in RAM ({self.stats.host_bytes}/{self.params.budget} B), "
                f"{len(self.disk)} on disk ({self.stats.disk_bytes}/{self.params.disk_budget} B)>")

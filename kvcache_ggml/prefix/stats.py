"""Counters of a prefix cache: requests, hits per tier, tokens reused and decoded, evictions, host bytes."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

__all__ = ["PrefixStats"]


@dataclass(slots=True)
class PrefixStats:
    """What the prefix cache did since it was made (or since :meth:`reset`)."""

    requests: int = 0          # attach() calls
    hits_device: int = 0       # attaches that reused a prefix held by a sequence on the device (its own included)
    hits_host: int = 0         # attaches that restored a prefix from a host blob (RAM or disk)
    misses: int = 0            # attaches that found no reusable prefix
    tokens_requested: int = 0  # prompt tokens asked for by attach()
    tokens_reused: int = 0     # prompt tokens taken from the cache instead of decoded
    tokens_shifted: int = 0    # of them, tokens moved into place by K-shift (chunk reuse, attach's n_cache_reuse)
    tokens_decoded: int = 0    # tokens decoded through the prefix cache (prompts and generation steps)
    padded_steps: int = 0      # advance() steps given throwaway rows to reach flash attention's tiles (FaTiles)
    padded_rows: int = 0       # throwaway rows decoded in them (their cells removed after each step)
    evictions: int = 0         # device sequences evicted to make room
    stale: int = 0             # entries found changed behind the prefix cache's back and dropped
    host_saves: int = 0        # evicted sequences kept as state blobs in RAM
    host_restores: int = 0     # blobs loaded back into a sequence (from RAM or disk)
    host_drops: int = 0        # blobs dropped for good (host and disk budgets full, or superseded)
    host_rejected: int = 0     # blobs larger than every budget, never kept
    disk_writes: int = 0       # blobs moved from RAM to disk
    disk_reads: int = 0        # restores read from disk
    host_bytes: int = 0        # bytes of blobs in RAM now (never above the budget)
    host_bytes_peak: int = 0   # most bytes of blobs in RAM at any time
    disk_bytes: int = 0        # bytes of blob files on disk now

    def reset(self) -> None:
        """Zero the counters (the byte gauges keep their current values)."""
        keep = {"host_bytes": self.host_bytes, "host_bytes_peak": self.host_bytes, "disk_bytes": self.disk_bytes}
        for f in fields(self):
            setattr(self, f.name, keep.get(f.name, 0))

    def hit_rate(self) -> float:
        """Fraction of attaches that reused a prefix."""
        return (self.hits_device + self.hits_host) / self.requests if self.requests else 0.0

    def reuse_rate(self) -> float:
        """Fraction of requested prompt tokens that were not decoded."""
        return self.tokens_reused / self.tokens_requested if self.tokens_requested else 0.0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def __str__(self) -> str:
        rows = [("requests", f"{self.requests}  (device hits {self.hits_device}, host hits {self.hits_host}, "
                             f"misses {self.misses}; hit rate {self.hit_rate():.0%})"),
                ("prompt tokens", f"{self.tokens_requested} requested, {self.tokens_reused} reused "
                                  f"({self.reuse_rate():.0%}); {self.tokens_decoded} tokens decoded in all"),
                ("evictions", f"{self.evictions} sequences ({self.stale} stale entries dropped)"),
                ("host tier", f"{self.host_saves} saved, {self.host_restores} restored, {self.host_drops} dropped, "
                              f"{self.host_rejected} too large; {_size(self.host_bytes)} in RAM "
                              f"(peak {_size(self.host_bytes_peak)})"),
                ("disk", f"{self.disk_writes} written, {self.disk_reads} read; {_size(self.disk_bytes)} on disk")]
        return "\n".join(f"{k:>14}: {v}" for k, v in rows)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024 or unit == "MiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)

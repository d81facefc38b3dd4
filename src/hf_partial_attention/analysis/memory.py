"""Memory of the score accumulators: what `ScoreCovariance` will hold, and what the machine has free."""

from __future__ import annotations

import os

__all__ = ["estimate_bytes", "available_memory_bytes", "gib"]


def estimate_bytes(seq_len: int, scopes, num_groups: int = 1) -> int:
    """Bytes of float64 accumulators for ``num_groups`` groups at sequence length n."""
    n = seq_len
    per_group = n * n * 8
    if "per_query" in scopes:
        per_group += n ** 3 * 8
    if "whole" in scopes:
        per_group += n ** 4 * 8
    return per_group * num_groups


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def gib(num_bytes: float) -> str:
    """``num_bytes`` in GiB, two decimals."""
    return f"{num_bytes / 2 ** 30:.2f} GiB"

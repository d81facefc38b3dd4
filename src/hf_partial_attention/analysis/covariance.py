"""Streaming float64 accumulators of attention-score moments (docs/method.md#scores-and-covariances).

`ScoreCovariance` keeps, for each group (pooled, per layer or per head), the count of score matrices, their
sum ``Σ A`` ``(n, n)`` and the second moments

- per-query: ``Σ a_i a_iᵀ`` for each row i, ``(n, n, n)``;
- whole-matrix: ``Σ vec(A) vec(A)ᵀ``, ``(n², n²)`` (row-major, so each per-query block sits on its diagonal).

Only sums are stored, so `merge` and the reduction across processes are exact additions, and centred
covariance and second moment are both available at read time. The covariance is the population one
(divided by the count), so the error of eq. 8 is exactly the in-sample mean squared error.
Finer groups add up to coarser ones: pooled = Σ over layers = Σ over layers and heads.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save_file

from ..cost import SCOPES
from ..pattern import open_tagged_file

logger = logging.getLogger(__name__)

__all__ = ["ScoreCovariance", "GRANULARITIES", "estimate_bytes", "available_memory_bytes"]

GRANULARITIES = ("pooled", "layer", "head")
_META_KEY = "hf_partial_attention_covariance"
_FORMAT_VERSION = "1"


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


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2 ** 30:.2f} GiB"


@dataclass
class _Moments:
    count: int
    sum: torch.Tensor  # (n, n)
    per_query: torch.Tensor | None  # (n, n, n): [i, j, k] = Σ A_ij A_ik
    whole: torch.Tensor | None  # (n², n²)


class ScoreCovariance:
    """Accumulated moments of attention-score matrices of one sequence length.

    Args:
        seq_len: n, the size of each (square) score matrix.
        scopes: any of ``"per_query"`` and ``"whole"``.
        granularity: ``"pooled"`` (one group over layers and heads, the paper's default), ``"layer"`` or
            ``"head"``; finer groups can always be summed into coarser ones.
        centered: default for reads: covariance ``E[(a − μ)(a − μ)ᵀ]`` (True) or second moment ``E[aaᵀ]``.
        max_memory_bytes: refuse to allocate accumulators beyond this (default: 80% of available memory).
        metadata: JSON-serialisable facts (model, corpus, ...), saved with the accumulators.
    """

    def __init__(self, seq_len: int, scopes=("per_query",), granularity: str = "pooled", centered: bool = True,
                 max_memory_bytes: int | None = None, metadata: dict[str, Any] | None = None):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}.")
        scopes = (scopes,) if isinstance(scopes, str) else tuple(scopes)
        bad = [s for s in scopes if s not in SCOPES]
        if bad or not scopes:
            raise ValueError(f"scopes must be a non-empty subset of {SCOPES}, got {scopes!r}.")
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}.")
        self.seq_len = int(seq_len)
        self.scopes = tuple(s for s in SCOPES if s in scopes)
        self.granularity = granularity
        self.centered = bool(centered)
        self.max_memory_bytes = max_memory_bytes
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.num_sequences = 0  # input windows consumed (the resume cursor)
        self._groups: dict[tuple[int, ...], _Moments] = {}

    # ------------------------------------------------------------------ accumulation
    def check_memory(self, num_groups: int) -> None:
        """Raise a ValueError with the estimate when ``num_groups`` groups would not fit in memory."""
        need = estimate_bytes(self.seq_len, self.scopes, num_groups)
        limit = self.max_memory_bytes if self.max_memory_bytes is not None else int(0.8 * available_memory_bytes())
        if need > limit:
            raise ValueError(
                f"Accumulators for scopes={self.scopes}, seq_len={self.seq_len}, granularity={self.granularity!r} "
                f"({num_groups} groups) need {_gib(need)} of float64 but only {_gib(limit)} may be used; "
                "drop 'whole' from scopes, use a smaller seq_len or a coarser granularity."
            )

    def _group_keys(self, layer: int, num_heads: int) -> list[tuple[int, ...]]:
        if self.granularity == "pooled":
            return [()]
        if self.granularity == "layer":
            return [(layer,)]
        return [(layer, h) for h in range(num_heads)]

    def _new_group(self, key: tuple[int, ...]) -> _Moments:
        self.check_memory(len(self._groups) + 1)
        n = self.seq_len
        z = dict(dtype=torch.float64)
        moments = _Moments(0, torch.zeros(n, n, **z),
                           torch.zeros(n, n, n, **z) if "per_query" in self.scopes else None,
                           torch.zeros(n * n, n * n, **z) if "whole" in self.scopes else None)
        self._groups[key] = moments
        return moments

    def update(self, layer: int, scores: torch.Tensor) -> None:
        """Add score matrices ``(B, H, n, n)`` (or ``(S, n, n)``, taken as one head) of one layer."""
        if scores.dim() == 3:
            scores = scores.unsqueeze(1)  # (S, 1, n, n)
        if scores.dim() != 4 or scores.shape[-1] != self.seq_len or scores.shape[-2] != self.seq_len:
            raise ValueError(f"scores must be (B, H, {self.seq_len}, {self.seq_len}) for seq_len={self.seq_len}, "
                             f"got shape {tuple(scores.shape)}; build windows of exactly seq_len tokens.")
        x = scores.detach().to("cpu", torch.float64)
        b, h, n, _ = x.shape
        keys = self._group_keys(layer, h)
        for key in keys:
            xs = x[:, key[1]] if len(key) == 2 else x.reshape(b * h, n, n)  # (S, n, n)
            group = self._groups.get(key) or self._new_group(key)
            group.count += xs.shape[0]
            group.sum += xs.sum(0)
            if group.per_query is not None:
                # [i, j, k] += Σ_s x[s, i, j] x[s, i, k]: one batched matmul over the rows i.
                group.per_query.baddbmm_(xs.permute(1, 2, 0), xs.permute(1, 0, 2))  # (n, n, S) @ (n, S, n)
            if group.whole is not None:
                flat = xs.reshape(xs.shape[0], n * n)  # (S, n²), row-major vec(A)
                group.whole.addmm_(flat.T, flat)

    # ------------------------------------------------------------------ reads
    @property
    def count(self) -> int:
        """Number of score matrices accumulated (sequences × layers × heads) over all groups."""
        return sum(g.count for g in self._groups.values())

    @property
    def layers(self) -> list[int]:
        """Layers with their own accumulators (empty for granularity='pooled')."""
        return sorted({key[0] for key in self._groups if key})

    @property
    def heads(self) -> list[int]:
        """Heads with their own accumulators (empty unless granularity='head')."""
        return sorted({key[1] for key in self._groups if len(key) == 2})

    def _select(self, layer: int | None, head: int | None) -> list[_Moments]:
        if not self._groups:
            raise ValueError("The covariance is empty: run collect_covariance or update() first.")
        if layer is None and head is not None:
            raise ValueError("head given without layer; pass layer=<int> too.")
        if layer is not None and self.granularity == "pooled":
            raise ValueError(f"layer={layer} requested but the covariance was collected with granularity='pooled'; "
                             "collect with granularity='layer' or 'head'.")
        if head is not None and self.granularity != "head":
            raise ValueError(f"head={head} requested but granularity={self.granularity!r}; "
                             "collect with granularity='head'.")
        chosen = [g for key, g in self._groups.items()
                  if (layer is None or key[0] == layer) and (head is None or key[1] == head)]
        if not chosen:
            raise ValueError(f"No accumulator for layer={layer}, head={head}; available layers {self.layers}.")
        return chosen

    def _total(self, layer, head, field: str) -> tuple[int, torch.Tensor, torch.Tensor]:
        groups = self._select(layer, head)
        if getattr(groups[0], field) is None:
            raise ValueError(f"scope {field!r} was not collected (scopes={self.scopes}); collect with "
                             f"scopes=(..., {field!r}).")
        count = sum(g.count for g in groups)
        total_sum = groups[0].sum.clone() if len(groups) == 1 else sum(g.sum for g in groups)
        moment = getattr(groups[0], field)
        if len(groups) > 1:
            moment = moment.clone()
            for g in groups[1:]:
                moment += getattr(g, field)
        return count, total_sum, moment

    def mean_per_query(self, layer: int | None = None, head: int | None = None) -> torch.Tensor:
        """Mean score matrix μ ``(n, n)``; row i is the mean of the per-query vector a_i."""
        groups = self._select(layer, head)
        return sum(g.sum for g in groups) / sum(g.count for g in groups)

    def mean_whole(self, layer: int | None = None, head: int | None = None) -> torch.Tensor:
        """Mean of vec(A), ``(n²,)``."""
        return self.mean_per_query(layer, head).reshape(-1)

    def per_query(self, layer: int | None = None, head: int | None = None,
                  centered: bool | None = None) -> torch.Tensor:
        """Per-query covariances ``(n, n, n)`` float64: entry [i] is Q^i, the covariance of row i."""
        centered = self.centered if centered is None else centered
        count, total_sum, moment = self._total(layer, head, "per_query")
        out = moment / count
        if centered:
            mean = total_sum / count  # (n, n)
            out = out - mean.unsqueeze(-1) * mean.unsqueeze(-2)  # (n, n, n): μ_i μ_iᵀ per row
        return out

    def whole(self, layer: int | None = None, head: int | None = None, centered: bool | None = None) -> torch.Tensor:
        """Whole-matrix covariance C_a ``(n², n²)`` float64 over row-major vec(A)."""
        centered = self.centered if centered is None else centered
        count, total_sum, moment = self._total(layer, head, "whole")
        out = moment / count
        if centered:
            mean = (total_sum / count).reshape(-1)
            out.sub_(torch.outer(mean, mean))
        return out

    def total_variance(self, layer: int | None = None, head: int | None = None, centered: bool | None = None) -> float:
        """Tr(C_a) = Σ_i Tr(Q^i), from whichever scope was collected."""
        centered = self.centered if centered is None else centered
        groups = self._select(layer, head)
        count = sum(g.count for g in groups)
        if groups[0].per_query is not None:
            sq = sum(torch.diagonal(g.per_query, dim1=-2, dim2=-1).sum() for g in groups)
        else:
            sq = sum(torch.diagonal(g.whole).sum() for g in groups)
        mean = sum(g.sum for g in groups) / count
        return float(sq / count - (mean.pow(2).sum() if centered else 0.0))

    # ------------------------------------------------------------------ combination
    def _check_compatible(self, other: "ScoreCovariance") -> None:
        if not isinstance(other, ScoreCovariance):
            raise TypeError(f"can only merge a ScoreCovariance, got {type(other).__name__}.")
        for field in ("seq_len", "scopes", "granularity"):
            if getattr(self, field) != getattr(other, field):
                mine, theirs = getattr(self, field), getattr(other, field)
                raise ValueError(f"cannot merge: {field} differs ({mine!r} vs {theirs!r}).")

    def merge(self, other: "ScoreCovariance") -> "ScoreCovariance":
        """Add ``other``'s sums and counts into this one (in place; returns self). Exact: nothing is re-weighted."""
        self._check_compatible(other)
        for key, g in other._groups.items():
            mine = self._groups.get(key) or self._new_group(key)
            mine.count += g.count
            mine.sum += g.sum
            if mine.per_query is not None:
                mine.per_query += g.per_query
            if mine.whole is not None:
                mine.whole += g.whole
        self.num_sequences += other.num_sequences
        return self

    def group_keys(self) -> list[tuple[int, ...]]:
        return sorted(self._groups)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat name -> tensor view of every accumulator (for save and cross-process reduction)."""
        out = {}
        for key in sorted(self._groups):
            g = self._groups[key]
            name = _key_name(key)
            out[f"{name}.sum"] = g.sum
            if g.per_query is not None:
                out[f"{name}.per_query"] = g.per_query
            if g.whole is not None:
                out[f"{name}.whole"] = g.whole
        return out

    def counts(self) -> dict[str, int]:
        return {_key_name(key): g.count for key, g in sorted(self._groups.items())}

    def ensure_groups(self, keys) -> None:
        """Create empty accumulators for ``keys`` (so that processes with no data join a reduction)."""
        for key in keys:
            if tuple(key) not in self._groups:
                self._new_group(tuple(key))

    def set_counts(self, counts: dict[str, int]) -> None:
        for name, value in counts.items():
            self._groups[_name_key(name)].count = int(value)

    # ------------------------------------------------------------------ io
    def save(self, path: str | os.PathLike) -> None:
        """Write the accumulators (safetensors, float64) and their counts; `load` restores them exactly."""
        header = {"format_version": _FORMAT_VERSION, "seq_len": self.seq_len, "scopes": list(self.scopes),
                  "granularity": self.granularity, "centered": self.centered, "counts": self.counts(),
                  "num_sequences": self.num_sequences, "metadata": self.metadata}
        tmp = os.fspath(path) + ".tmp"
        save_file({k: v.contiguous() for k, v in self.tensors().items()}, tmp, metadata={_META_KEY: json.dumps(header)})
        os.replace(tmp, os.fspath(path))  # atomic: an interrupted save never leaves a half-written file

    @classmethod
    def load(cls, path: str | os.PathLike, max_memory_bytes: int | None = None) -> "ScoreCovariance":
        """Read a file written by `save`."""
        with open_tagged_file(path, _META_KEY, "ScoreCovariance", _FORMAT_VERSION) as (header, f):
            cov = cls(header["seq_len"], header["scopes"], header["granularity"], header["centered"],
                      max_memory_bytes=max_memory_bytes, metadata=header.get("metadata", {}))
            cov.num_sequences = int(header.get("num_sequences", 0))
            for name, count in header["counts"].items():
                cov._groups[_name_key(name)] = _Moments(
                    int(count), f.get_tensor(f"{name}.sum"),
                    f.get_tensor(f"{name}.per_query") if "per_query" in cov.scopes else None,
                    f.get_tensor(f"{name}.whole") if "whole" in cov.scopes else None)
        return cov

    def __repr__(self) -> str:
        return (f"ScoreCovariance(seq_len={self.seq_len}, scopes={self.scopes}, granularity={self.granularity!r}, "
                f"centered={self.centered}, count={self.count}, num_sequences={self.num_sequences})")


def _key_name(key: tuple[int, ...]) -> str:
    if not key:
        return "pooled"
    return f"L{key[0]}" if len(key) == 1 else f"L{key[0]}.H{key[1]}"


def _name_key(name: str) -> tuple[int, ...]:
    if name == "pooled":
        return ()
    parts = name.split(".")
    return tuple(int(p[1:]) for p in parts)

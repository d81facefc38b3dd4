"""Streaming float64 accumulators of attention-score moments (docs/method.md#scores-and-covariances).

`ScoreCovariance` keeps, for each group (pooled, per layer or per head), the count of score matrices, their sum and
their per-query or whole-matrix second moments, for inputs of n tokens or shorter; its docstring says what is
stored and how shorter inputs count. The accumulation, combination and files are here; the reads (mean,
covariances, total variance) are `covariance_reads.CovarianceReads`, which `ScoreCovariance` inherits.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ..cost import SCOPES
from .covariance_file import key_name as _key_name, name_key as _name_key, read_file, write_file
from .covariance_reads import CovarianceReads, Moments
from .memory import available_memory_bytes, estimate_bytes, gib as _gib

logger = logging.getLogger(__name__)

__all__ = ["ScoreCovariance", "GRANULARITIES", "estimate_bytes", "available_memory_bytes"]

GRANULARITIES = ("pooled", "layer", "head")


class ScoreCovariance(CovarianceReads):
    """Accumulated moments of attention-score matrices of one sequence length.

    Each group keeps the count of score matrices, their sum ``Σ A`` ``(n, n)`` and the second moments

    - per-query: ``Σ a_i a_iᵀ`` for each row i, ``(n, n, n)``;
    - whole-matrix: ``Σ vec(A) vec(A)ᵀ``, ``(n², n²)`` (row-major, so each per-query block sits on its diagonal).

    Only sums are stored, so `merge` and the reduction across processes are exact additions, and centred
    covariance and second moment are both available at read time. The covariance is the population one
    (divided by the count), so the error of eq. 8 is exactly the in-sample mean squared error.
    Finer groups add up to coarser ones: pooled = Σ over layers = Σ over layers and heads.

    Inputs shorter than n (`update(..., lengths=...)`, per-query scope only): a sequence of t tokens has query rows
    i < t only, and its keys j >= t score zero (the zero fill the model runs with). Each group then also counts, per
    query row i, the score rows that reached it (``rows``, ``(n,)``): row i's moments are divided by its own count.
    A row no sequence reached (count 0) reads as mean zero and covariance zero. Files with per-row counts are of
    format version 2; files without them (version 1) read with the one count of every row, exactly as before.

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
        self._groups: dict[tuple[int, ...], Moments] = {}
        self.row_counts = False  # per-row counts kept (set by the first `update` with lengths, or by `load`)

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

    def _new_group(self, key: tuple[int, ...]) -> Moments:
        self.check_memory(len(self._groups) + 1)
        n = self.seq_len
        z = dict(dtype=torch.float64)
        moments = Moments(0, torch.zeros(n, n, **z),
                           torch.zeros(n, n, n, **z) if "per_query" in self.scopes else None,
                           torch.zeros(n * n, n * n, **z) if "whole" in self.scopes else None,
                           torch.zeros(n, **z) if self.row_counts else None)
        self._groups[key] = moments
        return moments

    def enable_row_counts(self) -> None:
        """Keep per-row counts from now on; the groups so far get ``count`` for every row (exact: they saw every
        row). Called by the first `update` with lengths, by `merge` and by the distributed reduction."""
        if "whole" in self.scopes:
            raise ValueError(f"per-row counts (inputs shorter than seq_len) need scopes=('per_query',), got "
                             f"scopes={self.scopes}; the whole-matrix covariance has no per-row count: collect it "
                             "on windows of exactly seq_len tokens.")
        if self.row_counts:
            return
        self.row_counts = True
        for g in self._groups.values():
            g.rows = torch.full((self.seq_len,), float(g.count), dtype=torch.float64)

    def _lengths(self, lengths, b: int) -> torch.Tensor:
        t = torch.as_tensor(lengths).to("cpu")
        if t.shape != (b,) or t.is_floating_point() or t.is_complex():
            raise ValueError(f"lengths must be an int tensor of shape ({b},), one length per sequence of the batch, "
                             f"got {tuple(t.shape)} {t.dtype}; pass the number of real tokens of each sequence.")
        if b and (int(t.min()) < 1 or int(t.max()) > self.seq_len):
            raise ValueError(f"lengths must be in [1, seq_len={self.seq_len}], got values in [{int(t.min())}, "
                             f"{int(t.max())}]; pad each batch to seq_len and pass each sequence's real length.")
        return t.to(torch.int64)

    def update(self, layer: int, scores: torch.Tensor, lengths: torch.Tensor | None = None) -> None:
        """Add score matrices ``(B, H, n, n)`` (or ``(S, n, n)``, taken as one head) of one layer.

        ``lengths`` ``(B,)`` int: sequence s has t = lengths[s] real tokens. Its rows i >= t and keys j >= t are
        zeroed here (whatever the padded positions scored), so its rows i < t enter the moments with keys >= t
        scoring zero, and only those rows are counted (per-query scope only). With lengths, the scores may be
        ``(B, H, w, w)`` for a w < n no shorter than the longest sequence: positions w..n-1 score zero, and only
        the moments' leading w × w (× w) block is touched (a batch of short inputs costs (w/n)³ of a full one).
        """
        if scores.dim() == 3:
            scores = scores.unsqueeze(1)  # (S, 1, n, n)
        w = scores.shape[-1]
        if scores.dim() != 4 or scores.shape[-2] != w or not (w == self.seq_len or lengths is not None
                                                               and 0 < w < self.seq_len):
            raise ValueError(f"scores must be (B, H, {self.seq_len}, {self.seq_len}) for seq_len={self.seq_len} "
                             f"(or (B, H, w, w), w < seq_len, with lengths), got shape {tuple(scores.shape)}; "
                             "build windows of exactly seq_len tokens.")
        x = scores.detach().to("cpu", torch.float64)
        b, h, n = x.shape[0], x.shape[1], self.seq_len
        reached = None
        if lengths is not None:
            t = self._lengths(lengths, b)
            if b and int(t.max()) > w:
                raise ValueError(f"scores of {w} positions cannot hold sequences of up to {int(t.max())} tokens; "
                                 f"pass scores of at least the longest sequence's length (or seq_len={n}).")
            self.enable_row_counts()
            real = torch.arange(w) < t[:, None]  # (B, w): position < t
            x = x * (real[:, None, :, None] & real[:, None, None, :])  # (B, H, w, w): rows and keys >= t zeroed
            reached = (torch.arange(n) < t[:, None]).to(torch.float64).sum(0)  # (n,): sequences that reach row i
        keys = self._group_keys(layer, h)
        for key in keys:
            xs = x[:, key[1]] if len(key) == 2 else x.reshape(b * h, w, w)  # (S, w, w)
            group = self._groups.get(key) or self._new_group(key)
            group.count += xs.shape[0]
            if group.rows is not None:
                heads = 1 if len(key) == 2 else h
                group.rows += reached * heads if reached is not None else float(xs.shape[0])
            group.sum[:w, :w] += xs.sum(0)
            if group.per_query is not None:
                # [i, j, k] += Σ_s x[s, i, j] x[s, i, k]: one batched matmul over the rows i (of the w × w block).
                group.per_query[:w, :w, :w].baddbmm_(xs.permute(1, 2, 0), xs.permute(1, 0, 2))  # (w, w, S) @ (w, S, w)
            if group.whole is not None:  # never with lengths (refused above), so w = n
                flat = xs.reshape(xs.shape[0], n * n)  # (S, n²), row-major vec(A)
                group.whole.addmm_(flat.T, flat)

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
        if other.row_counts:
            self.enable_row_counts()
        for key, g in other._groups.items():
            mine = self._groups.get(key) or self._new_group(key)
            mine.count += g.count
            if mine.rows is not None:
                mine.rows += g.rows if g.rows is not None else float(g.count)
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
            if g.rows is not None:
                out[f"{name}.rows"] = g.rows
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
        header = {"seq_len": self.seq_len, "scopes": list(self.scopes), "granularity": self.granularity,
                  "centered": self.centered, "counts": self.counts(), "num_sequences": self.num_sequences,
                  "metadata": self.metadata}
        write_file(path, header, self.tensors(), self.row_counts)

    @classmethod
    def load(cls, path: str | os.PathLike, max_memory_bytes: int | None = None) -> "ScoreCovariance":
        """Read a file written by `save` (format 1: one count per group; format 2: with per-row counts)."""
        header, groups = read_file(path)
        cov = cls(header["seq_len"], header["scopes"], header["granularity"], header["centered"],
                  max_memory_bytes=max_memory_bytes, metadata=header.get("metadata", {}))
        cov.num_sequences = int(header.get("num_sequences", 0))
        cov.row_counts = header["row_counts"]
        for key, (count, total, per_query, whole, rows) in groups.items():
            cov._groups[key] = Moments(count, total, per_query, whole, rows)
        return cov

    def __repr__(self) -> str:
        return (f"ScoreCovariance(seq_len={self.seq_len}, scopes={self.scopes}, granularity={self.granularity!r}, "
                f"centered={self.centered}, count={self.count}, num_sequences={self.num_sequences})")

"""One group's float64 sums (`Moments`) and the reads of `ScoreCovariance` from them (`CovarianceReads`): counts,
the groups a read selects, the mean, the per-query and whole-matrix covariances (or second moments) and the total
variance, each row divided by its own count where per-row counts were kept (see `ScoreCovariance`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Moments", "CovarianceReads"]


@dataclass
class Moments:
    """One group's sums: its count of score matrices, Σ A and the second moments of the scopes collected."""

    count: int
    sum: torch.Tensor  # (n, n)
    per_query: torch.Tensor | None  # (n, n, n): [i, j, k] = Σ A_ij A_ik
    whole: torch.Tensor | None  # (n², n²)
    rows: torch.Tensor | None = None  # (n,) float64: score rows that reached query row i; None: `count` for all


class CovarianceReads:
    """The reads of `ScoreCovariance` (a mixin): every group's `Moments` in ``_groups``, keyed ``()``, ``(layer,)``
    or ``(layer, head)``; ``seq_len``, ``scopes``, ``granularity`` and ``centered`` as `ScoreCovariance` sets them.
    """

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

    def _select(self, layer: int | None, head: int | None) -> list[Moments]:
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

    def _row_divisor(self, groups: list[Moments]) -> torch.Tensor | None:
        """``(n,)`` per-row counts summed over ``groups``, rows no sequence reached set to 1 (their sums are zero,
        so they read as zero); None without per-row counts (then every row divides by the one count)."""
        if groups[0].rows is None:
            return None
        rows = sum(g.rows for g in groups)
        return torch.where(rows > 0, rows, torch.ones_like(rows))

    def row_counts_of(self, layer: int | None = None, head: int | None = None) -> torch.Tensor:
        """``(n,)`` float64: the score rows that reached each query row (``count`` for every row without
        per-row counts)."""
        groups = self._select(layer, head)
        if groups[0].rows is None:
            return torch.full((self.seq_len,), float(sum(g.count for g in groups)), dtype=torch.float64)
        return sum(g.rows for g in groups)

    def mean_per_query(self, layer: int | None = None, head: int | None = None) -> torch.Tensor:
        """Mean score matrix μ ``(n, n)``; row i is the mean of the per-query vector a_i (zero for a row no
        sequence reached)."""
        groups = self._select(layer, head)
        rows = self._row_divisor(groups)
        if rows is not None:
            return sum(g.sum for g in groups) / rows[:, None]
        return sum(g.sum for g in groups) / sum(g.count for g in groups)

    def mean_whole(self, layer: int | None = None, head: int | None = None) -> torch.Tensor:
        """Mean of vec(A), ``(n²,)``."""
        return self.mean_per_query(layer, head).reshape(-1)

    def per_query(self, layer: int | None = None, head: int | None = None,
                  centered: bool | None = None) -> torch.Tensor:
        """Per-query covariances ``(n, n, n)`` float64: entry [i] is Q^i, the covariance of row i.

        With per-row counts (inputs shorter than n), Q^i is over the score rows that reached row i; a row that
        none reached is all zeros (no NaN): the greedy then takes its lowest keys and fits R = 0.
        """
        centered = self.centered if centered is None else centered
        count, total_sum, moment = self._total(layer, head, "per_query")
        rows = self._row_divisor(self._select(layer, head))
        if rows is not None:
            out = moment / rows[:, None, None]
            mean = total_sum / rows[:, None]  # (n, n)
        else:
            out = moment / count
            mean = total_sum / count  # (n, n)
        if centered:
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
        rows = self._row_divisor(groups)
        if rows is not None:  # Σ_i of row i's trace, each over its own count
            sq = sum(torch.diagonal(g.per_query, dim1=-2, dim2=-1).sum(-1) for g in groups) / rows  # (n,)
            mean = sum(g.sum for g in groups) / rows[:, None]  # (n, n)
            return float((sq - (mean.pow(2).sum(-1) if centered else 0.0)).sum())
        count = sum(g.count for g in groups)
        if groups[0].per_query is not None:
            sq = sum(torch.diagonal(g.per_query, dim1=-2, dim2=-1).sum() for g in groups)
        else:
            sq = sum(torch.diagonal(g.whole).sum() for g in groups)
        mean = sum(g.sum for g in groups) / count
        return float(sq / count - (mean.pow(2).sum() if centered else 0.0))

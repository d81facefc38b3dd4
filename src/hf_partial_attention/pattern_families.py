"""Constrained greedy selection of P: pattern families whose exact part is a dense, fast computation.

The paper's per-query greedy gives every query its own key set P_i; computing those k scores needs a
gather (or the full QKᵀ). Constraining the choice trades a little reconstruction error for speed:

- ``"columns"``: one key set shared by every query (the exact part is one GEMM, Q·K_Cᵀ);
- ``"blocks"``: consecutive rows in blocks of ``block_rows`` (default gcd(n, 32)) share one key set (one small
  GEMM per block);
  block-local windows are the special case where each block picks its own diagonal block;
- ``"bands"``: diagonal offsets shared by every query, P_i = {(i + o) mod n : o ∈ O} [ours: circular at the
  edges so every row keeps exactly k distinct keys];
- ``"per_query"``: no constraint (the paper's setting; same result as `reconstruction.greedy_select`).

Each step adds, for every group of rows, the candidate that removes the most residual variance summed
over the group's rows (the per-query greedy's criterion, pooled), then updates each row's residual.
"""

from __future__ import annotations

import math

import torch

from .pattern import AttentionPattern
from .reconstruction import solve_reconstruction

__all__ = ["FAMILIES", "grouped_greedy", "family_indices", "family_pattern", "window_indices"]

FAMILIES = ("per_query", "columns", "blocks", "bands", "windows")


def grouped_greedy(
    cov: torch.Tensor, k: int, groups: torch.Tensor, key_of: torch.Tensor, rel_tol: float = 1e-10
) -> torch.Tensor:
    """Greedy P under a sharing constraint.

    Args:
        cov: ``(n, l, l)`` per-row covariances (float64).
        k: keys per row.
        groups: ``(n,)`` int64 group of each row; rows of a group take the same candidate at each step.
        key_of: ``(n, c)`` int64, the key row i gets when its group takes candidate c.

    Returns:
        ``(n, k)`` sorted int64 indices.
    """
    n, l, _ = cov.shape
    if not 1 <= k <= l:
        raise ValueError(f"k must be in [1, {l}], got {k}.")
    num_groups = int(groups.max()) + 1
    s = cov.clone()
    chosen = torch.zeros(n, l, dtype=torch.bool)
    picks = torch.empty(n, k, dtype=torch.long)
    tiny = torch.finfo(cov.dtype).tiny
    tol = rel_tol * torch.diagonal(cov, dim1=-2, dim2=-1).amax(-1, keepdim=True).clamp_min(tiny)  # (n, 1)
    rows = torch.arange(n)
    for step in range(k):
        diag = torch.diagonal(s, dim1=-2, dim2=-1)  # (n, l)
        gain = torch.where(diag > tol, (s * s).sum(-2) / diag.clamp_min(tiny), torch.zeros_like(diag))
        cand_gain = gain.gather(-1, key_of)  # (n, c)
        cand_used = chosen.gather(-1, key_of)  # (n, c)
        pooled = torch.zeros(num_groups, key_of.shape[1], dtype=cov.dtype).index_add_(0, groups, cand_gain)
        # A candidate is unavailable to a group once it maps to an already chosen key of any of its rows.
        used = torch.zeros_like(pooled).index_add_(0, groups, cand_used.to(cov.dtype)) > 0  # (G, c)
        pooled = torch.where(used, torch.full_like(pooled, -1.0), pooled)
        best = pooled.argmax(-1)  # (G,): lowest candidate index on ties
        j = key_of[rows, best[groups]]  # (n,)
        picks[:, step] = j
        chosen[rows, j] = True
        col = s[rows, :, j].unsqueeze(-1)  # (n, l, 1)
        pivot = s[rows, j, j].view(n, 1, 1)
        ok = pivot > tol.unsqueeze(-1)
        update = col @ col.transpose(-1, -2) / torch.where(ok, pivot, torch.ones_like(pivot))
        s = s - torch.where(ok, update, torch.zeros_like(update))
    return torch.sort(picks, dim=-1).values


def window_indices(n: int, k: int) -> torch.Tensor:
    """Block-local windows: rows of block b (k rows each) compute keys of block b exactly. Needs k | n."""
    if n % k:
        raise ValueError(f"family='windows' needs k to divide n; got n={n}, k={k}.")
    return torch.arange(n).view(n // k, k).repeat_interleave(k, 0)  # (n, k)


def family_indices(cov: torch.Tensor, k: int, family: str = "per_query", block_rows: int | None = None) -> torch.Tensor:
    """P ``(n, k)`` for a family (see module docstring) from per-query covariances ``(n, n, n)``."""
    n = cov.shape[0]
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}.")
    if cov.shape != (n, n, n):
        raise ValueError(f"cov must be (n, n, n) per-query covariances, got {tuple(cov.shape)}.")
    ident = torch.arange(n).expand(n, n)
    if family == "windows":
        return window_indices(n, k)
    if family == "per_query":
        return grouped_greedy(cov, k, torch.arange(n), ident)
    if family == "columns":
        return grouped_greedy(cov, k, torch.zeros(n, dtype=torch.long), ident)
    if family == "blocks":
        rows = block_rows or math.gcd(n, 32)  # [ours] default: blocks of 32 rows (when 32 divides n)
        if rows < 1 or n % rows:
            raise ValueError(f"block_rows must divide n={n}, got {rows}.")
        return grouped_greedy(cov, k, torch.arange(n) // rows, ident)
    offsets = (torch.arange(n)[:, None] + torch.arange(n)[None, :]) % n  # bands: (n, offsets) -> key
    return grouped_greedy(cov, k, torch.zeros(n, dtype=torch.long), offsets)


def family_pattern(
    cov: torch.Tensor,
    k: int,
    family: str = "per_query",
    block_rows: int | None = None,
    mean: torch.Tensor | None = None,
    ridge: float = 1e-6,
    metadata: dict | None = None,
) -> AttentionPattern:
    """P from `family_indices` with its optimal R (and bias when ``mean`` ``(n, n)`` is given).

    The metadata holds ``normalized_error`` = Σ_i ε_i / Σ_i Tr(C_i), the error predicted from ``cov``.
    """
    cov = cov.to(torch.float64)
    indices = family_indices(cov, k, family, block_rows)
    recon, bias, error = solve_reconstruction(cov, indices, None if mean is None else mean.to(torch.float64), ridge)
    total = torch.diagonal(cov, dim1=-2, dim2=-1).sum()
    meta = {"method": f"greedy_{family}", "family": family, "normalized_error": float(error.sum() / total)}
    if family == "blocks":
        meta["block_rows"] = block_rows or math.gcd(cov.shape[0], 32)
    meta.update(metadata or {})
    return AttentionPattern(indices, recon, bias, metadata=meta)

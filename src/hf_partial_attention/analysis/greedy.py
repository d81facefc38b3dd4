"""The greedy choice of P (docs/method.md#greedy-choice-of-p): `greedy_select` adds, one step at a time, the entry
whose exact value removes the most residual (optionally M-weighted) variance, under an optional sharing constraint.
`selection` builds the pattern families and R on it."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

__all__ = ["TIE_RTOL", "greedy_select"]

# Candidates whose gains differ by less than TIE_RTOL times the problem's largest first-step gain (its scale) tie,
# and the tie goes to the lowest index. Gains equal in exact arithmetic (a rank-one residual, which a covariance of
# fewer windows than n reaches, gives every column the same gain ‖v‖²) otherwise differ by roundoff, and the CPU's
# summation order would choose P; roundoff of the covariance (1e-12 relative) grows ~10^4-fold through the
# elimination. The covariances are sums of float32 scores, which resolve ~1e-7 of their scale: a difference below
# 1e-6 of the scale is not a measured difference between keys, and choosing either moves the error by less.
TIE_RTOL = 1e-6


def greedy_select(cov: torch.Tensor, k: int, groups: torch.Tensor | None = None,
                  candidates: torch.Tensor | None = None, rel_tol: float = 1e-10,
                  metric: torch.Tensor | None = None, order: bool = False,
                  tie_rtol: float = TIE_RTOL) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy P minimising the reconstruction error, optionally under a sharing constraint.

    Starting from ``S = C``, each step adds ``j* = argmax_j ‖S[:, j]‖² / S[j, j]`` (the entry whose exact value
    removes the most residual variance) and updates ``S ← S − S[:, j*] S[j*, :] / S[j*, j*]``. Ties go to the
    lowest index: candidates whose gains are within ``tie_rtol`` times the problem's largest first-step gain of the
    step's largest gain tie, so that roundoff never chooses P (`TIE_RTOL`). Entries whose residual variance is below
    ``rel_tol`` times the problem's largest initial variance are taken only once nothing else is left (their error
    contribution is already zero).

    Args:
        cov: ``(..., l, l)`` covariances (symmetric), one problem per leading index (float64).
        k: entries to select per problem (``1 <= k <= l``).
        groups: optional ``(R,)`` int64 group of each of the R problems (cov then ``(R, l, l)``): the rows of a
            group take the same candidate at each step, the one whose gains summed over the group are largest.
            Default: every problem its own group.
        candidates: optional ``(R, c)`` int64, the entry problem r gets when its group takes candidate c.
            Default: candidate c is entry c. A candidate mapping to an entry a row already holds is skipped.
        metric: optional ``(..., l, l)`` positive semi-definite M: the error measured is ``E[eᵀ M e]`` instead of
            ``E[‖e‖²]`` (`objective_metric`); a step then adds ``argmax_j S[:, j]ᵀ M S[:, j] / S[j, j]``.

        order: return the picks in the order the greedy took them and the residual after every step instead
            (``(..., k)`` each): the greedy is nested, so the first k' picks are its answer for k' (one run gives
            Fig. 9's whole curve and the patterns of every k' ≤ k).

    Returns:
        ``(indices, residual)``: sorted ``(..., k)`` int64 and ``Tr(M S)`` ``(...)`` (``Tr(S)`` without a metric),
        the error of the optimal R.
    """
    lead, l = cov.shape[:-2], cov.shape[-1]
    if not 1 <= k <= l:
        raise ValueError(f"k must be in [1, {l}] for covariances of size {l}, got k={k}.")
    c = cov.reshape(-1, l, l)  # (R, l, l), read only: S = C − L Lᵀ is never formed
    groups, candidates = _constraint(c.shape[0], l, groups, candidates)
    m = None if metric is None else metric.reshape(-1, l, l).to(cov.dtype)  # (R, l, l)
    # The residual S = C − L Lᵀ (L: the steps' normalised columns) is tracked through its diagonal and the
    # energies ‖S[:, j]‖²_M; each step then costs one product of C with a vector, not an update of all of S.
    diag = torch.diagonal(c, dim1=-2, dim2=-1).clone()  # (R, l)
    tol = rel_tol * diag.amax(-1, keepdim=True).clamp_min(torch.finfo(cov.dtype).tiny)  # (R, 1)
    # M C, once: M's column j of S is then read from it and M L (each step's M u kept), not computed by a product
    mc = None if m is None else torch.bmm(m, c)  # (R, l, l)
    picks, diag, basis, m_basis, path = _steps(c, mc, diag, tol, k, groups, candidates, tie_rtol, order)
    if m is None:
        residual = diag.clamp_min(0).sum(-1)  # (R,): Tr(S)
    else:
        residual, metric_path = _metric_residual(c, m, basis, m_basis)
        path = metric_path if path is not None else None
    if order:
        return picks.reshape(*lead, k), path.reshape(*lead, k)
    return torch.sort(picks, dim=-1).values.reshape(*lead, k), residual.reshape(lead)


def _steps(c, mc, diag, tol, k: int, groups, candidates, tie_rtol: float, order: bool):
    """`greedy_select`'s k steps on ``c`` ``(R, l, l)`` (and ``mc`` = M C): ``(picks (R, k) in the order taken, the
    residual's diagonal (R, l), Lᵀ (R, k, l), (M L)ᵀ or None, and without a metric, with ``order``, the residual
    after each step (R, k), else None)``."""
    r, l = c.shape[0], c.shape[-1]
    rows = torch.arange(r)
    num_groups = int(groups.max()) + 1
    chosen = torch.zeros(r, l, dtype=torch.bool)
    picks = torch.empty(r, k, dtype=torch.long)
    energy = _column_energy(c, mc)  # (R, l)
    # Lᵀ and (M L)ᵀ, a step per row: the products below are then row vectors times row-major matrices, the form
    # MKL's batched product runs fastest (2-3x the column form at l = 128, float64, one thread)
    basis = torch.zeros(r, k, l, dtype=c.dtype)  # (R, k, l): Lᵀ
    m_basis = None if mc is None else torch.zeros_like(basis)  # (R, k, l): (M L)ᵀ
    path = torch.empty(r, k, dtype=c.dtype) if order else None  # residual after each step
    # (G, 1): gains closer than this tie (tie_rtol times each group's largest first-step gain)
    tie = tie_rtol * _best_candidate(_gain(diag, energy, tol), chosen, groups, candidates, num_groups, None)[1]
    # a progress bar where a run takes minutes (whole-matrix covariances, l = n² >= 4096)
    for step in tqdm(range(k), desc=f"greedy (l={l})", disable=l < 4096, leave=False, unit="step"):
        j, _ = _best_candidate(_gain(diag, energy, tol), chosen, groups, candidates, num_groups, tie)  # (R,)
        picks[:, step] = j
        chosen[rows, j] = True
        u, w, energy = _step(c, mc, basis[:, :step], None if m_basis is None else m_basis[:, :step], j, tol, energy)
        diag = diag - u * u
        basis[:, step] = u
        if m_basis is not None:
            m_basis[:, step] = w
        if path is not None and mc is None:
            path[:, step] = diag.clamp_min(0).sum(-1)
    return picks, diag, basis, m_basis, path


def _gain(diag: torch.Tensor, energy: torch.Tensor, tol: torch.Tensor) -> torch.Tensor:
    """``(R, l)``: the residual variance each entry would remove, ‖S[:, j]‖²_M / S[j, j] (zero where
    S[j, j] <= tol)."""
    return torch.where(diag > tol, energy / diag.clamp_min(torch.finfo(diag.dtype).tiny), torch.zeros_like(diag))


def _step(c, mc, low, m_low, j, tol, energy) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One greedy step at entries ``j`` ``(R,)``, given Lᵀ so far ``low`` ``(R, t, l)`` (and ``m_low``, (M L)ᵀ, with
    a metric, ``mc`` = M C): ``u = S[:, j] / √S[j, j]`` (zero where the pivot is below ``tol``), ``w = M u`` and the
    energies ‖S'[:, i]‖²_M of the residual S' = S − u uᵀ, each ``(R, l)``."""
    rows = torch.arange(c.shape[0])
    at_j = low[rows, :, j].unsqueeze(1)  # (R, 1, t): L[j]
    col = c[rows, :, j] - (at_j @ low).squeeze(1)  # (R, l): S[:, j]
    pivot = col[rows, j].unsqueeze(-1)  # (R, 1)
    ok = pivot > tol
    root = torch.where(ok, pivot, torch.ones_like(pivot)).sqrt()  # (R, 1)
    u = torch.where(ok, col / root, torch.zeros_like(col))  # (R, l)
    # (R, l): M u = (M C[:, j] − M L L[j]ᵀ) / √S[j, j]
    w = u if mc is None else torch.where(ok, (mc[rows, :, j] - (at_j @ m_low).squeeze(1)) / root, torch.zeros_like(col))
    # (R, l): S M u = C w − L Lᵀ w, with C w as wᵀ C (C is symmetric)
    s_w = (torch.bmm(w.unsqueeze(1), c) - ((low * w.unsqueeze(1)).sum(-1).unsqueeze(1) @ low)).squeeze(1)
    # S' = S − u uᵀ:  ‖S'_j‖²_M = ‖S_j‖²_M − 2 u_j (S M u)_j + u_j² uᵀ M u
    return u, w, energy - 2 * u * s_w + u * u * (u * w).sum(-1, keepdim=True)


def _best_candidate(gain: torch.Tensor, chosen: torch.Tensor, groups: torch.Tensor, candidates: torch.Tensor,
                    num_groups: int, tie: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``((R,), (G, 1))``: the entry each row takes this step, its group's candidate whose gains ``(R, l)`` summed over
    the group's rows are largest, among those that map to no entry already ``chosen`` in any of them, the lowest of
    those within ``tie`` ``(G, 1)`` of the largest (None: exact ties only); and each group's largest summed gain."""
    rows = torch.arange(gain.shape[0])
    pooled = torch.zeros(num_groups, candidates.shape[1], dtype=gain.dtype).index_add_(
        0, groups, gain.gather(-1, candidates))  # (G, c): gains summed over each group's rows
    used = torch.zeros_like(pooled).index_add_(0, groups, chosen.gather(-1, candidates).to(gain.dtype)) > 0
    pooled = torch.where(used, torch.full_like(pooled, -1.0), pooled)  # (G, c): gains >= 0, a used candidate -1
    top = pooled.amax(-1, keepdim=True)  # (G, 1)
    # the first candidate within the tolerance of the largest (argmax of a bool row: its first True)
    near = pooled >= (top if tie is None else top - tie)  # (G, c)
    best = (near & ~used).to(torch.int8).argmax(-1)  # (G,): the first True of each row
    return candidates[rows, best[groups]], top


def _constraint(r: int, l: int, groups, candidates) -> tuple[torch.Tensor, torch.Tensor]:
    """`greedy_select`'s ``groups`` ``(R,)`` and ``candidates`` ``(R, c)``, defaults filled in and shapes checked."""
    groups = torch.arange(r) if groups is None else groups.to(torch.int64)
    candidates = torch.arange(l).expand(r, l) if candidates is None else candidates.to(torch.int64)
    if groups.shape != (r,) or candidates.shape[0] != r:
        raise ValueError(f"groups must be ({r},) and candidates ({r}, c) for {r} problems; got "
                         f"{tuple(groups.shape)} and {tuple(candidates.shape)}.")
    return groups, candidates


def _column_energy(c: torch.Tensor, mc: torch.Tensor | None) -> torch.Tensor:
    """``(R, l)``: ‖C[:, j]‖²_M of every column of the ``(R, l, l)`` covariances, given ``mc = M C`` (M = I
    without a metric)."""
    if mc is not None:
        return (c * mc).sum(-2)  # C_jᵀ M C_j
    if c.numel() <= 1 << 26:
        return (c * c).sum(-2)
    # a whole-matrix covariance (2 GiB at n = 128): no temporary of its size
    return torch.cat([(c[:, :, a:a + 1024] ** 2).sum(-2) for a in range(0, c.shape[-1], 1024)], dim=-1)


def _metric_residual(c: torch.Tensor, m: torch.Tensor, basis: torch.Tensor,
                     m_basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Tr(M S) (R,), its value after each step (R, k))`` from the steps' columns as rows, ``basis``
    ``(R, k, l)``, and ``m_basis``, M times each: Tr(M S) = Tr(M C) − Σ_t u_tᵀ M u_t."""
    spent = (basis * m_basis).sum(-1)  # (R, k): u_tᵀ M u_t
    start = (m * c).sum((-1, -2))  # (R,): Tr(M C)
    return (start - spent.sum(-1)).clamp_min(0), (start.unsqueeze(-1) - spent.cumsum(-1)).clamp_min(0)

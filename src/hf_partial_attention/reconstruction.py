"""Linear algebra of reconstruction from partial computation (method.md, section 2).

A score vector a (a row of the score matrix, or the whole matrix flattened) with covariance C is split into
the exactly computed entries P (|P| = k) and the rest P̄. The optimal linear map is `R = C_P̄P C_PP⁻¹`
(the paper's eq. 7 read as the linear MMSE estimator) with mean squared error
`ε(P) = Tr(C_P̄P̄ − C_P̄P C_PP⁻¹ C_PP̄)` (eq. 8, the trace of the Schur complement).

Every function is batched over leading dimensions, so one call handles the n per-query problems.
This file is part of the remote-code bundle: only ``torch`` imports.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

__all__ = ["complement_indices", "inverse_permutation", "solve_reconstruction", "greedy_select", "local_prior"]


def complement_indices(indices: torch.Tensor, size: int) -> torch.Tensor:
    """Sorted indices in ``[0, size)`` not in each row of ``indices``: ``(..., k) -> (..., size - k)``."""
    lead = indices.shape[:-1]
    taken = torch.zeros(*lead, size, dtype=torch.bool, device=indices.device)  # (..., size)
    taken.scatter_(-1, indices, True)
    order = torch.argsort(taken.to(torch.int8), dim=-1, stable=True)  # not-taken first, in index order
    return order[..., : size - indices.shape[-1]].contiguous()


def inverse_permutation(indices: torch.Tensor, size: int) -> torch.Tensor:
    """For each row, where position j sits in ``cat(P, P̄)``: gathering ``cat(exact, rest)`` with it restores order."""
    perm = torch.cat([indices, complement_indices(indices, size)], dim=-1)  # (..., size)
    return torch.argsort(perm, dim=-1)


def _ridge(c_pp: torch.Tensor, ridge: float) -> torch.Tensor:
    k = c_pp.shape[-1]
    scale = torch.diagonal(c_pp, dim1=-2, dim2=-1).sum(-1).clamp_min(torch.finfo(c_pp.dtype).tiny) / k
    return ridge * scale  # (...,)


def solve_reconstruction(
    cov: torch.Tensor,
    indices: torch.Tensor,
    mean: torch.Tensor | None = None,
    ridge: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Optimal reconstruction of the entries outside P from those in P.

    Args:
        cov: ``(..., l, l)`` covariance (or second moment) of the score vectors.
        indices: ``(..., k)`` int64, the exactly computed entries P of each problem.
        mean: optional ``(..., l)`` mean; when given, a bias ``b = μ_P̄ − R μ_P`` is returned too.
        ridge: Tikhonov term ``λ = ridge · Tr(C_PP)/k`` added to ``C_PP`` before its Cholesky factorisation.

    Returns:
        ``(R, bias, error)``: R ``(..., l−k, k)`` with rows in the order of ``complement_indices``, bias
        ``(..., l−k)`` or ``None``, and the Schur-complement error ``(...)`` (expected squared error summed
        over P̄). All in the dtype of ``cov``; pass float64 for accurate results.
    """
    l = cov.shape[-1]
    k = indices.shape[-1]
    comp = complement_indices(indices, l)  # (..., l-k)
    rows_p = torch.gather(cov, -2, indices.unsqueeze(-1).expand(*indices.shape, l))  # (..., k, l)
    rows_c = torch.gather(cov, -2, comp.unsqueeze(-1).expand(*comp.shape, l))  # (..., l-k, l)
    c_pp = torch.gather(rows_p, -1, indices.unsqueeze(-2).expand(*indices.shape[:-1], k, k))  # (..., k, k)
    c_cp = torch.gather(rows_c, -1, indices.unsqueeze(-2).expand(*comp.shape[:-1], l - k, k))  # (..., l-k, k)
    lam = _ridge(c_pp, ridge)
    eye = torch.eye(k, dtype=cov.dtype, device=cov.device)
    chol, info = torch.linalg.cholesky_ex(c_pp + lam[..., None, None] * eye)  # (..., k, k)
    if bool((info != 0).any()):
        # A singular C_PP (for example constant scores) still has a least-squares R: fall back to lstsq.
        logger.warning("C_PP not positive definite for %d problems; using a pseudo-inverse", int((info != 0).sum()))
        r_t = torch.linalg.pinv(c_pp + lam[..., None, None] * eye, hermitian=True) @ c_cp.transpose(-1, -2)
    else:
        r_t = torch.cholesky_solve(c_cp.transpose(-1, -2), chol)  # (..., k, l-k) = C_PP⁻¹ C_PP̄
    recon = r_t.transpose(-1, -2).contiguous()  # (..., l-k, k)
    c_cc_trace = torch.gather(torch.diagonal(cov, dim1=-2, dim2=-1), -1, comp).sum(-1)  # (...,)
    error = c_cc_trace - (recon * c_cp).sum((-1, -2))
    bias = None
    if mean is not None:
        mu_p = torch.gather(mean, -1, indices)  # (..., k)
        mu_c = torch.gather(mean, -1, comp)  # (..., l-k)
        bias = mu_c - (recon @ mu_p.unsqueeze(-1)).squeeze(-1)
    return recon, bias, error


def greedy_select(cov: torch.Tensor, k: int, rel_tol: float = 1e-10) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy choice of P minimising the reconstruction error (method.md, section 2).

    Starting from ``S = C``, each step adds ``j* = argmax_j ‖S[:, j]‖² / S[j, j]`` (the entry whose exact
    value removes the most residual variance) and updates ``S ← S − S[:, j*] S[j*, :] / S[j*, j*]``.
    Ties go to the lowest index. Entries whose residual variance is below ``rel_tol`` times the largest
    initial variance are only taken once nothing else is left (their error contribution is already zero).

    Args:
        cov: ``(..., l, l)`` covariance, batched.
        k: number of entries to select (``1 <= k <= l``).

    Returns:
        ``(indices, error)``: sorted ``(..., k)`` int64 and the residual ``Tr(S)`` ``(...)``.
    """
    l = cov.shape[-1]
    if not 1 <= k <= l:
        raise ValueError(f"k must be in [1, {l}] for covariances of size {l}, got {k}.")
    s = cov.clone()
    lead = cov.shape[:-2]
    chosen = torch.zeros(*lead, l, dtype=torch.bool, device=cov.device)  # (..., l)
    picks = torch.empty(*lead, k, dtype=torch.long, device=cov.device)
    diag0 = torch.diagonal(cov, dim1=-2, dim2=-1)
    tol = rel_tol * diag0.amax(-1, keepdim=True).clamp_min(torch.finfo(cov.dtype).tiny)  # (..., 1)
    for step in range(k):
        diag = torch.diagonal(s, dim1=-2, dim2=-1)  # (..., l)
        gain = (s * s).sum(-2) / diag.clamp_min(torch.finfo(cov.dtype).tiny)
        usable = (diag > tol) & ~chosen
        gain = torch.where(usable, gain, torch.full_like(gain, -1.0))
        # Where nothing is usable, every remaining entry has gain -1 and argmax takes the lowest free index.
        gain = torch.where(chosen, torch.full_like(gain, -2.0), gain)
        j = gain.argmax(-1)  # (...,)
        picks[..., step] = j
        chosen.scatter_(-1, j.unsqueeze(-1), True)
        col = torch.gather(s, -1, j[..., None, None].expand(*lead, l, 1))  # (..., l, 1)
        pivot = torch.gather(col, -2, j[..., None, None])  # (..., 1, 1)
        ok = pivot > tol.unsqueeze(-1)
        update = col @ col.transpose(-1, -2) / torch.where(ok, pivot, torch.ones_like(pivot))
        s = s - torch.where(ok, update, torch.zeros_like(update))
    error = torch.diagonal(s, dim1=-2, dim2=-1).clamp_min(0).sum(-1)
    return torch.sort(picks, dim=-1).values, error


def local_prior(n: int, k: int, correlation: float = 0.9) -> tuple[torch.Tensor, torch.Tensor]:
    """The deterministic default pattern: each query's k nearest keys and R under a stationary prior.

    P_i holds the k positions closest to i (ties to the lower position); R_i is the optimal reconstruction
    for the covariance ``ρ^|j − j'|`` of a row's scores (an AR(1) prior: nearby keys score alike).

    Returns:
        ``(indices (n, k) int64, reconstruction (n, n−k, k) float32)``.
    """
    pos = torch.arange(n)
    dist = (pos[:, None] - pos[None, :]).abs()  # (n, n)
    order = torch.argsort(dist * n + pos[None, :], dim=-1)  # nearest first, lower position on ties
    indices = torch.sort(order[:, :k], dim=-1).values  # (n, k)
    prior = torch.tensor(correlation, dtype=torch.float64) ** dist.to(torch.float64)  # (n, n)
    recon, _, _ = solve_reconstruction(prior.expand(n, n, n), indices)
    return indices, recon.to(torch.float32)

"""Linear algebra of reconstruction from partial computation (docs/method.md#optimal-reconstruction).

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

__all__ = ["complement_indices", "inverse_permutation", "solve_reconstruction", "nearest_keys", "local_prior"]


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
    """Optimal reconstruction of the entries outside P from those in P (docs/method.md#optimal-reconstruction).

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
    c_cc_trace = torch.gather(torch.diagonal(cov, dim1=-2, dim2=-1), -1, comp).sum(-1)  # (...,)
    recon, error = _solve_blocks(c_pp, c_cp, c_cc_trace, ridge)
    bias = None
    if mean is not None:
        mu_p = torch.gather(mean, -1, indices)  # (..., k)
        mu_c = torch.gather(mean, -1, comp)  # (..., l-k)
        bias = mu_c - (recon @ mu_p.unsqueeze(-1)).squeeze(-1)
    return recon, bias, error


# A C_PP whose eigenvalues fall below SPECTRAL_RTOL times its largest is rank-deficient as far as the covariance can
# tell: covariances are sums of float32 scores, which resolve ~1e-7 of their scale, and one fitted on fewer windows
# than n has exact null directions that roundoff fills with noise. R is then the minimum-norm solution: those
# directions are left out (they carry at most SPECTRAL_RTOL of C_PP's variance), so R does not depend on the noise.
SPECTRAL_RTOL = 1e-6
# Problems whose smallest Cholesky pivot² is below this fraction of their largest (ill-conditioned or rank-deficient)
# are solved through C_PP's eigendecomposition to apply SPECTRAL_RTOL; the others keep the Cholesky solve (the same
# R in exact arithmetic: no eigenvalue of theirs is near the cut).
_CHECK_SPECTRUM_BELOW = 1e-3


def _solve_blocks(c_pp: torch.Tensor, c_cp: torch.Tensor, c_cc_trace: torch.Tensor, ridge: float):
    """``R = C_P̄P C_PP⁻¹`` and ``Tr(C_P̄P̄) − Tr(R C_PP̄)`` from the blocks of C (no explicit inverse): a Cholesky
    solve of ``C_PP + λI``, or, where C_PP is rank-deficient (`SPECTRAL_RTOL`), the minimum-norm R."""
    k = c_pp.shape[-1]
    lam = _ridge(c_pp, ridge)
    eye = torch.eye(k, dtype=c_pp.dtype, device=c_pp.device)
    shifted = c_pp + lam[..., None, None] * eye  # (..., k, k)
    chol, info = torch.linalg.cholesky_ex(shifted)  # (..., k, k)
    r_t = torch.cholesky_solve(c_cp.transpose(-1, -2), chol)  # (..., k, l-k) = C_PP⁻¹ C_PP̄
    pivots = torch.diagonal(chol, dim1=-2, dim2=-1) ** 2  # (..., k)
    flagged = (info != 0) | ~(pivots.amin(-1) > _CHECK_SPECTRUM_BELOW * pivots.amax(-1))  # (...,)
    if bool(flagged.any()):
        logger.debug("C_PP rank-deficient or ill-conditioned for %d problems: minimum-norm R", int(flagged.sum()))
        r_t = r_t.clone()
        r_t[flagged] = _min_norm(c_pp[flagged], c_cp[flagged], lam[flagged])  # (m, k, l-k) of the flagged problems
    recon = r_t.transpose(-1, -2).contiguous()  # (..., l-k, k)
    return recon, c_cc_trace - (recon * c_cp).sum((-1, -2))


def _min_norm(c_pp: torch.Tensor, c_cp: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """``(m, k, l-k)``: ``(C_PP + λI)⁻¹ C_PP̄`` restricted to the eigenvectors of C_PP above `SPECTRAL_RTOL` of its
    largest eigenvalue, for ``(m, k, k)`` C_PP, ``(m, l-k, k)`` C_P̄P and ``(m,)`` λ."""
    vals, vecs = torch.linalg.eigh(c_pp)  # (m, k), (m, k, k)
    keep = vals > SPECTRAL_RTOL * vals.amax(-1, keepdim=True).clamp_min(torch.finfo(vals.dtype).tiny)  # (m, k)
    inv = torch.where(keep, 1.0 / (vals + lam[..., None]).clamp_min(torch.finfo(vals.dtype).tiny), 0.0)  # (m, k)
    return vecs @ (inv.unsqueeze(-1) * (vecs.transpose(-1, -2) @ c_cp.transpose(-1, -2)))  # (m, k, l-k)


def nearest_keys(n: int, k: int) -> torch.Tensor:
    """``(n, k)`` sorted: for each query the k nearest key positions (ties to the lower position); a band."""
    pos = torch.arange(n)
    dist = (pos[:, None] - pos[None, :]).abs()  # (n, n)
    order = torch.argsort(dist * n + pos[None, :], dim=-1)  # nearest first, lower position on ties
    return torch.sort(order[:, :k], dim=-1).values


def local_prior(n: int, k: int, correlation: float = 0.9) -> tuple[torch.Tensor, torch.Tensor]:
    """The deterministic default pattern: each query's k nearest keys and R under a stationary prior.

    P_i holds the k positions closest to i (`nearest_keys`); R_i is the optimal reconstruction for the
    covariance ``ρ^|j − j'|`` of a row's scores (an AR(1) prior: nearby keys score alike). Only the blocks
    C_PP ``(n, k, k)`` and C_P̄P ``(n, n−k, k)`` are formed, never the n per-query n×n covariances.

    Returns:
        ``(indices (n, k) int64, reconstruction (n, n−k, k) float32)``.
    """
    indices = nearest_keys(n, k)  # (n, k)
    comp = complement_indices(indices, n)  # (n, n-k)
    rho = torch.tensor(correlation, dtype=torch.float64)
    c_pp = rho ** (indices[:, :, None] - indices[:, None, :]).abs().to(torch.float64)  # (n, k, k)
    c_cp = rho ** (comp[:, :, None] - indices[:, None, :]).abs().to(torch.float64)  # (n, n-k, k)
    recon, _ = _solve_blocks(c_pp, c_cp, torch.full((n,), float(n - k), dtype=torch.float64), 1e-6)
    return indices, recon.to(torch.float32)

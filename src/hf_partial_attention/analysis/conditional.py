"""The conditional optimal R for an input of t < n tokens: reconstruct only the keys that exist, from the exact
scores that exist (docs/method.md#padding-and-short-inputs; method spec §5).

With P_i fitted for n positions, a query i < t of a t-token input has exact scores at S = P_i ∩ [0, t) and must
estimate U = [0, t) \\ P_i; the keys >= t do not exist. The linear MMSE estimate of a_U from a_S is
``R_i(t) = C_US C_SS⁻¹`` (plus ``μ_U − R μ_S`` when centred), the same eq. 7 on the sub-blocks of Q^i. The model
runs instead the R of n with zeros for the missing keys (the zero fill); this is what an exact treatment of the
missing keys would give, measured beside it by `derive.derive_lengths`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import NamedTuple

import torch

from ..reconstruction import complement_indices
from ._threads import single_thread

logger = logging.getLogger(__name__)

__all__ = ["ConditionalReconstruction", "conditional_reconstruction", "ConditionalReconstructor"]


class ConditionalReconstruction(NamedTuple):
    """R_i(t) of every row in the layout of a pattern of n: ``reconstruction`` ``(n, n−k, k)`` (row m of query i
    estimates key ``complement[i, m]`` from the exact scores ``indices[i]``), zero outside ``missing`` × ``exact``;
    ``bias`` ``(n, n−k)`` or None, zero outside ``missing``; ``error`` ``(n,)`` the Schur-complement error over U;
    ``exact`` ``(n, k)`` bool: the keys of P_i in S; ``missing`` ``(n, n−k)`` bool: the keys of P̄_i in U. Rows
    i >= t are all zero."""

    reconstruction: torch.Tensor
    bias: torch.Tensor | None
    error: torch.Tensor
    exact: torch.Tensor
    missing: torch.Tensor


def conditional_reconstruction(cov: torch.Tensor, indices: torch.Tensor, t: int, mean: torch.Tensor | None = None,
                               ridge: float = 1e-6) -> ConditionalReconstruction:
    """``R_i(t) = C_US C_SS⁻¹`` with S = P_i ∩ [0, t), U = [0, t) \\ P_i for every query row i < t.

    Solved like `reconstruction.solve_reconstruction`: a float64 Cholesky factorisation of ``C_SS + λI``,
    ``λ = ridge · Tr(C_SS)/|S|``, never an inverse. The n problems of different |S| are solved in one batch: the
    entries of P_i outside S are replaced by an identity block (decoupled, so they get R = 0).

    Args:
        cov: per-query covariances ``(n, n, n)`` (Q^i, centred or second moment).
        indices: P ``(n, k)`` int64.
        t: the input's length, 1 <= t <= n.
        mean: optional ``(n, n)`` mean scores: a bias ``μ_U − R μ_S`` is returned too.
        ridge: relative Tikhonov term.
    """
    n, k = indices.shape
    if cov.shape != (n, n, n):
        raise ValueError(f"cov must be (n, n, n) = ({n}, {n}, {n}) for indices of {n} rows, got {tuple(cov.shape)}.")
    if not 1 <= t <= n:
        raise ValueError(f"t must be in [1, n={n}], got {t}; an input longer than n has no pattern.")
    cov = cov.to(torch.float64)
    indices = indices.to(torch.int64)
    comp = complement_indices(indices, n)  # (n, n-k)
    rows = torch.arange(n) < t  # (n,)
    exact = (indices < t) & rows[:, None]  # (n, k): S
    missing = (comp < t) & rows[:, None]  # (n, n-k): U
    s = exact.to(torch.float64)
    u = missing.to(torch.float64)
    rows_p = torch.gather(cov, 1, indices.unsqueeze(-1).expand(n, k, n))  # (n, k, n)
    c_pp = torch.gather(rows_p, 2, indices.unsqueeze(1).expand(n, k, k))  # (n, k, k)
    rows_c = torch.gather(cov, 1, comp.unsqueeze(-1).expand(n, n - k, n))  # (n, n-k, n)
    c_cp = torch.gather(rows_c, 2, indices.unsqueeze(1).expand(n, n - k, k))  # (n, n-k, k)
    c_ss = c_pp * s[:, :, None] * s[:, None, :]  # (n, k, k): zero outside S × S
    c_us = c_cp * u[:, :, None] * s[:, None, :]  # (n, n-k, k): zero outside U × S
    size = s.sum(-1).clamp_min(1)  # (n,)
    trace = torch.diagonal(c_ss, dim1=-2, dim2=-1).sum(-1).clamp_min(torch.finfo(torch.float64).tiny)
    lam = ridge * trace / size  # (n,)
    system = c_ss + torch.diag_embed(s * lam[:, None] + (1 - s))  # (n, k, k): identity on the entries outside S
    with single_thread():  # n small problems: see _threads
        chol, info = torch.linalg.cholesky_ex(system)
        if bool((info != 0).any()):
            logger.warning("C_SS not positive definite for %d rows at t=%d; using a pseudo-inverse",
                           int((info != 0).sum()), t)
            r_t = torch.linalg.pinv(system, hermitian=True) @ c_us.transpose(-1, -2)
        else:
            r_t = torch.cholesky_solve(c_us.transpose(-1, -2), chol)  # (n, k, n-k) = C_SS⁻¹ C_SU
    recon = r_t.transpose(-1, -2) * s[:, None, :]  # (n, n-k, k)
    c_uu = torch.gather(torch.diagonal(cov, dim1=-2, dim2=-1), 1, comp) * u  # (n, n-k)
    error = c_uu.sum(-1) - (recon * c_us).sum((-1, -2))  # (n,)
    bias = None
    if mean is not None:
        mean = mean.to(torch.float64)
        mu_p = torch.gather(mean, 1, indices) * s  # (n, k)
        mu_c = torch.gather(mean, 1, comp) * u  # (n, n-k)
        bias = mu_c - (recon @ mu_p.unsqueeze(-1)).squeeze(-1)
    return ConditionalReconstruction(recon, bias, error, exact, missing)


class ConditionalReconstructor:
    """Apply R_i(t) to score matrices of t-token inputs: ``(S, b, b)`` (b <= n, zero beyond t) → reconstruction
    ``(S, b, b)``, valid at rows and keys < t. The solves are cached per t (at most ``cache`` of them, the least
    recently used dropped)."""

    def __init__(self, cov: torch.Tensor, indices: torch.Tensor, mean: torch.Tensor | None = None,
                 ridge: float = 1e-6, cache: int = 32):
        self.cov, self.indices, self.mean, self.ridge = cov, indices.to(torch.int64), mean, ridge
        self.n = indices.shape[0]
        self.complement = complement_indices(self.indices, self.n)
        self.cache = cache
        self._solved: OrderedDict[int, tuple[torch.Tensor, torch.Tensor | None]] = OrderedDict()

    @classmethod
    def for_pattern(cls, cov, pattern, centered: bool | None = None, cache: int = 32) -> "ConditionalReconstructor":
        """The conditional R of ``pattern``'s P from ``cov`` (a `ScoreCovariance` of the pattern's n, pooled per
        query): centred as the pattern was fitted unless ``centered`` says otherwise, with the pattern's ridge, and a
        bias where the pattern has one."""
        if centered is None:
            centered = pattern.metadata.get("covariance", "centered") == "centered"
        mean = cov.mean_per_query() if pattern.bias is not None else None
        return cls(cov.per_query(centered=centered), pattern.indices, mean, pattern.metadata.get("ridge", 1e-6), cache)

    def params(self, t: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """R_t ``(n, n−k, k)`` and bias ``(n, n−k)`` (or None), float32."""
        if t in self._solved:
            self._solved.move_to_end(t)
            return self._solved[t]
        solved = conditional_reconstruction(self.cov, self.indices, t, self.mean, self.ridge)
        value = (solved.reconstruction.float(), None if solved.bias is None else solved.bias.float())
        self._solved[t] = value
        while len(self._solved) > self.cache:
            self._solved.popitem(last=False)
        return value

    def __call__(self, scores: torch.Tensor, t: int) -> torch.Tensor:
        s, b, _ = scores.shape
        padded = scores.new_zeros(s, self.n, self.n)
        padded[:, :b, :b] = scores
        recon, bias = self.params(t)
        exact = padded.gather(-1, self.indices.expand(s, *self.indices.shape))  # (S, n, k)
        rest = torch.einsum("sik,imk->sim", exact, recon.to(scores.dtype))  # (S, n, n−k)
        if bias is not None:
            rest = rest + bias.to(scores.dtype)
        out = padded.scatter(-1, self.complement.expand(s, *self.complement.shape), rest)
        return out[:, :b, :b]

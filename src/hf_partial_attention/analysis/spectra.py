"""Eigen analysis of score covariances (paper Fig. 3–7; docs/method.md#scores-and-covariances).

Every function takes plain float64 tensors (from `ScoreCovariance`) and returns tensors or small dataclasses;
nothing here draws.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ._threads import single_thread

logger = logging.getLogger(__name__)

__all__ = [
    "eigh_desc",
    "top_eigh",
    "cumulative_energy",
    "projection_energy",
    "LayerProjection",
    "layer_projections",
    "subspace_overlap",
    "per_query_spectra",
    "top_eigenvalue_share",
    "pooled_per_query_energy",
    "per_query_top_eigenvectors",
    "eigenvector_images",
]


def eigh_desc(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (descending, clamped at 0) and eigenvectors (columns) of symmetric ``(..., l, l)``."""
    with single_thread(cov.dim() > 2):  # many small problems: see _threads
        vals, vecs = torch.linalg.eigh(cov)
    return vals.flip(-1).clamp_min(0), vecs.flip(-1)


def top_eigh(cov: torch.Tensor, k: int, dense_limit: int = 4096, oversample: int = 32, iters: int = 6,
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k eigenpairs of a symmetric PSD ``(l, l)`` matrix: ``(k,)`` descending and ``(l, k)``.

    Up to ``dense_limit`` a full ``eigh``; above, randomized subspace iteration (Halko et al. 2011) with
    ``k + oversample`` columns and ``iters`` power steps, which for l = n² = 16384 costs a few GEMMs instead of
    an O(l³) factorisation.
    """
    l = cov.shape[-1]
    k = min(k, l)
    if l <= dense_limit:
        vals, vecs = eigh_desc(cov)
        return vals[:k], vecs[:, :k]
    gen = torch.Generator().manual_seed(seed)
    width = min(l, k + oversample)
    basis = torch.linalg.qr(cov @ torch.randn(l, width, dtype=cov.dtype, generator=gen)).Q  # (l, width)
    for _ in range(iters):
        basis = torch.linalg.qr(cov @ basis).Q
    small = basis.T @ cov @ basis  # (width, width)
    vals, vecs = eigh_desc((small + small.T) / 2)
    return vals[:k], basis @ vecs[:, :k]


def cumulative_energy(eigenvalues: torch.Tensor, total: float | None = None) -> torch.Tensor:
    """``Σ_{j≤k} λ_j / total`` for k = 1..len (total defaults to the sum of all eigenvalues)."""
    total = float(eigenvalues.sum()) if total is None else total
    return torch.cumsum(eigenvalues, 0) / max(total, torch.finfo(torch.float64).tiny)


def projection_energy(basis: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """``π(V_k; C) / Tr C`` for k = 1..K, with V_k the first k columns of ``basis`` ``(l, K)`` (orthonormal)."""
    diag = ((cov @ basis) * basis).sum(0)  # (K,): v_jᵀ C v_j
    return torch.cumsum(diag, 0) / torch.trace(cov).clamp_min(torch.finfo(cov.dtype).tiny)


@dataclass
class LayerProjection:
    """Fig. 3 for one layer: its own cumulative spectrum beside its energy on the global top-k eigenspace."""

    layer: int
    own: torch.Tensor  # (K,) cumulative energy of the layer's top-k eigenvalues
    on_global: torch.Tensor  # (K,) π(V_k^global; C^l) / Tr C^l


def layer_projections(cov, max_k: int, **top_kwargs) -> tuple[torch.Tensor, list[LayerProjection]]:
    """Global top-``max_k`` cumulative energy and, for every layer, Fig. 3's two curves.

    Args:
        cov: a `ScoreCovariance` with scope ``"whole"`` and granularity ``"layer"`` or ``"head"``.
        max_k: largest k on the curves.

    Layers are processed one at a time, so memory holds the per-layer accumulators plus two n²×n² matrices.
    """
    if not cov.layers:
        raise ValueError("layer_projections needs per-layer covariances; collect with granularity='layer'.")
    glob = cov.whole()
    g_vals, g_vecs = top_eigh(glob, max_k, **top_kwargs)
    g_curve = cumulative_energy(g_vals, float(torch.trace(glob)))
    del glob
    out = []
    for layer in cov.layers:
        c_l = cov.whole(layer=layer)
        vals, _ = top_eigh(c_l, max_k, **top_kwargs)
        trace = float(torch.trace(c_l))
        out.append(LayerProjection(layer, cumulative_energy(vals, trace), projection_energy(g_vecs, c_l)))
        del c_l
    return g_curve, out


def subspace_overlap(cov_a: torch.Tensor, cov_b: torch.Tensor, max_k: int, **top_kwargs) -> dict[str, torch.Tensor]:
    """How much of B's energy A's top-k eigenspace captures (Fig. 3 across models, Fig. 4 across datasets).

    Returns ``{"b_on_a": π(V_k^A; C_B)/Tr C_B, "b_own": B's cumulative energy, "a_own": A's}``, each ``(max_k,)``.
    """
    if cov_a.shape != cov_b.shape:
        raise ValueError(f"covariances must have the same shape, got {tuple(cov_a.shape)} and {tuple(cov_b.shape)}; "
                         "collect both at the same seq_len.")
    a_vals, a_vecs = top_eigh(cov_a, max_k, **top_kwargs)
    b_vals, _ = top_eigh(cov_b, max_k, **top_kwargs)
    return {"b_on_a": projection_energy(a_vecs, cov_b),
            "b_own": cumulative_energy(b_vals, float(torch.trace(cov_b))),
            "a_own": cumulative_energy(a_vals, float(torch.trace(cov_a)))}


def per_query_spectra(per_query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigen-decomposition of every Q^i: ``(n, n, n) -> (eigenvalues (n, n) descending, vectors (n, n, n))``."""
    return eigh_desc(per_query)


def top_eigenvalue_share(eigenvalues: torch.Tensor) -> torch.Tensor:
    """``λ_1(Q^i) / Tr Q^i`` for each row: ``(n, n) -> (n,)``."""
    return eigenvalues[:, 0] / eigenvalues.sum(-1).clamp_min(torch.finfo(eigenvalues.dtype).tiny)


def pooled_per_query_energy(eigenvalues: torch.Tensor, total: float) -> torch.Tensor:
    """Cumulative energy of all n² per-query eigenvalues pooled and sorted (Fig. 6, beside the global one)."""
    pooled = torch.sort(eigenvalues.reshape(-1), descending=True).values  # (n²,)
    return cumulative_energy(pooled, total)


def _fix_sign(vectors: torch.Tensor) -> torch.Tensor:
    """Flip each column so that its largest-magnitude entry is positive (eigenvectors are defined up to sign)."""
    idx = vectors.abs().argmax(-2, keepdim=True)  # (..., 1, m)
    sign = torch.sign(torch.gather(vectors, -2, idx))
    return vectors * torch.where(sign == 0, torch.ones_like(sign), sign)


def per_query_top_eigenvectors(vectors: torch.Tensor, count: int = 5) -> torch.Tensor:
    """Fig. 7: ``(n, n, n)`` per-query eigenvectors -> ``(count, n, n)``; row i of image r: eigenvector r of Q^i."""
    top = _fix_sign(vectors[..., :count])  # (n rows, n keys, count)
    return top.permute(2, 0, 1).contiguous()  # (count, n, n)


def eigenvector_images(vectors: torch.Tensor, seq_len: int, count: int = 8) -> torch.Tensor:
    """Fig. 5: the first ``count`` global eigenvectors ``(n², K)`` reshaped to ``(count, n, n)`` (row-major)."""
    top = _fix_sign(vectors[:, :count])  # (n², count)
    return top.T.reshape(-1, seq_len, seq_len)  # (count, n, n)

"""Greedy P, optimal R and their errors from a score covariance (paper Fig. 8–9; method.md, section 2).

The math lives in `hf_partial_attention.reconstruction` (`greedy_select`, `solve_reconstruction`); this module
chooses the covariance (per-query or whole, centred or second moment), normalises errors by Tr(C_a), builds
`AttentionPattern` objects and the curves of Fig. 9 with their eigenvector references and cost model.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..pattern import AttentionPattern
from ..pattern_families import family_indices
from ..reconstruction import greedy_select, solve_reconstruction
from ._threads import single_thread
from .covariance import ScoreCovariance
from .spectra import eigh_desc, top_eigh

logger = logging.getLogger(__name__)

__all__ = [
    "cost_per_query",
    "cost_whole",
    "cost_dense",
    "covariance_for",
    "fit_pattern",
    "greedy_pattern",
    "error_curve",
    "pattern_mask",
]


def cost_per_query(n: int, k: int, d_head: int) -> int:
    """Multiply-adds of one head's scores, per-query setting: ``n·k·d_h`` exact + ``n·(n−k)·k`` reconstructed."""
    return n * k * d_head + n * (n - k) * k


def cost_whole(n: int, k: int, d_head: int) -> int:
    """Whole-matrix setting: ``k·d_h`` exact + ``(n² − k)·k`` reconstructed."""
    return k * d_head + (n * n - k) * k


def cost_dense(n: int, d_head: int) -> int:
    """Dense ``Q Kᵀ``: ``n²·d_h``."""
    return n * n * d_head


def covariance_for(cov: ScoreCovariance | torch.Tensor, scope: str, centered: bool | None = None,
                   mean: torch.Tensor | None = None, layer: int | None = None, head: int | None = None):
    """``(C, mean or None, centered)``: per_query ``(n, n, n)`` / ``(n, n)``, whole ``(n², n²)`` / ``(n²,)``.

    ``cov`` may be a `ScoreCovariance` or a ready covariance tensor (then ``mean`` is taken as given).
    """
    if scope not in ("per_query", "whole"):
        raise ValueError(f"scope must be 'per_query' or 'whole', got {scope!r}.")
    if isinstance(cov, torch.Tensor):
        want = 3 if scope == "per_query" else 2
        if cov.dim() != want:
            raise ValueError(f"a {scope} covariance tensor must have {want} dims, got shape {tuple(cov.shape)}.")
        mean = None if mean is None else mean.to(torch.float64)
        return cov.to(torch.float64), mean, bool(centered if centered is not None else mean is not None)
    if not isinstance(cov, ScoreCovariance):
        raise TypeError(f"cov must be a ScoreCovariance or a tensor, got {type(cov).__name__}.")
    centered = cov.centered if centered is None else centered
    if scope == "per_query":
        return cov.per_query(layer, head, centered), cov.mean_per_query(layer, head), centered
    return cov.whole(layer, head, centered), cov.mean_whole(layer, head), centered


def _trace(c: torch.Tensor, scope: str) -> float:
    return float(torch.diagonal(c, dim1=-2, dim2=-1).sum())


def fit_pattern(cov, indices: torch.Tensor, scope: str = "per_query", *, centered: bool | None = None,
                bias: bool | None = None, mean: torch.Tensor | None = None, ridge: float = 1e-6,
                layer: int | None = None, head: int | None = None, metadata: dict[str, Any] | None = None,
                _prepared=None) -> AttentionPattern:
    """Optimal R (eq. 7) for a given P, with its predicted error (eq. 8) normalised by Tr(C_a).

    Args:
        cov: `ScoreCovariance`, or a covariance tensor (per_query ``(n, n, n)``, whole ``(n², n²)``).
        indices: P: per_query ``(n, k)``, whole ``(k,)`` over row-major pairs ``i·n + j``.
        centered: covariance (with a bias ``μ_P̄ − R μ_P``) or second moment (pure ``R a_P``); default the
            covariance's own flag.
        bias: store the bias (default: when centred). The predicted error is exact for (centred, bias) and
            (second moment, no bias).
        ridge: relative Tikhonov term of the Cholesky solve (see `solve_reconstruction`).
    """
    c, mu, centered = _prepared or covariance_for(cov, scope, centered, mean, layer, head)
    bias = centered if bias is None else bias
    if bias and mu is None:
        raise ValueError("bias=True needs the mean; pass mean=<tensor> with a covariance tensor "
                         "or use a ScoreCovariance.")
    n = c.shape[0] if scope == "per_query" else int(round(c.shape[0] ** 0.5))
    indices = torch.sort(indices.to(torch.int64), dim=-1).values
    with single_thread(scope == "per_query" or c.shape[-1] <= 2048):  # small problems: see _threads
        recon, b, err = solve_reconstruction(c, indices, mu if bias else None, ridge=ridge)
    total = _trace(c, scope)
    meta = {"scope": scope, "covariance": "centered" if centered else "second_moment", "ridge": ridge,
            "total_variance": total, "normalized_error": float(err.sum()) / total,
            "k_bar": int(indices.numel()), "seq_len": n}
    if isinstance(cov, ScoreCovariance):
        meta.update(source_model=cov.metadata.get("model", ""), num_sequences=cov.num_sequences,
                    layer=layer, head=head)
    meta.update(metadata or {})
    return AttentionPattern(indices, recon, b if bias else None, scope=scope, seq_len=n, metadata=meta)


def greedy_pattern(cov, k: int, scope: str = "per_query", *, centered: bool | None = None, bias: bool | None = None,
                   mean: torch.Tensor | None = None, ridge: float = 1e-6, layer: int | None = None,
                   head: int | None = None, metadata: dict[str, Any] | None = None, family: str = "per_query",
                   block_rows: int | None = None) -> AttentionPattern:
    """Greedy P (method.md §2) and optimal R, as an `AttentionPattern`.

    Args:
        cov: `ScoreCovariance` (or a covariance tensor, see `fit_pattern`).
        k: exact scores per query (per_query) or in total (whole, k̄ = k).
        scope: ``"per_query"`` (each row i its own P_i from Q^i; k̄ = n·k) or ``"whole"`` (one P over n² pairs).
        family: with scope per_query, a constrained greedy whose exact part is a fast dense computation:
            ``"columns"``, ``"blocks"`` (``block_rows``), ``"windows"``, ``"bands"`` (see `pattern_families`).

    Returns:
        The pattern; ``metadata["normalized_error"]`` is the predicted error Σε / Tr(C_a) of its R, and
        ``metadata["greedy_normalized_error"]`` the greedy residual Tr(S) / Tr(C_a) (equal up to the ridge).
    """
    prepared = covariance_for(cov, scope, centered, mean, layer, head)
    c = prepared[0]
    l = c.shape[-1]
    if not 1 <= k <= l:
        raise ValueError(f"k must be in [1, {l}] for scope={scope!r} at this seq_len, got k={k}.")
    if scope == "whole" and l > 4096 and k > 512:
        logger.warning("Whole-matrix greedy over %d pairs with k=%d: each step costs O(l²); this may take long", l, k)
    if family != "per_query":
        if scope != "per_query":
            raise ValueError(f"family={family!r} constrains per-query patterns; use scope='per_query'.")
        with single_thread(True):
            indices = family_indices(c, k, family, block_rows)
        meta = {"method": f"greedy_{family}", "family": family, "k": k}
        meta.update(metadata or {})
        return fit_pattern(cov, indices, scope, centered=prepared[2], bias=bias, mean=mean, ridge=ridge,
                           layer=layer, head=head, metadata=meta, _prepared=prepared)
    with single_thread(scope == "per_query" or l <= 2048):  # small problems: see _threads
        indices, residual = greedy_select(c, k)
    meta = {"method": "greedy", "greedy_normalized_error": float(residual.sum()) / _trace(c, scope), "k": k}
    meta.update(metadata or {})
    return fit_pattern(cov, indices, scope, centered=prepared[2], bias=bias, mean=mean, ridge=ridge,
                       layer=layer, head=head, metadata=meta, _prepared=prepared)


def error_curve(cov, ks, scope: str = "per_query", *, centered: bool | None = None, layer: int | None = None,
                head: int | None = None, d_head: int | None = None, indices_out: dict | None = None) -> dict[str, list]:
    """Fig. 9: greedy error and the eigenvector reference for each k, normalised by Tr(C_a).

    Returns lists keyed ``k``, ``k_bar`` (n·k per-query, k whole), ``greedy``, ``eigen`` and, when ``d_head``
    is given, ``relative_cost`` (multiply-adds over dense QKᵀ). When ``indices_out`` is a dict, the greedy P of
    each k is stored in it (so patterns at these k need no second greedy run, see `fit_pattern`).
    """
    c, _, _ = covariance_for(cov, scope, centered, None, layer, head)
    total = _trace(c, scope)
    ks = sorted({int(k) for k in ks})
    if scope == "per_query":
        n = c.shape[0]
        vals, _ = eigh_desc(c)  # (n, n)
        eigen = [float(vals[:, k:].sum()) / total for k in ks]
        k_bar = [n * k for k in ks]
    else:
        n = int(round(c.shape[0] ** 0.5))
        vals, _ = top_eigh(c, max(ks))
        eigen = [max(0.0, 1.0 - float(vals[:k].sum()) / total) for k in ks]
        k_bar = list(ks)
    greedy = []
    for k in ks:
        with single_thread(scope == "per_query" or c.shape[-1] <= 2048):
            indices, residual = greedy_select(c, k)
        greedy.append(float(residual.sum()) / total)
        if indices_out is not None:
            indices_out[k] = indices
    out = {"k": ks, "k_bar": k_bar, "greedy": greedy, "eigen": eigen, "scope": scope, "seq_len": n}
    if d_head is not None:
        cost = cost_per_query if scope == "per_query" else cost_whole
        out["relative_cost"] = [cost(n, k, d_head) / cost_dense(n, d_head) for k in ks]
    return out


def pattern_mask(pattern: AttentionPattern) -> torch.Tensor:
    """``(n, n)`` bool: True where the score (query i, key j) is computed exactly (Fig. 8)."""
    n = pattern.seq_len
    if pattern.scope == "whole":
        mask = torch.zeros(n * n, dtype=torch.bool).scatter_(0, pattern.indices, True)  # (n²,)
        return mask.reshape(n, n)
    return torch.zeros(n, n, dtype=torch.bool).scatter_(-1, pattern.indices, True)

"""The error a greedy choice of P minimises: one metric per objective on a row's score error (the paper's,
modulo a per-row shift, or Fisher-weighted by the softmax). `selection` uses it; `objectives` compares them.
"""

from __future__ import annotations

import torch

__all__ = ["OBJECTIVES", "objective_metric"]

OBJECTIVES = ("paper", "shift", "fisher")


def objective_metric(objective: str, n: int, mean: torch.Tensor | None = None) -> torch.Tensor | None:
    """The metric M ``(n, n, n)`` (one n×n per query row) of an objective ``E[eᵀ M e]`` on a row's score error e
    (docs/method.md#choices-the-paper-leaves-open):

    - ``"paper"``: ``None``, i.e. M = I: the squared error of all n scores alike (the paper's eq. 8);
    - ``"shift"``: M = I − 11ᵀ/n: the error modulo a constant added to the row, which the softmax ignores;
    - ``"fisher"``: M_i = diag(p_i) − p_i p_iᵀ with p_i = softmax(μ_i), μ_i the mean score row: the Fisher metric
      of the softmax, so that ½ eᵀ M_i e is the KL divergence between the exact and the reconstructed attention
      of query i to second order. It is shift invariant and weights each key by the probability it receives
      [ours: p from the mean scores, not the mean of per-input probabilities, which the covariance cannot give].

    For every such M the optimal R for a given P is the same (the linear MMSE estimator minimises the error
    covariance in the positive semi-definite order), so an objective changes which P the greedy picks, not R.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}.")
    if objective == "paper":
        return None
    if objective == "shift":
        eye = torch.eye(n, dtype=torch.float64)
        return (eye - torch.full((n, n), 1.0 / n, dtype=torch.float64)).expand(n, n, n)
    if mean is None:
        raise ValueError("objective='fisher' needs the mean scores; pass mean=<(n, n) tensor> with a covariance "
                         "tensor, or a ScoreCovariance.")
    p = torch.softmax(mean.to(torch.float64), dim=-1)  # (n, n): row i, the attention of the mean scores
    return torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)  # (n, n, n)

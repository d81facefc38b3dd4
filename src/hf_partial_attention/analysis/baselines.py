"""Other ways to cut the cost of ``QKᵀ``, at equal cost on the same scores.

See docs/method.md#equal-cost-baselines-and-error-measures. `build_methods` lists the methods at a per-query budget
of k exact scores per row: other choices of P with their optimal R, a wider band without R, and Nyström CUR.
"""

from __future__ import annotations

import torch

from ..cost import dense_cost, nystrom_cost, score_cost
from ..reconstruction import nearest_keys
from .evaluation import LinearReconstructor, MeanFill, NystromCUR
from .selection import fit_pattern, select_pattern

__all__ = [
    "random_indices",
    "landmark_indices",
    "equal_cost_band",
    "equal_cost_landmarks",
    "build_methods",
]


def random_indices(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """``(n, k)``: an independent uniform k-subset of keys for each query (seeded), sorted."""
    gen = torch.Generator().manual_seed(seed)
    return torch.sort(torch.argsort(torch.rand(n, n, generator=gen), dim=-1)[:, :k], dim=-1).values


def _spaced(n: int, k: int) -> torch.Tensor:
    return torch.unique(torch.linspace(0, n - 1, k).round().to(torch.int64))


def landmark_indices(n: int, k: int) -> torch.Tensor:
    """``(n, k)``: the same k evenly spaced key columns (including 0 and n−1) for every query."""
    return _spaced(n, k).expand(n, k).clone()


def equal_cost_band(n: int, k: int, d_head: int) -> int:
    """Band width with no reconstruction costing what the per-query pattern at k costs (at most n)."""
    return min(n, score_cost(n, k, d_head).total // (n * d_head))


def equal_cost_landmarks(n: int, k: int, d_head: int) -> int:
    """Largest m whose CUR cost is at most the per-query cost at k (at least 1)."""
    budget = score_cost(n, k, d_head).total
    fits = [m for m in range(1, n + 1) if nystrom_cost(n, m, d_head) <= budget]
    return max(fits) if fits else 1


def build_methods(cov, k: int, d_head: int, seed: int = 0, centered: bool | None = None,
                  greedy=None) -> dict[str, dict]:
    """Reconstructors for every method at per-query budget k, with their cost and predicted error.

    At a per-query budget of k exact scores per row:

    - ``greedy``: the paper's greedy P_i with optimal R_i;
    - ``band+R``, ``random+R``, ``landmark+R``: P_i a band of diagonals (the k keys nearest query i,
      `reconstruction.nearest_keys`), a uniformly random subset, or the same k evenly spaced key columns for every
      query (Nyström-style landmarks), each with its own optimal R_i: same cost as greedy, so only the choice of P
      differs;
    - ``band only``: no reconstruction, the band widened to the equal cost ``k_eq = k + (n−k)·k/d_h``; the
      scores outside it are filled with their training mean;
    - ``Nyström CUR``: m evenly spaced landmark rows and columns and ``A[:, L] A[L, L]⁺ A[L, :]`` (truncated
      pseudo-inverse, see `evaluation.NystromCUR`), with the largest m whose cost fits the same budget.

    Args:
        cov: the fitting `ScoreCovariance` (scope per_query).
        k: exact scores per query of the greedy pattern and of the other P+R methods.
        d_head: head dimension of the cost model.
        greedy: an already derived greedy `AttentionPattern` at this k (derived here when None).

    Returns:
        ``{name: {"reconstructor", "relative_cost", "predicted" (normalised error or None), "param"}}``.
    """
    n = cov.seq_len
    dense = dense_cost(n, d_head)
    same = score_cost(n, k, d_head).relative
    greedy = greedy if greedy is not None else select_pattern(cov, k, "per_query", centered=centered)
    methods = {"greedy P + R": {"pattern": greedy, "param": f"k={k}"}}
    for name, idx in (("band P + R", nearest_keys(n, k)), ("random P + R", random_indices(n, k, seed)),
                      ("landmark columns + R", landmark_indices(n, k))):
        methods[name] = {"pattern": fit_pattern(cov, idx, "per_query", centered=centered), "param": f"k={k}"}
    out = {name: {"reconstructor": LinearReconstructor(m["pattern"]), "relative_cost": same,
                  "predicted": m["pattern"].normalized_error, "param": m["param"]} for name, m in methods.items()}
    k_band = equal_cost_band(n, k, d_head)
    band = nearest_keys(n, k_band)
    mean = cov.mean_per_query()
    c = cov.per_query(centered=True)
    outside = torch.diagonal(c, dim1=-2, dim2=-1).sum() - torch.diagonal(c, dim1=-2, dim2=-1).gather(-1, band).sum()
    out["band only"] = {"reconstructor": MeanFill(band, mean), "param": f"width={k_band}",
                        "relative_cost": k_band * n * d_head / dense,
                        "predicted": max(0.0, float(outside) / float(torch.diagonal(c, dim1=-2, dim2=-1).sum()))}
    m = equal_cost_landmarks(n, k, d_head)
    out["Nyström CUR"] = {"reconstructor": NystromCUR(_spaced(n, m)), "param": f"m={m}",
                          "relative_cost": nystrom_cost(n, m, d_head) / dense, "predicted": None}
    return out

"""The ``shared_blocks`` family: consecutive rows in blocks share both P and R (docs/method.md#greedy-choice-of-p).

A block's rows then reconstruct with one matrix, so every step of the attention is a plain matrix product on
the block (exact scores Q_b K_Pᵀ, reconstruction E_b W_b, P·V) and the `tiled` kernel runs it in cache-sized
chunks. The cost is accuracy: one R per block instead of one per query.

With one R for the rows i of a block b, the expected error summed over the block is that of the pooled second
moment (or covariance) ``C_b = Σ_{i∈b} C_i``: ``Σ_i Tr(C_i,P̄P̄) − 2 Tr(R C_b,PP̄) + Tr(R C_b,PP Rᵀ)``, so the
optimal R is eq. 7 on C_b and the greedy runs on C_b, one problem per block. Each row keeps its own bias
``μ_i,P̄ − R_b μ_i,P`` (the kernels add the bias per row anyway), which is why C_i's pool without the spread of
the row means.
"""

from __future__ import annotations

from typing import Any

import torch

from ..pattern import AttentionPattern
from ..reconstruction import complement_indices, solve_reconstruction
from ._threads import single_thread

__all__ = ["pooled_blocks", "fit_shared_blocks"]


def pooled_blocks(c: torch.Tensor, rows: int) -> torch.Tensor:
    """``(n, n, n)`` per-query covariances -> ``(n / rows, n, n)`` sums over each block of ``rows`` queries."""
    n = c.shape[0]
    if rows < 1 or n % rows:
        raise ValueError(f"block_rows must divide n={n}, got {rows}.")
    return c.reshape(n // rows, rows, n, n).sum(1)  # (n / rows, n, n)


def fit_shared_blocks(c: torch.Tensor, mean: torch.Tensor | None, block_indices: torch.Tensor, rows: int, *,
                      bias: bool, ridge: float, total: float, meta: dict[str, Any]) -> AttentionPattern:
    """One R per block of ``rows`` queries, optimal for the pooled ``c`` ``(n, n, n)``, given each block's P
    ``block_indices`` ``(n / rows, k)``; expanded to the per-query layout the model stores (P ``(n, k)``, R
    ``(n, n−k, k)``, identical within a block) with each row's own bias when ``bias``."""
    n = c.shape[0]
    pooled = pooled_blocks(c, rows)  # (n / rows, n, n)
    block_indices = torch.sort(block_indices.to(torch.int64), dim=-1).values
    with single_thread(True):  # small problems: see _threads
        recon, _, err = solve_reconstruction(pooled, block_indices, None, ridge=ridge)  # (nb, n-k, k), (nb,)
    indices = block_indices.repeat_interleave(rows, 0)  # (n, k)
    recon_rows = recon.repeat_interleave(rows, 0)  # (n, n-k, k)
    row_bias = None
    if bias:
        if mean is None:
            raise ValueError("bias=True needs the mean; pass mean=<tensor> with a covariance tensor "
                             "or use a ScoreCovariance.")
        comp = complement_indices(indices, n)  # (n, n-k)
        mu_p, mu_c = mean.gather(-1, indices), mean.gather(-1, comp)  # (n, k), (n, n-k)
        row_bias = mu_c - (recon_rows @ mu_p.unsqueeze(-1)).squeeze(-1)  # (n, n-k)
    meta = {**meta, "normalized_error": float(err.sum()) / total, "k_bar": int(indices.numel()), "seq_len": n,
            "block_rows": rows}
    return AttentionPattern(indices, recon_rows, row_bias, scope="per_query", seq_len=n, metadata=meta)

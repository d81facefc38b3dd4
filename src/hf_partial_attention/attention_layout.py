"""P's layout and structure: the index tensors derived from P (its complement, the permutation to key order), the
blocks of rows that share one key set or one P and R, and the structure a kernel is chosen by; the bias in key order.

Part of the remote-code bundle (imports: torch and siblings only); `attention_common` re-exports every name.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch

from .reconstruction import complement_indices, inverse_permutation

__all__ = ["PatternStructure", "MIN_SHARED_ROWS", "PatternLayout", "block_rows", "shared_rows", "bias_in_key_order"]

# Blocks of at least this many rows sharing P and R make a pattern ROWS_SHARING_P_AND_R (fewer: the tiles of the
# tiled kernel are too thin to pay for themselves).
MIN_SHARED_ROWS = 16


class PatternStructure(str, enum.Enum):
    """What rows of P (and R) share, which decides how a kernel computes the exact scores and which kernel is fast.

    - ``PER_QUERY``: every row its own key set; exact scores by QKᵀ then select P.
    - ``BLOCKS_SHARING_KEYS``: blocks of consecutive rows share one key set (one set for all: shared columns),
      each row its own R; exact scores by one GEMM per block.
    - ``ROWS_SHARING_P_AND_R``: blocks of at least `MIN_SHARED_ROWS` rows share P and R; every step of a block is
      a plain matrix product (the ``tiled`` kernel).
    """

    PER_QUERY = "per_query"
    BLOCKS_SHARING_KEYS = "blocks_sharing_keys"
    ROWS_SHARING_P_AND_R = "rows_sharing_p_and_r"


def block_rows(indices: torch.Tensor) -> int | None:
    """The largest r >= 2 dividing n such that each block of r consecutive rows shares one key set, else None.

    ``n`` means one key set for every query (shared columns); smaller values are block-local patterns.
    """
    n, k = indices.shape
    for rows in sorted((r for r in range(2, n + 1) if n % r == 0), reverse=True):
        blocks = indices.view(n // rows, rows, k)  # (n / rows, rows, k)
        if bool((blocks == blocks[:, :1]).all()):
            return rows
    return None


@torch.no_grad()
def shared_rows(indices: torch.Tensor, reconstruction: torch.Tensor) -> int:
    """The largest r dividing n such that each block of r consecutive rows shares one P and one R (1: none).

    Compares every row of R with the next (n·(n−k)·k values): `DerivedState` keeps the answer while P and R are
    unchanged. Under ``torch.compile`` / ``torch.export`` (which cannot branch on tensor values) it answers 1: every
    kernel is exact with blocks of one row, only not as fast.
    """
    n = indices.shape[0]
    if n < 2 or torch.compiler.is_compiling():
        return 1
    same = (indices[1:] == indices[:-1]).all(-1)  # (n-1,): row j+1 has row j's P
    same &= (reconstruction[1:] == reconstruction[:-1]).flatten(1).all(-1)  # ... and its R
    breaks = (~same).nonzero().flatten().add(1).tolist()  # rows that start a new (P, R)
    for rows in sorted((r for r in range(1, n + 1) if n % r == 0), reverse=True):
        if all(b % rows == 0 for b in breaks):
            return rows
    return 1


class PatternLayout(NamedTuple):
    """Index tensors and structure derived from P (and R): build with `PatternLayout.from_indices`; a model's
    pattern module keeps them (`partial_pattern.PartialBertPattern`)."""

    indices: torch.Tensor  # (n, k) P
    complement: torch.Tensor  # (n, n-k) P̄, sorted
    inverse_permutation: torch.Tensor  # (n, n) slot of each key in cat(P_i, P̄_i)
    block_rows: int | None  # rows per block sharing one key set, or None
    shared_rows: int = 1  # rows per block sharing P and R (1: none, or R not known)

    @property
    def structure(self) -> PatternStructure:
        if self.shared_rows >= MIN_SHARED_ROWS:
            return PatternStructure.ROWS_SHARING_P_AND_R
        if self.block_rows is not None:
            return PatternStructure.BLOCKS_SHARING_KEYS
        return PatternStructure.PER_QUERY

    @classmethod
    def from_indices(cls, indices: torch.Tensor, reconstruction: torch.Tensor | None = None) -> "PatternLayout":
        """The layout of P; with R, also the blocks of rows that share P and R."""
        n = indices.shape[0]
        rows = 1 if reconstruction is None else shared_rows(indices, reconstruction)
        return cls(indices, complement_indices(indices, n), inverse_permutation(indices, n), block_rows(indices), rows)


def bias_in_key_order(layout: PatternLayout, bias: torch.Tensor | None, dtype: torch.dtype,
                      device) -> torch.Tensor | None:
    """The bias ``(n, n−k)`` scattered to key order ``(n, n)`` (zero at P), or None."""
    if bias is None:
        return None
    n = layout.indices.shape[0]
    full = torch.zeros(n, n, dtype=dtype, device=device)
    return full.scatter(-1, layout.complement, bias.to(dtype))  # (n, n) in key order

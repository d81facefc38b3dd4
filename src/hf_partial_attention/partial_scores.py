"""The pieces of partial attention's scores: P's layout, the exact scores at P, W = [I | R] and its cache,
masks. The kernels that assemble them are in `partial_attention` (which re-exports the public names here).

Part of the remote-code bundle (imports: torch and siblings only).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
from torch import nn

from .reconstruction import complement_indices, inverse_permutation
from .tiled_kernel import needs_grad

__all__ = ["PatternLayout", "block_rows", "reconstruction_matrix", "exact_partial_scores", "reconstruct_scores",
           "rows_first", "structured_exact_method"]


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


class PatternLayout(NamedTuple):
    """Index tensors derived from P once (the model caches them): build with `PatternLayout.from_indices`."""

    indices: torch.Tensor  # (n, k) P
    complement: torch.Tensor  # (n, n-k) P̄, sorted
    inverse_permutation: torch.Tensor  # (n, n) slot of each key in cat(P_i, P̄_i)
    block_rows: int | None  # rows per block sharing one key set, or None

    @classmethod
    def from_indices(cls, indices: torch.Tensor) -> "PatternLayout":
        n = indices.shape[0]
        return cls(indices, complement_indices(indices, n), inverse_permutation(indices, n), block_rows(indices))


def reconstruction_matrix(layout: "PatternLayout", reconstruction: torch.Tensor) -> torch.Tensor:
    """W ``(n, k, n)`` with ``W[i, m, P_i[m]] = 1`` and ``W[i, :, P̄_i[j]] = R_i[j, :]``: row i of the scores is
    ``exact_i @ W_i``, in key order. Differentiable in R.

    Built by two scatters into one uninitialised tensor (every entry is written once: P_i and P̄_i partition the
    keys), rather than ``[I | R_iᵀ]`` concatenated and gathered into key order: fewer passes over n·k·n values,
    and one fresh allocation instead of three (at n = 512, k = 32 each is above glibc's mmap threshold, so each
    page-faults).
    """
    n, k = layout.indices.shape
    eye = torch.eye(k, dtype=reconstruction.dtype, device=reconstruction.device).expand(n, k, k)
    w = reconstruction.new_empty(n, k, n)
    w.scatter_(2, layout.complement[:, None, :].expand(n, k, n - k), reconstruction.transpose(1, 2))  # R_iᵀ at P̄_i
    return w.scatter_(2, layout.indices[:, None, :].expand(n, k, k), eye)  # I at P_i


# W of frozen R tensors (fixed R, or any R in inference without autograd), by the R tensor's id (tensors compare
# elementwise, so no weak-key dict), dropped when R is freed and rebuilt when R or P changes (their version counters
# and storage) or another dtype is asked for.
_FROZEN_W: dict[int, tuple] = {}


def _reconstruction_matrix_for(layout: "PatternLayout", reconstruction: torch.Tensor, dtype: torch.dtype,
                               fresh: bool = False):
    """`reconstruction_matrix`, reused across calls while R is frozen (not under torch.compile, which traces it, nor
    when ``fresh``: a trained R changes at every step, so caching would only time a build that training pays)."""
    if fresh or torch.compiler.is_compiling() or needs_grad(reconstruction):
        return reconstruction_matrix(layout, reconstruction.to(dtype))
    stamp = (reconstruction.data_ptr(), reconstruction._version, layout.indices.data_ptr(), layout.indices._version,
             dtype, reconstruction.device, torch.is_inference_mode_enabled())  # inference tensors stay inside
    key = id(reconstruction)
    cached = _FROZEN_W.get(key)
    if cached is None or cached[0]() is not reconstruction or cached[1] != stamp:
        w = reconstruction_matrix(layout, reconstruction.detach().to(dtype))
        ref = weakref.ref(reconstruction, lambda _, key=key: _FROZEN_W.pop(key, None))
        cached = _FROZEN_W[key] = (ref, stamp, w)
    return cached[2]


def check_length(t: int, n: int) -> None:
    """Refuse an input of ``t`` tokens longer than the pattern's ``n`` (P and R exist for n positions only)."""
    if t > n:
        raise ValueError(f"Input length {t} exceeds the partial attention length n={n} (config.partial_seq_len); "
                         f"truncate inputs to {n} tokens or use a pattern derived for a longer n.")


def _masked_keys(attention_mask: torch.Tensor | None, t: int, dtype: torch.dtype):
    """From a bool (True = attend) or additive float mask, return (additive mask, bool masked-out)."""
    if attention_mask is None:
        return None, None
    if attention_mask.dtype == torch.bool:
        additive = torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device)
        additive = additive.masked_fill(~attention_mask, torch.finfo(dtype).min)
        return additive, ~attention_mask
    # Additive masks hold 0 for kept keys and a large negative value (finfo.min) for masked ones.
    return attention_mask.to(dtype), attention_mask < torch.finfo(attention_mask.dtype).min / 2


def _gather_scores(query, key, indices, scaling, rows):
    t = query.shape[2]
    k_sel = key[:, :, indices[:t]]  # (B, H, T, k, D)
    return torch.einsum("bhtd,bhtkd->bhtk", query, k_sel) * scaling


def _dense_scores(query, key, indices, scaling, rows):
    b, h, t, _ = query.shape
    full = torch.matmul(query, key.transpose(-1, -2))  # (B, H, T, n); scaled after the selection (n·k, not n²)
    return full.gather(-1, indices[:t].expand(b, h, t, indices.shape[1])) * scaling


def _block_scores(query, key, indices, scaling, rows):
    if rows is None:
        raise ValueError("implementation='blocks' needs a pattern whose rows share key sets in equal blocks.")
    b, h, t, d = query.shape
    n, k = indices.shape
    nb = n // rows
    if t < n:
        query = nn.functional.pad(query, (0, 0, 0, n - t))  # (B, H, n, D)
    # index_select rather than key[:, :, indices[::rows]]: faster on CPU, and so is its backward (index_add).
    cols = key.index_select(2, indices[::rows].flatten()).view(b, h, nb, k, d)  # (B, H, nb, k, D): each block's keys
    exact = torch.matmul(query.view(b, h, nb, rows, d), cols.transpose(-1, -2)) * scaling  # (B, H, nb, rows, k)
    return exact.view(b, h, n, k)[:, :, :t]


# How the k exact scores of each query are computed; all give the same values and gradients.
# gather: only these B·H·T·k dot products; dense: QKᵀ, then select P; blocks: one GEMM per block of rows
# sharing their keys (needs `block_rows`).
_EXACT_SCORES = {"gather": _gather_scores, "dense": _dense_scores, "blocks": _block_scores}


def exact_partial_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    indices: torch.Tensor,
    scaling: float,
    implementation: str = "gather",
    rows: int | None = None,
) -> torch.Tensor:
    """Scores of each query with its k keys in P: ``(B, H, T, D), (B, H, T, D), (n, k) -> (B, H, T, k)``.

    Keys at positions >= T (the input is shorter than n) score zero. ``implementation`` is one of
    ``"gather"``, ``"dense"``, ``"blocks"`` (which needs ``rows``, see `block_rows`).
    """
    if implementation not in _EXACT_SCORES:
        raise ValueError(f"implementation must be one of {tuple(_EXACT_SCORES)}, got {implementation!r}.")
    t, n = query.shape[2], indices.shape[0]
    if t < n:
        key = nn.functional.pad(key, (0, 0, 0, n - t))  # (B, H, n, D): zero keys beyond the input
    return _EXACT_SCORES[implementation](query, key, indices, scaling, rows)


def structured_exact_method(layout: PatternLayout) -> str:
    """How the ``fused`` and ``tiled`` kernels get the exact scores: ``"blocks"`` (block GEMMs) where blocks of rows
    share keys, else ``"dense"`` (the whole QKᵀ, then select P: gathering each query's keys would move B·H·n·k·d
    values)."""
    return "blocks" if layout.block_rows is not None else "dense"


def rows_first(exact: torch.Tensor) -> torch.Tensor:
    """``(B, H, T, k) -> (T, B·H, k)``: the layout in which the product with each row's W is one bmm over rows."""
    b, h, t, k = exact.shape
    return exact.permute(2, 0, 1, 3).reshape(t, b * h, k)  # (T, B·H, k)


def _fused_scores(exact, w, bias_full, t):
    """``(B, H, T, k) -> (T, B·H, T)`` full scores, rows first so the per-row matmul is one bmm."""
    scores = torch.bmm(rows_first(exact), w[:t, :, :t])  # (T, B·H, T)
    if bias_full is not None:
        scores = scores + bias_full[:t, None, :t]
    return scores


def reconstruct_scores(
    exact: torch.Tensor,
    reconstruction: torch.Tensor,
    bias: torch.Tensor | None,
    inverse_permutation: torch.Tensor,
) -> torch.Tensor:
    """Full rows from the exact scores: ``(B, H, T, k) -> (B, H, T, n)`` in key order.

    ``reconstruction`` is ``(n, n−k, k)``, ``bias`` ``(n, n−k)``, ``inverse_permutation`` ``(n, n)`` maps each
    key position to its slot in ``cat(P_i, P̄_i)``.
    """
    b, h, t, k = exact.shape
    n = inverse_permutation.shape[-1]
    rest = torch.einsum("bhtk,tmk->bhtm", exact, reconstruction[:t])  # (B, H, T, n-k)
    if bias is not None:
        rest = rest + bias[:t]
    both = torch.cat([exact, rest], dim=-1)  # (B, H, T, n) in the order cat(P_i, P̄_i)
    return both.gather(-1, inverse_permutation[:t].expand(b, h, t, n))  # (B, H, T, n) in key order


def _exact_masked(query, key, attention_mask, layout, scaling, exact_impl):
    """Exact scores at P with masked keys set to zero, and the additive mask: ``(B, H, T, k)``, ``(B|1, 1|H, T, T)``."""
    t = query.shape[2]
    indices = layout.indices
    n = indices.shape[0]
    check_length(t, n)
    additive, masked = _masked_keys(attention_mask, t, query.dtype)
    exact = exact_partial_scores(query, key, indices, scaling, exact_impl, layout.block_rows)  # (B, H, T, k)
    if masked is not None:
        exact = exact.masked_fill(masked_at_p(masked, indices, t), 0.0)  # masked keys enter R with score zero
    return exact, additive


def masked_at_p(masked: torch.Tensor | None, indices: torch.Tensor, t: int) -> torch.Tensor | None:
    """The exact scores that enter R as zero, bool ``(B|1, 1|H, T, k)``: keys masked out (``masked``, bool
    ``(B|1, 1|H, T, T)``, True = masked, or None) and keys at positions >= T; None when there are none."""
    n, k = indices.shape
    if masked is None:
        return None if t == n else (indices[:t] >= t)[None, None]  # (1, 1, T, k)
    masked = nn.functional.pad(masked, (0, n - t), value=True)  # (B|1, 1|H, T, n)
    return masked.gather(-1, indices[:t].expand(*masked.shape[:2], t, k))


def _bias_full(layout: "PatternLayout", bias: torch.Tensor | None, dtype: torch.dtype, device) -> torch.Tensor | None:
    """The bias ``(n, n−k)`` scattered to key order ``(n, n)`` (zero at P), or None."""
    if bias is None:
        return None
    n = layout.indices.shape[0]
    full = torch.zeros(n, n, dtype=dtype, device=device)
    return full.scatter(-1, layout.complement, bias.to(dtype))  # (n, n) in key order

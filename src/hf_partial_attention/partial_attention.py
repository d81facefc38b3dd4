"""The partial attention function: exact scores at P, the rest reconstructed by R, then mask, softmax, ·V.

Part of the remote-code bundle (imports: torch only).

Padding and short inputs. P and R are defined for positions 0..n−1. An input of length T < n behaves as
if padded to n with keys whose scores are zero; a key masked out by the attention mask also enters the
reconstruction with score zero. Both make a sequence's output independent of how much padding its batch
carries (the exact scores of padding tokens would otherwise leak into the reconstructed scores of real
keys). Masked keys then receive no probability, as in dense attention.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["partial_attention_forward", "exact_partial_scores", "reconstruct_scores", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("gather", "dense")


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


def exact_partial_scores(
    query: torch.Tensor, key: torch.Tensor, indices: torch.Tensor, scaling: float, implementation: str = "gather"
) -> torch.Tensor:
    """Scores of each query with its k keys in P: ``(B, H, T, D), (B, H, T, D), (n, k) -> (B, H, T, k)``.

    Keys at positions >= T (the input is shorter than n) score zero. ``"gather"`` computes only these
    B·H·T·k dot products; ``"dense"`` computes QKᵀ and selects (same values and gradients).
    """
    b, h, t, d = query.shape
    n, k = indices.shape
    idx = indices[:t]  # (T, k)
    if t < n:
        key = nn.functional.pad(key, (0, 0, 0, n - t))  # (B, H, n, D): zero keys beyond the input
    if implementation == "gather":
        k_sel = key[:, :, idx]  # (B, H, T, k, D)
        return torch.einsum("bhtd,bhtkd->bhtk", query, k_sel) * scaling
    if implementation == "dense":
        full = torch.matmul(query, key.transpose(-1, -2)) * scaling  # (B, H, T, n)
        return full.gather(-1, idx.expand(b, h, t, k))
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}.")


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


def partial_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    indices: torch.Tensor,
    inverse_permutation: torch.Tensor,
    reconstruction: torch.Tensor,
    bias: torch.Tensor | None = None,
    scaling: float,
    dropout: float = 0.0,
    implementation: str = "gather",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with partial computation, in the calling convention of transformers' attention functions.

    Args:
        query, key, value: ``(B, H, T, D)`` with T <= n.
        attention_mask: ``None``, bool ``(B|1, 1|H, T, T)`` (True = attend) or additive float of that shape.
        indices: P, ``(n, k)`` int64. inverse_permutation: ``(n, n)`` from `reconstruction.inverse_permutation`.
        reconstruction: R, ``(n, n−k, k)``. bias: ``(n, n−k)`` or None.

    Returns:
        ``(output (B, T, H, D), probabilities (B, H, T, T))`` like ``eager_attention_forward``.
    """
    b, h, t, d = query.shape
    n = indices.shape[0]
    if t > n:
        raise ValueError(
            f"Input length {t} exceeds the partial attention length n={n} (config.partial_seq_len); "
            f"truncate inputs to {n} tokens or use a pattern derived for a longer n."
        )
    additive, masked = _masked_keys(attention_mask, t, query.dtype)
    exact = exact_partial_scores(query, key, indices, scaling, implementation)  # (B, H, T, k)
    if masked is not None:
        masked = nn.functional.pad(masked, (0, n - t), value=True)  # (B|1, 1|H, T, n)
        masked_sel = masked.gather(-1, indices[:t].expand(*masked.shape[:2], t, indices.shape[1]))
        exact = exact.masked_fill(masked_sel, 0.0)  # masked keys enter R with score zero
    scores = reconstruct_scores(exact, reconstruction.to(exact.dtype),
                                None if bias is None else bias.to(exact.dtype), inverse_permutation)
    scores = scores[..., :t]  # (B, H, T, T): reconstructed scores of keys beyond the input are dropped
    if additive is not None:
        scores = scores + additive
    probs = nn.functional.softmax(scores, dim=-1)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs, value)  # (B, H, T, D)
    return out.transpose(1, 2).contiguous(), probs  # (B, T, H, D)

"""Partial attention with P and R per head, every head in one pass (``partial_granularity="head"``, under autograd).

Run head by head, a layer with P and R per head makes H kernel calls, each with its own small products and backward
(`partial_layer.run_bucket`); in a training step at n = 128 that costs about an eighth more than pooled P and R
(benchmarks/results/granularity/). Here the heads go together: the scores QKᵀ of all heads in one product, each
head's exact scores gathered at its own P, full rows by ``einsum`` with each head's ``W_h = [I at P_h | R_hᵀ]``
(one batched product over (head, row) pairs), then mask, softmax, dropout and ·V, differentiated by autograd. The
numbers and gradients are the reference kernel's, head by head (tested in float64).

Part of the remote-code bundle (imports: torch and siblings only).
"""

from __future__ import annotations

import torch
from torch import nn

from .attention_common import PartialTensors, bias_in_key_order, check_length, masked_keys
from .attention_gather import attend

__all__ = ["all_heads_attention"]


def all_heads_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float, dropout: float,
                        heads: list[PartialTensors]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, H, T, D)`` q, k, v and one `PartialTensors` per head -> ``(output (B, T, H, D), probabilities
    (B, H, T, T))``, as the reference kernel gives them head by head."""
    b, h, t, _ = query.shape
    n = heads[0].layout.indices.shape[0]
    check_length(t, n)
    indices = torch.stack([p.layout.indices[:t] for p in heads])  # (H, T, k)
    k = indices.shape[-1]
    # W_h (T, k, T) of every head: from each owner's cache where R is frozen, built (differentiable) where it trains
    w = torch.stack([p.matrix(query.dtype)[:t, :, :t] for p in heads])  # (H, T, k, T)
    additive, masked = masked_keys(attention_mask, t, query.dtype)
    dense = torch.matmul(query, key.transpose(-1, -2))  # (B, H, T, T)
    # Keys beyond the input (P of n positions, t < n) score zero: select them at t - 1, then zero them.
    exact = dense.gather(-1, indices.clamp(max=t - 1).expand(b, h, t, k)) * scaling  # (B, H, T, k)
    zero = (indices >= t)[None]  # (1, H, T, k)
    if masked is not None:  # masked keys enter R with score zero, as in every kernel
        at = indices.clamp(max=t - 1).expand(masked.shape[0], h, t, k)  # (B|1, H, T, k)
        zero = zero | masked.expand(-1, h, -1, -1).gather(-1, at)
    exact = exact.masked_fill(zero, 0.0)
    scores = torch.einsum("bhtk,htkn->bhtn", exact, w)  # (B, H, T, T) in key order
    if heads[0].bias is not None:
        bias = torch.stack([bias_in_key_order(p.layout, p.bias, query.dtype, query.device)[:t, :t] for p in heads])
        scores = scores + bias  # (H, T, T) broadcast over the batch
    return attend(module, scores, additive, value, dropout)

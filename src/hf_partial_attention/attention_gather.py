"""The reference kernel, ``partial_implementation="gather"``: only the k exact scores per query, full rows by
concatenation with R's reconstruction and one gather into key order, then mask, softmax, dropout, ·V.

Every other kernel equals it (tested in float64, outputs and gradients); it is also the one that returns the
attention map, so the dispatcher runs it whenever the map is asked for. Part of the remote-code bundle.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention_common import PartialTensors, first_keys, masked_exact_scores

__all__ = ["gather_attention", "reconstruct_scores", "attend"]


def reconstruct_scores(exact: torch.Tensor, reconstruction: torch.Tensor, bias: torch.Tensor | None,
                       inverse_permutation: torch.Tensor) -> torch.Tensor:
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


def gather_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0, *,
                     partial: PartialTensors, extra: torch.Tensor | None = None, **kwargs
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention by the reference kernel, in transformers' calling convention.

    Args:
        query, key, value: ``(B, H, T, D)`` with T <= n.
        attention_mask: ``None``, bool ``(B|1, 1|H, T, T)`` (True = attend) or additive float of that shape.
        scaling: the scores' scale (``module.scaling`` when None); dropout: the probability of dropping an
            attention probability (applied in training mode only).
        partial: P's layout, R and the bias (`attention_layer.layer_tensors`), a required keyword.
        extra: the score's terms other than q·k at P, ``(B|1, H, T, k)``, scaled (DeBERTa's position terms), or
            None; R reconstructs the rest from the sum.

    Returns:
        ``(output (B, T, H, D), probabilities (B, H, T, T))`` like ``eager_attention_forward``.
    """
    scaling = module.scaling if scaling is None else scaling
    layout, reconstruction, bias = partial.layout, partial.reconstruction, partial.bias
    exact, additive = masked_exact_scores(query, key, attention_mask, layout, scaling, structured=False,
                                          extra=extra)
    scores = reconstruct_scores(exact, reconstruction.to(exact.dtype), None if bias is None else bias.to(exact.dtype),
                                layout.inverse_permutation)
    # (B, H, T, T): reconstructed scores of keys beyond the input are dropped
    scores = first_keys(scores, query.shape[2])
    return attend(module, scores, additive, value, dropout)


def attend(module: nn.Module, scores: torch.Tensor, additive: torch.Tensor | None, value: torch.Tensor,
           dropout: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Full scores ``(B, H, T, T)`` in key order to ``(output (B, T, H, D), probabilities)``: mask, softmax,
    dropout (in training mode), ·V; autograd differentiates it (the reference kernel's last steps)."""
    if additive is not None:
        scores = scores + additive
    probs = nn.functional.softmax(scores, dim=-1)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs, value)  # (B, H, T, D)
    return out.transpose(1, 2).contiguous(), probs  # (B, T, H, D)

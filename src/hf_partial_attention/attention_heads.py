"""P and R per head without autograd, every head of a layer in one pass (`heads_no_grad_attention`): one QKᵀ, one
gather at each head's P, one softmax and one ·V for all heads, and only the product with each head's W = [I | Rᵀ]
head by head, where the head-by-head kernel paid for H calls of every step (inference of a per-head model: 12
calls per layer on MPNet-base, each with its own mask decoding and copies). Per-query patterns (each row its own P,
as the greedy's), no dropout; the dispatcher runs each head by its own kernel otherwise. Its numbers are the
reference's head by head (tests/test_heads_kernel.py, float64).

Part of the remote-code bundle (imports: torch and siblings only).
"""

from __future__ import annotations

import torch

from .attention_common import (TILE_ELEMENTS, PartialTensors, PatternStructure, bias_in_key_order, broadcast_slice,
                               check_length, masked_at_p, masked_keys, softmax_in_place)

__all__ = ["heads_in_one_pass", "heads_no_grad_attention"]


def heads_in_one_pass(heads: list[PartialTensors], dropout: float) -> bool:
    """Whether `heads_no_grad_attention` takes these heads: every head's P per query (no blocks of rows sharing
    keys, which the head-by-head kernel scores by block GEMMs), one k for all, no dropout in effect."""
    return (dropout == 0.0 and all(p.layout.structure is PatternStructure.PER_QUERY for p in heads)
            and len({p.layout.indices.shape for p in heads}) == 1)


def heads_no_grad_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, heads: list[PartialTensors], scaling: float,
                            extra: torch.Tensor | None = None) -> torch.Tensor:
    """Partial attention with P and R per head, without autograd: ``(B, H, T, D)`` q, k, v and one `PartialTensors`
    per head -> output ``(B, T, H, Dv)``. ``attention_mask``: bool or additive ``(B|1, 1|H, T, T)``; ``extra``: the
    score's terms beyond q·k at each head's P, ``(B|1, H, T, k)`` (DeBERTa-v2's), added before R. Groups of heads
    and sequences (`_groups`), so that B·H·n² values are never allocated at once."""
    b, h, t, _ = query.shape
    check_length(t, heads[0].layout.indices.shape[0])
    indices = torch.stack([p.layout.indices for p in heads])  # (H, n, k)
    additive, masked = masked_keys(attention_mask, t, query.dtype)
    zero_at = masked_at_p(masked, indices, t)  # (B|1, H, T, k) or None: keys masked out or beyond T enter R as zero
    ws = [p.matrix(query.dtype) for p in heads]  # each (n, k, n), from its owner's cache where R is frozen
    biases = [bias_in_key_order(p.layout, p.bias, query.dtype, query.device) for p in heads]  # each (n, n) or None
    out = value.new_empty(b, t, h, value.shape[-1])  # (B, T, H, Dv)
    for rows, heads_of in _groups(b, h, t, indices.shape[-1]):
        def part(x):  # a (B|1, H|1, ...) tensor's part of this group: whole where a dimension broadcasts
            return x if x is None else x[broadcast_slice((rows, heads_of), x)]

        out[rows, :, heads_of] = _group(query[rows, heads_of], key[rows, heads_of], value[rows, heads_of],
                                        part(additive), part(zero_at), indices[heads_of], ws[heads_of],
                                        biases[heads_of], scaling, part(extra))
    return out


def _groups(b: int, h: int, t: int, k: int) -> list[tuple[slice, slice]]:
    """The (batch, head) slices worked one at a time: about `TILE_ELEMENTS` scores each, heads split before the
    batch, so that each head's W (t·k·t values, its own) is read once per call where the batch allows (and by
    groups of at least 8·k sequences where it does not: W's reads then cost at most an eighth of the scores)."""
    bc = min(b, max(TILE_ELEMENTS // (t * t), 8 * k))  # sequences a group
    hc = max(1, min(h, TILE_ELEMENTS // (bc * t * t)))  # heads a group
    return [(slice(b0, b0 + bc), slice(h0, h0 + hc)) for b0 in range(0, b, bc) for h0 in range(0, h, hc)]


def _group(query, key, value, additive, zero_at, indices, ws, biases, scaling, extra) -> torch.Tensor:
    """One batch group, every head: ``(B, H, T, D)`` -> ``(B, T, H, Dv)`` (a view). The scores live head-major, as
    ``(H, T, B, T)``: each head's products (with its W, then with V) read and write one contiguous slice (a strided
    ``out=`` would make bmm loop over its matrices one by one)."""
    b, h, t, d = query.shape
    k = indices.shape[-1]
    q3, k3t = query.reshape(b * h, t, d), key.transpose(2, 3).reshape(b * h, d, t)  # (B·H, T, D), (B·H, D, T)
    dense = torch.bmm(q3, k3t)  # (B·H, T, T): the one n×n buffer, reused for the scores below
    # Keys beyond the input (t < n) are read at position t-1 and zeroed with `zero_at`
    index = indices[:, :t].clamp(max=t - 1).expand(b, h, t, k)  # (B, H, T, k)
    exact = dense.view(b, h, t, t).gather(-1, index).mul_(scaling)  # (B, H, T, k)
    if extra is not None:
        exact.add_(extra)
    if zero_at is not None:
        exact.masked_fill_(zero_at, 0.0)
    rows = exact.permute(1, 2, 0, 3).contiguous()  # (H, T, B, k): each head's rows one (T, B, k) block
    scores = dense.view(h, t, b, t)  # (H, T, B, T) in QKᵀ's memory, read for the last time above
    for head, (w, bias) in enumerate(zip(ws, biases)):
        torch.bmm(rows[head], w[:t, :, :t], out=scores[head])  # (T, B, T): exact at P, R's elsewhere
        if bias is not None:
            scores[head] += bias[:t, None, :t]  # (T, 1, T)
    if additive is not None:
        scores += additive.permute(1, 2, 0, 3)  # (1|H, T, B|1, T)
    softmax_in_place(scores)
    out = value.new_empty(h, b, t, value.shape[-1])  # (H, B, T, Dv)
    for head in range(h):
        torch.bmm(scores[head].transpose(0, 1), value[:, head], out=out[head])  # (B, T, T) @ (B, T, Dv)
    return out.permute(1, 2, 0, 3)  # (B, T, H, Dv) view

"""Partial attention with P and R per head under autograd, every head in one autograd node with a backward written
out by hand (``partial_granularity="head"``), as the ``fused`` kernel's.

One ``fused`` call per head costs H autograd nodes, each with its own small products and allocations; one pass over
all heads at once (QKᵀ of every head, then the rows, softmax and ·V over B·H·n² scores) sweeps tensors far larger
than the cache at every step, and autograd through those ops stacked every head's W at each call (H·n·k·n values,
200 MB per layer at n = 512, k = 16, H = 12). Here (`benchmarks/results/granularity/` has the timings) one node
works head by head: QKᵀ of the head into a scratch n×n buffer, its exact scores gathered at its own P, its full rows
by one batched matmul with its ``W_h = [I at P_h | R_hᵀ]`` written into its slice of the saved probabilities, mask,
softmax and dropout there in place, then ·V; the backward the same way, the head's scratch buffers reused, so each
step's tensors stay in cache. Each head's W comes from its own owner's cache where R is frozen; where R trains it is
built without autograd and R's gradient is gathered from W's, as in ``fused``.

Any P (per query or blocks) runs here: the exact scores are read from QKᵀ. The numbers and gradients are the
reference kernel's, head by head (tested in float64).

Part of the remote-code bundle (imports: torch and siblings only).
"""

from __future__ import annotations

import torch
from torch import nn

from .attention_backward import dropped_probabilities, scatter_to_complement, softmax_backward_in_place
from .attention_common import PartialTensors, bias_in_key_order, check_length, masked_at_p, masked_keys, softmax_in_place

__all__ = ["all_heads_attention"]


def _head(x: torch.Tensor | None, head: int) -> torch.Tensor | None:
    """Head ``head``'s slice of a ``(B|1, H|1, ...)`` tensor (the whole of a dimension that broadcasts)."""
    return None if x is None else x[:, head if x.shape[1] > 1 else 0]


class _AllHeadsFused(torch.autograd.Function):
    """Head by head: exact scores by QKᵀ then select P_h, full rows by W_h, mask, softmax, dropout, ·V."""

    @staticmethod
    def forward(ctx, query, key, value, heads, indices, additive, zero_at, scaling, dropout, *trained):
        b, h, t, _ = query.shape
        train_r = any(p.reconstruction.requires_grad for p in heads)
        ws = [p.matrix(query.dtype, fresh=train_r) for p in heads]  # each (n, k, n), without autograd
        biases = [bias_in_key_order(p.layout, None if p.bias is None else p.bias.detach(), query.dtype, query.device)
                  for p in heads]  # each (n, n) or None
        index = indices[:, :t].clamp(max=t - 1)  # (H, T, k): keys beyond the input at t − 1, zeroed by zero_at
        k = index.shape[-1]
        rows = query.new_empty(h, t, b, k)  # (H, T, B, k): each head's exact scores, rows first
        probs = query.new_empty(h, t, b, t)  # (H, T, B, T): kept for the backward
        keep = None if dropout == 0.0 else torch.empty_like(probs).bernoulli_(1.0 - dropout).bool()  # (H, T, B, T)
        out = value.new_empty(h, b, t, value.shape[-1])  # (H, B, T, Dv)
        scratch = query.new_empty(b, t, t)  # (B, T, T): one head's QKᵀ, reused head after head
        for head in range(h):
            torch.bmm(query[:, head], key[:, head].transpose(1, 2), out=scratch)  # (B, T, D) @ (B, D, T)
            exact = scratch.gather(-1, index[head].expand(b, t, k)).mul_(scaling)  # (B, T, k)
            zero = _head(zero_at, head)  # (B|1, T, k) or None
            if zero is not None:
                exact.masked_fill_(zero, 0.0)  # masked keys (and keys beyond the input) enter R with score zero
            rows[head].copy_(exact.transpose(0, 1))
            scores = torch.bmm(rows[head], ws[head][:t, :, :t], out=probs[head])  # (T, B, k) @ (T, k, T)
            if biases[head] is not None:
                scores += biases[head][:t, None, :t]  # (T, 1, T)
            mask = _head(additive, head)  # (B|1, T, T) or None
            if mask is not None:
                scores += mask.transpose(0, 1)  # (T, B|1, T)
            normalised = softmax_in_place(scores)  # in place on CPU
            if normalised is not scores:
                scores.copy_(normalised)
            kept = probs[head] if keep is None else dropped_probabilities(probs[head], keep[head], dropout)
            torch.bmm(kept.transpose(0, 1), value[:, head], out=out[head])  # (B, T, T) @ (B, T, Dv)
        ctx.save_for_backward(query, key, value, rows, probs, keep, index, zero_at)
        ctx.heads, ctx.ws, ctx.scaling, ctx.dropout = heads, ws, scaling, dropout
        ctx.dtypes = [(p.reconstruction.dtype, None if p.bias is None else p.bias.dtype) for p in heads]
        return out  # (H, B, T, Dv)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        query, key, value, rows, probs, keep, index, zero_at = ctx.saved_tensors
        h, t, b, k = rows.shape
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        need_trained = ctx.needs_input_grad[9:]
        grads = {name: x.new_empty(h, b, t, x.shape[-1]) for name, x, need in
                 (("q", query, need_q), ("k", key, need_k), ("v", value, need_v)) if need}  # each (H, B, T, D)
        grads_r, grads_bias = [None] * h, [None] * (len(need_trained) - h)
        grad_s = probs.new_empty(t, b, t)  # (T, B, T): one head's scores' gradient, reused head after head
        grad_dense = probs.new_empty(b, t, t)  # (B, T, T): one head's QKᵀ gradient
        for head in range(h):
            g = grad_out[head]  # (B, T, Dv)
            p = probs[head]  # (T, B, T)
            if need_v:
                kept = p if keep is None else dropped_probabilities(p, keep[head], ctx.dropout)
                torch.bmm(kept.permute(1, 2, 0), g, out=grads["v"][head])  # (B, T, T) @ (B, T, Dv)
            torch.bmm(g, value[:, head].transpose(1, 2), out=grad_s.transpose(0, 1))  # written as (B, T, T)
            if keep is not None:
                grad_s.mul_(keep[head]).div_(1.0 - ctx.dropout)
            grad_s = softmax_backward_in_place(grad_s, p)  # (T, B, T)
            layout = ctx.heads[head].layout
            if need_trained[head]:
                grad_w = torch.bmm(rows[head].transpose(1, 2), grad_s)  # (T, k, T)
                grads_r[head] = scatter_to_complement(grad_w, layout, t, True).to(ctx.dtypes[head][0])
            if grads_bias and need_trained[h + head]:
                grads_bias[head] = scatter_to_complement(grad_s.sum(1), layout, t, False).to(ctx.dtypes[head][1])
            if need_q or need_k:
                grad_rows = torch.bmm(grad_s, ctx.ws[head][:t, :, :t].transpose(1, 2))  # (T, B, k)
                grad_exact = grad_rows.transpose(0, 1).mul_(ctx.scaling)  # (B, T, k) view
                zero = _head(zero_at, head)
                if zero is not None:
                    grad_exact.masked_fill_(zero, 0.0)
                grad_dense.zero_().scatter_add_(-1, index[head].expand(b, t, k), grad_exact)  # (B, T, T)
                if need_q:
                    torch.bmm(grad_dense, key[:, head], out=grads["q"][head])  # (B, T, T) @ (B, T, D)
                if need_k:
                    torch.bmm(grad_dense.transpose(1, 2), query[:, head], out=grads["k"][head])
        # (B, H, T, D) views of the (H, B, T, D) buffers
        grad_q, grad_k, grad_v = (grads[name].transpose(0, 1) if name in grads else None for name in "qkv")
        return (grad_q, grad_k, grad_v, None, None, None, None, None, None, *grads_r, *grads_bias)


def all_heads_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float, dropout: float,
                        heads: list[PartialTensors]) -> tuple[torch.Tensor, None]:
    """``(B, H, T, D)`` q, k, v and one `PartialTensors` per head -> ``(output (B, T, H, D), None)``, the reference
    kernel's numbers head by head, with the hand-written backward (the path under autograd; without it, a model runs
    each head by its own kernel, which tiles the batch)."""
    t = query.shape[2]
    check_length(t, heads[0].layout.indices.shape[0])
    additive, masked = masked_keys(attention_mask, t, query.dtype)
    indices = torch.stack([p.layout.indices for p in heads])  # (H, n, k)
    zero_at = masked_at_p(masked, indices, t)  # (B|1, H, T, k) or None
    trained = [p.reconstruction for p in heads] + ([] if heads[0].bias is None else [p.bias for p in heads])
    out = _AllHeadsFused.apply(query, key, value, heads, indices, additive, zero_at, scaling, dropout, *trained)
    return out.permute(1, 2, 0, 3).contiguous(), None  # (B, T, H, Dv)

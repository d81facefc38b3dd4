"""The ``fused`` kernel: full rows of scores by one batched matmul with ``W_i = [I at P_i | R_iᵀ at P̄_i]`` (no
scatter), then mask, softmax, dropout and ·V, with a backward written out by hand; without autograd the same in one
n×n buffer per group of (batch, head) pairs, worked in place. Returns no attention map (like SDPA): the dispatcher
runs the reference kernel when the map is asked for. Per-query patterns run `_ScoresFused`; blocks of rows sharing
keys get their exact scores from block GEMMs, then `_RowsFused`; P and R per head run `_ScoresFused` head by head
(`all_heads_attention`; without autograd `attention_heads`). Why by hand, and why head by head: docs/method.md,
"The fused kernel". Its numbers and gradients are the reference's (tested in float64 against ``gather``).

Part of the remote-code bundle (imports: torch and siblings only).
"""

from __future__ import annotations

import torch
from torch import nn

from .attention_backward import dropped_probabilities, scatter_to_complement, softmax_backward_in_place
from .attention_common import (PartialTensors, PatternStructure, bias_in_key_order, broadcast_slice, check_length,
                               masked_at_p, masked_exact_scores, masked_keys, needs_grad, normalised_in_place,
                               rows_first, sum_to_shape, tile_groups)
from .attention_heads import heads_in_one_pass, heads_no_grad_attention

__all__ = ["fused_attention", "all_heads_attention"]


def _dense_exact_rows(query, key, indices, scaling, zero_at, dense_out=None, extra=None):
    """Exact scores by QKᵀ then select P (plus ``extra``, the score's other terms at P, ``(B|1, H, T, k)``), rows
    first: ``(T, B·H, k)``, the QKᵀ buffer ``(B·H, T, T)`` (free for reuse; ``dense_out`` when given) and what the
    backward needs."""
    b, h, t, d = query.shape
    k = indices.shape[1]
    bh = b * h
    # Keys beyond the input (t < n) score zero: they are selected at position t-1 and zeroed with `zero_at`.
    index = indices[:t].clamp(max=t - 1).expand(bh, t, k)  # (B·H, T, k)
    # Copies of a model's views, as eager's matmul makes them; Kᵀ made contiguous, as eager's matmul does, rather
    # than transposed inside the GEMM (one head's slices are views already: no copy)
    q3, k3t = query.reshape(bh, t, d), key.transpose(2, 3).reshape(bh, d, t)  # (B·H, T, D), (B·H, D, T)
    dense = torch.bmm(q3, k3t, out=dense_out)  # (B·H, T, T): the one n×n buffer of the forward
    exact = dense.gather(-1, index).mul_(scaling)  # (B·H, T, k)
    if extra is not None:
        exact.view(b, h, t, k).add_(extra)
    if zero_at is not None:
        exact.view(b, h, t, k).masked_fill_(zero_at, 0.0)  # masked keys enter R with score zero
    return exact.transpose(0, 1).contiguous(), dense, (q3, k3t, index)  # rows (T, B·H, k): one bmm over rows


def _rows_forward(rows, value, w, bias_full, additive, dropout, scores_out=None):
    """Full scores from rows-first exact ones ``(T, B·H, k)``, mask, softmax, dropout, ·V, in one n×n buffer
    (``scores_out`` when given): ``(B·H, T, Dv)`` output, probabilities ``(T, B·H, T)``, kept mask or None, the
    probabilities after dropout (the same tensor without dropout) and V as ``(B·H, T, Dv)``."""
    b, h, t, dv = value.shape
    bh = b * h
    if scores_out is None:
        scores = torch.bmm(rows, w[:t, :, :t])  # (T, B·H, T)
    else:
        scores = torch.bmm(rows, w[:t, :, :t], out=scores_out.view(t, bh, t))
    bias = None if bias_full is None else bias_full[:t, None, None, :t]  # (T, 1, 1, T)
    mask = None if additive is None else additive.permute(2, 0, 1, 3)  # (T, B|1, 1|H, T)
    probs = normalised_in_place(scores.view(t, b, h, t), bias, mask).view(t, bh, t)  # (T, B·H, T)
    keep = None if dropout == 0.0 else torch.empty_like(probs).bernoulli_(1.0 - dropout).bool()  # (T, B·H, T)
    kept = dropped_probabilities(probs, keep, dropout)
    v3 = value.reshape(bh, t, dv)  # (B·H, T, Dv): a copy of a model's view, kept for the backward
    out = torch.bmm(kept.transpose(0, 1), v3)  # (B·H, T, Dv)
    return out, probs, keep, kept, v3


def _rows_backward(grad_out, rows, w, v3, probs, keep, dropout, layout, dtypes, need_rows, need_v, need_r,
                   need_bias, grad_buffer=None):
    """The backward of `_rows_forward` up to the exact scores (``v3``: V as ``(B·H, T, Dv)``): the scores'
    gradient ``(T, B·H, T)`` (in ``grad_buffer`` when given; the caller may reuse it), the rows' ``(T, B·H, k)``,
    V's ``(B·H, T, Dv)``, and R's and the bias's (of ``dtypes``) when they train."""
    bh, t, dv = v3.shape
    g3 = grad_out.reshape(bh, t, dv)  # (B·H, T, Dv)
    grad_v = None
    if need_v:
        kept = dropped_probabilities(probs, keep, dropout)
        grad_v = torch.bmm(kept.permute(1, 2, 0), g3)  # (B·H, T, Dv)
        del kept
    if torch.compiler.is_compiling():  # a graph takes no `out=` into a non-contiguous view: one copy instead
        grad_p = torch.bmm(g3, v3.transpose(1, 2)).transpose(0, 1).contiguous()  # (T, B·H, T)
    else:
        grad_p = probs.new_empty(probs.shape) if grad_buffer is None else grad_buffer  # (T, B·H, T)
        torch.bmm(g3, v3.transpose(1, 2), out=grad_p.transpose(0, 1))  # written through its (B·H, T, T) view
    if keep is not None:
        grad_p.mul_(keep).div_(1.0 - dropout)
    grad_s = softmax_backward_in_place(grad_p, probs)  # (T, B·H, T)
    grad_r = grad_bias = grad_rows = None
    if need_r:
        grad_w = torch.bmm(rows.transpose(1, 2), grad_s)  # (T, k, T)
        grad_r = scatter_to_complement(grad_w, layout, t, True).to(dtypes[0])
    if need_bias:
        grad_bias = scatter_to_complement(grad_s.sum(1), layout, t, False).to(dtypes[1])
    if need_rows:
        grad_rows = torch.bmm(grad_s, w[:t, :, :t].transpose(1, 2))  # (T, B·H, k)
    return grad_s, grad_rows, grad_v, grad_r, grad_bias


def _w_and_bias(partial: PartialTensors, dtype, device):
    """W (from the owner's cache where R is frozen; built without autograd where R trains: its gradient is gathered
    from W's) and the bias in key order."""
    w = partial.matrix(dtype, fresh=partial.reconstruction.requires_grad)  # (n, k, n)
    return w, bias_in_key_order(partial.layout, partial.bias, dtype, device)


def _dtypes(partial: PartialTensors) -> tuple:
    return partial.reconstruction.dtype, None if partial.bias is None else partial.bias.dtype


def _no_grad_attention(query, key, value, attention_mask, layout, w, bias_full, scaling, dropout=0.0, extra=None):
    """The forward without autograd on one group of (batch, head) pairs, in one n×n buffer worked in place:
    ``(B, H, T, D)`` -> output ``(B, T, H, Dv)``. Exact scores by QKᵀ then select P (per-query patterns), or by
    block GEMMs where blocks of rows share keys."""
    t, n = query.shape[2], layout.indices.shape[0]
    check_length(t, n)
    b, h = query.shape[:2]
    if layout.structure is PatternStructure.PER_QUERY:
        additive, masked = masked_keys(attention_mask, t, query.dtype)
        zero_at = masked_at_p(masked, layout.indices, t)  # (B|1, 1|H, T, k) or None
        rows, dense, _ = _dense_exact_rows(query, key, layout.indices, scaling, zero_at, extra=extra)
    else:
        exact, additive = masked_exact_scores(query, key, attention_mask, layout, scaling, True,
                                              extra=extra)  # (B, H, T, k)
        rows, dense = rows_first(exact), None  # (T, B·H, k)
    out = _rows_forward(rows, value, w, bias_full, additive, dropout, scores_out=dense)[0]  # (B·H, T, Dv)
    return out.view(b, h, t, -1).transpose(1, 2)  # (B, T, H, Dv) view


def _heads_of(x: torch.Tensor | None, group: int, size: int) -> torch.Tensor | None:
    """The heads of group ``group`` (``size`` heads each) of a ``(B|1, H|1, ...)`` tensor: the whole of a dimension
    that broadcasts."""
    return x if x is None or x.shape[1] == 1 else x[:, group * size:(group + 1) * size]


class _ScoresFused(torch.autograd.Function):
    """Exact scores read from QKᵀ at P, full rows by one batched matmul with W, mask, softmax, dropout, ·V, group
    by group of heads that share a P and R: one group of every head (one P and R for all), or one per head (P and R
    per head, any P: per query or blocks). Each group works in its own slice of one buffer of probabilities, its
    QKᵀ written there first; the backward reuses one scratch n×n buffer group after group, so that with a group per
    head each step's tensors stay in cache."""

    @staticmethod
    def forward(ctx, query, key, value, partials, indices, additive, zero_at, extra, scaling, dropout, *trained):
        b, h, t, _ = query.shape
        g = len(partials)
        size = h // g  # heads per group
        bh = b * size
        probs_all = query.new_empty(g, t, bh, t)  # (G, T, B·Hg, T): each group's QKᵀ, then its probabilities
        outs, saved, keeps, ws = [], [], [], []
        for group, partial in enumerate(partials):
            w, bias_full = _w_and_bias(partial, query.dtype, query.device)
            heads = slice(group * size, (group + 1) * size)
            rows, dense, (q3, k3t, index) = _dense_exact_rows(
                query[:, heads], key[:, heads], indices[group], scaling, _heads_of(zero_at, group, size),
                dense_out=probs_all[group].view(bh, t, t), extra=_heads_of(extra, group, size))
            out, probs, keep, _, v3 = _rows_forward(rows, value[:, heads], w, bias_full,
                                                    _heads_of(additive, group, size), dropout, scores_out=dense)
            if probs.device.type != "cpu":  # the softmax wrote a new tensor (in place on CPU only): keep it saved
                probs_all[group].copy_(probs)
            outs.append(out)  # (B·Hg, T, Dv)
            saved += [q3, k3t, v3, rows, index]
            keeps.append(keep)
            ws.append(w)
        keep_all = None if dropout == 0.0 else keeps[0][None] if g == 1 else torch.stack(keeps)  # (G, T, B·Hg, T)
        ctx.save_for_backward(probs_all, keep_all, zero_at, *ws, *saved)
        ctx.layouts, ctx.dtypes = [p.layout for p in partials], [_dtypes(p) for p in partials]
        ctx.scaling, ctx.dropout, ctx.shape = scaling, dropout, (b, h, g, size, t, value.shape[-1])
        ctx.mask_shape = None if additive is None else additive.shape
        ctx.extra_shape = None if extra is None else extra.shape
        out = outs[0] if g == 1 else torch.stack(outs)  # (G, B·Hg, T, Dv)
        return out.view(g, b, size, t, -1)  # (G, B, Hg, T, Dv)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        probs_all, keep_all, zero_at, *rest = ctx.saved_tensors
        b, h, g, size, t, dv = ctx.shape
        ws, saved = rest[:g], rest[g:]
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        need_extra = ctx.needs_input_grad[7]
        need_trained = ctx.needs_input_grad[10:]
        grads = {name: grad_out.new_empty(g, b, size, t, d) for name, d, need in
                 (("q", saved[0].shape[-1], need_q), ("k", saved[1].shape[-2], need_k)) if need}  # (G, B, Hg, T, D)
        grads_v = []  # each group's (B·Hg, T, Dv)
        grads_r, grads_bias = [None] * g, [None] * (len(need_trained) - g)
        # The additive mask's gradient, where it trains (a position bias in it, MPNet's): the scores' own
        grad_mask = grad_out.new_empty(b, h, t, t) if ctx.needs_input_grad[5] else None  # (B, H, T, T)
        grad_extra = None  # (B, H, T, k): the rows' own gradient, zero where a masked key entered R as zero
        scratch = None if g == 1 else probs_all.new_empty(probs_all.shape[1:])  # (T, B·Hg, T), reused
        for group in range(g):
            q3, k3t, v3, rows, index = saved[5 * group:5 * group + 5]
            keep = None if keep_all is None else keep_all[group]
            grad_s, grad_rows, grad_v, grads_r[group], bias_grad = _rows_backward(
                grad_out[group], rows, ws[group], v3, probs_all[group], keep, ctx.dropout, ctx.layouts[group],
                ctx.dtypes[group], need_q or need_k or need_extra, need_v, need_trained[group],
                bool(grads_bias) and need_trained[g + group], grad_buffer=scratch)
            if grads_bias:
                grads_bias[group] = bias_grad
            if grad_mask is not None:  # before grad_s's memory is reused below
                grad_mask[:, group * size:(group + 1) * size] = grad_s.view(t, b, size, t).permute(1, 2, 0, 3)
            grads_v.append(grad_v)
            zero = _heads_of(zero_at, group, size)
            if need_extra:
                g_extra = grad_rows.transpose(0, 1).reshape(b, size, t, -1)  # (B, Hg, T, k), a copy
                if zero is not None:
                    g_extra.masked_fill_(zero, 0.0)
                if grad_extra is None:
                    grad_extra = g_extra.new_empty(b, h, t, g_extra.shape[-1])
                grad_extra[:, group * size:(group + 1) * size] = g_extra
            if need_q or need_k:
                grad_exact = grad_rows.transpose(0, 1).mul_(ctx.scaling)  # (B·Hg, T, k)
                if zero is not None:
                    grad_exact.view(b, size, t, -1).masked_fill_(zero, 0.0)
                # The gradient of QKᵀ, (B·Hg, T, T), in the memory of grad_s (read for the last time above).
                grad_dense = grad_s.view(b * size, t, t).zero_().scatter_add_(-1, index, grad_exact)
                if need_q:
                    torch.bmm(grad_dense, k3t.transpose(1, 2), out=grads["q"][group].view(b * size, t, -1))
                if need_k:
                    torch.bmm(grad_dense.transpose(1, 2), q3, out=grads["k"][group].view(b * size, t, -1))
        if need_v:
            grads["v"] = (grads_v[0] if g == 1 else torch.stack(grads_v)).view(g, b, size, t, dv)
        # (B, H, T, D) views of the (G, B, Hg, T, D) buffers
        grad_q, grad_k, grad_v = (grads[name].transpose(0, 1).flatten(1, 2) if name in grads else None
                                  for name in "qkv")
        grad_mask = None if grad_mask is None else sum_to_shape(grad_mask, ctx.mask_shape)
        grad_extra = None if grad_extra is None else sum_to_shape(grad_extra, ctx.extra_shape)
        return (grad_q, grad_k, grad_v, None, None, grad_mask, None, grad_extra, None, None, *grads_r, *grads_bias)


class _RowsFused(torch.autograd.Function):
    """The same after the exact scores, which autograd computes and differentiates (block patterns: small GEMMs)."""

    @staticmethod
    def forward(ctx, exact, value, reconstruction, bias, partial, additive, dropout):
        w, bias_full = _w_and_bias(partial, exact.dtype, exact.device)
        rows = rows_first(exact)  # (T, B·H, k)
        out, probs, keep, _, v3 = _rows_forward(rows, value, w, bias_full, additive, dropout)
        ctx.save_for_backward(rows, w, v3, probs, keep)
        ctx.layout, ctx.dtypes, ctx.dropout, ctx.value_shape = partial.layout, _dtypes(partial), dropout, value.shape
        ctx.mask_shape = None if additive is None else additive.shape
        return out.view(value.shape)  # (B, H, T, Dv)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        rows, w, v3, probs, keep = ctx.saved_tensors
        b, h, t, _ = ctx.value_shape
        need_exact, need_v, need_r, need_bias = ctx.needs_input_grad[:4]
        grad_s, grad_rows, grad_v, grad_r, grad_bias = _rows_backward(
            grad_out, rows, w, v3, probs, keep, ctx.dropout, ctx.layout, ctx.dtypes, need_exact, need_v, need_r,
            need_bias)
        grad_exact = None if grad_rows is None else grad_rows.view(t, b, h, -1).permute(1, 2, 0, 3)  # (B, H, T, k)
        grad_v = None if grad_v is None else grad_v.view(ctx.value_shape)
        grad_mask = None  # the additive mask's, where it trains (a position bias in it): the scores' own
        if ctx.needs_input_grad[5]:
            grad_mask = sum_to_shape(grad_s.view(t, b, h, t).permute(1, 2, 0, 3), ctx.mask_shape)  # (B|1, H|1, T, T)
        return grad_exact, grad_v, grad_r, grad_bias, None, grad_mask, None


def _scores_fused(query, key, value, attention_mask, partials: list[PartialTensors], scaling, dropout, extra=None):
    """``(B, H, T, D)`` -> ``(B, T, H, Dv)`` by `_ScoresFused`, one group of heads per entry of ``partials``."""
    t = query.shape[2]
    check_length(t, partials[0].layout.indices.shape[0])
    additive, masked = masked_keys(attention_mask, t, query.dtype)
    indices = torch.stack([p.layout.indices for p in partials])  # (G, n, k)
    # (B|1, 1|H, T, k) or None: one P, or each head's (G = H)
    zero_at = masked_at_p(masked, indices[0] if len(partials) == 1 else indices, t)
    trained = [p.reconstruction for p in partials] + ([] if partials[0].bias is None else [p.bias for p in partials])
    out = _ScoresFused.apply(query, key, value, partials, indices, additive, zero_at, extra, scaling, dropout,
                             *trained)
    return out.transpose(0, 1).flatten(1, 2).transpose(1, 2).contiguous()  # (B, T, H, Dv)


def _with_autograd(query, key, value, attention_mask, partial: PartialTensors, scaling, dropout, extra=None):
    """``(B, H, T, D)`` -> ``(B, T, H, D)`` under autograd, by the hand-written backward: `_ScoresFused` for
    per-query patterns; patterns whose blocks of rows share keys get their exact scores from block GEMMs under
    autograd, then `_RowsFused`."""
    layout = partial.layout
    if layout.structure is PatternStructure.PER_QUERY:
        return _scores_fused(query, key, value, attention_mask, [partial], scaling, dropout, extra)
    check_length(query.shape[2], layout.indices.shape[0])
    exact, additive = masked_exact_scores(query, key, attention_mask, layout, scaling, True,
                                          extra=extra)  # (B, H, T, k)
    out = _RowsFused.apply(exact, value, partial.reconstruction, partial.bias, partial, additive, dropout)
    return out.transpose(1, 2).contiguous()  # (B, T, H, D)


def all_heads_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float, dropout: float,
                        heads: list[PartialTensors], extra: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
    """P and R per head (``partial_granularity="head"``): ``(B, H, T, D)`` q, k, v and one `PartialTensors` per
    head -> ``(output (B, T, H, D), None)``, the reference kernel's numbers head by head. Under autograd every head
    in one autograd node (`_ScoresFused`, a group per head) rather than H nodes with their own small products and
    allocations; without, every head in one pass where `attention_heads.heads_in_one_pass` allows (else
    `_ScoresFused`'s forward, which keeps what a backward would read)."""
    if not needs_grad(query, key, value, attention_mask, extra, *(p.reconstruction for p in heads),
                      *(p.bias for p in heads)) and heads_in_one_pass(heads, dropout):
        return heads_no_grad_attention(query, key, value, attention_mask, heads, scaling, extra), None
    return _scores_fused(query, key, value, attention_mask, heads, scaling, dropout, extra), None


def fused_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0, *,
                    partial: PartialTensors, extra: torch.Tensor | None = None, **kwargs
                    ) -> tuple[torch.Tensor, None]:
    """Partial attention by the fused kernel, in transformers' calling convention (arguments as
    `attention_gather.gather_attention`): ``(output (B, T, H, D), None)``, the reference kernel's numbers.

    With autograd: the hand-written backward. Without: groups of (batch, head) pairs whose n×n scores hold about
    `attention_common.TILE_ELEMENTS` values each, written into one output, so that B·H·n² values are never
    allocated at once."""
    scaling = module.scaling if scaling is None else scaling
    dropout = dropout if module.training else 0.0
    if needs_grad(query, key, value, partial.reconstruction, partial.bias, attention_mask, extra):
        return _with_autograd(query, key, value, attention_mask, partial, scaling, dropout, extra), None
    layout = partial.layout
    w = partial.matrix(query.dtype)  # (n, k, n)
    bias_full = bias_in_key_order(layout, partial.bias, query.dtype, query.device)
    b, h, t, d = query.shape
    k = layout.indices.shape[1]
    # Every group reads all of W (n·k·n values): where W does not stay in cache (over 8 MiB), groups hold at least
    # 8·k pairs so that reading W costs at most an eighth of the scores they write.
    pairs = 8 * k if w.numel() * w.element_size() > 8 * 2**20 else 2
    out = value.new_empty(b, t, h, value.shape[-1])  # (B, T, H, Dv)
    for group in tile_groups(b, h, t, t, pairs):
        # (B|1, 1|H, T, T): slice the dimensions that do not broadcast
        mask = None if attention_mask is None else attention_mask[broadcast_slice(group, attention_mask)]
        part = None if extra is None else extra[broadcast_slice(group, extra)]  # (B|1, H, T, k) sliced as the mask
        out[group[0], :, group[1]] = _no_grad_attention(query[group], key[group], value[group], mask, layout, w,
                                                        bias_full, scaling, dropout, part)
    return out, None

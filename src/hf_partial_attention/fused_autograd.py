"""The ``fused`` kernel's training path for patterns whose rows do not share key sets (per-query P): one autograd
Function whose backward is written out by hand.

Part of the remote-code bundle (imports: torch and siblings only).

Autograd through the ops of `partial_attention._fused_group` costs more than the arithmetic needs, measured on a
2-core CPU at n = 512, B = 8, H = 12, k = 32 (fwd + bwd 1.28x of eager attention in the committed bench):

- the scores are reconstructed rows first, ``(T, B·H, T)``, and the gradient of the probabilities reaches the
  softmax backward as ``(B·H, T, T)``; the softmax backward then copies one of them (an n×n pass) and works on
  mixed layouts. Here the gradient of the probabilities is written straight into the rows-first layout.
- the gradient of the exact scores goes back to QKᵀ through a fresh zero n×n tensor (``gather``'s backward);
  under glibc's default malloc that is a page-faulting allocation of B·H·n² values. Here the memory of the
  scores' gradient, no longer needed by then, is zeroed and reused.
- W = [I | Rᵀ] is rebuilt under autograd, and its backward scatters into another (n, k, n) zero tensor; here it is
  built without autograd and R's gradient is gathered from W's.

The numbers and gradients are the reference kernel's (tested in float64 against ``gather``).
"""

from __future__ import annotations

import torch

from .partial_scores import PatternLayout, _bias_full, _masked_keys, _reconstruction_matrix_for, check_length, masked_at_p

__all__ = ["per_query_fused_attention", "rows_first_attention"]


def _scatter_to_complement(full: torch.Tensor, layout: PatternLayout, t: int, dim_k: bool) -> torch.Tensor:
    """A gradient in key order, ``(T, k, T)`` (W) or ``(T, T)`` (bias), to R's ``(n, n−k, k)`` or the bias's
    ``(n, n−k)``: the entries at P̄_i, zero for rows and keys beyond the input."""
    n, k = layout.indices.shape
    comp = layout.complement  # (n, n-k)
    if dim_k:
        padded = full.new_zeros(n, k, n)
        padded[:t, :, :t] = full
        return padded.gather(-1, comp[:, None, :].expand(n, k, n - k)).transpose(1, 2)  # (n, n-k, k)
    padded = full.new_zeros(n, n)
    padded[:t, :t] = full
    return padded.gather(-1, comp)  # (n, n-k)


# Under glibc's default malloc every fresh n×n tensor above the mmap threshold costs page faults (at n = 512,
# B = 8, H = 12: 100 MB, ~20 ms each), so the forward and the backward each allocate one and work in it in place.
# CPU's softmax kernels read a row before writing it, so their output may alias their input (tested in float64);
# elsewhere they run out of place.
def _softmax_in_place(scores: torch.Tensor) -> torch.Tensor:
    if scores.device.type != "cpu":
        return torch.softmax(scores, dim=-1)
    return torch.ops.aten._softmax.out(scores, -1, False, out=scores)


def _softmax_backward_in_place(grad: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    if grad.device.type != "cpu":
        return torch._softmax_backward_data(grad, probs, -1, probs.dtype)
    return torch.ops.aten._softmax_backward_data.out(grad, probs, -1, probs.dtype, grad_input=grad)


def _forward(query, key, value, w, bias_full, additive, zero_at, indices, scaling, dropout):
    """The forward, without autograd: ``(B, H, T, D)`` -> ``(B·H, T, Dv)`` output and what the backward needs.

    ``w``: W ``(n, k, n)``; ``bias_full``: the bias in key order ``(n, n)`` or None; ``indices``: P ``(n, k)``."""
    b, h, t, d = query.shape
    k = indices.shape[1]
    bh = b * h
    # Keys beyond the input (t < n) score zero: they are selected at position t-1 and zeroed with `zero_at`.
    index = indices[:t].clamp(max=t - 1).expand(bh, t, k)  # (B·H, T, k)
    # Copies of a model's views (as eager's matmul makes them); Kᵀ contiguous: QKᵀ ran 20 % faster than
    # with K transposed in the GEMM (n = 512, 2-core CPU).
    q3, k3t = query.reshape(bh, t, d), key.transpose(2, 3).reshape(bh, d, t)  # (B·H, T, D), (B·H, D, T)
    v3 = value.reshape(bh, t, value.shape[-1])  # (B·H, T, Dv)
    dense = torch.bmm(q3, k3t)  # (B·H, T, T): the one n×n buffer of the forward
    exact = dense.gather(-1, index).mul_(scaling)  # (B·H, T, k)
    if zero_at is not None:
        exact.view(b, h, t, k).masked_fill_(zero_at, 0.0)  # masked keys enter R with score zero
    rows = exact.transpose(0, 1).contiguous()  # (T, B·H, k): one bmm over rows
    w = w[:t, :, :t]  # (T, k, T)
    scores = torch.bmm(rows, w, out=dense.view(t, bh, t))  # (T, B·H, T), in the memory of QKᵀ
    if bias_full is not None:
        scores += bias_full[:t, None, :t]
    if additive is not None:
        scores.view(t, b, h, t).add_(additive.permute(2, 0, 1, 3))  # (T, B|1, 1|H, T)
    probs = _softmax_in_place(scores)  # (T, B·H, T)
    keep = None
    if dropout > 0.0:
        keep = torch.empty_like(probs).bernoulli_(1.0 - dropout).bool()  # (T, B·H, T)
        kept = probs * keep / (1.0 - dropout)
    else:
        kept = probs
    out = torch.bmm(kept.transpose(0, 1), v3)  # (B·H, T, Dv)
    return out, (q3, k3t, v3, rows, w, probs, keep, index)


def rows_first_attention(query, key, value, attention_mask, layout, w, bias_full, scaling, dropout=0.0):
    """The same forward without autograd (inference, or a group of pairs of it): ``(B, H, T, D)`` ->
    ``(output (B, T, H, Dv), probabilities (B, H, T, T), a view of the rows-first ones)``."""
    t, n = query.shape[2], layout.indices.shape[0]
    check_length(t, n)
    additive, masked = _masked_keys(attention_mask, t, query.dtype)
    zero_at = masked_at_p(masked, layout.indices, t)  # (B|1, 1|H, T, k) or None
    b, h = query.shape[:2]
    out, saved = _forward(query, key, value, w, bias_full, additive, zero_at, layout.indices, scaling, dropout)
    probs = saved[5] if saved[6] is None else saved[5] * saved[6] / (1.0 - dropout)  # after dropout, as eager's
    return out.view(b, h, t, -1).transpose(1, 2).contiguous(), probs.view(t, b, h, t).permute(1, 2, 0, 3)


class _PerQueryFused(torch.autograd.Function):
    """Exact scores by QKᵀ then select P, full rows by one batched matmul with W, mask, softmax, dropout, ·V."""

    @staticmethod
    def forward(ctx, query, key, value, reconstruction, bias, layout, additive, zero_at, scaling, dropout):
        w = _reconstruction_matrix_for(layout, reconstruction, query.dtype, fresh=reconstruction.requires_grad)
        bias_full = _bias_full(layout, bias, query.dtype, query.device)
        out, saved = _forward(query, key, value, w, bias_full, additive, zero_at, layout.indices, scaling, dropout)
        ctx.save_for_backward(*saved, zero_at)
        b, h, t, d = query.shape
        ctx.layout, ctx.scaling, ctx.dropout, ctx.shape = layout, scaling, dropout, (b, h, t, d, value.shape[-1])
        ctx.dtypes = (reconstruction.dtype, None if bias is None else bias.dtype)
        return out.view(b, h, t, -1)  # (B, H, T, Dv)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q3, k3t, v3, rows, w, probs, keep, index, zero_at = ctx.saved_tensors
        b, h, t, d, dv = ctx.shape
        bh = b * h
        need_q, need_k, need_v, need_r, need_bias = ctx.needs_input_grad[:5]
        g3 = grad_out.reshape(bh, t, dv)  # (B·H, T, Dv)
        grad_v = None
        if need_v:
            kept = probs if keep is None else probs * keep / (1.0 - ctx.dropout)
            grad_v = torch.bmm(kept.permute(1, 2, 0), g3).view(b, h, t, dv)  # (B·H, T, Dv) -> (B, H, T, Dv)
            del kept
        grad_p = probs.new_empty(probs.shape)  # (T, B·H, T), written through its (B·H, T, T) view
        torch.bmm(g3, v3.transpose(1, 2), out=grad_p.transpose(0, 1))
        if keep is not None:
            grad_p.mul_(keep).div_(1.0 - ctx.dropout)
        grad_s = _softmax_backward_in_place(grad_p, probs)  # (T, B·H, T)
        grad_r = grad_bias = None
        if need_r:
            grad_w = torch.bmm(rows.transpose(1, 2), grad_s)  # (T, k, T)
            grad_r = _scatter_to_complement(grad_w, ctx.layout, t, True).to(ctx.dtypes[0])
        if need_bias:
            grad_bias = _scatter_to_complement(grad_s.sum(1), ctx.layout, t, False).to(ctx.dtypes[1])
        grad_q = grad_k = None
        if need_q or need_k:
            grad_exact = torch.bmm(grad_s, w.transpose(1, 2)).transpose(0, 1).mul_(ctx.scaling)  # (B·H, T, k)
            if zero_at is not None:
                grad_exact.view(b, h, t, -1).masked_fill_(zero_at, 0.0)
            # The gradient of QKᵀ, (B·H, T, T), in the memory of grad_s (read for the last time above).
            grad_dense = grad_s.view(bh, t, t).zero_().scatter_add_(-1, index, grad_exact)
            if need_q:
                grad_q = torch.bmm(grad_dense, k3t.transpose(1, 2)).view(b, h, t, d)
            if need_k:
                grad_k = torch.bmm(grad_dense.transpose(1, 2), q3).view(b, h, t, d)
        return grad_q, grad_k, grad_v, grad_r, grad_bias, None, None, None, None, None


def per_query_fused_attention(query, key, value, attention_mask, layout, reconstruction, bias, scaling,
                              dropout=0.0):
    """Partial attention with autograd: ``(B, H, T, D)`` -> ``(B, T, H, D)``, no attention map; for patterns
    without shared key blocks (`partial_scores.block_rows` is None), where it is faster than autograd through
    `partial_attention._fused_group`. ``attention_mask`` as in `partial_attention.partial_attention_forward`;
    ``dropout``: the probability of dropping an attention probability (0 outside training)."""
    t, n = query.shape[2], layout.indices.shape[0]
    check_length(t, n)
    additive, masked = _masked_keys(attention_mask, t, query.dtype)
    zero_at = masked_at_p(masked, layout.indices, t)  # (B|1, 1|H, T, k) or None
    out = _PerQueryFused.apply(query, key, value, reconstruction, bias, layout, additive, zero_at, scaling, dropout)
    return out.transpose(1, 2).contiguous()  # (B, T, H, D)

"""A fused partial-attention kernel in Triton (``partial_implementation="triton"``): the n×n scores are never
written to memory, forward or backward.

Returns no attention map (like SDPA): the dispatcher runs the reference kernel when the map is asked for. How the
kernel tiles its work, and which inputs it takes, is `triton_partial_attention`'s docstring.

Runs on CUDA GPUs; with ``TRITON_INTERPRET=1`` set before the first call, Triton's interpreter runs it on CPU
tensors (slow: that is how the tests check it).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .attention_common import PartialTensors, bias_in_key_order, check_length, masked_at_p, masked_keys

__all__ = ["triton_attention", "triton_partial_attention", "triton_available", "TritonUnavailable"]


class TritonUnavailable(RuntimeError):
    """The triton kernel cannot run here (no triton, or no GPU without the interpreter)."""


try:  # triton is optional: the remote-code loader ignores imports inside try blocks
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_available(device: torch.device | str = "cuda") -> tuple[bool, str]:
    """(whether the kernel can run on `device`, why not)."""
    if triton is None:
        return False, "triton is not installed (pip install triton)"
    if torch.device(device).type == "cuda":
        return (True, "") if torch.cuda.is_available() else (False, "no CUDA GPU is available")
    if _interpreting() and _INTERPRETED:
        return True, ""
    return False, (f"tensors are on {torch.device(device).type}: the triton kernel needs a CUDA GPU (or "
                   "TRITON_INTERPRET=1 set before hf_partial_attention.attention_triton is imported, to run it on CPU "
                   "for testing)")


# Triton reads TRITON_INTERPRET when a kernel is defined, i.e. when this module is imported.
_INTERPRETED = _interpreting()

if triton is not None:
    @triton.jit
    def _exact(q_ptr, k_ptr, idx_ptr, msel_ptr, rows, row_ok, m_ok, T, scale, sq_t, sk_t, si_n, sms_t, sms_m,
               HAS_MSEL: tl.constexpr, D: tl.constexpr, KP: tl.constexpr):
        """Exact scores at P of BLOCK_M rows: (BLOCK_M, KP), and the gathered keys (BLOCK_M, KP, D)."""
        d = tl.arange(0, D)
        q = tl.load(q_ptr + rows[:, None] * sq_t + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        idx = tl.load(idx_ptr + rows[:, None] * si_n + tl.arange(0, KP)[None, :],
                      mask=row_ok[:, None] & m_ok[None, :], other=0)
        key_ok = row_ok[:, None] & m_ok[None, :] & (idx < T)  # keys beyond the input are zero
        ksel = tl.load(k_ptr + idx[:, :, None] * sk_t + d[None, None, :], mask=key_ok[:, :, None],
                       other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * ksel, axis=2) * scale
        if HAS_MSEL:  # masked keys enter R with score zero
            ms = tl.load(msel_ptr + rows[:, None] * sms_t + tl.arange(0, KP)[None, :] * sms_m,
                         mask=row_ok[:, None] & m_ok[None, :], other=0)
            s = tl.where(ms != 0, 0.0, s)
        else:
            ms = tl.zeros_like(idx)
        return q, idx, key_ok, ksel, s, ms

    @triton.jit
    def _scores(s, w_ptr, bias_ptr, mask_ptr, rows, row_ok, m_ok, cols, T, sw_n, sw_m, sb_n, smk_t,
                HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, KP: tl.constexpr):
        """Reconstructed, biased and masked scores of one (BLOCK_M, BLOCK_N) tile; -inf beyond the input."""
        col_ok = cols < T
        m = tl.arange(0, KP)
        w = tl.load(w_ptr + rows[:, None, None] * sw_n + m[None, :, None] * sw_m + cols[None, None, :],
                    mask=row_ok[:, None, None] & m_ok[None, :, None] & col_ok[None, None, :], other=0.0)
        a = tl.sum(s[:, :, None] * w.to(tl.float32), axis=1)
        if HAS_BIAS:
            a += tl.load(bias_ptr + rows[:, None] * sb_n + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                         other=0.0).to(tl.float32)
        if HAS_MASK:
            a += tl.load(mask_ptr + rows[:, None] * smk_t + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                         other=0.0).to(tl.float32)
        return tl.where(col_ok[None, :], a, float("-inf")), w

    @triton.jit
    def forward(q_ptr, k_ptr, v_ptr, idx_ptr, w_ptr, bias_ptr, mask_ptr, msel_ptr, o_ptr, lse_ptr,
                T, H, k, scale, s_bh, si_n, sw_n, sw_m, sb_n, smk_b, smk_h, smk_t, sms_b, sms_h, sms_t, sms_m,
                HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_MSEL: tl.constexpr, D: tl.constexpr,
                KP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
        pid_m, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok, m_ok = rows < T, tl.arange(0, KP) < k
        base = bh * s_bh  # q, k, v, o are contiguous (B, H, T, D)
        _, _, _, _, s, _ = _exact(q_ptr + base, k_ptr + base, idx_ptr, msel_ptr + b * sms_b + h * sms_h, rows,
                                  row_ok, m_ok, T, scale, D, D, si_n, sms_t, sms_m, HAS_MSEL, D, KP)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        d = tl.arange(0, D)
        for n0 in range(0, T, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            a, _ = _scores(s, w_ptr, bias_ptr, mask_ptr + b * smk_b + h * smk_h, rows, row_ok, m_ok, cols, T,
                           sw_n, sw_m, sb_n, smk_t, HAS_BIAS, HAS_MASK, KP)
            m_new = tl.maximum(m_i, tl.max(a, axis=1))
            p = tl.exp(a - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            v = tl.load(v_ptr + base + cols[:, None] * D + d[None, :], mask=(cols < T)[:, None], other=0.0)
            if DOT_F32:  # Triton's interpreter gets bfloat16 tl.dot wrong (3.9.0): float32 there
                pv = tl.dot(p, v.to(tl.float32))
            else:  # on the GPU, P·V in the input dtype on the tensor cores, accumulated in float32
                pv = tl.dot(p.to(v.dtype), v).to(tl.float32)
            acc = acc * alpha[:, None] + pv
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(o_ptr + base + rows[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.store(lse_ptr + bh * T + rows, m_i + tl.log(l_i), mask=row_ok)

    @triton.jit
    def backward(q_ptr, k_ptr, v_ptr, idx_ptr, w_ptr, bias_ptr, mask_ptr, msel_ptr, do_ptr, lse_ptr, delta_ptr,
                 dq_ptr, dk_ptr, dv_ptr, dw_ptr, dbias_ptr,
                 T, H, k, scale, s_bh, si_n, sw_n, sw_m, sb_n, smk_b, smk_h, smk_t, sms_b, sms_h, sms_t, sms_m,
                 HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_MSEL: tl.constexpr, D: tl.constexpr,
                 KP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_m, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok, m_ok = rows < T, tl.arange(0, KP) < k
        base = bh * s_bh
        q, idx, key_ok, ksel, s, ms = _exact(q_ptr + base, k_ptr + base, idx_ptr, msel_ptr + b * sms_b + h * sms_h,
                                             rows, row_ok, m_ok, T, scale, D, D, si_n, sms_t, sms_m, HAS_MSEL, D, KP)
        d = tl.arange(0, D)
        m = tl.arange(0, KP)
        do = tl.load(do_ptr + base + rows[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        lse = tl.load(lse_ptr + bh * T + rows, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + bh * T + rows, mask=row_ok, other=0.0)
        ds = tl.zeros((BLOCK_M, KP), tl.float32)
        for n0 in range(0, T, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < T
            a, w = _scores(s, w_ptr, bias_ptr, mask_ptr + b * smk_b + h * smk_h, rows, row_ok, m_ok, cols, T,
                           sw_n, sw_m, sb_n, smk_t, HAS_BIAS, HAS_MASK, KP)
            p = tl.where(row_ok[:, None], tl.exp(a - lse[:, None]), 0.0)
            v = tl.load(v_ptr + base + cols[:, None] * D + d[None, :], mask=col_ok[:, None], other=0.0)
            dp = tl.dot(do.to(tl.float32), tl.trans(v.to(tl.float32)))
            da = p * (dp - delta[:, None])  # gradient of the pre-softmax scores of this tile
            tl.atomic_add(dv_ptr + base + cols[:, None] * D + d[None, :],
                          tl.dot(tl.trans(p), do.to(tl.float32)), mask=col_ok[:, None])
            ds += tl.sum(w.to(tl.float32) * da[:, None, :], axis=2)
            tile_ok = row_ok[:, None, None] & m_ok[None, :, None] & col_ok[None, None, :]
            tl.atomic_add(dw_ptr + rows[:, None, None] * sw_n + m[None, :, None] * sw_m + cols[None, None, :],
                          s[:, :, None] * da[:, None, :], mask=tile_ok)
            if HAS_BIAS:
                tl.atomic_add(dbias_ptr + rows[:, None] * sb_n + cols[None, :], da,
                              mask=row_ok[:, None] & col_ok[None, :])
        ds = tl.where(ms != 0, 0.0, ds) * scale  # a masked key's exact score was a constant zero
        dq = tl.sum(ds[:, :, None] * ksel, axis=1)
        tl.store(dq_ptr + base + rows[:, None] * D + d[None, :], dq, mask=row_ok[:, None])
        tl.atomic_add(dk_ptr + base + idx[:, :, None] * D + d[None, None, :], ds[:, :, None] * q[:, None, :],
                      mask=key_ok[:, :, None])



def _kernels():
    if triton is None:
        raise TritonUnavailable("partial_implementation='triton' needs triton (pip install triton).")
    return triton, forward, backward


def _pow2(x: int) -> int:
    """The next power of two (tl.arange needs one): the kernels mask the padded key slots."""
    return 1 << (int(x) - 1).bit_length()


def _strides(t: torch.Tensor | None, dims: int) -> list[int]:
    """Strides of a broadcastable tensor, 0 along its size-1 dims; zeros when absent."""
    if t is None:
        return [0] * dims
    return [0 if size == 1 else stride for size, stride in zip(t.shape, t.stride())]


class _TritonPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, w, bias_full, add_mask, msel, idx, scaling, blocks):
        triton, fwd, _ = _kernels()
        bsz, heads, t, d = q.shape
        kk = idx.shape[1]
        out = torch.empty_like(q)
        lse = torch.empty(bsz, heads, t, dtype=torch.float32, device=q.device)
        block_m, block_n = blocks
        grid = (triton.cdiv(t, block_m), bsz * heads)
        dummy = w  # any tensor: pointers of absent inputs are never read (constexpr flags)
        fwd[grid](q, k, v, idx, w, bias_full if bias_full is not None else dummy,
                  add_mask if add_mask is not None else dummy, msel if msel is not None else idx, out, lse,
                  t, heads, kk, scaling, t * d, idx.stride(0), w.stride(0), w.stride(1),
                  bias_full.stride(0) if bias_full is not None else 0, *_strides(add_mask, 4)[:3],
                  *_strides(msel, 4), HAS_BIAS=bias_full is not None, HAS_MASK=add_mask is not None,
                  HAS_MSEL=msel is not None, D=d, KP=_pow2(kk), BLOCK_M=block_m, BLOCK_N=block_n,
                  DOT_F32=_INTERPRETED)
        ctx.save_for_backward(q, k, v, w, bias_full, add_mask, msel, idx, out, lse)
        ctx.scaling, ctx.blocks = scaling, blocks
        return out

    @staticmethod
    def backward(ctx, grad_out):
        triton, _, bwd = _kernels()
        q, k, v, w, bias_full, add_mask, msel, idx, out, lse = ctx.saved_tensors
        bsz, heads, t, d = q.shape
        grad_out = grad_out.contiguous()
        delta = (grad_out.float() * out.float()).sum(-1)  # (B, H, T): rowsum(dO ∘ O)
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        dw = torch.zeros(w.shape, dtype=torch.float32, device=q.device)
        dbias = torch.zeros(bias_full.shape, dtype=torch.float32, device=q.device) if bias_full is not None else dw
        block_m, block_n = ctx.blocks
        grid = (triton.cdiv(t, block_m), bsz * heads)
        bwd[grid](q, k, v, idx, w, bias_full if bias_full is not None else w, add_mask if add_mask is not None else w,
                  msel if msel is not None else idx, grad_out, lse, delta, dq, dk, dv, dw, dbias,
                  t, heads, idx.shape[1], ctx.scaling, t * d, idx.stride(0), w.stride(0), w.stride(1),
                  bias_full.stride(0) if bias_full is not None else 0, *_strides(add_mask, 4)[:3],
                  *_strides(msel, 4), HAS_BIAS=bias_full is not None, HAS_MASK=add_mask is not None,
                  HAS_MSEL=msel is not None, D=d, KP=_pow2(idx.shape[1]), BLOCK_M=block_m, BLOCK_N=block_n)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dw.to(w.dtype),
                dbias.to(bias_full.dtype) if bias_full is not None else None, None, None, None, None, None)


def triton_partial_attention(query, key, value, w, bias_full, additive_mask, masked_at_p, indices, scaling,
                             blocks: tuple[int, int] = (32, 32)) -> torch.Tensor:
    """``(B, H, T, D)`` output of partial attention by the fused kernel (differentiable in Q, K, V, W, bias).

    Per tile of BLOCK_M query rows and each (batch, head), one program computes the k exact scores of every row at
    its P_i (gathered keys, k·d multiply-adds per row), then walks the keys in tiles of BLOCK_N: the reconstructed
    scores ``a_i = s_i W_i (+ bias, + mask)`` with ``W_i = [I | R_iᵀ]`` in key order (the same W the ``fused``
    kernel uses), an online softmax and ``P·V``. It stores the output and each row's log-sum-exp. The backward
    recomputes the scores tile by tile from the log-sum-exp (as FlashAttention does) and accumulates dQ, dK, dV,
    dW (hence dR, by autograd through W) and the bias gradient; keys shared by several row tiles, and W shared by
    every batch and head, are accumulated with atomic adds in float32.

    Works for any P (per-query included) and any R mode; the exact scores at masked keys enter R as zero, keys
    beyond a shorter input are dropped, exactly as in the reference kernel (`attention_gather`).
    Inputs in float32, bfloat16 or float16 (accumulation in float32); attention dropout is not supported (set
    ``attention_probs_dropout_prob=0`` or evaluate with ``model.eval()``).

    Args:
        query, key, value: ``(B, H, T, D)``, D a power of two >= 16.
        w: ``(n, k, n)`` W in key order (`attention_common.reconstruction_matrix`); bias_full ``(n, n)`` or None.
        additive_mask: ``(B|1, H|1, T, T)`` float or None; masked_at_p: ``(B|1, H|1, T, k)`` bool or None (the
            keys of P that are masked: their exact score enters R as zero).
        indices: P, ``(n, k)``. blocks: (BLOCK_M, BLOCK_N), powers of two >= 16.
    """
    ok, why = triton_available(query.device)
    if not ok:
        raise TritonUnavailable(f"partial_implementation='triton': {why}.")
    d = query.shape[-1]
    if d < 16 or d & (d - 1):
        raise ValueError(f"The triton kernel needs a head size that is a power of two >= 16, got {d}; use "
                         "partial_implementation='fused'.")
    if any(b < 16 or b & (b - 1) for b in blocks):
        raise ValueError(f"blocks must be powers of two >= 16, got {blocks}.")
    q, k, v = (x.contiguous() for x in (query, key, value))
    idx = indices.to(torch.int32).contiguous()
    msel = None if masked_at_p is None else masked_at_p.to(torch.int8)
    return _TritonPartial.apply(q, k, v, w.contiguous(), None if bias_full is None else bias_full.contiguous(),
                                additive_mask, msel, idx, float(scaling), tuple(blocks))


def triton_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0, *,
                     partial: PartialTensors, extra: torch.Tensor | None = None, **kwargs
                     ) -> tuple[torch.Tensor, None]:
    """Partial attention by the Triton kernel, in transformers' calling convention (arguments as
    `attention_gather.gather_attention`): ``(output (B, T, H, D), None)``; no attention dropout, and no score terms
    beyond q·k (``extra``: DeBERTa's position terms)."""
    if extra is not None:
        raise ValueError("partial_implementation='triton' scores q·k only; this model's scores have other terms at P "
                         "(DeBERTa-v2's position terms): use partial_implementation='fused' (or 'auto', which does).")
    scaling = module.scaling if scaling is None else scaling
    layout = partial.layout
    if module.training and dropout > 0:
        raise ValueError(f"partial_implementation='triton' has no attention dropout (got p={dropout} in training); "
                         "set config.attention_probs_dropout_prob=0, or use partial_implementation='fused'.")
    t = query.shape[2]
    check_length(t, layout.indices.shape[0])
    additive, masked = masked_keys(attention_mask, t, torch.float32)
    zero_at = None
    if masked is not None:
        zero_at = masked_at_p(masked, layout.indices, t)  # (B|1, 1|H, T, k)
        additive = additive if additive.stride(-1) == 1 else additive.contiguous()
    w = partial.matrix(torch.float32)  # (n, k, n), float32 whatever the input
    bias_full = bias_in_key_order(layout, partial.bias, torch.float32, query.device)
    out = triton_partial_attention(query, key, value, w, bias_full, additive, zero_at, layout.indices, scaling)
    return out.transpose(1, 2).contiguous(), None  # (B, T, H, D)

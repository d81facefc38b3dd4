"""The ``tiled`` kernel: partial attention in cache-sized tiles, fast when blocks of rows share P and R.

Part of the remote-code bundle (imports: torch and siblings only).

When the r rows of a block share their key set P_b and their reconstruction R_b (`shared_rows`; the
``shared_blocks`` pattern family is built that way), every step of a block is a plain matrix product:
exact scores ``E_b = Q_b K_{P_b}ᵀ`` ``(r, k)``, full scores ``E_b W_b`` with ``W_b = [I | R_bᵀ]`` in key order
``(k, n)``, softmax, ``· V``. The kernel runs them tile by tile — one block of rows for a group of (batch, head)
pairs whose scores fit in a few MiB, each group through all its blocks before the next so that its V stays in
cache — so that the n×n scores of a tile are reconstructed, masked, normalised
and multiplied by V while they are still in cache, and the full attention map is never written unless it is
asked for (``need_weights``). On a 2-core CPU that is what turns the saved multiply-adds into time:
reading and writing the n×n scores, not the arithmetic, bounds the other kernels.

It is exact for any P and R (a block of one row is every pattern), and its numbers and gradients equal the
reference kernel's; it is only fast when the shared blocks are large (`auto_implementation` decides).
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn

__all__ = ["TILE_ELEMENTS", "needs_grad", "normalised_in_place", "shared_rows", "softmax_in_place", "tie_rows",
           "tiled_attention"]

# Scores per tile (float32: 2 MiB): large enough for efficient GEMMs, small enough to stay in a core's L2/L3
# while the tile is reconstructed, normalised and multiplied by V (measured on a 2-core EPYC, 2 MiB L2).
TILE_ELEMENTS = 1 << 19


# CPU's softmax kernels read a row before writing it, so their output may alias their input (tested in float64,
# against the reference kernel, through `tiled` and `fused`); elsewhere they run out of place.
def softmax_in_place(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, written into ``scores`` on CPU (a new tensor elsewhere); no autograd."""
    if scores.device.type != "cpu":
        return torch.softmax(scores, dim=-1)
    return torch.ops.aten._softmax.out(scores, -1, False, out=scores)


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will record an op on these tensors (grad mode on and one of them requires grad): the one
    test the kernels use to choose between their autograd and their in-place paths."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# shared_rows of R tensors by id, rechecked when R or P changes (version counters and storage).
_SHARED: dict[int, tuple] = {}


def _shared_rows(indices: torch.Tensor, reconstruction: torch.Tensor) -> int:
    n = indices.shape[0]
    if n < 2:
        return 1
    same = (indices[1:] == indices[:-1]).all(-1)  # (n-1,): row j+1 has row j's P
    same &= (reconstruction[1:] == reconstruction[:-1]).flatten(1).all(-1)  # ... and its R
    breaks = (~same).nonzero().flatten().add(1).tolist()  # rows that start a new (P, R)
    for rows in sorted((r for r in range(1, n + 1) if n % r == 0), reverse=True):
        if all(b % rows == 0 for b in breaks):
            return rows
    return 1


def shared_rows(indices: torch.Tensor, reconstruction: torch.Tensor) -> int:
    """The largest r dividing n such that each block of r consecutive rows shares one P and one R (1: none).

    Cached per R tensor until R or P is modified (an optimizer step, ``copy_``), so a frozen or slowly changing
    R is compared once, not at every call. Under ``torch.compile`` / ``torch.export`` (which cannot branch on
    tensor values) it answers 1: every kernel is exact with blocks of one row, only not as fast.
    """
    if torch.compiler.is_compiling():
        return 1
    stamp = (reconstruction.data_ptr(), reconstruction._version, indices.data_ptr(), indices._version,
             tuple(reconstruction.shape))
    key = id(reconstruction)
    cached = _SHARED.get(key)
    if cached is None or cached[0]() is not reconstruction or cached[1] != stamp:
        with torch.no_grad():
            rows = _shared_rows(indices, reconstruction.detach())
        ref = weakref.ref(reconstruction, lambda _, key=key: _SHARED.pop(key, None))
        cached = _SHARED[key] = (ref, stamp, rows)
    return cached[2]


class _TieRows(torch.autograd.Function):
    """Identity forward; backward gives every row of a block of ``rows`` the block's summed gradient."""

    @staticmethod
    def forward(ctx, tensor, rows):
        ctx.rows = rows
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        n = grad.shape[0]
        blocks = grad.reshape(n // ctx.rows, ctx.rows, *grad.shape[1:])  # (n / rows, rows, ...)
        return blocks.sum(1, keepdim=True).expand_as(blocks).reshape(grad.shape), None


def tie_rows(reconstruction: torch.Tensor, rows: int) -> torch.Tensor:
    """R, whose gradient is summed over each block of ``rows`` rows and given to every row of the block (the
    gradient of one R per block): R that starts shared stays shared under elementwise optimizers."""
    if rows <= 1 or not needs_grad(reconstruction):
        return reconstruction
    return _TieRows.apply(reconstruction, rows)


class _RowSharedMatmul(torch.autograd.Function):
    """``e_i @ w_i`` for the rows i of a block whose ``w_i`` are all equal: one GEMM with ``w_0`` forward; the
    backward gives each row its own gradient ``Σ_bh e_iᵀ dS_i`` (the reference kernel's, not the block's sum)."""

    @staticmethod
    def forward(ctx, e, w_rows):  # e (..., r, k), w_rows (r, k, T)
        ctx.save_for_backward(e, w_rows)
        return torch.matmul(e, w_rows[0])  # (..., r, T)

    @staticmethod
    def backward(ctx, grad):
        e, w_rows = ctx.saved_tensors
        grad_e = torch.matmul(grad, w_rows[0].transpose(0, 1)) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            r, k = e.shape[-2:]
            e_rows = e.reshape(-1, r, k).transpose(0, 1)  # (r, B·H, k)
            g_rows = grad.reshape(-1, r, grad.shape[-1]).transpose(0, 1)  # (r, B·H, T)
            grad_w = torch.bmm(e_rows.transpose(1, 2), g_rows)  # (r, k, T)
        return grad_e, grad_w


def _split(tensor: torch.Tensor | None, sizes: int, dim: int, count: int) -> list:
    """``tensor.split(sizes, dim)``, or ``count`` times the tensor itself where it broadcasts along ``dim``."""
    if tensor is None:
        return [None] * count
    if tensor.shape[dim] == 1:
        return [tensor] * count
    return list(tensor.split(sizes, dim))


def _broadcast_slice(group: tuple[slice, slice], tensor: torch.Tensor) -> tuple[slice, slice]:
    """The (batch, head) slices of ``group`` for a tensor ``(B|1, H|1, ...)``: whole where it broadcasts."""
    return tuple(g if size > 1 else slice(None) for g, size in zip(group, tensor.shape[:2]))


def _tile_sizes(b: int, h: int, rows: int, t: int, tile: int) -> tuple[int, int]:
    """(batch, heads) per tile so that a tile holds about ``tile`` scores of ``rows`` × ``t``."""
    pairs = max(1, tile // max(rows * t, 1))
    if pairs >= h:
        return max(1, min(b, pairs // h)), h
    return 1, pairs


def _buffer(flat: torch.Tensor, lead: torch.Size, last: int) -> torch.Tensor:
    """The first values of a flat buffer as a ``(*lead, last)`` tensor (the tiles at the edges are smaller)."""
    return flat[:math.prod(lead) * last].view(*lead, last)


def normalised_in_place(scores: torch.Tensor, bias: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
    """``softmax(scores + bias + mask)`` over the last dimension, written into ``scores`` on CPU (bias and mask
    broadcast to it, or None); no autograd. The in-place step of the ``tiled`` and ``fused`` kernels."""
    if bias is not None:
        scores += bias
    if mask is not None:
        scores += mask
    return softmax_in_place(scores)


def tiled_attention(query, key, value, exact, additive, w_rows, bias_full, rows: int, *, dropout: float = 0.0,
                    training: bool = False, need_weights: bool = True, tile: int | None = None):
    """Reconstruction, mask, softmax and ·V tile by tile.

    Args:
        query, key, value: ``(B, H, T, D)`` (query and key only fix shapes here: ``exact`` holds their scores).
        exact: ``(B, H, T, k)`` exact scores at P (scaled, zero at masked keys).
        additive: ``None`` or the additive mask ``(B|1, 1|H, T, T)``.
        w_rows: ``(n, k, n)`` W of every row (`partial_scores.reconstruction_matrix`); rows of one block of
            ``rows`` must be equal (`shared_rows`).
        bias_full: ``None`` or ``(n, n)`` bias in key order (zero at P).
        need_weights: also return the attention probabilities ``(B, H, T, T)`` (else ``None``: they are the one
            n×n tensor the tiles otherwise never write).

    Returns:
        ``(output (B, T, H, D), probabilities or None)``.
    """
    b, h, t, d = query.shape
    tile = TILE_ELEMENTS if tile is None else tile
    nb = -(-t // rows)  # blocks of rows covering the input
    bc, hc = _tile_sizes(b, h, rows, t, tile)
    trainable_w = needs_grad(w_rows)
    w_blocks = w_rows[:t, :, :t].split(rows, 0)  # per block (r, k, T); the last may hold fewer rows
    bias_blocks = _split(None if bias_full is None else bias_full[:t, :t], rows, 0, nb)  # per block (r, T)
    # Without autograd each tile's output is copied into its place in (B, T, H, D) (the kernel's output layout);
    # with autograd the tiles are concatenated.
    direct = not needs_grad(exact, value, w_rows, bias_full)
    if direct:
        value = value.contiguous()  # once: a strided V (a model's transposed projection) would be copied per tile
    out = value.new_empty(b, t, h, d) if direct else None  # (B, T, H, D)
    # Without autograd and without the map, every tile's scores are reconstructed, masked and normalised in one
    # buffer, which stays in cache, instead of a fresh tensor per step.
    buffers = (value.new_empty(bc * hc * rows * t), value.new_empty(bc * hc * rows * d)) \
        if direct and not need_weights else None
    out_b, prob_b = [], []
    # Loop order: each group of (batch, head) pairs runs all its blocks of rows before the next group, so that the
    # group's V and exact scores stay in cache while its blocks are reconstructed, normalised and multiplied by V.
    for b0 in range(0, b, bc):
        out_h, prob_h = [], []
        for h0 in range(0, h, hc):
            group = (slice(b0, b0 + bc), slice(h0, h0 + hc))
            v_t = value[group]  # (bc, hc, T, D)
            mask_blocks = _split(None if additive is None else additive[_broadcast_slice(group, additive)],
                                 rows, 2, nb)  # per block (bc|1, hc|1, r, T)
            out_g, prob_g = [], []
            for g, e_t in enumerate(exact[group].split(rows, 2)):  # e_t (bc, hc, r, k)
                w_g = w_blocks[g]
                if buffers is not None:
                    scores = torch.matmul(e_t, w_g[0], out=_buffer(buffers[0], e_t.shape[:3], t))  # (bc, hc, r, T)
                    probs = normalised_in_place(scores, bias_blocks[g], mask_blocks[g])
                else:
                    scores = _RowSharedMatmul.apply(e_t, w_g) if trainable_w else torch.matmul(e_t, w_g[0])
                    if bias_blocks[g] is not None:
                        scores = scores + bias_blocks[g]
                    if mask_blocks[g] is not None:
                        scores = scores + mask_blocks[g]
                    probs = nn.functional.softmax(scores, dim=-1)  # (bc, hc, r, T)
                probs = nn.functional.dropout(probs, p=dropout, training=training)
                o = torch.matmul(probs, v_t, out=None if buffers is None
                                 else _buffer(buffers[1], probs.shape[:3], d))  # (bc, hc, r, D)
                if direct:
                    out[b0:b0 + bc, g * rows: g * rows + o.shape[2], h0:h0 + hc] = o.transpose(1, 2)
                else:
                    out_g.append(o)
                if need_weights:
                    prob_g.append(probs)
            if not direct:
                out_h.append(torch.cat(out_g, 2) if len(out_g) > 1 else out_g[0])  # (bc, hc, T, D)
            if need_weights:
                prob_h.append(torch.cat(prob_g, 2) if len(prob_g) > 1 else prob_g[0])  # (bc, hc, T, T)
        if not direct:
            out_b.append(torch.cat(out_h, 1) if len(out_h) > 1 else out_h[0])  # (bc, H, T, D)
        if need_weights:
            prob_b.append(torch.cat(prob_h, 1) if len(prob_h) > 1 else prob_h[0])  # (bc, H, T, T)
    probs = (torch.cat(prob_b, 0) if len(prob_b) > 1 else prob_b[0]) if need_weights else None  # (B, H, T, T)
    if direct:
        return out, probs
    out = torch.cat(out_b, 0) if len(out_b) > 1 else out_b[0]  # (B, H, T, D)
    return out.transpose(1, 2).contiguous(), probs

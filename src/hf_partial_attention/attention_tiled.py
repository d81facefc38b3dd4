"""The ``tiled`` kernel, inference only: partial attention in cache-sized tiles, fast when blocks of rows share P
and R (`attention_common.PatternStructure.ROWS_SHARING_P_AND_R`; the ``shared_blocks`` pattern family).

Part of the remote-code bundle (imports: torch and siblings only).

The n×n scores are never written: reading and writing them, not the arithmetic, bounds the other kernels on a CPU.
It is exact for any P and R (a block of one row is every pattern) and equals the reference kernel; it is only fast
when the shared blocks are large. With autograd the dispatcher runs ``fused`` instead (the committed benchmark
results show no training case where a tiled backward is fastest). How it tiles: `tiled_attention`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .attention_common import (PartialTensors, bias_in_key_order, broadcast_slice, masked_exact_scores, needs_grad,
                               normalised_in_place, tile_groups)

__all__ = ["tiled_attention"]


def _split(tensor: torch.Tensor | None, sizes: int, dim: int, count: int) -> list:
    """``tensor.split(sizes, dim)``, or ``count`` times the tensor itself where it broadcasts along ``dim``."""
    if tensor is None:
        return [None] * count
    if tensor.shape[dim] == 1:
        return [tensor] * count
    return list(tensor.split(sizes, dim))


def _buffer(flat: torch.Tensor, lead: torch.Size, last: int) -> torch.Tensor:
    """The first values of a flat buffer as a ``(*lead, last)`` tensor (the tiles at the edges are smaller)."""
    return flat[:math.prod(lead) * last].view(*lead, last)


def tiled_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0, *,
                    partial: PartialTensors, extra: torch.Tensor | None = None, **kwargs
                    ) -> tuple[torch.Tensor, None]:
    """Partial attention by the tiled kernel, in transformers' calling convention (arguments as
    `attention_gather.gather_attention`), without autograd: ``(output (B, T, H, D), None)``.

    When the r rows of a block share their key set P_b and their reconstruction R_b, every step of a block is a plain
    matrix product: exact scores ``E_b = Q_b K_{P_b}ᵀ`` ``(r, k)``, full scores ``E_b W_b`` with ``W_b = [I | R_bᵀ]``
    in key order ``(k, n)``, softmax, ``· V``. The kernel runs them tile by tile — one block of rows for a group of
    (batch, head) pairs (`attention_common.tile_groups`), each group through all its blocks before the next so that
    its V stays in cache — so that the scores of a tile are reconstructed, masked, normalised and multiplied by V
    while they are still in cache, in one reused buffer; the n×n scores are never written."""
    scaling = module.scaling if scaling is None else scaling
    layout = partial.layout
    if needs_grad(query, key, value, partial.reconstruction, partial.bias, attention_mask, extra):
        raise ValueError("partial_implementation='tiled' runs without autograd only (inference); under autograd "
                         "use partial_implementation='fused' (or 'auto', which does).")
    exact, additive = masked_exact_scores(query, key, attention_mask, layout, scaling, True,
                                          extra=extra)  # (B, H, T, k)
    b, h, t, d = query.shape
    rows = layout.shared_rows
    nb = -(-t // rows)  # blocks of rows covering the input
    w_blocks = partial.matrix(exact.dtype)[:t, :, :t].split(rows, 0)  # per block (r, k, T); the last may be shorter
    bias_full = bias_in_key_order(layout, partial.bias, exact.dtype, exact.device)
    bias_blocks = _split(None if bias_full is None else bias_full[:t, :t], rows, 0, nb)  # per block (r, T)
    value = value.contiguous()  # once: a strided V (a model's transposed projection) would be copied per tile
    out = value.new_empty(b, t, h, value.shape[-1])  # (B, T, H, D)
    groups = tile_groups(b, h, rows, t)
    bc, hc = (groups[0][0].stop - groups[0][0].start), (groups[0][1].stop - groups[0][1].start)
    # Every tile's scores are reconstructed, masked and normalised in one buffer, which stays in cache.
    scores_buffer, out_buffer = value.new_empty(bc * hc * rows * t), value.new_empty(bc * hc * rows * value.shape[-1])
    p = dropout if module.training else 0.0
    for group in groups:  # each group runs all its blocks of rows: its V and exact scores stay in cache
        v_t = value[group]  # (bc, hc, T, D)
        mask_blocks = _split(None if additive is None else additive[broadcast_slice(group, additive)],
                             rows, 2, nb)  # per block (bc|1, hc|1, r, T)
        for g, e_t in enumerate(exact[group].split(rows, 2)):  # e_t (bc, hc, r, k)
            scores = torch.matmul(e_t, w_blocks[g][0], out=_buffer(scores_buffer, e_t.shape[:3], t))  # (bc, hc, r, T)
            probs = normalised_in_place(scores, bias_blocks[g], mask_blocks[g])
            probs = nn.functional.dropout(probs, p=p, training=module.training)
            o = torch.matmul(probs, v_t, out=_buffer(out_buffer, probs.shape[:3], v_t.shape[-1]))  # (bc, hc, r, D)
            out[group[0], g * rows: g * rows + o.shape[2], group[1]] = o.transpose(1, 2)
    return out, None

"""Length buckets at run time: each sequence runs the P and R of the smallest bucket that holds it.

A model with ``config.partial_lengths = [b_1, ..., n]`` holds one P and R per bucket; `bucketed_attention` says how
a batch is split by bucket and put back together.

Under ``torch.compile`` / ``torch.export`` (no branching on tensor values) every sequence runs the bucket of the
batch's padded length T instead: one specialisation per bucket, the same numbers as eager for a batch padded to its
longest sequence whose members share that bucket (pad batches to the longest, and group them by length).

Part of the remote-code bundle (imports: torch, transformers and siblings only).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .architectures import architecture_for
from .attention_common import masked_keys, masked_out
from .pattern_buckets import bucket_for

__all__ = ["sequence_lengths", "bucket_groups", "exact_attention", "bucketed_attention"]


def sequence_lengths(attention_mask: torch.Tensor | None, batch: int, t: int) -> torch.Tensor:
    """Each sequence's length ``(B,)``: the last key its queries attend, plus one (``t`` without a mask).

    ``attention_mask``: bool ``(B|1, 1|H, T, T)`` (True = attend) or additive float, as the attention functions get it.
    """
    if attention_mask is None:
        return torch.full((batch,), t, dtype=torch.long)
    attends = ~masked_out(attention_mask)
    attended = attends.any(-2).any(1)  # (B|1, T): keys some query of some head attends
    positions = torch.arange(1, t + 1, device=attended.device)
    lengths = torch.where(attended, positions, 0).amax(-1)  # (B|1,)
    return lengths.expand(batch).to("cpu", torch.long)


def bucket_groups(lengths: list[int], seq_lengths: torch.Tensor, t: int) -> list[tuple[int, torch.Tensor | None]]:
    """``[(bucket, batch rows or None for all)]``: the sequences of each bucket present, in bucket order.

    Under compile/export: one group, the bucket of the padded length ``t`` (see the module docstring)."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return [(bucket_for(lengths, t), None)]
    buckets = torch.tensor(lengths)
    if int(seq_lengths.max()) > lengths[-1]:
        bucket_for(lengths, int(seq_lengths.max()))  # raises, naming the fix
    index = torch.bucketize(seq_lengths, buckets)  # (B,): smallest bucket >= T
    present = torch.unique(index).tolist()
    if len(present) == 1:
        return [(lengths[present[0]], None)]
    return [(lengths[j], (index == j).nonzero().flatten()) for j in present]


def exact_attention(module: nn.Module, query, key, value, attention_mask, scaling: float, dropout: float,
                    need_weights: bool):
    """Dense attention for a bucket of b <= k (nothing to reconstruct): sdpa, or eager when the map is asked for."""
    if not need_weights:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=False)
    additive, _ = masked_keys(attention_mask, query.shape[2], query.dtype)  # eager adds the mask
    eager = architecture_for(module.config).eager_attention()  # the architecture's own
    return eager(module, query, key, value, additive, scaling=scaling, dropout=dropout)


def _rows(tensor: torch.Tensor | None, rows: torch.Tensor | None, t: int, square: bool = False):
    """``tensor`` cut to the group's batch rows and its first ``t`` positions (dim 2; and 3 when ``square``)."""
    if tensor is None:
        return None
    if rows is not None and tensor.shape[0] > 1:
        tensor = tensor.index_select(0, rows.to(tensor.device))
    tensor = tensor[:, :, :t]
    return tensor[..., :t] if square else tensor


def bucketed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, lengths: list[int], run_bucket: Callable,
                       need_weights: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of a batch whose sequences may fall in different buckets.

    Each sequence's length T is read from its own attention mask (`sequence_lengths`: the last key it attends, plus
    one), so its bucket, and so its output, does not depend on how much padding its batch carries. The batch is split
    into one group per bucket present (`bucket_groups`); a group of bucket b runs on the first min(T_batch, b)
    positions (positions beyond are padding for every sequence of the group), with the bucket's P and R (or exact
    attention for b <= k), and the outputs are put back in batch order, zero at the positions cut off.

    ``run_bucket(b, query, key, value, attention_mask)`` runs one group ``(B_g, H, T_g, D)`` in bucket ``b`` and
    returns ``(output (B_g, T_g, H, D), probabilities (B_g, H, T_g, T_g) or None)``.

    Returns ``(output (B, T, H, D), probabilities (B, H, T, T) or None)`` in batch order.
    """
    b, h, t, d = query.shape
    groups = bucket_groups(lengths, sequence_lengths(attention_mask, b, t), t)
    out_all = probs_all = None
    for bucket, rows in groups:
        tg = min(t, bucket)
        out, probs = run_bucket(bucket, _rows(query, rows, tg), _rows(key, rows, tg), _rows(value, rows, tg),
                                _rows(attention_mask, rows, tg, square=True))
        if tg < t:  # positions beyond the bucket are padding for every sequence of this group
            out = nn.functional.pad(out, (0, 0, 0, 0, 0, t - tg))  # (B_g, T, H, D)
            probs = None if probs is None else nn.functional.pad(probs, (0, t - tg, 0, t - tg))  # (B_g, H, T, T)
        if rows is None:
            return out, probs
        idx = rows.to(out.device)
        out_all = (out.new_zeros(b, t, h, d) if out_all is None else out_all).index_copy(0, idx, out)
        if probs is not None:
            probs_all = (probs.new_zeros(b, h, t, t) if probs_all is None else probs_all).index_copy(0, idx, probs)
    return out_all, probs_all

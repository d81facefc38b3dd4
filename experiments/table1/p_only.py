"""P alone: attention restricted to the keys of P, every other key masked, no reconstruction (the study's control
of what R adds; sparse attention with the same pattern).

A BERT model runs it through transformers' `AttentionInterface` under the name ``p_only``: `install_p_only` writes P
and the layers it applies to into the config (``p_only_indices``, ``p_only_layers``: saved with the checkpoint), and
the function reads them from ``module.config`` and ``module.layer_idx``; the other layers run SDPA. Where an input is
shorter than P's n and a query's P holds none of its keys, that query attends to every key of the input (the
softmax of an empty row is undefined); with the study's n-token windows no row is empty.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

__all__ = ["P_ONLY", "install_p_only", "allowed_keys"]

P_ONLY = "p_only"


def allowed_keys(indices: torch.Tensor, t: int) -> torch.Tensor:
    """(t, t) bool: key j allowed for query i when j is in P's row i (P: (n, k) key indices, n >= t); a row with
    no allowed key of the t keys allows all of them."""
    n = indices.shape[0]
    allowed = torch.zeros(n, n, dtype=torch.bool, device=indices.device)  # (n, n)
    allowed.scatter_(1, indices, True)
    allowed = allowed[:t, :t]  # (t, t)
    return allowed | ~allowed.any(dim=-1, keepdim=True)


def _p_only_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    config = module.config
    if module.layer_idx not in config.p_only_layers:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    # P as a tensor, made once per (config list, device): a new install_p_only writes a new list
    cache_key = (id(config.p_only_indices), query.device)
    cached = getattr(module, "_p_only_cache", None)
    if cached is None or cached[0] != cache_key:
        cached = module._p_only_cache = (cache_key, torch.tensor(config.p_only_indices, device=query.device))  # (n, k)
    keep = allowed_keys(cached[1], query.shape[-2])[None, None]  # (1, 1, T, T)
    if attention_mask is not None:  # sdpa_mask's bool (B, 1, T, T), True = attend
        keep = keep & attention_mask.bool()
    return sdpa_attention_forward(module, query, key, value, keep, scaling=scaling, dropout=dropout, **kwargs)


AttentionInterface.register(P_ONLY, _p_only_attention)
AttentionMaskInterface.register(P_ONLY, sdpa_mask)  # without it the function would get no padding mask


def install_p_only(model, indices: torch.Tensor, layers: list[int]) -> None:
    """Make ``model`` (a BERT model of transformers) attend only to P's keys in ``layers``; saved with its config."""
    n = indices.shape[0]
    if n > model.config.max_position_embeddings:
        raise ValueError(f"P has n={n} rows, more than the model's {model.config.max_position_embeddings} positions.")
    model.config.p_only_indices = indices.tolist()
    model.config.p_only_layers = list(layers)
    model.set_attn_implementation(P_ONLY)

"""Attention modules that compute their scores themselves, made to dispatch through transformers' AttentionInterface.

MPNet's ``MPNetSelfAttention`` scores ``q kᵀ / √d + position_bias`` in its own forward and calls no attention function.
Its adapter (`MPNetDispatchingSelfAttention`: the module's weights and names) sends the scores through
``ALL_ATTENTION_FUNCTIONS[module.config._attn_implementation]`` with the bias in the additive mask, which every
attention function adds to every score: a partial layer computes ``q kᵀ`` at P, reconstructs the rest with R and then
adds the bias, a lookup (docs/method.md, "Relative-position bias"). DeBERTa-v2's ``DisentangledSelfAttention``
(`DebertaV2DispatchingSelfAttention`) passes its position terms as ``score_terms`` (`DisentangledTerms`): computed at P
in a partial layer, in full in an exact one (docs/method.md, "Disentangled scores"). A table entry names its adapter
(`architectures.Architecture.adapter`). Part of the remote-code bundle (imports: torch, transformers, siblings).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

__all__ = ["ADAPTERS", "DisentangledTerms", "adapt", "eager_attention_forward", "with_position_bias"]


def eager_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                            score_terms: DisentangledTerms | None = None, **kwargs):
    """Eager attention in transformers' calling convention (q, k, v ``(B, H, T, D)``, additive or bool mask):
    ``(output (B, T, H, D), probabilities (B, H, T, T))``; what an adapted module runs where it ran its own math.
    ``score_terms``: the score's terms beyond q·k (DeBERTa-v2's), added in full."""
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, T, T)
    if score_terms is not None:
        weights = weights + score_terms.full(query, key)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            attention_mask = torch.zeros_like(attention_mask, dtype=weights.dtype).masked_fill(
                ~attention_mask, torch.finfo(weights.dtype).min)
        weights = weights + attention_mask
    weights = nn.functional.softmax(weights, dim=-1)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights  # (B, T, H, D)


def with_position_bias(attention_mask: torch.Tensor | None, position_bias: torch.Tensor | None,
                       dtype: torch.dtype) -> torch.Tensor | None:
    """One additive mask ``(B|1, H, T, T)`` of a mask (bool, True = attend, or additive float ``(B|1, 1|H, T, T)``, or
    None) and a position bias ``(B|1, H, T, T)``: the bias at the kept keys, ``finfo.min`` plus the bias (still below
    ``finfo.min / 2``, so read as masked) at the masked ones."""
    if position_bias is None:
        return attention_mask
    bias = position_bias.to(dtype)
    if attention_mask is None:
        return bias
    if attention_mask.dtype == torch.bool:
        return bias.masked_fill(~attention_mask, torch.finfo(dtype).min)
    return bias + attention_mask.to(dtype)


def _mpnet_forward(self, hidden_states, attention_mask=None, position_bias=None, output_attentions=False, **kwargs):
    """``MPNetSelfAttention.forward`` (transformers 5) with its scores dispatched (see the module docstring)."""
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.attention_head_size)
    query = self.q(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, H, T, D)
    key = self.k(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, H, T, D)
    value = self.v(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, H, T, D)
    mask = with_position_bias(attention_mask, position_bias, query.dtype)  # (B|1, H, T, T)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
    # MPNet says whether the maps are wanted (output_attentions, passed down by its encoder; no output recorder):
    # need_weights tells the partial functions so, where they would otherwise ask transformers' recorder.
    context, probs = attention(self, query, key, value, mask, scaling=self.attention_head_size ** -0.5,
                               dropout=self.dropout.p if self.training else 0.0,
                               need_weights=bool(output_attentions))
    output = self.o(context.reshape(*input_shape, -1))  # (B, T, H·D) -> (B, T, hidden)
    return (output, probs) if output_attentions else (output,)


class DisentangledTerms:
    """DeBERTa-v2's position terms of one layer's scores, content-to-position ``c2p_ij = q_i·pk[δ(i, j)]`` and
    position-to-content ``p2c_ij = k_j·pq[δ'(j, i)]`` (relative positions bucketed, `pos_att_type`), scaled as the
    content term, at any set of (query, key) pairs: `at` P only (k·d multiply-adds per term and query, what a partial
    layer computes; R reconstructs the rest from the sum), `full` every pair (an exact layer, the analysis).

    Built once per layer call from the module (its projections of the relative embeddings), the encoder's relative
    positions ``(1, T, T)`` and embeddings ``(2·span, hidden)``."""

    def __init__(self, module: nn.Module, t: int, relative_pos: torch.Tensor | None, rel_embeddings: torch.Tensor,
                 scaling: float):
        from transformers.models.deberta_v2.modeling_deberta_v2 import build_relative_position

        span, heads, d = module.pos_ebd_size, module.num_attention_heads, module.attention_head_size
        if relative_pos is None:
            anchor = rel_embeddings.new_empty(1, t, 1)
            relative_pos = build_relative_position(anchor, anchor, bucket_size=module.position_buckets,
                                                   max_position=module.max_relative_positions)
        rel = relative_pos.reshape(-1, relative_pos.shape[-2], relative_pos.shape[-1])[0, :t, :t].long()  # (T, T)
        rel = rel.to(rel_embeddings.device)
        embeddings = module.pos_dropout(rel_embeddings)[: 2 * span]  # (2·span, hidden)
        kinds = module.pos_att_type
        key_proj = module.key_proj if module.share_att_key else getattr(module, "pos_key_proj", None)
        query_proj = module.query_proj if module.share_att_key else getattr(module, "pos_query_proj", None)
        split = lambda x: x.view(-1, heads, d).transpose(0, 1)  # noqa: E731  (2·span, H·D) -> (H, 2·span, D)
        self.pos_key = split(key_proj(embeddings)) if "c2p" in kinds else None  # (H, 2·span, D)
        self.pos_query = split(query_proj(embeddings)) if "p2c" in kinds else None  # (H, 2·span, D)
        self.c2p_index = torch.clamp(rel + span, 0, 2 * span - 1)  # (T, T): [i, j] -> pk row of δ(i, j)
        self.p2c_index = torch.clamp(span - rel.transpose(0, 1), 0, 2 * span - 1)  # (T, T): [i, j] -> pq row
        self.scaling = scaling

    def at(self, query: torch.Tensor, key: torch.Tensor, indices: torch.Tensor, heads: slice = slice(None)):
        """The terms at P: q, k ``(B, Hs, T, D)`` of the heads ``heads``, P ``(n, k)`` (keys at or beyond T score
        zero in every kernel: clamped here) -> ``(B, Hs, T, k)``."""
        t = query.shape[2]
        p = indices[:t].clamp(max=t - 1)  # (T, k)
        terms = 0
        if self.pos_key is not None:
            pk = self.pos_key[heads][:, self.c2p_index[:t, :t].gather(1, p)]  # (Hs, T, k, D)
            terms = terms + torch.einsum("bhtd,htkd->bhtk", query, pk.to(query.dtype))
        if self.pos_query is not None:
            pq = self.pos_query[heads][:, self.p2c_index[:t, :t].gather(1, p)]  # (Hs, T, k, D)
            keys = key[:, :, p]  # (B, Hs, T, k, D)
            terms = terms + torch.einsum("bhtkd,htkd->bhtk", keys, pq.to(key.dtype))
        return terms * self.scaling

    def full(self, query: torch.Tensor, key: torch.Tensor, heads: slice = slice(None)) -> torch.Tensor | int:
        """The terms at every pair: q, k ``(B, Hs, T, D)`` -> ``(B, Hs, T, T)``, as DeBERTa computes them (every
        query against every relative position, then gathered)."""
        b, h, t, _ = query.shape
        terms = 0
        if self.pos_key is not None:
            c2p = torch.matmul(query, self.pos_key[heads].to(query.dtype).transpose(-1, -2))  # (B, Hs, T, 2·span)
            terms = terms + c2p.gather(-1, self.c2p_index[:t, :t].expand(b, h, t, t))
        if self.pos_query is not None:
            p2c = torch.matmul(key, self.pos_query[heads].to(key.dtype).transpose(-1, -2))  # (B, Hs, T_k, 2·span)
            # p2c_ij = k_j·pq[p2c_index[i, j]]: gathered along keys' rows, then transposed to (query, key)
            terms = terms + p2c.gather(-1, self.p2c_index[:t, :t].transpose(0, 1).expand(b, h, t, t)).transpose(-1, -2)
        return terms * self.scaling


def _deberta_forward(self, hidden_states, attention_mask, output_attentions=False, query_states=None,
                     relative_pos=None, rel_embeddings=None):
    """``DisentangledSelfAttention.forward`` (transformers 5) with its scores dispatched: the content term q·k and
    the position terms (`DisentangledTerms`, passed as ``score_terms``) go to the attention function, which computes
    them at P in a partial layer and in full in an exact one."""
    queries = hidden_states if query_states is None else query_states
    b, t = hidden_states.shape[:2]
    split = lambda x: x.view(b, -1, self.num_attention_heads, self.attention_head_size).transpose(1, 2)  # noqa: E731
    query = split(self.query_proj(queries))  # (B, H, T, D)
    key = split(self.key_proj(hidden_states))  # (B, H, T, D)
    value = split(self.value_proj(hidden_states))  # (B, H, T, D)
    scale_factor = 1 + sum(kind in self.pos_att_type for kind in ("c2p", "p2c"))
    scaling = (self.attention_head_size * scale_factor) ** -0.5
    terms = None
    if self.relative_attention and any(kind in self.pos_att_type for kind in ("c2p", "p2c")):
        terms = DisentangledTerms(self, t, relative_pos, rel_embeddings, scaling)
    mask = attention_mask.bool()  # (B, 1, T, T), True = attend (padded queries attend nothing, as in DeBERTa)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
    context, probs = attention(self, query, key, value, mask, scaling=scaling,
                               dropout=self.dropout.p if self.training else 0.0,
                               need_weights=bool(output_attentions), score_terms=terms)
    context = context.reshape(b, t, -1)  # (B, T, H, D) -> (B, T, H·D)
    return (context, probs if output_attentions else None)


def _adapter_classes() -> dict[str, type]:
    classes = {}
    try:
        from transformers.models.mpnet.modeling_mpnet import MPNetSelfAttention
    except ImportError:  # pragma: no cover - every transformers 5 has MPNet
        return classes
    classes["mpnet"] = type("MPNetDispatchingSelfAttention", (MPNetSelfAttention,), {
        "__module__": __name__, "forward": _mpnet_forward, "__doc__": (
            "`MPNetSelfAttention` whose scores go through ``ALL_ATTENTION_FUNCTIONS`` (`_mpnet_forward`); the same "
            "weights and names. Its ``config`` is set by whoever adapts it (a view naming the function to run).")})
    from transformers.models.deberta_v2.modeling_deberta_v2 import DisentangledSelfAttention

    classes["deberta-v2"] = type("DebertaV2DispatchingSelfAttention", (DisentangledSelfAttention,), {
        "__module__": __name__, "forward": _deberta_forward, "__doc__": (
            "DeBERTa-v2's `DisentangledSelfAttention` whose scores go through ``ALL_ATTENTION_FUNCTIONS`` "
            "(`_deberta_forward`); the same weights and names.")})
    return classes


# adapter name (`architectures.Architecture.adapter`) -> the class its attention modules become
ADAPTERS: dict[str, type] = _adapter_classes()
globals().update({cls.__name__: cls for cls in ADAPTERS.values()})  # importable by name: pickling finds them


def adapt(module: nn.Module, adapter: str) -> type:
    """Make ``module`` (of the class the adapter adapts) an instance of the adapter's class, in place (its weights,
    buffers and hooks kept); returns its previous class, for whoever restores it. Idempotent."""
    cls = ADAPTERS[adapter]
    previous = type(module)
    if not isinstance(module, cls):
        if not isinstance(module, cls.__mro__[1]):
            raise TypeError(f"adapter {adapter!r} adapts {cls.__mro__[1].__name__}, got {previous.__name__}.")
        module.__class__ = cls
    return previous

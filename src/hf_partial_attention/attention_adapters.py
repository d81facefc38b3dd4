"""Attention modules that compute their scores themselves, made to dispatch through transformers' AttentionInterface.

MPNet's ``MPNetSelfAttention`` scores ``q kᵀ / √d + position_bias`` in its own forward and calls no attention function,
so neither partial attention nor score capture could reach it. Its adapter (`MPNetDispatchingSelfAttention`) keeps the
module's weights and names and differs in one place: the scores go through
``ALL_ATTENTION_FUNCTIONS[module.config._attn_implementation]`` with the position bias added to the additive mask. Every
attention function adds the mask to every score, exact or reconstructed, so a partial layer computes ``q kᵀ`` at P,
reconstructs the rest with R and then adds the bias, as the bias is a lookup (docs/method.md, "Relative-position
bias"). An architecture's table entry names its adapter (`architectures.Architecture.adapter`).

Part of the remote-code bundle (imports: torch, transformers and siblings only).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

__all__ = ["ADAPTERS", "adapt", "eager_attention_forward", "with_position_bias"]


def eager_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs):
    """Eager attention in transformers' calling convention (q, k, v ``(B, H, T, D)``, additive or bool mask):
    ``(output (B, T, H, D), probabilities (B, H, T, T))``; what an adapted module runs where it ran its own math."""
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, T, T)
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

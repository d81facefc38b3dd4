"""Capture pre-softmax attention scores ``Q Kᵀ · scaling`` (before the mask) of any model that dispatches
attention through transformers' ``AttentionInterface``.

`capture_scores(model, sink)` switches the model to a registered attention function that computes the
scores, hands them to ``sink(layer, scores)`` and then runs the model's own eager attention on the same
inputs, so the model's output is that of ``attn_implementation="eager"``. The matching mask function is
registered with ``AttentionMaskInterface`` (without it transformers would pass no mask at all). MPNet's attention
modules, which score in their own forward, are adapted for the context (`architectures.Architecture.adapter`): their
captured scores are the content scores ``q kᵀ · scaling``, before the position bias, what R reconstructs; DeBERTa-v2's
are adapted the same way, and theirs are the whole score, content and position terms (R reconstructs their sum).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.masking_utils import eager_mask

from ..architectures import ARCHITECTURES, Architecture
from ..partial_layer import config_view

logger = logging.getLogger(__name__)

__all__ = ["CAPTURE_IMPLEMENTATION", "capture_scores", "ScoreSink"]

CAPTURE_IMPLEMENTATION = "hf_partial_attention_capture"

ScoreSink = Callable[[int, torch.Tensor], None]

# id(attention module) -> its capture state, for the models inside an active `capture_scores` context.
_ACTIVE: dict[int, "_CaptureState"] = {}


class _CaptureState:
    def __init__(self, sink: ScoreSink):
        self.sink = sink
        self.layer_of: dict[int, int] = {}  # id(module) -> layer index, in order of first call
        self.calls = 0

    def layer(self, module: nn.Module) -> int:
        return self.layer_of.setdefault(id(module), len(self.layer_of))


def _generic_eager(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    if key.shape[1] != query.shape[1]:  # grouped-query attention: repeat the K/V heads
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask[:, :, :, : key.shape[-2]]
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def _model_eager(module: nn.Module) -> Callable:
    """The eager attention function of the module's own modeling file (identical output to eager mode)."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None) or _generic_eager


def _capture_attention(module, query, key, value, attention_mask, *args, **kwargs):
    state = _ACTIVE.get(id(module))
    if state is not None:
        scaling = kwargs.get("scaling")
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        k = key
        if k.shape[1] != query.shape[1]:  # grouped-query attention: (B, kv_heads, T, D) -> (B, H, T, D)
            k = k.repeat_interleave(query.shape[1] // k.shape[1], dim=1)
        with torch.no_grad():
            scores = torch.matmul(query, k.transpose(2, 3)) * scaling  # (B, H, Tq, Tk), pre-mask
            terms = kwargs.get("score_terms")  # DeBERTa-v2's position terms: the score R reconstructs is the sum
            if terms is not None:
                scores = scores + terms.full(query, k)
        state.calls += 1
        state.sink(state.layer(module), scores.detach())
    return _model_eager(module)(module, query, key, value, attention_mask, *args, **kwargs)


def _register() -> None:
    AttentionInterface.register(CAPTURE_IMPLEMENTATION, _capture_attention)
    # Required: an implementation without a registered mask function receives attention_mask=None.
    AttentionMaskInterface.register(CAPTURE_IMPLEMENTATION, eager_mask)


def _adapted(model) -> Architecture | None:
    """The table entry of ``model`` when its attention modules need an adapter to dispatch (MPNet), else None."""
    arch = ARCHITECTURES.get(getattr(model.config, "model_type", None))
    return arch if arch is not None and arch.adapter and arch.available() else None


def check_capturable(model) -> None:
    """Raise TypeError/ValueError when scores of ``model`` cannot be captured through the attention interface."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}.")
    if _adapted(model) is None and not type(model)._can_set_attn_implementation():
        raise ValueError(
            f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface, so its "
            "scores cannot be captured; use a model whose attention calls ALL_ATTENTION_FUNCTIONS "
            "(BERT, RoBERTa, DistilBERT, ELECTRA, Llama, GPT-2, ...)."
        )


@contextlib.contextmanager
def capture_scores(model: PreTrainedModel, sink: ScoreSink) -> Iterator[_CaptureState]:
    """Within the context, every attention call of ``model`` reports ``sink(layer, scores (B, H, Tq, Tk))``.

    The model runs its eager attention math (outputs equal ``attn_implementation="eager"``); its previous
    attention implementation is restored on exit. Layers are numbered in order of first call. The yielded
    state's ``calls`` counts captured calls (zero after a forward pass means the model bypasses the interface).
    """
    check_capturable(model)
    _register()
    state = _CaptureState(sink)
    arch = _adapted(model)
    if arch is not None:  # MPNet: its attention modules, adapted, run the capture function for the context
        with _adapted_capture(model, arch, state):
            yield state
        return
    original = model.config._attn_implementation
    ids = [id(m) for m in model.modules()]
    model.set_attn_implementation(CAPTURE_IMPLEMENTATION)
    if model.config._attn_implementation != CAPTURE_IMPLEMENTATION:
        model.set_attn_implementation(original)
        raise ValueError(f"{type(model).__name__} refused attn_implementation={CAPTURE_IMPLEMENTATION!r}; its "
                         "attention cannot be captured.")
    for i in ids:
        _ACTIVE[i] = state
    try:
        yield state
    finally:
        for i in ids:
            _ACTIVE.pop(i, None)
        model.set_attn_implementation(original if original is not None else "sdpa")


@contextlib.contextmanager
def _adapted_capture(model, arch: Architecture, state: _CaptureState) -> Iterator[None]:
    """Within the context, the attention modules of ``model`` (an architecture whose modules score in their own
    forward) are adapted (`architectures.Architecture.dispatching`) with a config view naming the capture function;
    the model's own config, and so its masks, are left as they are. Their classes are restored on exit."""
    modules = {id(m): m for _, m in arch.attention_modules(model.base_model)}
    restore = []
    for module in modules.values():
        restore.append((module, arch.dispatching(module), module.__dict__.get("config")))
        module.config = config_view(model.config, CAPTURE_IMPLEMENTATION)
        _ACTIVE[id(module)] = state
    try:
        yield
    finally:
        for module, cls, config in restore:
            _ACTIVE.pop(id(module), None)
            module.__class__ = cls
            if config is None:
                del module.config
            else:
                module.config = config


def require_calls(state: _CaptureState, model) -> None:
    """Raise a ValueError when a forward pass under `capture_scores` reported no attention call."""
    if state.calls == 0:
        raise ValueError(f"No attention call of {type(model).__name__} went through AttentionInterface during a "
                         "forward pass, so no scores were captured; this model's attention cannot be analysed here.")

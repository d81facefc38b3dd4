"""One partial layer's state at each call: whether an attention module is partial, the P and R it reconstructs with in
a bucket (read through its owner's pattern modules), and whether this forward returns attention maps. Used by
`attention_dispatch`'s attention functions (which re-export these names).

Part of the remote-code bundle (imports: torch, transformers and siblings only).
"""

from __future__ import annotations

from torch import nn

from .attention_common import PartialTensors
from .partial_places import place

try:  # transformers' recorder of `output_*` (private), read by `attention_weights_requested` at every forward
    from transformers.utils.output_capturing import _active_collector
except ImportError:
    _active_collector = None

__all__ = ["is_partial", "layer_tensors", "attention_weights_requested"]


def is_partial(module: nn.Module) -> bool:
    """Whether ``module`` is an attention module made partial by `make_partial`."""
    return getattr(module, "_partial_owner", None) is not None


def layer_tensors(module: nn.Module, length: int | None = None) -> PartialTensors:
    """P's layout, R, its bias and their derived state in bucket ``length`` (default n), as the partial ``module``
    reconstructs with them. The owner's pattern module of the bucket is called (not held), so that a wrapper installed
    in its place (peft's modules_to_save) is the one that runs."""
    where = place(module.config, module._partial_layer, length)
    pattern_module = getattr(module._partial_owner, where.pattern)
    if where.on_attention:  # per_layer with a pooled P: this layer's own R
        return pattern_module(getattr(module, where.r_name), getattr(module, where.bias_name), where.layer)
    return pattern_module()


def attention_weights_requested(config, kwargs: dict) -> bool:
    """Whether this forward returns attention maps (``output_attentions`` in the call or the config, or an active
    transformers output recorder that collects them): only then must a kernel write the n×n probabilities."""
    if kwargs.get("output_attentions") or getattr(config, "output_attentions", False):
        return True
    if _active_collector is None:  # the recorder moved: keep returning the maps
        return True
    collected = _active_collector.get()
    return bool(collected) and "attentions" in collected

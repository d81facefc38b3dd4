"""One attention module of any supported encoder made partial (or kept exact) in place, and the attention functions
transformers calls for it.

Every supported architecture's attention module (BERT's ``BertSelfAttention``, RoBERTa's, ModernBERT's
``ModernBertAttention``, ...) projects q, k and v itself and then calls
``ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, ...)``. So a layer is made partial without
touching its forward: its ``config`` becomes a *view* of the model's config (the same ``__dict__``, so every field
and every later change is shared) whose ``_attn_implementation`` names this project's function, ``partial_<kernel>``
for a partial layer, ``partial_exact`` for an exact one. The model's own config keeps the user's setting (sdpa,
eager), which builds the masks and runs the exact layers. P and R come from the pattern modules of the layer's owner
(`partial_pattern.PartialPattern`); a per-layer R is registered on the attention module itself.

Part of the remote-code bundle (imports: torch, transformers and siblings only).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .attention_common import PartialTensors, needs_grad
from .attention_heads import all_heads_attention
from .attention_dispatch import attention_function_name, kernel_for, kernel_function
from .attention_lengths import bucketed_attention, exact_attention
from .configuration_partial import PARTIAL_IMPLEMENTATIONS
from .partial_pattern import r_tensor
from .partial_places import attention_r_names, place, r_on_attention

try:  # transformers' recorder of `output_*` (private), read by `attention_weights_requested` at every forward
    from transformers.utils.output_capturing import _active_collector
except ImportError:
    _active_collector = None

__all__ = ["EXACT_FUNCTION", "config_view", "make_partial", "make_exact", "is_partial", "layer_tensors",
           "attention_weights_requested", "register_attention_functions"]

# The function name of the exact layers: the model's own `_attn_implementation`, or eager when maps are asked for.
EXACT_FUNCTION = "partial_exact"
_VIEW_CLASSES: dict[tuple[type, str], type] = {}


def _rebuild_view(config, name: str):
    return config_view(config, name)


def config_view(config, name: str):
    """A view of ``config`` (same ``__dict__``: every field shared, now and later) whose ``_attn_implementation``
    reads ``name`` (``"partial"`` for a partial layer: ``partial_<config.partial_implementation>``). Copies and pickles
    of a model keep each view tied to the model's (copied) config."""
    base = type(config)
    while base.__name__.endswith("PartialView"):  # a view of a view: view the config itself
        config, base = config._partial_base, base.__mro__[1]
    cls = _VIEW_CLASSES.get((base, name))
    if cls is None:
        def implementation(self):
            if name == "partial":
                return attention_function_name(self.partial_implementation)
            return name

        def set_implementation(self, value):  # a write reaches the model's config
            base._attn_implementation.fset(self._partial_base, value)

        cls = type(f"{base.__name__}PartialView", (base,), {
            "__slots__": ("_partial_base",), "__module__": __name__,
            "_attn_implementation": property(implementation, set_implementation),
            "__reduce_ex__": lambda self, protocol: (_rebuild_view, (self._partial_base, name))})
        _VIEW_CLASSES[(base, name)] = cls
    view = object.__new__(cls)
    object.__setattr__(view, "__dict__", config.__dict__)
    object.__setattr__(view, "_partial_base", config)
    return view


def make_partial(module: nn.Module, owner: nn.Module, layer_idx: int | None, config, pattern=None) -> None:
    """Make ``module`` (an attention module calling ``ALL_ATTENTION_FUNCTIONS``) partial: it reads P (and a common or
    fixed R) from ``owner``'s pattern modules and, with ``reconstruction="per_layer"``, gets its own R (and bias) per
    bucket, registered on it (``<module>.reconstruction``, ``.reconstruction_len{b}``) holding ``pattern``'s values."""
    # An unregistered reference: the owner is a parent module, whose tensors are saved once, under its own name.
    object.__setattr__(module, "_partial_owner", owner)
    object.__setattr__(module, "_partial_layer", layer_idx)
    module.config = config_view(config, "partial")
    if r_on_attention(config):  # else R lives in the pattern module beside P (`partial_places`)
        for length in (None, *config.partial_buckets):  # n's R, then each shorter bucket's
            r_name, bias_name = attention_r_names(config, length)
            setattr(module, r_name, r_tensor(config, True, False, pattern, length))
            setattr(module, bias_name, r_tensor(config, True, True, pattern, length) if config.partial_use_bias else None)


def make_exact(module: nn.Module, config) -> None:
    """Keep ``module`` exact: the model's ``_attn_implementation``, or eager when attention maps are asked for (so
    that ``attentions[i]`` is layer i's map in every layer; sdpa returns none)."""
    module.config = config_view(config, EXACT_FUNCTION)


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


def _partial_function(implementation: str) -> Callable:
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, need_weights=None,
                  partial: PartialTensors | None = None, **kwargs):
        """Partial attention of one layer: q, k, v ``(B, H, T, D)`` -> ``(output (B, T, H, D), maps or None)``; each
        sequence in its length bucket, a bucket with k_b = b exactly."""
        if partial is None and not is_partial(module):
            raise TypeError(
                f"attention {attention_function_name(implementation)!r} runs only in the partial layers of a "
                f"partial model (got {type(module).__name__}); set attn_implementation to 'sdpa' or 'eager'.")
        config = module.config
        scaling = module.scaling if scaling is None else scaling
        if need_weights is None:
            need_weights = attention_weights_requested(config, kwargs)

        def run_kernel(tensors, query, key, value, attention_mask):
            name = kernel_for(implementation, tensors, query, key, value, need_weights=need_weights,
                              dropout=dropout if module.training else 0.0)
            return kernel_function(name)(module, query, key, value, attention_mask, scaling, dropout,
                                         partial=tensors)

        def run_bucket(length, query, key, value, attention_mask, tensors=partial):
            if length in config.exact_lengths:  # b <= k: every score is exact
                return exact_attention(module, query, key, value, attention_mask, scaling, dropout, need_weights)
            tensors = layer_tensors(module, length) if tensors is None else tensors  # P, R: read once, passed down
            if not isinstance(tensors, list):
                return run_kernel(tensors, query, key, value, attention_mask)
            # P and R per head. Where the fused kernel would run under autograd (not for the map, the reference or
            # Triton settings, nor under export): every head in one autograd node with a hand-written backward,
            # where one kernel call per head would pay for H small backward passes (`attention_heads`).
            if needs_grad(query, key, value, *(t.reconstruction for t in tensors), *(t.bias for t in tensors)) and \
                    kernel_for(implementation, tensors[0], query, key, value, need_weights=need_weights,
                               dropout=dropout if module.training else 0.0) == "fused":
                return all_heads_attention(module, query, key, value, attention_mask, scaling,
                                           dropout if module.training else 0.0, tensors)
            # Otherwise each head by the kernel of its own P and R, on its own slice of q, k, v
            outs, maps = [], []
            for h, head_tensors in enumerate(tensors):
                mask = (attention_mask if attention_mask is None or attention_mask.shape[1] == 1
                        else attention_mask[:, h:h + 1])  # (B|1, 1, T, T)
                out, probs = run_kernel(head_tensors, query[:, h:h + 1], key[:, h:h + 1], value[:, h:h + 1], mask)
                outs.append(out)  # (B, T, 1, D)
                maps.append(probs)  # (B, 1, T, T) or None
            return torch.cat(outs, dim=2), None if maps[0] is None else torch.cat(maps, dim=1)  # (B, T, H, D)

        if partial is not None or len(config.partial_lengths) == 1:  # one bucket: n's P and R for every input
            return run_bucket(config.partial_seq_len, query, key, value, attention_mask)
        return bucketed_attention(module, query, key, value, attention_mask, config.partial_lengths, run_bucket,
                                  need_weights)

    attention.__name__ = f"{attention_function_name(implementation)}_attention_forward"
    return attention


def _exact_function(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """An exact layer of a partial model: the model's ``_attn_implementation``; eager when the map is asked for."""
    chosen = module.config._partial_base._attn_implementation or "sdpa"
    if chosen == "eager" or attention_weights_requested(module.config, kwargs):
        return exact_attention(module, query, key, value, attention_mask, scaling, dropout, need_weights=True)
    return ALL_ATTENTION_FUNCTIONS[chosen](module, query, key, value, attention_mask, scaling=scaling,
                                          dropout=dropout, **kwargs)


def register_attention_functions() -> None:
    """Register every setting (``partial_<kernel>``, ``partial_auto``) and the exact layers' function with
    transformers' `AttentionInterface`, each with a mask builder so that a mask is never silently dropped; safe to
    call more than once."""
    for name in PARTIAL_IMPLEMENTATIONS:  # every kernel, and "auto"
        AttentionInterface.register(attention_function_name(name), _partial_function(name))
        AttentionMaskInterface.register(attention_function_name(name), sdpa_mask)
    AttentionInterface.register(EXACT_FUNCTION, _exact_function)
    AttentionMaskInterface.register(EXACT_FUNCTION, sdpa_mask)


register_attention_functions()

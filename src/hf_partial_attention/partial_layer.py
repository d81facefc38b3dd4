"""One attention module of any supported encoder made partial (or kept exact) in place.

A layer is made partial without touching its forward: its ``config`` becomes a *view* of the model's config whose
``_attn_implementation`` names this project's function (`config_view` says why that suffices). P and R come from the
pattern modules of the layer's owner (`partial_pattern.PartialPattern`); a per-layer R is registered on the attention
module itself. What runs at each call (the attention functions transformers calls, the kernel choice) is
`attention_dispatch`'s.

Part of the remote-code bundle (imports: torch, transformers and siblings only).
"""

from __future__ import annotations

from torch import nn

# The per-call names, re-exported here where 0.x had them
from .attention_dispatch import EXACT_FUNCTION, attention_function_name, is_partial, layer_tensors
from .partial_pattern import r_tensor
from .partial_places import attention_r_names, r_on_attention, r_trainable

__all__ = ["EXACT_FUNCTION", "config_view", "make_partial", "make_exact", "is_partial", "layer_tensors"]

_VIEW_CLASSES: dict[tuple[type, str], type] = {}


def _rebuild_view(config, name: str):
    return config_view(config, name)


def config_view(config, name: str):
    """A view of ``config`` (same ``__dict__``: every field shared, now and later) whose ``_attn_implementation``
    reads ``name`` (``"partial"`` for a partial layer: ``partial_<config.partial_implementation>``). Copies and pickles
    of a model keep each view tied to the model's (copied) config.

    Why a view suffices: every supported architecture's attention module (BERT's ``BertSelfAttention``, RoBERTa's,
    ModernBERT's ``ModernBertAttention``, ...) projects q, k and v itself and then calls
    ``ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, ...)``, so a layer whose ``config``
    names ``partial_<kernel>`` (a partial layer) or ``partial_exact`` (an exact one) runs this project's function
    with its forward untouched. The model's own config keeps the user's setting (sdpa, eager), which builds the masks
    and runs the exact layers."""
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
            setattr(module, r_name, r_tensor(config, r_trainable(config), False, pattern, length))
            setattr(module, bias_name,
                    r_tensor(config, r_trainable(config), True, pattern, length) if config.partial_use_bias else None)


def make_exact(module: nn.Module, config) -> None:
    """Keep ``module`` exact: the model's ``_attn_implementation``, or eager when attention maps are asked for (so
    that ``attentions[i]`` is layer i's map in every layer; sdpa returns none)."""
    module.config = config_view(config, EXACT_FUNCTION)

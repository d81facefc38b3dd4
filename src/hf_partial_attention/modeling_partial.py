"""What every partial model shares, whatever its architecture: installing partial attention, the pattern's tensors at
construction and at loading (refusing a checkpoint whose P or R is missing or mis-shaped), pattern access, the kernel
setting, conversion from a source checkpoint and the Hub hooks.

`PartialModelMixin` goes first among the bases of every partial class, all generated from the architecture table
(`modeling_partial_encoders`): ``PartialBertPreTrainedModel(PartialModelMixin, BertPreTrainedModel)``,
``PartialBertModel(PartialBertPreTrainedModel, BertModel)``, ``PartialRobertaForMaskedLM(...)`` and so on. Its
``post_init`` finds the architecture's attention modules through its table entry
(``_partial_arch``, `architectures.Architecture`), gives their owner the pattern modules (one per length bucket) and
makes each attention module partial or exact in place (`partial_layer`). Part of the remote-code bundle.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from transformers import initialization as init

from .architectures import Architecture
from .configuration_partial import check_implementation
from .conversion import from_source
from .partial_layer import is_partial, make_exact, make_partial
from .partial_pattern import PartialPattern, check_buckets, check_layers, init_bias, initial_for, initial_stack
from .partial_places import (PARTIAL_NAME, Place, attention_r_names, bucket_suffix, head_count, heads, pattern_layers,
                             pattern_module_layers, pattern_module_name, place, r_on_attention)
from .pattern import AttentionPattern
from .pattern_buckets import PatternBuckets
from .pattern_layers import LayerPatterns

__all__ = ["PartialModelMixin", "PARTIAL_NAME"]


class PartialModelMixin:
    """Partial attention for a transformers model class of a supported architecture (see the module docstring)."""

    _partial_arch: ClassVar[Architecture]
    _source_class: ClassVar[type]  # the upstream class whose checkpoints map one-to-one onto this one
    # Set by `hf_partial_attention.hub.register()` (auto_map, model card on save and push); None under remote
    # code, where saving and pushing are transformers' own.
    _hub: ClassVar[type | None] = None
    # The pattern a model is being built with (its constructor's ``pattern``), read by `_init_weights` while the
    # constructor runs and dropped once it returns, so the model holds no second copy of R.
    _initial_pattern: AttentionPattern | PatternBuckets | None = None

    def __init__(self, config, *args, pattern: AttentionPattern | PatternBuckets | None = None, **kwargs):
        if pattern is not None:
            self._initial_pattern = pattern
        super().__init__(config, *args, **kwargs)

    # ------------------------------------------------------------------ installation
    def post_init(self):
        """The source's ``__init__`` built the model; make its attention partial or exact, then its post-init."""
        self._install_partial_attention(self._initial_pattern)
        super().post_init()
        self.__dict__.pop("_initial_pattern", None)  # now in P and R: no second copy of R is kept

    def _install_partial_attention(self, pattern) -> None:
        """Give the owner its pattern modules, one per length bucket with a pattern (starting from ``pattern``, else
        the default), and make every attention module partial (``config.partial_layers``) or exact (idempotent)."""
        config, base = self.config, self.base_model
        owner = self._partial_arch.owner_module(base)
        layers = pattern_module_layers(config)
        if not layers or pattern_module_name(config, None, layers[0]) in owner._modules:
            return
        if pattern is not None:
            check_layers(config, pattern)
            for layer in layers:
                for head in heads(config):
                    check_buckets(config, pattern.group(layer, head) if isinstance(pattern, LayerPatterns) else pattern,
                                  layer)
        for layer in layers:
            for length in (None, *config.partial_buckets):
                module = PartialPattern(config, pattern, length, layer)
                setattr(owner, pattern_module_name(config, length, layer), module)
        done = set()
        for layer_idx, module in self._partial_arch.attention_modules(base):
            if id(module) in done:  # a module serving several layers (ALBERT): its group is all partial or exact
                continue
            done.add(id(module))
            self._partial_arch.dispatching(module)  # MPNet's: its scores through the attention functions
            if layer_idx in config.partial_layers:
                make_partial(module, owner, layer_idx, config, pattern)
            else:
                make_exact(module, config)

    def _partial_owner(self):
        """The module holding the pattern modules (``encoder`` in BERT's layout, the base model in ModernBERT's)."""
        return self._partial_arch.owner_module(self.base_model)

    def _partial_attention(self, layer: int):
        """Layer ``layer``'s attention module."""
        return dict(self._partial_arch.attention_modules(self.base_model))[layer]

    def _place(self, layer: int | None = None, length: int | None = None, head: int | None = None
               ) -> tuple[PartialPattern, torch.nn.Module, Place]:
        """The modules holding the P and R of ``layer``, ``head``, bucket ``length`` (`partial_places.place`): the
        pattern module (P), the module holding R and its bias, and their `Place`."""
        where = place(self.config, layer, length, head)
        pattern = getattr(self._partial_owner(), where.pattern)
        return pattern, (self._partial_attention(where.layer) if where.on_attention else pattern), where

    def initialize_weights(self):
        # transformers initialises a sub-model's modules with the sub-model's own `_init_weights`. The base model of a
        # generated head (``PartialRobertaForMaskedLM.roberta``) is the source's class, which knows no P and R: left
        # to it, a model built on the meta device (`to_empty` + `init_weights`) would run uninitialised indices. Route
        # its modules through this model's `_init_weights` while the initialisation runs.
        base = self.base_model
        if base is self or isinstance(base, PartialModelMixin):
            return super().initialize_weights()
        base._init_weights = self._init_weights  # an instance attribute shadows the class's method
        try:
            return super().initialize_weights()
        finally:
            del base._init_weights

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, PartialPattern):
            indices, r, bias = initial_stack(self.config, self._initial_pattern, module.length, module.layer)
            init.copy_(module.indices, indices)
            # The layout buffers are non-persistent: a model built on the meta device (big-model loading) gets them
            # only here, derived from the P just installed.
            complement, inverse, module.block_rows = module.derive_layout(indices)
            init.copy_(module.complement, complement)
            init.copy_(module.inverse_permutation, inverse)
            if getattr(module, "reconstruction", None) is not None:
                init.copy_(module.reconstruction, r)
            if getattr(module, "reconstruction_bias", None) is not None:
                if bias is None:
                    init.zeros_(module.reconstruction_bias)
                else:
                    init.copy_(module.reconstruction_bias, bias)
        elif is_partial(module) and r_on_attention(self.config):
            for length in (None, *self.config.partial_buckets):
                pattern = initial_for(self.config, self._initial_pattern, length)
                r_name, bias_name = attention_r_names(self.config, length)
                init.copy_(getattr(module, r_name), pattern.reconstruction)
                if getattr(module, bias_name) is not None:
                    init_bias(getattr(module, bias_name), pattern)

    def set_partial_implementation(self, implementation: str) -> None:
        """Switch the kernel of the partial layers at run time: ``"auto"``, ``"gather"``, ``"fused"``, ``"tiled"`` or
        ``"triton"`` (all give the same numbers). Like ``attn_implementation`` it is a setting of
        this process, never read from a checkpoint; exact layers keep ``config._attn_implementation``."""
        check_implementation(implementation)
        self.config.partial_implementation = implementation

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, refusing a checkpoint whose P or R is missing or of the wrong shape.

        transformers would initialise such tensors afresh (the default pattern here) with only a generic note; a
        model that silently runs another pattern than the one it was trained with is wrong, so it is an error.
        """
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        model._check_loaded_pattern(info, args[0] if args else kwargs.get("pretrained_model_name_or_path"))
        return (model, info) if want_info else model

    def _partial_tensor_names(self) -> list[str]:
        return [name for name in self.state_dict() if PARTIAL_NAME.search(f".{name}")]

    def _check_loaded_pattern(self, info: dict, source) -> None:
        names = set(self._partial_tensor_names())
        mismatched = {entry[0] if isinstance(entry, tuple) else entry for entry in info.get("mismatched_keys", [])}
        for kind, found in (("missing", names & set(info.get("missing_keys", []))),
                            ("of the wrong shape", names & mismatched)):
            if found:
                raise ValueError(
                    f"{source!s} has P/R tensors {kind}: {sorted(found)}. Loading would start them from the default "
                    f"pattern and run a different model than the one saved. Load a folder written by "
                    f"{type(self).__name__}.save_pretrained with the same partial_seq_len, partial_k and "
                    "reconstruction, or convert a source checkpoint with from_source(path, pattern) (from_bert for "
                    "PartialBert; `hf-partial-attention convert`).")
        # P and R must also be a valid pattern (sorted, unique, in range, finite): AttentionPattern checks that.
        for layer in pattern_layers(self.config):
            try:
                for head in heads(self.config):
                    self.get_patterns(layer, head)
            except ValueError as err:
                raise ValueError(f"{source!s} holds an invalid P or R ({sorted(names)}): {err}") from err
            for owner in self._pattern_modules(layer).values():
                owner.refresh_layout()

    # ------------------------------------------------------------------ pattern access
    def _pattern_modules(self, layer: int | None = None) -> dict[int, PartialPattern]:
        """Bucket length -> the owner's pattern module of that bucket (n first, then the shorter buckets); of
        ``layer`` (default: the first partial layer) when each layer has its own P."""
        owner, config = self._partial_owner(), self.config
        if pattern_module_layers(config) != [None]:  # each layer its own pattern modules
            layer = self._check_layer(layer)
        return {length or config.partial_seq_len: getattr(owner, pattern_module_name(config, length, layer))
                for length in (None, *config.partial_buckets)}

    def _check_layer(self, layer: int | None) -> int:
        layer = self.config.partial_layers[0] if layer is None else layer
        if layer not in self.config.partial_layers:
            raise ValueError(f"layer={layer} is not a partial layer; partial_layers={self.config.partial_layers}.")
        return layer

    def reconstruction_tensors(self) -> dict[str, torch.Tensor]:
        """Name -> R tensor: ``{"common": R}`` / ``{"fixed": R}`` or ``{"layer.3": R_3, ...}`` (per_layer, or P per
        layer or head: the layer's R, its heads stacked); a bucket b < n adds ``"common.len{b}"`` /
        ``"layer.3.len{b}"``."""
        out = {}
        for length in (None, *self.config.partial_buckets):
            tag = bucket_suffix(self.config, length).replace("_", ".")
            for layer in pattern_layers(self.config):
                _, holder, where = self._place(layer, length)
                out[(self.config.reconstruction if layer is None else f"layer.{layer}") + tag] = \
                    getattr(holder, where.r_name)
        return out

    def get_pattern(self, layer: int | None = None, length: int | None = None, head: int | None = None
                    ) -> AttentionPattern:
        """The model's P and R in bucket ``length`` (default n; of `layer` when R or P is per layer, the first
        partial layer by default; of `head` when they are per head, head 0 by default). A bucket that runs exactly
        (b <= k) has no pattern: a ValueError."""
        length = length or self.config.partial_seq_len
        modules = self._pattern_modules(layer)
        if length not in modules:
            raise ValueError(f"length={length} is not a length bucket with a pattern; the buckets with P and R are "
                             f"{sorted(modules)} (partial_lengths={self.config.partial_lengths}, partial_lengths_k="
                             f"{self.config.partial_lengths_k}: buckets with k = b run exactly).")
        if head_count(self.config) is not None:  # P and R per head: a head is meant
            head = self._check_head(head)
        layer = None if pattern_layers(self.config) == [None] else self._check_layer(layer)
        pattern, holder, where = self._place(layer, length, head)
        p, r, bias = pattern.indices, getattr(holder, where.r_name), getattr(holder, where.bias_name, None)
        if where.head is not None:  # head h's slice of the stacked tensors
            p, r, bias = p[where.head], r[where.head], None if bias is None else bias[where.head]
        return AttentionPattern(
            p, r, bias,
            metadata={"source_model": self.config._name_or_path or "", "reconstruction": self.config.reconstruction},
        )

    def _check_head(self, head: int | None) -> int:
        heads = self.config.num_attention_heads
        head = 0 if head is None else head
        if not 0 <= head < heads:
            raise ValueError(f"head={head} is out of range for num_attention_heads={heads}.")
        return head

    def get_patterns(self, layer: int | None = None, head: int | None = None) -> PatternBuckets:
        """Every bucket's P and R (of `layer` when R or P is per layer, of `head` per head) as `PatternBuckets`."""
        return PatternBuckets({b: self.get_pattern(layer, b, head) for b in self._pattern_modules(layer)},
                              exact_lengths=self.config.exact_lengths, k=self.config.bucket_k(None, layer))

    def get_layer_patterns(self) -> LayerPatterns:
        """Every partial layer's (and head's) P and R, every bucket, as `LayerPatterns` (what `set_pattern` takes
        back)."""
        each = heads(self.config)
        return LayerPatterns({layer: self.get_patterns(layer) if each == [None] else
                              [self.get_patterns(layer, head) for head in each]
                              for layer in self.config.partial_layers})

    @torch.no_grad()
    def set_pattern(self, pattern: AttentionPattern | PatternBuckets | LayerPatterns) -> None:
        """Install P and R of every bucket (R into every partial layer's reconstruction tensors, whatever the mode).

        An `AttentionPattern` is one bucket of n: for a model with one bucket (``partial_lengths == [n]``). A
        model with P and R per layer (``partial_granularity="layer"``) takes `LayerPatterns` holding every partial
        layer."""
        if not isinstance(pattern, (AttentionPattern, PatternBuckets, LayerPatterns)):
            raise TypeError(f"pattern must be an AttentionPattern, PatternBuckets or LayerPatterns, got "
                            f"{type(pattern).__name__}.")
        try:
            check_layers(self.config, pattern)
        except ValueError as err:
            raise ValueError(f"{err} Build the model with from_source(..., pattern).") from err
        if isinstance(pattern, LayerPatterns):
            each = heads(self.config)
            for layer in self.config.partial_layers:
                for head in each:
                    # one module holds every head's P: its layout is derived once, after the last head's P is in
                    self._set_buckets(pattern.group(layer, head), layer, head, refresh=head == each[-1])
        else:
            self._set_buckets(pattern, None)

    def _set_buckets(self, pattern: AttentionPattern | PatternBuckets, layer: int | None, head: int | None = None,
                     refresh: bool = True) -> None:
        try:
            buckets = check_buckets(self.config, pattern, layer)
        except ValueError as err:
            raise ValueError(f"{err} Build the model with from_source(..., pattern).") from err
        if buckets.has_bias != self.config.partial_use_bias:
            raise ValueError(f"pattern {'has' if buckets.has_bias else 'has no'} bias but "
                             f"config.partial_use_bias={self.config.partial_use_bias}.")
        # R goes where it lives: beside P, or (pooled P, R per layer) into every partial layer's attention module
        r_layers = self.config.partial_layers if layer is None and r_on_attention(self.config) else [layer]
        for length, module in self._pattern_modules(layer).items():
            bucket = buckets[length]
            pick = (lambda t: t) if head is None else (lambda t: t[head])  # head h's slice of stacked tensors
            pick(module.indices).copy_(bucket.indices)
            if refresh:
                module.refresh_layout()
            for r_layer in r_layers:
                _, holder, where = self._place(r_layer, length, head)
                pick(getattr(holder, where.r_name)).copy_(bucket.reconstruction)
                if bucket.bias is not None:
                    pick(getattr(holder, where.bias_name)).copy_(bucket.bias)

    # ------------------------------------------------------------------ hub
    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`; with the plugin imported, `hub.save_pretrained` also completes
        ``auto_map`` and writes the model card (its ``write_model_card`` argument), also when pushing."""
        hub = PartialModelMixin._hub
        if hub is None:
            kwargs.pop("write_model_card", None)
            return super().save_pretrained(save_directory, *args, **kwargs)
        return hub.save_pretrained(self, super().save_pretrained, save_directory, *args, **kwargs)

    def push_to_hub(self, *args, **kwargs):
        """`PreTrainedModel.push_to_hub`; with the plugin imported, `hub.push_to_hub` uploads this project's card."""
        hub = PartialModelMixin._hub
        if hub is None:
            return super().push_to_hub(*args, **kwargs)
        return hub.push_to_hub(self, *args, **kwargs)

    # ------------------------------------------------------------------ conversion
    # `conversion.from_source` with this class: PartialRobertaForMaskedLM.from_source(source, pattern, ...)
    from_source = classmethod(from_source)

"""The module that holds P and R for the partial layers of an encoder, and the pattern a new model starts with.

`PartialPattern` keeps P (``indices``), R when it is common or fixed (``reconstruction``), its bias, the
layout derived from P as non-persistent buffers (refreshed when P is installed or loaded), so that a compiled or
exported forward reads plain tensors, and what the kernels derive from P and each R (`DerivedState`: the rows
sharing P and R, W = [I | R] of a frozen R). Part of the remote-code bundle (imports: torch, transformers, siblings).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from transformers import initialization as init

from .configuration_partial import PartialConfigMixin
from .attention_common import DerivedState, PartialTensors, PatternLayout, needs_grad, tie_rows
from .pattern import AttentionPattern
from .pattern_buckets import PatternBuckets
from .pattern_layers import LayerPatterns
# Where P and R live (re-exported: the names were defined here before `partial_places`).
from .partial_places import (
    bucket_suffix, head_count, own_patterns, pattern_module_name, r_keys, r_on_attention, r_trainable,
)

__all__ = ["PartialPattern", "PartialBertPattern", "default_pattern", "initial_for", "initial_stack", "check_buckets",
           "check_layers", "r_tensor", "init_bias", "bucket_suffix", "pattern_module_name", "head_count"]


@functools.lru_cache(maxsize=4)
def _local_pattern(n: int, k: int, correlation: float) -> AttentionPattern:
    return AttentionPattern.local(n, k, correlation)


def default_pattern(config: PartialConfigMixin, length: int | None = None, layer: int | None = None
                    ) -> AttentionPattern:
    """The pattern a model built from a config alone starts with in bucket ``length`` (default n; at ``layer``'s k
    when the layers have a k each): `AttentionPattern.local`; the last few are cached."""
    return _local_pattern(length or config.partial_seq_len, config.bucket_k(length, layer),
                          float(config.partial_default_correlation))


def check_buckets(config: PartialConfigMixin, pattern: AttentionPattern | PatternBuckets,
                  layer: int | None = None) -> PatternBuckets:
    """``pattern`` as buckets, checked against the config's n, k and buckets (``layer``'s ks when the layers have a k
    each; a ValueError naming the fix)."""
    buckets = PatternBuckets.coerce(pattern)
    ks = [config.bucket_k(b, layer) for b in config.partial_lengths]
    if (buckets.seq_len, buckets.k) != (config.partial_seq_len, ks[-1]):
        raise ValueError(f"pattern has seq_len={buckets.seq_len}, k={buckets.k} but the config has "
                         f"partial_seq_len={config.partial_seq_len}, partial_k={ks[-1]}"
                         f"{'' if config.partial_layers_k is None else f' at layer {layer} (partial_layers_k)'}; "
                         "build the config from the pattern (from_source does) or pass a pattern of the config's "
                         "n and k.")
    if buckets.lengths != list(config.partial_lengths):
        raise ValueError(f"pattern has length buckets {buckets.lengths} but the config has partial_lengths="
                         f"{config.partial_lengths}; build the config from the pattern (from_source does) or pass "
                         "buckets of the config's lengths.")
    if buckets.lengths_k != ks:
        where = ("partial_lengths_k=" if config.partial_layers_k is None else f"at layer {layer} (partial_layers_k) ")
        raise ValueError(f"pattern has a k per bucket of {buckets.lengths_k} but the config has {where}{ks} (buckets "
                         f"{config.partial_lengths}); "
                         "build the config from the pattern (from_source does) or pass buckets of the config's ks.")
    return buckets


def check_layers(config: PartialConfigMixin, pattern) -> None:
    """A ValueError unless ``pattern``'s kind fits ``config.partial_granularity`` and (per layer or head) it holds a
    P for every partial layer (and head)."""
    granularity = config.partial_granularity
    if own_patterns(config):
        if not isinstance(pattern, LayerPatterns) or pattern.granularity != granularity:
            found = pattern.granularity if isinstance(pattern, LayerPatterns) else type(pattern).__name__
            raise ValueError(f"partial_granularity={granularity!r} needs P and R per {granularity} (LayerPatterns, "
                             f"from `derive --granularity {granularity}`), got {found}; pass such a pattern or build "
                             "the config from the pattern (from_source does).")
        if head_count(config) is not None and pattern.heads != head_count(config):
            raise ValueError(f"the per-head pattern holds {pattern.heads} heads per layer but the model has "
                             f"num_attention_heads={config.num_attention_heads}; derive it from this model.")
        missing = sorted(set(config.partial_layers) - set(pattern.layers))
        if missing:
            raise ValueError(f"the per-layer pattern has no P and R for partial layers {missing} (it holds layers "
                             f"{list(pattern.layers)}); derive them (`derive --granularity layer` fits every layer) "
                             f"or set partial_layers to layers it holds.")
    elif isinstance(pattern, LayerPatterns):
        raise ValueError(f"a pattern per {pattern.granularity} (LayerPatterns) needs partial_granularity="
                         f"{pattern.granularity!r} in the config; from_source sets it from the pattern.")


def initial_for(config: PartialConfigMixin, pattern: AttentionPattern | PatternBuckets | LayerPatterns | None = None,
                length: int | None = None, layer: int | None = None, head: int | None = None) -> AttentionPattern:
    """The pattern of bucket ``length`` (default n; of ``layer`` and ``head`` for P and R per layer or head) a model
    under construction starts with: the one passed to its constructor (`from_source` passes its own), else the
    default for the config."""
    if pattern is None:
        return default_pattern(config, length, layer)
    check_layers(config, pattern)
    if isinstance(pattern, LayerPatterns):
        pattern = pattern.group(layer, head)
    return check_buckets(config, pattern, layer)[length or config.partial_seq_len]


def initial_stack(config: PartialConfigMixin, pattern=None, length: int | None = None,
                  layer: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """P, R and the bias (or None) a pattern module starts with (`initial_for`): for P and R per head, the heads'
    stacked, ``(H, n, k)``, ``(H, n, n−k, k)``, ``(H, n, n−k)``."""
    heads = head_count(config)
    patterns = [initial_for(config, pattern, length, layer, head) for head in
                ([None] if heads is None else range(heads))]
    bias = None if patterns[0].bias is None else [p.bias for p in patterns]
    if heads is None:
        p = patterns[0]
        return p.indices, p.reconstruction, None if bias is None else bias[0]
    return (torch.stack([p.indices for p in patterns]), torch.stack([p.reconstruction for p in patterns]),
            None if bias is None else torch.stack(bias))


def _on_meta_device() -> bool:
    # from_pretrained builds models under torch.device("meta"): nothing to compute, the checkpoint fills them.
    return torch.empty(0).device.type == "meta"


def r_tensor(config: PartialConfigMixin, trainable: bool, bias: bool,
             pattern: AttentionPattern | PatternBuckets | LayerPatterns | None = None,
             length: int | None = None, layer: int | None = None) -> nn.Parameter | torch.Tensor:
    """R ``(b, b−k, k)`` (or its bias ``(b, b−k)``) of bucket ``length`` (default n; of ``layer`` for P and R per
    layer) holding the initial pattern's values (`initial_for`)."""
    n, k = length or config.partial_seq_len, config.bucket_k(length)
    shape = (n, n - k) if bias else (n, n - k, k)
    if _on_meta_device():
        tensor = torch.empty(shape)
    else:
        pattern = initial_for(config, pattern, length, layer)
        if bias:
            tensor = torch.zeros(shape) if pattern.bias is None else pattern.bias.clone()
        else:
            tensor = pattern.reconstruction.clone()
    return nn.Parameter(tensor) if trainable else tensor


def init_bias(tensor: torch.Tensor, pattern: AttentionPattern) -> None:
    if pattern.bias is None:
        init.zeros_(tensor)
    else:
        init.copy_(tensor, pattern.bias)


class PartialPattern(nn.Module):
    """Holds P (and R unless R is per layer) of one length bucket (``length``, default n) for all partial layers of
    an encoder; with P and R per layer (``partial_granularity="layer"``), P and R of layer ``layer`` alone, its R
    trainable for ``reconstruction="per_layer"``; per head (``"head"``), layer ``layer``'s heads' P and R, stacked
    along a leading head dimension (P ``(H, n, k)``, R ``(H, n, n−k, k)``)."""

    # Under torch.compile without autograd, whether the kernels run as one custom op reading W and the blocks of
    # rows sharing P and R from the derived state (`attention_dispatch.compiled_attention`); False: W built in the
    # graph at every
    # call (what compiled models did before; benchmarks/compiled.py compares both). Set before compiling.
    compiled_fast_path: bool = True

    def __init__(self, config: PartialConfigMixin, pattern: AttentionPattern | PatternBuckets | LayerPatterns | None
                 = None, length: int | None = None, layer: int | None = None):
        super().__init__()
        n, k = length or config.partial_seq_len, config.bucket_k(length, layer)
        self.length, self.layer = n, layer
        self.heads = head_count(config)
        lead = () if self.heads is None else (self.heads,)
        if _on_meta_device():
            indices = torch.empty(*lead, n, k, dtype=torch.long)
            r, r_bias = torch.empty(*lead, n, n - k, k), torch.empty(*lead, n, n - k)
        else:
            indices, r, r_bias = (t if t is None else t.clone() for t in initial_stack(config, pattern, length, layer))
            r_bias = torch.zeros(*lead, n, n - k, dtype=r.dtype) if r_bias is None else r_bias
        r_bias = r_bias if config.partial_use_bias else None
        self.register_buffer("indices", indices, persistent=True)
        self.mode = config.reconstruction
        # R lives beside P here, unless each layer's attention module holds its own (`partial_places`)
        if not r_on_attention(config) and r_trainable(config):
            self.reconstruction = nn.Parameter(r)
            self.reconstruction_bias = None if r_bias is None else nn.Parameter(r_bias)
        elif not r_on_attention(config):
            self.register_buffer("reconstruction", r, persistent=True)
            self.register_buffer("reconstruction_bias", r_bias, persistent=True)
        # The layout derived from P (complement, inverse permutation, block structure) is kept as non-persistent
        # buffers, refreshed whenever P is installed or loaded, so that a compiled or exported forward reads plain
        # tensors (no cache lookup in the graph).
        self.register_buffer("complement", torch.empty(*lead, n, n - k, dtype=torch.long), persistent=False)
        self.register_buffer("inverse_permutation", torch.empty(*lead, n, n, dtype=torch.long), persistent=False)
        self.block_rows: int | None | list[int | None] = None
        self._layout_stamp: tuple | None = None
        # What the kernels derive from P and each R, kept by the owner of P under the R's (layer, head)
        # (`partial_places.r_keys`). Memory: see `DerivedState` (one W per distinct R).
        self.derived = {key: DerivedState() for key in r_keys(config)}
        self.tie_shared_rows = config.partial_tie_shared_rows
        if not _on_meta_device():
            self.refresh_layout()
        self.register_load_state_dict_post_hook(lambda module, incompatible: module.refresh_layout())

    @torch.no_grad()
    def refresh_layout(self) -> None:
        """Recompute the layout buffers from P (done by `set_pattern`, loading, and before an eager forward when P
        changed in place)."""
        self.complement, self.inverse_permutation, self.block_rows = self.derive_layout()
        self._layout_stamp = (self.indices.data_ptr(), self.indices._version)
        for state in self.derived.values():
            state.clear()

    @torch.no_grad()
    def derive_layout(self, indices: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, int | None | list]:
        """The layout of ``indices`` (default: this module's P): the complement ``(n, n−k)``, the inverse permutation
        ``(n, n)`` (each head's stacked, ``(H, ...)``, for P per head) and the rows per block sharing keys (a list per
        head)."""
        indices = self.indices if indices is None else indices
        if self.heads is None:
            layout = PatternLayout.from_indices(indices)
            return layout.complement, layout.inverse_permutation, layout.block_rows
        layouts = [PatternLayout.from_indices(p) for p in indices]  # one per head
        return (torch.stack([l.complement for l in layouts]), torch.stack([l.inverse_permutation for l in layouts]),
                [l.block_rows for l in layouts])  # (H, n, n-k), (H, n, n)

    def layout(self, head: int | None = None) -> PatternLayout:
        """P and its layout (of ``head`` for P per head). In eager mode a P changed in place is noticed and the
        layout refreshed; a compiled or exported graph reads the buffers as they are (call `refresh_layout` after
        changing P by hand)."""
        if not torch.compiler.is_compiling() and self._layout_stamp != (self.indices.data_ptr(), self.indices._version):
            self.refresh_layout()
        if self.heads is None:
            return PatternLayout(self.indices, self.complement, self.inverse_permutation, self.block_rows)
        return PatternLayout(self.indices[head], self.complement[head], self.inverse_permutation[head],
                             self.block_rows[head])

    def forward(self, reconstruction: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                layer: int | None = None) -> PartialTensors | list[PartialTensors]:
        """What a partial layer reconstructs with: P's layout (with the blocks of rows sharing P and R), R, its bias
        and their derived state. A layer with its own R (per_layer) passes it, its bias and its index. With
        ``partial_tie_shared_rows`` a trainable R shared by blocks of rows gets its block's summed gradient. For P
        and R per head: a list, one per head (views of the stacked tensors, so gradients reach them)."""
        if reconstruction is None:
            reconstruction, bias = getattr(self, "reconstruction", None), getattr(self, "reconstruction_bias", None)
        if self.heads is None:
            return self._tensors(self.layout(), reconstruction, bias, (layer, None))
        return [self._tensors(self.layout(h), reconstruction[h], None if bias is None else bias[h], (None, h))
                for h in range(self.heads)]

    def _tensors(self, layout: PatternLayout, reconstruction, bias, key) -> PartialTensors:
        # Under torch.compile the state is passed but not read in the graph (no Python-side cache there): the
        # compiled fast path reads it at run time, outside the graph (`attention_dispatch.compiled_attention`); the
        # other paths build W
        # in the graph. Under torch.export, or without `compiled_fast_path`, no state: W is built in the graph.
        compiling = torch.compiler.is_compiling()
        fast = self.compiled_fast_path and not torch.compiler.is_exporting()
        derived = self.derived[key] if not compiling or fast else None
        if derived is not None and not compiling:
            layout = layout._replace(shared_rows=derived.shared_rows(layout.indices, reconstruction))
        if self.tie_shared_rows and needs_grad(reconstruction):
            reconstruction = tie_rows(reconstruction, layout.shared_rows)
        return PartialTensors(layout, reconstruction, bias, derived)


# The name of 0.x (PartialBert's encoder held it); the module serves every architecture.
PartialBertPattern = PartialPattern

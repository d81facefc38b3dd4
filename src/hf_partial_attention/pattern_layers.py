"""`LayerPatterns`: P and R per layer (each layer's own `PatternBuckets`) or per (layer, head), stored as one
safetensors file.

The paper fits one P and R on the covariance pooled over layers and heads; ``derive --granularity layer`` (``head``)
fits each layer's (each head's) own, and a model built from them (``partial_granularity="layer"``, ``"head"``) runs
each with its own P and R. `LayerPatterns` says why and what every group shares; `LayerPatterns.save` the file
format. `load_patterns` reads any pattern file `derive` writes.

This file is part of the remote-code bundle (imports: torch, safetensors and siblings only).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file

from .pattern import open_tagged_file
from .pattern_buckets import PatternBuckets

__all__ = ["LayerPatterns", "PATTERN_LAYERS_FORMAT_VERSION", "is_layer_patterns_file", "load_patterns"]

PATTERN_LAYERS_FORMAT_VERSION = "1"
_META_KEY = "hf_partial_attention_layers"
_EXPECTED = ("a per-layer pattern file written by `hf-partial-attention derive --granularity layer` "
             "(<out>/patterns/per_query_layer_k<k>.safetensors) or by LayerPatterns.save")


class LayerPatterns:
    """P and R per layer, ``{layer: PatternBuckets}`` (or ``AttentionPattern``, one bucket), or per (layer, head),
    ``{layer: [one per head]}``; every group with the same buckets and bias flag, every layer with the same number of
    heads; the heads of a layer with the same k per bucket (layers may differ: `layers_k`).

    Layers differ (MiniLM's layer 0 keeps 93 % of its score energy in 8 eigenvectors, layer 5 27 %), so ``derive
    --granularity layer`` fits each layer's P and R on that layer's own covariance; a model built from them
    (``partial_granularity="layer"``) runs layer l with its own P and R. ``derive --granularity head`` goes one step
    further: each head of each layer its own P and R (``partial_granularity="head"``). Every group has the same
    length buckets (and the same exact ones) and the same bias flag; k per bucket is the same for every group, so
    that the QKᵀ cost is the pooled pattern's, except after ``derive --saving``, which gives each layer its own k (the
    heads of a layer share it: ``config.partial_layers_k``).

    Args:
        layers: ``{layer index: pattern}`` or ``{layer index: [pattern of head 0, head 1, ...]}``, at least one.
        metadata: JSON-serialisable facts about the set (source model, objective, ...).

    Raises:
        ValueError: no layer, a negative index, groups whose buckets or bias differ, heads of a layer whose ks differ,
            or layers with different numbers of heads (each named).
        TypeError: a value that is neither pattern type.
    """

    def __init__(self, layers: Mapping[int, Any], metadata: dict[str, Any] | None = None):
        if not layers:
            raise ValueError("LayerPatterns needs at least one layer's pattern.")
        groups: dict[int, Any] = {}
        for layer, pattern in layers.items():
            if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                raise ValueError(f"layer indices must be ints >= 0, got {layer!r}.")
            if isinstance(pattern, (list, tuple)):
                if not pattern:
                    raise ValueError(f"layer {layer} has an empty list of head patterns.")
                groups[layer] = [PatternBuckets.coerce(p) for p in pattern]
            else:
                groups[layer] = PatternBuckets.coerce(pattern)
        per_head = {isinstance(g, list) for g in groups.values()}
        if len(per_head) > 1:
            raise ValueError("either every layer gives one pattern per head (a list) or none does.")
        self.heads: int | None = None
        if per_head == {True}:
            counts = {layer: len(g) for layer, g in groups.items()}
            if len(set(counts.values())) > 1:
                raise ValueError(f"layers have different numbers of head patterns: {counts}; give every layer one "
                                 "per attention head.")
            self.heads = next(iter(counts.values()))
        self.layers: dict[int, Any] = dict(sorted(groups.items()))
        first_name, first = next(iter(self.groups()))
        for name, b in self.groups():
            if (b.lengths, b.exact_lengths, b.has_bias) != (first.lengths, first.exact_lengths, first.has_bias):
                raise ValueError(
                    f"{name}'s pattern has buckets {b.lengths} (exact: {b.exact_lengths}, bias {b.has_bias}) but "
                    f"{first_name}'s has {first.lengths} (exact: {first.exact_lengths}, bias {first.has_bias}); "
                    "derive every group with the same buckets and --bias.")
        for layer, group in groups.items():
            if isinstance(group, list) and len({tuple(b.lengths_k) for b in group}) > 1:
                raise ValueError(f"layer {layer}'s heads have different ks per bucket "
                                 f"{sorted({tuple(b.lengths_k) for b in group})}; the heads of a layer share k (their "
                                 "P and R are stacked), only layers may differ (`derive --saving`).")
        self.metadata: dict[str, Any] = dict(metadata or {})

    @property
    def granularity(self) -> str:
        """``"layer"`` or ``"head"`` (``partial_granularity`` of a model built from it)."""
        return "layer" if self.heads is None else "head"

    def groups(self):
        """``(name, PatternBuckets)`` of every group: ``("layer 3", ...)`` or ``("layer 3 head 1", ...)``."""
        for layer, group in self.layers.items():
            if isinstance(group, list):
                for head, buckets in enumerate(group):
                    yield f"layer {layer} head {head}", buckets
            else:
                yield f"layer {layer}", group

    def group(self, layer: int, head: int | None = None) -> PatternBuckets:
        """The buckets of ``layer`` (and ``head`` when P and R are per head)."""
        group = self[layer]
        if self.heads is None:
            if head is not None:
                raise ValueError(f"head={head} asked of patterns per layer (no head dimension).")
            return group
        if head is None or not 0 <= head < self.heads:
            raise ValueError(f"patterns per head: name a head in [0, {self.heads}), got {head!r}.")
        return group[head]

    # The fields a config takes from a pattern, as `PatternBuckets` has them (every group has the same).
    def first(self) -> PatternBuckets:
        return next(self.groups())[1]

    @property
    def seq_len(self) -> int:
        return self.first().seq_len

    @property
    def k(self) -> int:
        """n's k: the largest of the layers' (they differ after `derive --saving`)."""
        return self.lengths_k[-1]

    @property
    def lengths(self) -> list[int]:
        return self.first().lengths

    @property
    def lengths_k(self) -> list[int]:
        """The k of each bucket, the largest of the layers' (``config.partial_lengths_k``)."""
        return [max(column) for column in zip(*(b.lengths_k for _, b in self.groups()))]

    def layer_lengths_k(self, layer: int) -> list[int]:
        """Layer ``layer``'s k of each bucket (its heads share it)."""
        group = self[layer]
        return (group if self.heads is None else group[0]).lengths_k

    def layers_k(self, layers=None) -> list[list[int]] | None:
        """The ks per bucket of ``layers`` (default: every layer held), in order (``config.partial_layers_k``), or
        None when they all have the same."""
        rows = [self.layer_lengths_k(layer) for layer in (self.layers if layers is None else layers)]
        return None if all(row == rows[0] for row in rows) else rows

    @property
    def has_bias(self) -> bool:
        return self.first().has_bias

    def __getitem__(self, layer: int):
        if layer not in self.layers:
            raise KeyError(f"no pattern for layer {layer}; the file holds layers {list(self.layers)}.")
        return self.layers[layer]

    # ------------------------------------------------------------------ io
    def save(self, path: str | os.PathLike) -> None:
        """Write one safetensors file: every layer's buckets (``layer{l}.`` + the buckets' tensor names).

        File format (``PATTERN_LAYERS_FORMAT_VERSION``): each group's `PatternBuckets` tensors prefixed ``layer{l}.``
        (per layer) or ``layer{l}.head{h}.`` (per head), e.g. ``layer{l}.len{b}.indices``; header
        ``{"format_version", "layers", "heads" (null per layer), "lengths", "lengths_k", "buckets": {"l" or "l.h":
        that group's buckets header}, "metadata"}`` under its own key, so that a pooled file's reader refuses it by
        name."""
        tensors, headers = {}, {}
        for layer, group in self.layers.items():
            for head, buckets in ([(None, group)] if self.heads is None else enumerate(group)):
                key = str(layer) if head is None else f"{layer}.{head}"
                parts, header = buckets.to_parts()
                prefix = f"layer{layer}." if head is None else f"layer{layer}.head{head}."
                tensors.update({prefix + name: tensor for name, tensor in parts.items()})
                headers[key] = header
        header = {"format_version": PATTERN_LAYERS_FORMAT_VERSION, "layers": list(self.layers), "heads": self.heads,
                  "lengths": self.lengths, "lengths_k": self.lengths_k, "buckets": headers, "metadata": self.metadata}
        save_file(tensors, os.fspath(path), metadata={_META_KEY: json.dumps(header)})

    @classmethod
    def load(cls, path: str | os.PathLike) -> "LayerPatterns":
        """Read a file of `save` (a ValueError naming the file and what is wrong otherwise)."""
        path = os.fspath(path)
        with open_tagged_file(path, _META_KEY, "per-layer pattern", PATTERN_LAYERS_FORMAT_VERSION,
                              expected=_EXPECTED) as (header, f):
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        try:
            heads = header.get("heads")

            def group(prefix: str, key: str) -> PatternBuckets:
                parts = {name.removeprefix(prefix): t for name, t in tensors.items() if name.startswith(prefix)}
                return PatternBuckets.from_parts(parts, header["buckets"][key])

            layers = {}
            for layer in map(int, header["layers"]):
                layers[layer] = (group(f"layer{layer}.", str(layer)) if heads is None else
                                 [group(f"layer{layer}.head{h}.", f"{layer}.{h}") for h in range(int(heads))])
            return cls(layers, metadata=header.get("metadata", {}))
        except (KeyError, ValueError, TypeError) as err:
            raise ValueError(f"{path!r} holds invalid per-layer patterns: {err}. Pass {_EXPECTED}.") from err

    def __repr__(self) -> str:
        return (f"LayerPatterns(layers={list(self.layers)}, heads={self.heads}, lengths={self.lengths}, "
                f"k={self.lengths_k}, bias={self.has_bias})")


def is_layer_patterns_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a safetensors file with `LayerPatterns`' header."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        return False
    try:
        with safe_open(path, framework="pt") as f:
            return _META_KEY in (f.metadata() or {})
    except Exception:  # not safetensors: the loaders say so
        return False


def load_patterns(path: str | os.PathLike) -> PatternBuckets | LayerPatterns:
    """Any pattern file `derive` writes: per layer (`LayerPatterns`), length buckets or a single pattern
    (`PatternBuckets`)."""
    return LayerPatterns.load(path) if is_layer_patterns_file(path) else PatternBuckets.load(path)

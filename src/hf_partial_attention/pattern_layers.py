"""`LayerPatterns`: P and R per layer (each layer's own `PatternBuckets`), stored as one safetensors file.

The paper fits one P and R on the covariance pooled over layers and heads. Layers differ (MiniLM's layer 0 keeps
93 % of its score energy in 8 eigenvectors, layer 5 27 %), so ``derive --granularity layer`` fits each layer's P and
R on that layer's own covariance; a model built from them (``partial_granularity="layer"``) runs layer l with its
own P and R. Every layer has the same length buckets, the same k per bucket and the same bias flag, so that the
QKᵀ cost is the pooled pattern's.

File format (``PATTERN_LAYERS_FORMAT_VERSION``): each layer's `PatternBuckets` tensors prefixed ``layer{l}.``
(``layer{l}.len{b}.indices``, ...), header ``{"format_version", "layers", "lengths", "lengths_k", "buckets":
{l: that layer's buckets header}, "metadata"}`` under its own key, so that a pooled file's reader refuses it by name.

This file is part of the remote-code bundle (imports: torch, safetensors and siblings only).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file

from .pattern import AttentionPattern, open_tagged_file
from .pattern_buckets import PatternBuckets

__all__ = ["LayerPatterns", "PATTERN_LAYERS_FORMAT_VERSION", "is_layer_patterns_file", "load_patterns"]

PATTERN_LAYERS_FORMAT_VERSION = "1"
_META_KEY = "hf_partial_attention_layers"
_EXPECTED = ("a per-layer pattern file written by `hf-partial-attention derive --granularity layer` "
             "(<out>/patterns/per_query_layer_k<k>.safetensors) or by LayerPatterns.save")


class LayerPatterns:
    """Per-layer P and R: ``{layer: PatternBuckets}`` (or ``AttentionPattern``, one bucket), every layer with the
    same buckets, k per bucket and bias flag.

    Args:
        layers: ``{layer index: AttentionPattern | PatternBuckets}``, at least one.
        metadata: JSON-serialisable facts about the set (source model, objective, ...).

    Raises:
        ValueError: no layer, a negative index, or layers whose buckets, ks or bias differ (each named).
        TypeError: a value that is neither pattern type.
    """

    def __init__(self, layers: Mapping[int, AttentionPattern | PatternBuckets], metadata: dict[str, Any] | None = None):
        if not layers:
            raise ValueError("LayerPatterns needs at least one layer's pattern.")
        buckets = {}
        for layer, pattern in layers.items():
            if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                raise ValueError(f"layer indices must be ints >= 0, got {layer!r}.")
            buckets[layer] = PatternBuckets.coerce(pattern)
        first_layer, first = min(buckets.items())
        for layer, b in buckets.items():
            if (b.lengths, b.lengths_k, b.has_bias) != (first.lengths, first.lengths_k, first.has_bias):
                raise ValueError(
                    f"layer {layer}'s pattern has buckets {b.lengths} with k {b.lengths_k} (bias {b.has_bias}) but "
                    f"layer {first_layer}'s has {first.lengths} with k {first.lengths_k} (bias {first.has_bias}); "
                    "derive every layer with the same --k, buckets and --bias (the cost of a layer is its k).")
        self.layers: dict[int, PatternBuckets] = dict(sorted(buckets.items()))
        self.metadata: dict[str, Any] = dict(metadata or {})

    # The fields a config takes from a pattern, as `PatternBuckets` has them (every layer has the same).
    def _first(self) -> PatternBuckets:
        return next(iter(self.layers.values()))

    @property
    def seq_len(self) -> int:
        return self._first().seq_len

    @property
    def k(self) -> int:
        return self._first().k

    @property
    def lengths(self) -> list[int]:
        return self._first().lengths

    @property
    def lengths_k(self) -> list[int]:
        return self._first().lengths_k

    @property
    def has_bias(self) -> bool:
        return self._first().has_bias

    def __getitem__(self, layer: int) -> PatternBuckets:
        if layer not in self.layers:
            raise KeyError(f"no pattern for layer {layer}; the file holds layers {list(self.layers)}.")
        return self.layers[layer]

    # ------------------------------------------------------------------ io
    def save(self, path: str | os.PathLike) -> None:
        """Write one safetensors file: every layer's buckets (``layer{l}.`` + the buckets' tensor names)."""
        tensors, headers = {}, {}
        for layer, buckets in self.layers.items():
            parts, header = buckets.to_parts()
            tensors.update({f"layer{layer}.{name}": tensor for name, tensor in parts.items()})
            headers[str(layer)] = header
        header = {"format_version": PATTERN_LAYERS_FORMAT_VERSION, "layers": list(self.layers),
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
            layers = {}
            for layer in header["layers"]:
                prefix = f"layer{int(layer)}."
                parts = {name.removeprefix(prefix): t for name, t in tensors.items() if name.startswith(prefix)}
                layers[int(layer)] = PatternBuckets.from_parts(parts, header["buckets"][str(layer)])
            return cls(layers, metadata=header.get("metadata", {}))
        except (KeyError, ValueError, TypeError) as err:
            raise ValueError(f"{path!r} holds invalid per-layer patterns: {err}. Pass {_EXPECTED}.") from err

    def __repr__(self) -> str:
        return (f"LayerPatterns(layers={list(self.layers)}, lengths={self.lengths}, k={self.lengths_k}, "
                f"bias={self.has_bias})")


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

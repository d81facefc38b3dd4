"""Where the P and R of a (layer, head, length bucket) live in a partial model: the one answer.

The rules are stated once, in `place`'s docstring. Installation (`partial_layer.make_partial`,
`PartialModelMixin`), initialisation, loading checks, `get_pattern` / `set_pattern`, `reconstruction_tensors`, the
state-dict names (`PARTIAL_NAME`) and the model card read these rules from here. Part of the remote-code bundle
(imports: siblings only).
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ["PARTIAL_NAME", "is_reconstruction_name", "Place", "bucket_suffix", "pattern_module_name", "r_on_attention",
           "attention_r_names", "place", "pattern_layers", "head_count", "heads", "tensor_names", "r_trainable",
           "pattern_module_layers", "r_keys", "own_patterns", "per_layer_granularity"]

# P, R and their biases in a state dict: the pattern modules' tensors and each partial layer's own R (per_layer).
PARTIAL_NAME = re.compile(r"\.partial_pattern(_layer\d+)?(_len\d+)?\.|\.reconstruction(_bias)?(_len\d+)?$")
# The last component of the name of an R or its bias, wherever it lives (a pattern module's or a layer's, any bucket).
_R_NAME = re.compile(r"reconstruction(_bias)?(_len\d+)?")


def is_reconstruction_name(name: str) -> bool:
    """True for R and its bias, of n and of every shorter length bucket (``...partial_pattern.reconstruction``,
    ``...self.reconstruction_bias``, ``...partial_pattern_len32.reconstruction``, ``...self.reconstruction_len32``)."""
    return _R_NAME.fullmatch(name.rsplit(".", 1)[-1]) is not None


def bucket_suffix(config, length: int | None) -> str:
    """The suffix of a bucket's tensor names: ``""`` for n (the names of format 1), ``"_len{b}"`` for b < n."""
    return "" if length is None or length == config.partial_seq_len else f"_len{length}"


def pattern_module_name(config, length: int | None = None, layer: int | None = None) -> str:
    """The owner's attribute holding the pattern module of bucket ``length`` (default n): ``partial_pattern`` +
    the bucket's suffix, with ``_layer{l}`` before it when each layer has its own P (``partial_granularity`` "layer"
    or "head", where ``layer`` is required)."""
    if own_patterns(config):
        if layer is None:
            raise ValueError(f"partial_granularity={config.partial_granularity!r}: name the layer whose pattern "
                             "module is meant.")
        return f"partial_pattern_layer{layer}" + bucket_suffix(config, length)
    return "partial_pattern" + bucket_suffix(config, length)


def r_on_attention(config) -> bool:
    """Whether each partial layer's attention module holds its own R (a pooled P with ``reconstruction="per_layer"``)
    rather than the pattern module beside P."""
    return config.reconstruction == "per_layer" and not own_patterns(config)


def attention_r_names(config, length: int | None) -> tuple[str, str]:
    """The names of R and its bias of bucket ``length`` on an attention module (`r_on_attention`)."""
    suffix = bucket_suffix(config, length)
    return "reconstruction" + suffix, "reconstruction_bias" + suffix


class Place(NamedTuple):
    """Where one (layer, head, bucket)'s P and R are: the owner's pattern module ``pattern`` (P at ``.indices``),
    R and its bias under ``r_name`` / ``bias_name`` on that module or (``on_attention``) on layer ``layer``'s
    attention module; ``head``: the slice of a leading head dimension (None: no such dimension)."""

    pattern: str
    on_attention: bool
    r_name: str
    bias_name: str
    layer: int | None
    head: int | None


def place(config, layer: int | None = None, length: int | None = None, head: int | None = None) -> Place:
    """The `Place` of layer ``layer``'s (None: the layers share it), head ``head``'s, bucket ``length``'s (None: n)
    P and R. Where P or R is per layer, a layer is required.

    The rules (``config``: a partial config):

    - P of every layer (``partial_granularity="pooled"``) is ``<owner>.partial_pattern<suffix>.indices``; with P per
      layer or per head (``"layer"``, ``"head"``), layer l's is ``<owner>.partial_pattern_layer{l}<suffix>.indices``,
      its heads stacked along a leading dimension for ``"head"``. ``<suffix>`` is ``""`` for n and ``_len{b}`` for a
      bucket b < n (`bucket_suffix`).
    - R (and its bias) sits beside P in the same pattern module (``.reconstruction``, ``.reconstruction_bias``),
      except for a pooled P with ``reconstruction="per_layer"``: then each partial layer's attention module holds its
      own (``<attention>.reconstruction<suffix>``, ``.reconstruction_bias<suffix>``).
    - Trainable: every R but ``reconstruction="fixed"`` (`r_trainable`)."""
    if r_on_attention(config):
        if layer is None:
            raise ValueError("reconstruction='per_layer': name the layer whose R is meant.")
        r_name, bias_name = attention_r_names(config, length)
        return Place(pattern_module_name(config, length), True, r_name, bias_name, layer, None)
    head = None if config.partial_granularity != "head" else (0 if head is None else head)
    return Place(pattern_module_name(config, length, layer), False, "reconstruction", "reconstruction_bias", layer,
                 head)


def per_layer_granularity(granularity: str) -> bool:
    """Whether P and R of this ``partial_granularity`` (or `derive --granularity`) are fitted per layer ("layer",
    "head") rather than pooled over the layers ("pooled")."""
    return granularity != "pooled"


def own_patterns(config) -> bool:
    """Whether each partial layer has a P (and R) of its own (P per layer or per head)."""
    return per_layer_granularity(config.partial_granularity)


def pattern_module_layers(config) -> list[int | None]:
    """The layers that own pattern modules of their own (P per layer or per head), else ``[None]``: one set of
    pattern modules serves every layer."""
    return list(config.partial_layers) if own_patterns(config) else [None]


def r_trainable(config) -> bool:
    """Whether R (and its bias) are trained: every mode but ``reconstruction="fixed"``."""
    return config.reconstruction != "fixed"


def pattern_layers(config) -> list[int | None]:
    """The layers with a P or an R of their own (R per layer, or P per layer or head), else ``[None]``."""
    if config.reconstruction == "per_layer" or own_patterns(config):
        return list(config.partial_layers)
    return [None]


def r_keys(config) -> list[tuple[int | None, int | None]]:
    """The ``(layer, head)`` of every R one pattern module reconstructs with (what the kernels derive from P and R
    is kept per R under this key): per head, ``(None, h)`` for head h's slice of its own R; else ``(None, None)`` for
    its own R (common or fixed) and ``(l, None)`` for layer l's own R on its attention module (per_layer)."""
    count = head_count(config)
    if count is not None:
        return [(None, h) for h in range(count)]
    return [(None, None), *((layer, None) for layer in config.partial_layers)]


def head_count(config) -> int | None:
    """The heads of a layer when each has its own P and R (``partial_granularity="head"``), else None."""
    return config.num_attention_heads if config.partial_granularity == "head" else None


def heads(config) -> list[int | None]:
    """Each head when P and R are per head, else ``[None]``."""
    count = head_count(config)
    return [None] if count is None else list(range(count))


def tensor_names(config, owner: str, attention: str, length: int | None = None) -> dict[str, str]:
    """The full state-dict names of bucket ``length``'s (None: n) P, R and (with ``partial_use_bias``) R's bias:
    ``{"P": ..., "R": ..., "bias": ...}``, with ``{l}`` standing for the layer where P or R is per layer.

    ``owner``: the path of the module holding the pattern modules, with a trailing dot (``"bert.encoder."``);
    ``attention``: the path of layer ``{l}``'s attention module (``"bert.encoder.layer.{l}.attention.self"``).
    """
    where = place(config, None if pattern_layers(config) == [None] else "{l}", length)  # "{l}": the layer, named later
    pattern = owner + where.pattern
    holder = attention if where.on_attention else pattern
    names = {"P": f"{pattern}.indices", "R": f"{holder}.{where.r_name}"}
    if getattr(config, "partial_use_bias", False):
        names["bias"] = f"{holder}.{where.bias_name}"
    return names

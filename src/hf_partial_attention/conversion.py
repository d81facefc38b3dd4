"""Converting a source checkpoint (BERT, RoBERTa, ModernBERT, ...) into its partial model: the source load, the config
and the weight copy.

`from_source` runs these steps for any partial class (``PartialRobertaModel.from_source``, and
``PartialBertModel.from_bert``, are this function);
the pattern goes to the model's constructor (``model_class(config, pattern=pattern)``), so that no default pattern
is built for a model that gets another one. Part of the remote-code bundle (imports: torch, transformers and
siblings only; the model class comes in as an argument, so this module sits below the modeling file).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from transformers import PreTrainedModel

from .architectures import ARCHITECTURES, check_supported
from .configuration_partial import PartialConfigMixin
from .pattern import AttentionPattern
from .pattern_buckets import PatternBuckets
from .pattern_layers import LayerPatterns

logger = logging.getLogger(__name__)

__all__ = ["from_source", "from_bert", "PARTIAL_FIELDS", "load_source", "partial_config", "copy_weights"]

# The partial fields; every other keyword of from_source is a setting of the source's config (num_labels, id2label,
# classifier_dropout, ...) that must also reach the source load, so that the source's head has the right shape.
PARTIAL_FIELDS = frozenset(f.name for f in dataclasses.fields(PartialConfigMixin))
_LOAD_KWARGS = ("revision", "token", "dtype", "cache_dir", "local_files_only", "trust_remote_code")
_NOT_BERT_FIELDS = ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path")



def from_source(model_class, source_model_or_path, pattern: AttentionPattern | PatternBuckets | LayerPatterns, *,
                output_loading_info: bool = False, revision: str | None = None, token: str | bool | None = None,
                dtype=None, cache_dir: str | None = None, **config_overrides):
    """Convert a source checkpoint of ``model_class``'s architecture (BERT, MiniLM, RoBERTa, ModernBERT, ...) into
    ``model_class`` (a partial class), keeping every weight, and install P and R.
    ``PartialBertForMaskedLM.from_bert(source, pattern)`` and ``PartialRobertaModel.from_source(...)`` call this.

    Args:
        model_class: the partial class to build (its ``_source_class`` is the class the source is loaded as).
        source_model_or_path: a model instance of the source architecture, or a path / Hub id loadable by the
            matching source class (`BertModel` for `PartialBertModel`, `RobertaForMaskedLM` for
            `PartialRobertaForMaskedLM`, and so on). A source of another architecture is an error naming both.
        pattern: a per-query `AttentionPattern` (one bucket), `PatternBuckets` (P and R per length bucket) or
            `LayerPatterns` (P and R per layer: ``partial_granularity="layer"``); n, k and the buckets
            (``partial_lengths``) come from it.
        output_loading_info: also return ``{"missing_keys", "unexpected_keys", "source"}``: the target weights
            the source did not provide (a new head), source weights without a place, and the source load's own
            report.
        revision, token, dtype, cache_dir: passed to the source's ``from_pretrained``; the converted model takes
            the source's dtype.
        **config_overrides: partial config fields (`PartialBertConfig`), e.g. ``reconstruction="per_layer"``,
            ``partial_layers=[0, 1]``, ``attn_implementation="eager"`` (for non-partial layers), and BERT
            settings of the head (``num_labels=3``, ``id2label=...``), which also reach the source load.
    """
    if not isinstance(pattern, LayerPatterns):
        pattern = PatternBuckets.coerce(pattern)  # a TypeError / ValueError naming what was given
    attn_impl = config_overrides.pop("attn_implementation", None)
    settings = {k: v for k, v in config_overrides.items() if k not in PARTIAL_FIELDS}
    source, source_info = load_source(
        model_class._source_class, source_model_or_path, settings,
        {"revision": revision, "token": token, "dtype": dtype, "cache_dir": cache_dir})
    config = partial_config(source, pattern, config_overrides, model_class.config_class)
    if attn_impl is not None:
        config._attn_implementation = attn_impl
    model = _build(model_class, config, pattern, source)
    model.to(next(source.parameters()).dtype)  # floating tensors only; P stays int64
    report = copy_weights(source, model, set(model._partial_tensor_names()))
    # Weights the source load itself initialised afresh (a new head) were copied, but are new all the same.
    report["missing_keys"] = sorted(set(report["missing_keys"]) | set(source_info.get("missing_keys", [])))
    model.set_pattern(pattern)  # also checks the pattern against the config
    return (model, {**report, "source": source_info}) if output_loading_info else model


def _build(model_class, config, pattern, source):
    """``model_class(config, pattern=pattern)`` (P and R go in at construction: the default is never built). Its
    weights are built without their random initialisation when the source provides every one of them (they are
    overwritten by the copy; initialising them was most of a conversion's time), and initialised as usual
    when some are new (a head the source lacks keeps its fresh initialisation)."""
    from transformers.initialization import no_init_weights

    with no_init_weights():  # also skips the tying `init_weights` does: tie here, as from_pretrained does
        model = model_class(config, pattern=pattern)
    model.tie_weights()
    if not _new_weights(source, model):
        return model
    return model_class(config, pattern=pattern)


def _new_weights(source, target) -> list[str]:
    """The target's weights (P and R excluded) the source has no tensor for, by `copy_weights`'s name mapping."""
    return sorted(set(target.state_dict()) - set(_source_state(source, target)) - set(target._partial_tensor_names()))


def _source_state(source, target) -> dict:
    """The source's state dict under the target's names (``bert.`` added to a bare base model's, or dropped)."""
    src_state = source.state_dict()
    prefix = target.base_model_prefix + "."
    if source.base_model_prefix not in source._modules:  # a bare base model (BertModel, RobertaModel, ...)
        src_state = {prefix + key: value for key, value in src_state.items()}
    if target.base_model_prefix not in target._modules:  # target is the bare partial base model
        src_state = {key.removeprefix(prefix): v for key, v in src_state.items() if key.startswith(prefix)}
    return src_state


def load_source(source_class, source_model_or_path, settings: dict[str, Any], load_kwargs: dict[str, Any]):
    """``(source model, its loading info)``: an instance as given, or ``source_class.from_pretrained`` of a path/Hub
    id with the head ``settings`` (num_labels, ...) and ``load_kwargs`` (revision, token, dtype, ...). A source whose
    ``model_type`` is not ``source_class``'s is refused (`architectures.check_supported` names what is supported)."""
    unknown = sorted(set(load_kwargs) - set(_LOAD_KWARGS))
    if unknown:
        raise TypeError(f"from_source got unknown loading arguments {unknown}; it takes {list(_LOAD_KWARGS)}.")
    if isinstance(source_model_or_path, (str, os.PathLike)):
        from transformers import AutoConfig

        kwargs = {k: v for k, v in load_kwargs.items() if v is not None}
        source_config = AutoConfig.from_pretrained(os.fspath(source_model_or_path), **{
            k: v for k, v in kwargs.items() if k in ("revision", "token", "cache_dir", "trust_remote_code")})
        _check_source_type(source_config, source_class)
        return source_class.from_pretrained(os.fspath(source_model_or_path), output_loading_info=True, **kwargs,
                                            **settings)
    if not isinstance(source_model_or_path, PreTrainedModel):
        raise TypeError("source_model_or_path (the source) must be a path, a Hub id or a transformers model, got "
                        f"{type(source_model_or_path).__name__}.")
    _check_source_type(source_model_or_path.config, source_class)
    given = {k: v for k, v in settings.items() if getattr(source_model_or_path.config, k, v) != v}
    if given:
        raise ValueError(f"from_source was given {given} for a model instance whose config says otherwise; pass the "
                         "path or Hub id instead (the source is then loaded with these settings).")
    if any(v is not None for v in load_kwargs.values()):
        raise ValueError(f"{sorted(load_kwargs)} apply to loading a path or Hub id, not to a model instance.")
    return source_model_or_path, {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}


def _check_source_type(config, source_class) -> None:
    """Refuse a source of another architecture than ``source_class``'s (a RoBERTa into PartialBert, ...): loading it
    would map its weights onto the wrong modules, or start them afresh."""
    expected = source_class.config_class.model_type
    if config.model_type == ARCHITECTURES[expected].partial_model_type:  # a partial checkpoint of this architecture
        return
    check_supported(config)  # one line naming the model type and what is supported
    if config.model_type != expected:
        raise ValueError(f"the source is a {config.model_type!r} model, but {source_class.__name__} loads "
                         f"{expected!r}; convert it with its own partial class "
                         f"(`hf_partial_attention.partial_class_for`({config.model_type!r})) or "
                         "`hf-partial-attention convert`, which picks it.")


def partial_config(source, pattern: AttentionPattern | PatternBuckets | LayerPatterns, overrides: dict[str, Any],
                   config_class=None):
    """The source's config as ``config_class`` (default: the partial config of the source's architecture) with n,
    k, the buckets and the bias flag
    of ``pattern`` (and, for `LayerPatterns`, ``partial_granularity="layer"`` and R per layer unless
    ``reconstruction="fixed"`` is asked for) and the given overrides."""
    if config_class is None:
        from .architectures import architecture_for
        from .configuration_partial_encoders import config_class_for

        config_class = config_class_for(architecture_for(source.config).model_type)
    if not isinstance(pattern, LayerPatterns):
        pattern = PatternBuckets.coerce(pattern)
    fields = source.config.to_dict()
    for drop in _NOT_BERT_FIELDS:
        fields.pop(drop, None)
    fields.pop("partial_layers_k", None)  # the pattern's (below), not a partial source's
    fields.update(partial_seq_len=pattern.seq_len, partial_k=pattern.k, partial_lengths=pattern.lengths,
                  partial_lengths_k=pattern.lengths_k, partial_use_bias=pattern.has_bias)
    if isinstance(pattern, LayerPatterns):
        # each layer (or head) its own P, so its own R: trainable per layer unless the caller fixes it
        fields.update(partial_granularity=pattern.granularity, reconstruction="per_layer")
    fields.update(overrides)
    exact = pattern.metadata.get("exact_layers") if isinstance(pattern, LayerPatterns) else None
    if exact and "partial_layers" not in overrides:
        # `derive --exact-layers`: the budget left these layers exact; they hold no P and R
        fields.update(partial_layers=[layer for layer in config_class(**fields).partial_layers if layer not in exact])
    if isinstance(pattern, LayerPatterns) and "partial_layers_k" not in overrides:
        # a k per layer (`derive --saving`): the partial layers' own, known once the config has chosen them
        layers = [layer for layer in config_class(**fields).partial_layers if layer in pattern.layers]
        rows = [pattern.layer_lengths_k(layer) for layer in layers]
        if rows:  # (a layer the pattern lacks is refused by name when the model is built)
            tops = [max(column) for column in zip(*rows)]
            fields.update(partial_lengths_k=tops, partial_k=tops[-1])
            if any(row != rows[0] for row in rows):
                fields.update(partial_layers_k=rows)
    if isinstance(source.config._name_or_path, str) and source.config._name_or_path:
        fields.setdefault("partial_base_model", source.config._name_or_path)
    return config_class(**fields)


def copy_weights(source: PreTrainedModel, target, partial_names: set[str]) -> dict[str, list[str]]:
    """Copy every source weight into ``target`` (same names up to the base model's prefix, ``bert.``, ...).

    Returns ``{"missing_keys": target tensors the source did not provide (new head weights; P and R excluded),
    "unexpected_keys": source tensors with no place in the target}``. Source weights of the matching source class
    that have no place are an error.
    """
    src_state = _source_state(source, target)
    tgt_keys = set(target.state_dict())
    unexpected = sorted(set(src_state) - tgt_keys)
    if unexpected and isinstance(source, type(target)._source_class):
        raise ValueError(f"Weights {unexpected[:5]} of the source have no place in {type(target).__name__}.")
    target.load_state_dict({key: value for key, value in src_state.items() if key in tgt_keys}, strict=False)
    missing = sorted(tgt_keys - set(src_state) - partial_names)
    if missing:
        logger.warning("from_source: %s were not in the source and keep their fresh initialisation (a new head); "
                       "train them before use.", missing)
    return {"missing_keys": missing, "unexpected_keys": unexpected}


# The name of 0.x, for PartialBert (``PartialBertModel.from_bert``).
from_bert = from_source

"""Build the model a training script asks for (`ModelArguments`): partial or exact, new or converted, for every
architecture of `architectures.ARCHITECTURES`.

The classes come from the architecture table (`architecture_for`, `partial_class_for`), never by BERT's name.
`build_model` lists the five cases, for any head in `HEADS`. A type partial attention cannot run in is refused in
one line (`UnsupportedModelError`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from transformers import AutoConfig, PreTrainedModel

from ..architectures import DEFAULT_MODEL_TYPE, HEAD_SUFFIXES, Architecture, architecture_for
from ..modeling_partial_encoders import partial_class_for
from ..pattern import AttentionPattern
from ..pattern_buckets import PatternBuckets, is_single_pattern_file
from ..pattern_layers import LayerPatterns, load_patterns

logger = logging.getLogger(__name__)

__all__ = ["HEADS", "BuiltModel", "build_model", "load_pattern_file"]

# head name of the scripts -> Auto class name (`architectures.HEAD_SUFFIXES`)
HEADS = {"masked_lm": "AutoModelForMaskedLM", "sequence_classification": "AutoModelForSequenceClassification"}
DEFAULT_SEQ_LEN = 128
DEFAULT_K = 32
_NOT_SOURCE_FIELDS = ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path")

Pattern = AttentionPattern | PatternBuckets | LayerPatterns


@dataclass
class BuiltModel:
    """The model plus what a model card needs to know about where it came from."""

    model: PreTrainedModel
    base_model: str | None  # the checkpoint it started from (None: trained from scratch)
    pattern_source: str  # human-readable origin of P and R ("exact attention" for the baseline)


def load_pattern_file(path: str | os.PathLike) -> Pattern:
    """Any pattern file `derive` writes, as `convert` reads it: one pattern (`AttentionPattern`), length buckets
    (`PatternBuckets`) or P and R per layer or head, with or without a k per layer (`LayerPatterns`)."""
    if is_single_pattern_file(os.fspath(path)):
        return AttentionPattern.load(path)
    return load_patterns(path)


def _base_config(model_args, vocab_size: int | None):
    kwargs = {"cache_dir": model_args.cache_dir, "revision": model_args.model_revision, "token": model_args.token,
              "trust_remote_code": model_args.trust_remote_code}
    if model_args.config_name:
        config = AutoConfig.from_pretrained(model_args.config_name, **kwargs)
    elif model_args.model_name_or_path:
        config = AutoConfig.from_pretrained(model_args.model_name_or_path, **kwargs)
    else:
        # architecture_for refuses a type partial attention does not run in, naming the supported ones
        config = architecture_for(model_args.model_type or DEFAULT_MODEL_TYPE).config_class()()
    if model_args.model_type and config.model_type not in (model_args.model_type,
                                                            architecture_for(model_args.model_type).partial_model_type):
        raise ValueError(f"--model_type {model_args.model_type!r} contradicts the config of "
                         f"{model_args.config_name or model_args.model_name_or_path} (model_type "
                         f"{config.model_type!r}); drop --model_type.")
    if model_args.config_overrides:
        if model_args.model_name_or_path:
            raise ValueError("--config_overrides only applies to models trained from scratch; "
                             "drop it or --model_name_or_path.")
        config.update_from_string(model_args.config_overrides)
    if vocab_size is not None and not model_args.model_name_or_path:
        config.vocab_size = vocab_size
    return config


def _describe(pattern: Pattern, path: str) -> str:
    meta = pattern.metadata
    parts = [f"`{path}`"]
    for key in ("method", "source_model", "num_sequences", "normalized_error", "covariance", "granularity"):
        if key in meta:
            parts.append(f"{key}={meta[key]}")
    return ", ".join(parts)


def _classes(arch: Architecture, head: str) -> tuple[type, type]:
    """(the source class, the partial class) of ``arch`` for ``head``; a ValueError if the architecture has none."""
    auto_name = HEADS[head]
    if auto_name not in arch.heads:
        raise ValueError(f"{arch.model_type!r} has no {HEAD_SUFFIXES[auto_name]} head; it has {list(arch.heads)}.")
    return arch.source_class(auto_name), partial_class_for(arch.model_type, auto_name)


def _source_config(config, arch: Architecture):
    """A partial config as its source architecture's config (P and R fields dropped), for the exact baseline."""
    from ..conversion import PARTIAL_FIELDS

    fields = {k: v for k, v in config.to_dict().items() if k not in PARTIAL_FIELDS and k not in _NOT_SOURCE_FIELDS}
    return arch.config_class()(**fields)


def build_model(head: str, model_args, tokenizer=None, max_seq_length: int | None = None, **head_kwargs) -> BuiltModel:
    """The model for `head` (a key of `HEADS`) as `model_args` describe it, of the architecture its config names.

    Five cases:

    - ``--attention exact``: the source architecture's own class (``RobertaForMaskedLM``, ...; the baseline), from
      ``--model_name_or_path`` or from scratch.
    - a partial checkpoint (``partial_roberta``, ...): loaded as is (its own P and R, any granularity, buckets,
      budget), or with P and R replaced by ``--pattern``.
    - a source checkpoint of a supported type: converted with ``from_source`` (every weight kept), P and R from
      ``--pattern`` (else the local default pattern).
    - nothing: a new model of ``--config_name`` / ``--model_type`` (+ ``--config_overrides``): the source class is
      initialised and converted, so the partial model starts from exactly the weights the exact baseline of the
      same seed starts from, with ``--pattern`` (any file `derive` writes) installed.
    - a partial config without weights (``--config_name`` of a partial folder): a new model of that config.

    Args:
        head: ``"masked_lm"`` or ``"sequence_classification"``.
        model_args: a `ModelArguments`.
        tokenizer: sets the vocabulary size and pad id of models trained from scratch.
        max_seq_length: n when neither ``--pattern`` nor a partial checkpoint fixes it.
        **head_kwargs: config fields of the head, e.g. ``num_labels=3, id2label=..., label2id=...``.

    Raises:
        ValueError: on an unknown head, a pattern whose n is shorter than `max_seq_length`, or a
            ``--reconstruction`` / ``--partial_layers`` that contradicts a partial checkpoint.
        UnsupportedModelError: for a model type partial attention does not run in (a decoder, DeBERTa-v2, ...).
    """
    if head not in HEADS:
        raise ValueError(f"head must be one of {sorted(HEADS)}, got {head!r}.")
    path = model_args.model_name_or_path
    if tokenizer is not None and tokenizer.pad_token_id is not None and path is None:
        head_kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)  # a new model: the tokenizer's pad id
    config = _base_config(model_args, len(tokenizer) if tokenizer is not None else None)
    arch = architecture_for(config)  # a partial config maps to its source's entry; one line for an unsupported type
    is_partial = config.model_type == arch.partial_model_type
    source_cls, partial_cls = _classes(arch, head)
    load_kw = {"cache_dir": model_args.cache_dir, "revision": model_args.model_revision, "token": model_args.token,
               "trust_remote_code": model_args.trust_remote_code}
    for key, value in head_kwargs.items():
        setattr(config, key, value)

    if model_args.attention == "exact":
        return _exact_model(source_cls, config, arch, model_args, is_partial, load_kw)

    pattern = load_pattern_file(model_args.pattern) if model_args.pattern else None
    if pattern is not None and max_seq_length is not None and pattern.seq_len < max_seq_length:
        raise ValueError(f"--pattern has n={pattern.seq_len} but --max_seq_length={max_seq_length}; "
                         "use max_seq_length <= n or a pattern for a longer n.")
    layers = model_args.partial_layer_list()
    if is_partial:
        return _partial_checkpoint(partial_cls, config, model_args, pattern, layers, head_kwargs, load_kw)

    overrides = _conversion_overrides(model_args, pattern, layers, head_kwargs)
    pattern, source = _pattern_or_default(pattern, model_args, max_seq_length)
    if path is not None:
        return BuiltModel(partial_cls.from_source(path, pattern, **overrides, **{
            k: v for k, v in load_kw.items() if k in ("revision", "token", "cache_dir") and v is not None}),
            path, source)
    # From scratch: the source class's own initialisation, then converted. The exact baseline built after the same
    # seed starts from the same weights, so a trained-in arm differs from it only by P and R.
    fresh = source_cls(config)
    model = partial_cls.from_source(fresh, pattern, **{k: v for k, v in overrides.items() if k not in head_kwargs})
    return BuiltModel(model, None, source)


def _exact_model(source_cls, config, arch: Architecture, model_args, is_partial: bool, load_kw: dict) -> BuiltModel:
    """``--attention exact``: the source architecture's own class, from the checkpoint or new (a ValueError for a
    partial checkpoint or config)."""
    path = model_args.model_name_or_path
    if is_partial:
        raise ValueError(f"{path or model_args.config_name} is a partial {arch.model_type} model "
                         f"({config.model_type}); --attention exact needs a {arch.model_type} checkpoint or "
                         "config (or --model_type).")
    model = source_cls.from_pretrained(path, config=config, **load_kw) if path else source_cls(config)
    return BuiltModel(model, path, "exact attention (no partial computation)")


def _conversion_overrides(model_args, pattern: Pattern | None, layers: list[int] | None, head_kwargs: dict) -> dict:
    """The config fields a conversion sets: the head's, R's mode and the partial layers."""
    overrides = dict(head_kwargs)
    if model_args.reconstruction is not None:
        overrides["reconstruction"] = model_args.reconstruction
    elif not isinstance(pattern, LayerPatterns):
        overrides["reconstruction"] = "common"  # (P and R per layer or head: R per layer, as `convert` makes it)
    if layers is not None:
        overrides["partial_layers"] = layers
    return overrides


def _pattern_or_default(pattern: Pattern | None, model_args, max_seq_length: int | None) -> tuple[Pattern, str]:
    """``(pattern, where it came from)``: ``--pattern``'s, else the local default pattern (with a warning)."""
    if pattern is not None:
        return pattern, _describe(pattern, model_args.pattern)
    n = max_seq_length or DEFAULT_SEQ_LEN
    k = model_args.partial_k or DEFAULT_K
    pattern = AttentionPattern.local(n, k)
    source = f"the local default pattern (k={k} nearest keys; R optimal for a correlation-0.9 prior)"
    logger.warning("No --pattern given: using %s. Derive P and R from covariances for the paper's method.", source)
    return pattern, source


def _partial_checkpoint(partial_cls, config, model_args, pattern, layers, head_kwargs, load_kw) -> BuiltModel:
    """A partial checkpoint (or config) loaded with its own P and R, or with ``--pattern``'s installed."""
    path = model_args.model_name_or_path
    mode = model_args.reconstruction
    if mode is not None and mode != config.reconstruction:
        raise ValueError(f"{path or model_args.config_name} was trained with reconstruction={config.reconstruction!r}; "
                         f"got --reconstruction {mode!r}. Drop the flag, or convert from the source model's weights.")
    if layers is not None and layers != list(config.partial_layers):
        raise ValueError(f"{path or model_args.config_name} has partial_layers={config.partial_layers}; got "
                         f"--partial_layers {layers}. Drop the flag, or convert from the source model's weights.")
    if path is None:
        model = partial_cls(config)
        source = "the default pattern of the config (local, k nearest keys)"
    else:
        model = partial_cls.from_pretrained(path, **head_kwargs, **load_kw)
        source = f"the checkpoint `{path}` (P and R as trained there)"
    if pattern is not None:
        model.set_pattern(pattern)
        source = _describe(pattern, model_args.pattern)
    return BuiltModel(model, path, source)

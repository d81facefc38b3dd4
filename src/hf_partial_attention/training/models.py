"""Build the model a training script asks for (`ModelArguments`): PartialBert or exact BERT, new or converted.

Four cases, for any head in `HEADS`:

- ``--attention exact``: plain ``BertFor*`` (the baseline), from ``--model_name_or_path`` or from scratch.
- a PartialBert checkpoint: loaded as is (its P and R), or with P and R replaced by ``--pattern``.
- a BERT-family checkpoint: converted with ``from_bert`` (every weight kept) and P, R from ``--pattern``
  (else the local default pattern).
- nothing: a new PartialBert from ``--config_name`` / ``--config_overrides``, with ``--pattern`` installed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from transformers import (
    AutoConfig,
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    PreTrainedModel,
)

from ..configuration_partial_bert import PartialBertConfig
from ..modeling_partial_bert import PartialBertForMaskedLM, PartialBertForSequenceClassification
from ..pattern import AttentionPattern

logger = logging.getLogger(__name__)

__all__ = ["HEADS", "BuiltModel", "build_model"]

HEADS = {
    "masked_lm": (BertForMaskedLM, PartialBertForMaskedLM),
    "sequence_classification": (BertForSequenceClassification, PartialBertForSequenceClassification),
}
DEFAULT_SEQ_LEN = 128
DEFAULT_K = 32
_NOT_BERT_FIELDS = ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path")


@dataclass
class BuiltModel:
    """The model plus what a model card needs to know about where it came from."""

    model: PreTrainedModel
    base_model: str | None  # the checkpoint it started from (None: trained from scratch)
    pattern_source: str  # human-readable origin of P and R ("exact attention" for the baseline)


def _base_config(model_args, vocab_size: int | None):
    kwargs = {"cache_dir": model_args.cache_dir, "revision": model_args.model_revision, "token": model_args.token,
              "trust_remote_code": model_args.trust_remote_code}
    if model_args.config_name:
        config = AutoConfig.from_pretrained(model_args.config_name, **kwargs)
    elif model_args.model_name_or_path:
        config = AutoConfig.from_pretrained(model_args.model_name_or_path, **kwargs)
    else:
        config = BertConfig()
    if model_args.config_overrides:
        if model_args.model_name_or_path:
            raise ValueError("--config_overrides only applies to models trained from scratch; "
                             "drop it or --model_name_or_path.")
        config.update_from_string(model_args.config_overrides)
    if vocab_size is not None and not model_args.model_name_or_path:
        config.vocab_size = vocab_size
    return config


def _describe(pattern: AttentionPattern, path: str) -> str:
    meta = pattern.metadata
    parts = [f"`{path}`"]
    for key in ("method", "source_model", "num_sequences", "normalized_error", "covariance"):
        if key in meta:
            parts.append(f"{key}={meta[key]}")
    return ", ".join(parts)


def build_model(head: str, model_args, tokenizer=None, max_seq_length: int | None = None, **head_kwargs) -> BuiltModel:
    """The model for `head` (a key of `HEADS`) as `model_args` describe it.

    Args:
        head: ``"masked_lm"`` or ``"sequence_classification"``.
        model_args: a `ModelArguments`.
        tokenizer: sets the vocabulary size and pad id of models trained from scratch.
        max_seq_length: n when neither ``--pattern`` nor a PartialBert checkpoint fixes it.
        **head_kwargs: config fields of the head, e.g. ``num_labels=3, id2label=..., label2id=...``.

    Raises:
        ValueError: on an unknown head, a pattern whose n is shorter than `max_seq_length`, or a
            ``--reconstruction`` that contradicts a PartialBert checkpoint.
    """
    if head not in HEADS:
        raise ValueError(f"head must be one of {sorted(HEADS)}, got {head!r}.")
    bert_cls, partial_cls = HEADS[head]
    vocab = len(tokenizer) if tokenizer is not None else None
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        head_kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
    path = model_args.model_name_or_path
    load_kw = {"cache_dir": model_args.cache_dir, "revision": model_args.model_revision, "token": model_args.token,
               "trust_remote_code": model_args.trust_remote_code}
    config = _base_config(model_args, vocab)
    is_partial_ckpt = getattr(config, "model_type", None) == PartialBertConfig.model_type

    if model_args.attention == "exact":
        if is_partial_ckpt:
            raise ValueError(f"{path or model_args.config_name} is a PartialBert model; --attention exact needs a "
                             "BERT checkpoint or config.")
        for key, value in head_kwargs.items():
            setattr(config, key, value)
        model = bert_cls.from_pretrained(path, config=config, **load_kw) if path else bert_cls(config)
        return BuiltModel(model, path, "exact attention (no partial computation)")

    pattern = AttentionPattern.load(model_args.pattern) if model_args.pattern else None
    if pattern is not None and max_seq_length is not None and pattern.seq_len < max_seq_length:
        raise ValueError(f"--pattern has n={pattern.seq_len} but --max_seq_length={max_seq_length}; "
                         "use max_seq_length <= n or a pattern for a longer n.")
    layers = model_args.partial_layer_list()

    if is_partial_ckpt:
        mode = model_args.reconstruction
        if mode is not None and mode != config.reconstruction:
            raise ValueError(f"{path} was trained with reconstruction={config.reconstruction!r}; got "
                             f"--reconstruction {mode!r}. Drop the flag, or convert from the BERT weights.")
        if layers is not None and layers != list(config.partial_layers):
            raise ValueError(f"{path} has partial_layers={config.partial_layers}; got --partial_layers {layers}.")
        if path is None:
            fields = {key: value for key, value in config.to_dict().items() if key not in _NOT_BERT_FIELDS}
            model = partial_cls(PartialBertConfig(**{**fields, **head_kwargs}))
            source = "the default pattern of the config (local, k nearest keys)"
        else:
            model = partial_cls.from_pretrained(path, **head_kwargs, **load_kw)
            source = f"the checkpoint `{path}` (P and R as trained there)"
        if pattern is not None:
            model.set_pattern(pattern)
            source = _describe(pattern, model_args.pattern)
        return BuiltModel(model, path, source)

    overrides = {"reconstruction": model_args.reconstruction or "common", **head_kwargs}
    if layers is not None:
        overrides["partial_layers"] = layers
    if pattern is None:
        n = max_seq_length or DEFAULT_SEQ_LEN
        k = model_args.partial_k or DEFAULT_K
        pattern = AttentionPattern.local(n, k)
        source = f"the local default pattern (k={k} nearest keys; R optimal for a correlation-0.9 prior)"
        logger.warning("No --pattern given: using %s. Derive P and R from covariances for the paper's method.", source)
    else:
        source = _describe(pattern, model_args.pattern)
    if path is not None:
        bert = bert_cls.from_pretrained(path, **head_kwargs, **load_kw)
        return BuiltModel(partial_cls.from_bert(bert, pattern, **overrides), path, source)
    fields = {key: value for key, value in config.to_dict().items() if key not in _NOT_BERT_FIELDS}
    fields.update(partial_seq_len=pattern.seq_len, partial_k=pattern.k, partial_use_bias=pattern.bias is not None)
    fields.update(overrides)
    model = partial_cls(PartialBertConfig(**fields))
    model.set_pattern(pattern)
    return BuiltModel(model, None, source)

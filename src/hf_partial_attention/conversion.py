"""Converting a BERT-family checkpoint into PartialBert: the source load, the config and the weight copy.

`PartialBertPreTrainedModel.from_bert` runs these steps; the pattern to install is handed to the model's
constructor through `initial_pattern`, so that no default pattern is built for a model that gets another one.
Part of the remote-code bundle (imports: torch, transformers and siblings only).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import os
from collections.abc import Iterator
from typing import Any

from transformers import BertConfig, BertPreTrainedModel

from .configuration_partial_bert import PartialBertConfig
from .pattern import AttentionPattern

logger = logging.getLogger(__name__)

__all__ = ["initial_pattern", "pending_pattern", "PARTIAL_FIELDS", "load_source", "partial_config", "copy_weights"]

# PartialBertConfig's own fields; every other keyword of from_bert is a BertConfig setting (num_labels, id2label,
# classifier_dropout, ...) that must also reach the source load, so that the source's head has the right shape.
PARTIAL_FIELDS = frozenset({f.name for f in dataclasses.fields(PartialBertConfig)}
                           - {f.name for f in dataclasses.fields(BertConfig)})
_LOAD_KWARGS = ("revision", "token", "dtype", "cache_dir", "local_files_only", "trust_remote_code")
_NOT_BERT_FIELDS = ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path")

_INITIAL_PATTERN: contextvars.ContextVar[AttentionPattern | None] = contextvars.ContextVar("initial_pattern",
                                                                                         default=None)


@contextlib.contextmanager
def initial_pattern(pattern: AttentionPattern) -> Iterator[None]:
    """Build models inside this block with ``pattern``'s P and R instead of the default (see `from_bert`)."""
    token = _INITIAL_PATTERN.set(pattern)
    try:
        yield
    finally:
        _INITIAL_PATTERN.reset(token)


def pending_pattern() -> AttentionPattern | None:
    """The pattern of the innermost `initial_pattern` block, if any."""
    return _INITIAL_PATTERN.get()


def load_source(bert_class, bert_model_or_path, settings: dict[str, Any], load_kwargs: dict[str, Any]):
    """``(source model, its loading info)``: an instance as given, or ``bert_class.from_pretrained`` of a path/Hub id
    with the head ``settings`` (num_labels, ...) and ``load_kwargs`` (revision, token, dtype, ...)."""
    unknown = sorted(set(load_kwargs) - set(_LOAD_KWARGS))
    if unknown:
        raise TypeError(f"from_bert got unknown loading arguments {unknown}; it takes {list(_LOAD_KWARGS)}.")
    if isinstance(bert_model_or_path, (str, os.PathLike)):
        return bert_class.from_pretrained(os.fspath(bert_model_or_path), output_loading_info=True,
                                          **{k: v for k, v in load_kwargs.items() if v is not None}, **settings)
    if not isinstance(bert_model_or_path, BertPreTrainedModel):
        raise TypeError("bert_model_or_path must be a path, a Hub id or a BertPreTrainedModel, got "
                        f"{type(bert_model_or_path).__name__}.")
    given = {k: v for k, v in settings.items() if getattr(bert_model_or_path.config, k, v) != v}
    if given:
        raise ValueError(f"from_bert was given {given} for a model instance whose config says otherwise; pass the "
                         "path or Hub id instead (the source is then loaded with these settings).")
    if any(v is not None for v in load_kwargs.values()):
        raise ValueError(f"{sorted(load_kwargs)} apply to loading a path or Hub id, not to a model instance.")
    return bert_model_or_path, {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}


def partial_config(source, pattern: AttentionPattern, overrides: dict[str, Any]) -> PartialBertConfig:
    """The source's BERT config with n, k and the bias flag of ``pattern`` and the given overrides."""
    fields = source.config.to_dict()
    for drop in _NOT_BERT_FIELDS:
        fields.pop(drop, None)
    fields.update(partial_seq_len=pattern.seq_len, partial_k=pattern.k, partial_use_bias=pattern.bias is not None)
    fields.update(overrides)
    if isinstance(source.config._name_or_path, str) and source.config._name_or_path:
        fields.setdefault("partial_base_model", source.config._name_or_path)
    return PartialBertConfig(**fields)


def copy_weights(source: BertPreTrainedModel, target, partial_names: set[str]) -> dict[str, list[str]]:
    """Copy every source weight into ``target`` (same names up to the ``bert.`` prefix).

    Returns ``{"missing_keys": target tensors the source did not provide (new head weights; P and R excluded),
    "unexpected_keys": source tensors with no place in the target}``. Source weights of the matching BERT class
    that have no place are an error.
    """
    src_state = source.state_dict()
    if not any(key.startswith("bert.") for key in src_state):  # a bare BertModel
        src_state = {f"bert.{key}": value for key, value in src_state.items()}
    if target.base_model_prefix not in target._modules:  # target is the bare PartialBertModel
        src_state = {key.removeprefix("bert."): v for key, v in src_state.items() if key.startswith("bert.")}
    tgt_keys = set(target.state_dict())
    unexpected = sorted(set(src_state) - tgt_keys)
    if unexpected and isinstance(source, type(target)._bert_class):
        raise ValueError(f"Weights {unexpected[:5]} of the source have no place in {type(target).__name__}.")
    target.load_state_dict({key: value for key, value in src_state.items() if key in tgt_keys}, strict=False)
    missing = sorted(tgt_keys - set(src_state) - partial_names)
    if missing:
        logger.warning("from_bert: %s were not in the source and keep their fresh initialisation (a new head); "
                       "train them before use.", missing)
    return {"missing_keys": missing, "unexpected_keys": unexpected}

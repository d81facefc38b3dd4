"""What `workflow.convert` checks before it converts: that the pattern can run in the model, whether it saves
work there, whether it was derived on another model, and which Hub id the checkpoint may name as its base.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..cost import saving_warning, score_dim
from ..pattern import AttentionPattern
from .collect import display_name, hub_id

logger = logging.getLogger(__name__)

__all__ = ["source_config", "head_dim", "check_convertible", "base_model_id", "pattern_source_name",
           "source_warnings"]


def source_config(source: Any):
    """The config of a model, of a local folder or of a Hub id (``AutoConfig``, nothing else is loaded)."""
    if not isinstance(source, (str, os.PathLike)):
        return source.config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(os.fspath(source))


def head_dim(config) -> int | None:
    """The cost model's d_h of a config: multiply-adds of one exact score (`cost.score_dim`: the head dimension,
    times DeBERTa-v2's score terms)."""
    return score_dim(config)


def check_convertible(pattern: AttentionPattern, pattern_path: str, config, name: str) -> list[str]:
    """Refuse a pattern the model cannot run (ValueError naming the fix); return the warnings for one that runs
    but saves no work (also logged)."""
    if pattern.scope != "per_query":
        raise ValueError(f"{pattern_path!r} holds a whole-matrix pattern (scope {pattern.scope!r}, k̄ = {pattern.k} "
                         "over all n² query-key pairs): whole-matrix patterns are for analysis; convert a per-query "
                         "pattern (patterns/per_query_k*.safetensors).")
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and pattern.seq_len > positions:
        raise ValueError(f"{pattern_path!r} is a pattern for n = {pattern.seq_len} positions, but {name} has "
                         f"max_position_embeddings = {positions}; derive a pattern on this model with "
                         f"`hf-partial-attention analyze --seq-len {positions}` (or less), then `derive`.")
    warnings = []
    d_head = head_dim(config)
    if d_head and (warning := saving_warning(pattern.seq_len, pattern.k, d_head)):
        warnings.append(f"{name}: {warning}")
    for warning in warnings:
        logger.warning(warning)
    return warnings


def _recorded_id(pattern: AttentionPattern) -> str | None:
    """The pattern's ``source_model_id``, unless it is the folder name that older versions put there for want of
    an id (it names no Hub repo)."""
    recorded = pattern.metadata.get("source_model_id") or None
    source = pattern.metadata.get("source_model")
    if recorded and source and os.path.exists(source) and recorded == display_name(source) != hub_id(source):
        return None
    return recorded


def _same_source(pattern: AttentionPattern, model: Any) -> bool:
    source = pattern.metadata.get("source_model")
    if model is None:
        return True
    if not isinstance(model, (str, os.PathLike)) or not source:
        return False
    model = os.fspath(model)
    if os.path.exists(model) and os.path.exists(source):
        return os.path.samefile(model, source)
    return model == source


def base_model_id(pattern: AttentionPattern, model: Any) -> str | None:
    """The Hub id the converted checkpoint names as its base: the pattern's own when it is converted into the
    model it was derived on, else that of ``model`` (`collect.hub_id`); None when there is none."""
    if _same_source(pattern, model):
        source = model if model is not None else pattern.metadata.get("source_model")
        return _recorded_id(pattern) or hub_id(source)
    return hub_id(model)


def pattern_source_name(pattern: AttentionPattern) -> str:
    """How to name the model a pattern was derived on: its Hub id, else its folder's name ("" if unrecorded)."""
    source = pattern.metadata.get("source_model")
    return _recorded_id(pattern) or (hub_id(source) or display_name(source) if source else "")


def source_warnings(pattern: AttentionPattern, pattern_path: str, model: Any, config, name: str) -> list[str]:
    """Warnings (also logged) when ``model`` (of ``config``, named ``name``) is not the model the pattern was
    derived on: another model id, another d_h or another number of positions, naming both."""
    if _same_source(pattern, model):
        return []
    derived_on = pattern_source_name(pattern)
    if not derived_on:
        return []
    warnings = []
    if derived_on != name:
        warnings.append(f"{pattern_path!r} was derived on {derived_on}, not on {name}, which this converts: P and R "
                        f"fit {derived_on}'s attention scores; derive a pattern on {name} for its own.")
    theirs = pattern.metadata.get("head_dim"), pattern.metadata.get("max_position_embeddings")
    if None in theirs and pattern.metadata.get("source_model"):
        try:  # the pattern file may not record the shapes: read its source's config, when it is at hand
            other = source_config(pattern.metadata["source_model"])
            theirs = (theirs[0] or head_dim(other), theirs[1] or getattr(other, "max_position_embeddings", None))
        except (OSError, ValueError) as err:
            logger.info("Could not read the config of the pattern's source %s (%s)", derived_on, err)
    ours = head_dim(config), getattr(config, "max_position_embeddings", None)
    for what, a, b in (("d_h", theirs[0], ours[0]), ("max_position_embeddings", theirs[1], ours[1])):
        if a is not None and b is not None and a != b:
            warnings.append(f"{pattern_path!r} was derived on {derived_on} ({what} = {a}) and is converted into "
                            f"{name} ({what} = {b}).")
    for warning in warnings:
        logger.warning(warning)
    return warnings

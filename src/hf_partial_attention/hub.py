"""Hub packaging of PartialBert: Auto-class registration, ``auto_map`` and the model card on save.

`register()` (run once by ``import hf_partial_attention``) registers the config and every head with
``AutoConfig`` / ``AutoModel*``, marks them for ``trust_remote_code`` (so ``save_pretrained`` copies the modeling
files next to the weights) and installs `save_pretrained` as the models' save hook. The modeling files know
nothing of this module, so it never travels in the remote-code bundle.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .configuration_partial_bert import PartialBertConfig
from . import model_card
from .modeling_partial_bert import (
    PartialBertForMaskedLM,
    PartialBertForQuestionAnswering,
    PartialBertForSequenceClassification,
    PartialBertForTokenClassification,
    PartialBertModel,
    PartialBertPreTrainedModel,
)

logger = logging.getLogger(__name__)

__all__ = ["AUTO_CLASSES", "AUTO_MAP", "register", "merged_auto_map", "save_pretrained"]

# Auto class -> (factory, PartialBert class).
AUTO_CLASSES = {
    "AutoModel": (AutoModel, PartialBertModel),
    "AutoModelForMaskedLM": (AutoModelForMaskedLM, PartialBertForMaskedLM),
    "AutoModelForSequenceClassification": (AutoModelForSequenceClassification, PartialBertForSequenceClassification),
    "AutoModelForTokenClassification": (AutoModelForTokenClassification, PartialBertForTokenClassification),
    "AutoModelForQuestionAnswering": (AutoModelForQuestionAnswering, PartialBertForQuestionAnswering),
}
# Only the saved class and its config get an auto_map entry by default; listing every head lets any AutoModel*
# class load a folder with trust_remote_code=True.
AUTO_MAP = {"AutoConfig": "configuration_partial_bert.PartialBertConfig",
            **{auto: f"modeling_partial_bert.{klass.__name__}" for auto, (_, klass) in AUTO_CLASSES.items()}}


def register() -> None:
    """Register the config and every head with the Auto classes and for remote code; safe to call more than once."""
    AutoConfig.register(PartialBertConfig.model_type, PartialBertConfig, exist_ok=True)
    PartialBertConfig.register_for_auto_class()
    for name, (factory, model_class) in AUTO_CLASSES.items():
        factory.register(PartialBertConfig, model_class, exist_ok=True)
        model_class.register_for_auto_class(name)
    PartialBertPreTrainedModel._save_hook = save_pretrained


def merged_auto_map(existing: dict[str, Any] | None) -> dict[str, Any]:
    """``existing`` entries (a user's own Auto classes) kept, this plugin's entries added or updated."""
    return {**(existing or {}), **AUTO_MAP}


def save_pretrained(model, parent_save: Callable, save_directory, *args, write_model_card: bool | None = None,
                    **kwargs):
    """`PreTrainedModel.save_pretrained` (``parent_save``) with the complete ``auto_map`` and a model card.

    Args:
        write_model_card: ``None`` (default) writes a card only if the folder has no ``README.md`` yet;
            ``True`` replaces an existing one; ``False`` writes none. Only the main process writes it.
    """
    model.config.auto_map = merged_auto_map(getattr(model.config, "auto_map", None))
    readme = os.path.join(os.fspath(save_directory), "README.md")
    had_readme = os.path.exists(readme)  # checked first: push_to_hub=True writes a README of its own
    result = parent_save(save_directory, *args, **kwargs)
    is_main_process = kwargs.get("is_main_process", args[0] if args else True)
    if is_main_process and (write_model_card or (write_model_card is None and not had_readme)):
        model_card.write_model_card(model, save_directory, overwrite=True)
    return result

"""Registration of PartialBert with transformers' Auto classes (run once by ``import hf_partial_attention``)."""

from __future__ import annotations

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .configuration_partial_bert import PartialBertConfig
from .modeling_partial_bert import AUTO_CLASSES

__all__ = ["register"]

_AUTO_FACTORIES = {
    "AutoModel": AutoModel,
    "AutoModelForMaskedLM": AutoModelForMaskedLM,
    "AutoModelForSequenceClassification": AutoModelForSequenceClassification,
    "AutoModelForTokenClassification": AutoModelForTokenClassification,
    "AutoModelForQuestionAnswering": AutoModelForQuestionAnswering,
}


def register() -> None:
    """Register the config and every head; safe to call more than once."""
    AutoConfig.register(PartialBertConfig.model_type, PartialBertConfig, exist_ok=True)
    for name, model_class in AUTO_CLASSES.items():
        _AUTO_FACTORIES[name].register(PartialBertConfig, model_class, exist_ok=True)

"""hf-partial-attention: attention scores computed at k positions per query, the rest reconstructed.

After ``import hf_partial_attention`` the PartialBert config and heads are registered with
``AutoConfig`` / ``AutoModel*``, so ``AutoModel.from_pretrained(folder)`` loads PartialBert checkpoints.
"""

from __future__ import annotations

from .configuration_partial_bert import PartialBertConfig
from .hub import register
from .modeling_partial_bert import (
    PartialBertForMaskedLM,
    PartialBertForQuestionAnswering,
    PartialBertForSequenceClassification,
    PartialBertForTokenClassification,
    PartialBertModel,
    PartialBertPreTrainedModel,
)
from .pattern import AttentionPattern
from .version import __version__

register()

__all__ = [
    "AttentionPattern",
    "PartialBertConfig",
    "PartialBertModel",
    "PartialBertPreTrainedModel",
    "PartialBertForMaskedLM",
    "PartialBertForSequenceClassification",
    "PartialBertForTokenClassification",
    "PartialBertForQuestionAnswering",
    "register",
    "__version__",
]

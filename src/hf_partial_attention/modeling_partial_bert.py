"""PartialBert: BERT with partial self-attention (Bhojanapalli et al., 2021), as transformers models.

The classes are generated from BERT's entry of `architectures.ARCHITECTURES` by the factory every architecture goes
through (`modeling_partial_encoders`): transformers' own `BertModel`, `BertForMaskedLM`, ... with `PartialModelMixin`
first, whose ``post_init`` makes each layer's ``BertSelfAttention`` partial (``config.partial_layers``) or exact in
place (`partial_layer`). They are written under this file's name, which PartialBert checkpoints' ``auto_map`` names
since 0.1. Parameter names are BERT's, so BERT checkpoints load unchanged; the names the method adds are listed at
the import below. Auto registration, ``auto_map`` and model cards live in `hub`; this file, with its sibling imports,
is copied next to saved checkpoints for ``trust_remote_code=True``.
"""

from __future__ import annotations

from .conversion import from_source
# The names the method adds (in ``model.safetensors``, shown for the base model, prefixed ``bert.`` in the heads):
# - ``encoder.partial_pattern.indices``: P, ``(n, k)`` int64 buffer, shared by every partial layer.
# - ``encoder.partial_pattern.reconstruction``: R, ``(n, n−k, k)``: a buffer (``reconstruction="fixed"``) or one
#   trainable parameter (``"common"``).
# - ``encoder.layer.{l}.attention.self.reconstruction``: R of layer l, trainable (``"per_layer"``).
# - ``...reconstruction_bias``: beside each R when ``partial_use_bias=True``, ``(n, n−k)``.
# - With length buckets (``config.partial_lengths``), each bucket b < n with b > k has the same tensors with the
#   suffix ``_len{b}`` and b in place of n: ``encoder.partial_pattern_len{b}.indices`` ``(b, k)``,
#   ``encoder.partial_pattern_len{b}.reconstruction`` ``(b, b−k, k)``, ``...attention.self.reconstruction_len{b}``.
# A pattern passed to a constructor (``PartialBertModel(config, pattern=...)``, as `from_source` does) is the one it
# starts with (docs/method.md#the-model-p-r-and-where-they-live). Attention runs through transformers'
# ``AttentionInterface``: partial layers call ``partial_<kernel>``, exact layers honour ``config._attn_implementation``.
from .modeling_partial_encoders import (
    PartialBertForMaskedLM,
    PartialBertForQuestionAnswering,
    PartialBertForSequenceClassification,
    PartialBertForTokenClassification,
    PartialBertModel,
    PartialBertPreTrainedModel,
)
from .partial_pattern import PartialBertPattern, default_pattern

__all__ = [
    "PartialBertPreTrainedModel",
    "PartialBertModel",
    "PartialBertForMaskedLM",
    "PartialBertForSequenceClassification",
    "PartialBertForTokenClassification",
    "PartialBertForQuestionAnswering",
    "PartialBertPattern",
    "default_pattern",
]

# The name of 0.x: PartialBertForMaskedLM.from_bert(bert_path_or_model, pattern, ...) is `conversion.from_source`.
PartialBertPreTrainedModel.from_bert = classmethod(from_source)

"""PartialBert: BERT with partial self-attention (Bhojanapalli et al., 2021), as transformers models.

Parameter names are BERT's, so BERT checkpoints load unchanged; the method adds (names in ``model.safetensors``,
shown for the base model, prefixed ``bert.`` in the heads):

- ``encoder.partial_pattern.indices``: P, ``(n, k)`` int64 buffer, shared by every partial layer.
- ``encoder.partial_pattern.reconstruction``: R, ``(n, n−k, k)``: a buffer (``reconstruction="fixed"``) or one
  trainable parameter (``"common"``).
- ``encoder.layer.{l}.attention.self.reconstruction``: R of layer l, trainable (``"per_layer"``).
- ``...reconstruction_bias``: beside each R when ``partial_use_bias=True``, ``(n, n−k)``.
- With length buckets (``config.partial_lengths``), each bucket b < n with b > k has the same tensors with the
  suffix ``_len{b}`` and b in place of n: ``encoder.partial_pattern_len{b}.indices`` ``(b, k)``,
  ``encoder.partial_pattern_len{b}.reconstruction`` ``(b, b−k, k)``, ``...attention.self.reconstruction_len{b}``.

The heads are BERT's classes with BERT's forward; their ``__init__`` builds a `PartialBertModel` body, whose
``post_init`` swaps the self-attention of every layer: `PartialBertSelfAttention` in the partial layers,
`PartialBertExactSelfAttention` in the others (docs/method.md#the-model-p-r-and-where-they-live). A pattern passed
to a constructor (``PartialBertModel(config, pattern=...)``, as `from_bert` does) is the one it starts with. All of
this is the shared mechanism of every architecture (`modeling_partial`, `partial_layer`): BERT is its table entry,
with classes of its own names. Attention runs through transformers' ``AttentionInterface``: partial layers call
``partial_<kernel>``, exact layers honour ``config._attn_implementation``. Auto registration, ``auto_map`` and model cards live in
`hub`; this file, with its sibling imports, is copied next to saved checkpoints for ``trust_remote_code=True``.
"""

from __future__ import annotations


from torch import nn
from transformers.models.bert.modeling_bert import (
    BertForMaskedLM,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
    BertPreTrainedModel,
    BertOnlyMLMHead,
    BertSelfAttention,
)

from .architectures import ARCHITECTURES
from .configuration_partial_bert import PartialBertConfig
from .conversion import from_source
from .modeling_partial import PartialModelMixin
from .partial_layer import layer_tensors, make_exact, make_partial
from .partial_pattern import PartialBertPattern, default_pattern
from .pattern import AttentionPattern
from .pattern_buckets import PatternBuckets

__all__ = [
    "PartialBertPreTrainedModel",
    "PartialBertModel",
    "PartialBertForMaskedLM",
    "PartialBertForSequenceClassification",
    "PartialBertForTokenClassification",
    "PartialBertForQuestionAnswering",
    "PartialBertSelfAttention",
    "PartialBertPattern",
    "PartialBertExactSelfAttention",
    "default_pattern",
]


class PartialBertSelfAttention(BertSelfAttention):
    """`BertSelfAttention` (same q/k/v parameters and forward) made partial (`partial_layer.make_partial`): its scores
    are computed at P and reconstructed elsewhere by the kernel ``config.partial_implementation``, through
    transformers' ``AttentionInterface``. ``encoder``: the module holding the pattern modules
    (``encoder.partial_pattern``)."""

    def __init__(self, config: PartialBertConfig, encoder: nn.Module, layer_idx: int | None = None,
                 pattern: AttentionPattern | PatternBuckets | None = None):
        super().__init__(config, layer_idx=layer_idx)
        make_partial(self, encoder, layer_idx, config, pattern)

    def partial_tensors(self, length: int | None = None):
        """P's layout, R, its bias and their derived state in bucket ``length`` (default n): `layer_tensors`."""
        return layer_tensors(self, length)


class PartialBertExactSelfAttention(BertSelfAttention):
    """`BertSelfAttention` of the layers that stay exact: ``config._attn_implementation`` as in BERT, except that a
    forward asked for attention maps runs eager attention, the reference, so that ``attentions[i]`` is layer i's map
    for every layer (sdpa and flash return none): `partial_layer.make_exact`."""

    def __init__(self, config: PartialBertConfig, layer_idx: int | None = None):
        super().__init__(config, layer_idx=layer_idx)
        make_exact(self, config)


class PartialBertPreTrainedModel(PartialModelMixin, BertPreTrainedModel):
    """PartialBert's base: the shared `PartialModelMixin` on `BertPreTrainedModel` (BERT's entry of
    `architectures.ARCHITECTURES`), with BERT's layers swapped for classes of their own names."""

    config_class = PartialBertConfig
    config: PartialBertConfig
    _partial_arch = ARCHITECTURES["bert"]
    _source_class = BertModel  # the upstream class whose checkpoints map one-to-one onto this one

    def _partial_attention_module(self, base, layer_idx, module, pattern):
        """`PartialBertSelfAttention` in the partial layers, `PartialBertExactSelfAttention` in the others."""
        attention = base.encoder.layer[layer_idx].attention
        if layer_idx in self.config.partial_layers:
            attention.self = PartialBertSelfAttention(self.config, base.encoder, layer_idx=layer_idx, pattern=pattern)
        else:
            attention.self = PartialBertExactSelfAttention(self.config, layer_idx=layer_idx)
        return attention.self

    def _start_head(self, bert_class, config: PartialBertConfig, pattern: AttentionPattern | PatternBuckets | None,
                    add_pooling_layer: bool) -> None:
        """What ``bert_class.__init__`` does before its head: the pretrained-model set-up, then the body, built
        here as a `PartialBertModel` starting from ``pattern``."""
        super(bert_class, self).__init__(config)
        self._initial_pattern = pattern
        self.bert = PartialBertModel(config, add_pooling_layer=add_pooling_layer, pattern=pattern)

    # `conversion.from_source` with this class: PartialBertForMaskedLM.from_bert(bert_path_or_model, pattern, ...)
    from_bert = classmethod(from_source)


class PartialBertModel(PartialBertPreTrainedModel, BertModel):
    """`BertModel` with partial self-attention in `config.partial_layers`; ``pattern``: the P and R it starts with
    (default: `default_pattern` of the config)."""

    _source_class = BertModel

    def __init__(self, config: PartialBertConfig, add_pooling_layer: bool = True,
                 pattern: AttentionPattern | PatternBuckets | None = None):
        self._initial_pattern = pattern
        super().__init__(config, add_pooling_layer=add_pooling_layer)


# The heads: BERT's classes and forward, with BERT's __init__ written out so that the body is built as a
# PartialBertModel (BERT's own would build a BertModel).
def _add_classifier(head, config: PartialBertConfig) -> None:
    """BERT's sequence- and token-classification heads: dropout, then a linear map to ``num_labels``."""
    head.num_labels = config.num_labels
    dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
    head.dropout = nn.Dropout(dropout)
    head.classifier = nn.Linear(config.hidden_size, config.num_labels)


class PartialBertForMaskedLM(PartialBertPreTrainedModel, BertForMaskedLM):
    """`BertForMaskedLM` on a `PartialBertModel`."""

    _source_class = BertForMaskedLM

    def __init__(self, config: PartialBertConfig, pattern: AttentionPattern | PatternBuckets | None = None):
        self._start_head(BertForMaskedLM, config, pattern, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(config)
        self.post_init()


class PartialBertForSequenceClassification(PartialBertPreTrainedModel, BertForSequenceClassification):
    """`BertForSequenceClassification` on a `PartialBertModel`."""

    _source_class = BertForSequenceClassification

    def __init__(self, config: PartialBertConfig, pattern: AttentionPattern | PatternBuckets | None = None):
        self._start_head(BertForSequenceClassification, config, pattern, add_pooling_layer=True)
        _add_classifier(self, config)
        self.post_init()


class PartialBertForTokenClassification(PartialBertPreTrainedModel, BertForTokenClassification):
    """`BertForTokenClassification` on a `PartialBertModel`."""

    _source_class = BertForTokenClassification

    def __init__(self, config: PartialBertConfig, pattern: AttentionPattern | PatternBuckets | None = None):
        self._start_head(BertForTokenClassification, config, pattern, add_pooling_layer=False)
        _add_classifier(self, config)
        self.post_init()


class PartialBertForQuestionAnswering(PartialBertPreTrainedModel, BertForQuestionAnswering):
    """`BertForQuestionAnswering` on a `PartialBertModel`."""

    _source_class = BertForQuestionAnswering

    def __init__(self, config: PartialBertConfig, pattern: AttentionPattern | PatternBuckets | None = None):
        self._start_head(BertForQuestionAnswering, config, pattern, add_pooling_layer=False)
        self.num_labels = config.num_labels
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

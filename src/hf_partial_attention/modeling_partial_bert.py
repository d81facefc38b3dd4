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
to a constructor (``PartialBertModel(config, pattern=...)``, as `from_bert` does) is the one it starts with. Attention
runs through transformers' ``AttentionInterface``: partial layers call ``partial_<kernel>`` (`attention_dispatch`),
exact layers honour ``config._attn_implementation``. Auto registration, ``auto_map`` and model cards live in
`hub`; this file, with its sibling imports, is copied next to saved checkpoints for ``trust_remote_code=True``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn
from transformers import initialization as init
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.bert.modeling_bert import (
    BertEncoder,
    BertForMaskedLM,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
    BertPreTrainedModel,
    BertOnlyMLMHead,
    BertSelfAttention,
    eager_attention_forward,
)

from .configuration_partial_bert import PartialBertConfig
from .conversion import from_bert
from .attention_common import PartialTensors, PatternLayout
from .attention_dispatch import attention_function_name, check_implementation
from .attention_lengths import bucketed_attention, exact_attention
from .partial_pattern import (PartialBertPattern, bucket_suffix, check_buckets, default_pattern, init_bias,
                              initial_for, r_tensor)
from .pattern import AttentionPattern
from .pattern_buckets import PatternBuckets

try:  # transformers' recorder of `output_*` (private), read by `_attention_weights_requested` at every forward
    from transformers.utils.output_capturing import _active_collector
except ImportError:
    _active_collector = None

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



def _project(attention: BertSelfAttention, hidden_states: torch.Tensor, cache) -> tuple[torch.Tensor, ...]:
    """BERT's query, key and value projections of ``hidden_states`` (B, T, H·D), each as (B, H, T, D)."""
    if cache is not None:
        raise ValueError("PartialBert is an encoder and does not take a cache (got cache).")
    hidden_shape = (*hidden_states.shape[:-1], -1, attention.attention_head_size)
    return tuple(proj(hidden_states).view(*hidden_shape).transpose(1, 2)  # (B, H, T, D)
                 for proj in (attention.query, attention.key, attention.value))


class PartialBertSelfAttention(BertSelfAttention):
    """`BertSelfAttention` (same q/k/v parameters) whose scores are computed at P and reconstructed elsewhere.

    The kernel is ``config.partial_implementation`` (a runtime setting, see
    `PartialBertPreTrainedModel.set_partial_implementation`), run through transformers' ``AttentionInterface``.
    """

    def __init__(self, config: PartialBertConfig, encoder: BertEncoder, layer_idx: int | None = None,
                 pattern: AttentionPattern | PatternBuckets | None = None):
        super().__init__(config, layer_idx=layer_idx)
        # The pattern modules are owned by the encoder and looked up there at every call (an unregistered reference,
        # so their tensors are saved once, not once per layer). Calling them, rather than holding them, means that a
        # wrapper installed in their place (peft's modules_to_save) is the one that runs.
        object.__setattr__(self, "_encoder", encoder)
        if config.reconstruction == "per_layer":
            for length in (None, *config.partial_buckets):  # n's R, then each shorter bucket's
                suffix = bucket_suffix(config, length)
                setattr(self, "reconstruction" + suffix, r_tensor(config, True, False, pattern, length))
                setattr(self, "reconstruction_bias" + suffix,
                        r_tensor(config, True, True, pattern, length) if config.partial_use_bias else None)

    def partial_tensors(self, length: int | None = None) -> PartialTensors:
        """P's layout, R, its bias and their derived state in bucket ``length`` (default n), as this layer
        reconstructs with them (read by the attention functions); the encoder's pattern module of the bucket owns
        the layout and what is derived from each R."""
        suffix = bucket_suffix(self.config, length)
        owner = getattr(self._encoder, "partial_pattern" + suffix)
        if "reconstruction" in self._parameters:  # per_layer: this layer's own R
            return owner(getattr(self, "reconstruction" + suffix), getattr(self, "reconstruction_bias" + suffix),
                         self.layer_idx)
        return owner()

    def forward(self, hidden_states, attention_mask=None, cache=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        query, key, value = _project(self, hidden_states, cache)  # (B, H, T, D) each
        # "partial_auto" picks its kernel from P inside the call (one read of the layer's P and R per call)
        name = attention_function_name(self.config.partial_implementation)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS[name]
        dropout = self.dropout.p if self.training else 0.0
        need_weights = _attention_weights_requested(self.config, kwargs)

        def run_bucket(length, query, key, value, attention_mask):
            if length in self.config.exact_lengths:  # b <= k: every score is exact
                return exact_attention(self, query, key, value, attention_mask, self.scaling, dropout, need_weights)
            return attention_interface(self, query, key, value, attention_mask, scaling=self.scaling,
                                       dropout=dropout, need_weights=need_weights,
                                       partial=self.partial_tensors(length))  # P, R: read once, passed down

        if len(self.config.partial_lengths) == 1:  # one bucket (format 1): n's P and R for every input
            out, probs = run_bucket(self.config.partial_seq_len, query, key, value, attention_mask)
        else:
            out, probs = bucketed_attention(self, query, key, value, attention_mask, self.config.partial_lengths,
                                            run_bucket, need_weights)
        return out.reshape(*input_shape, -1).contiguous(), probs  # (B, T, H·D)


def _attention_weights_requested(config, kwargs: dict) -> bool:
    """Whether this forward returns attention maps (``output_attentions`` in the call or the config, or an active
    transformers output recorder that collects them): only then must a kernel write the n×n probabilities."""
    if kwargs.get("output_attentions") or getattr(config, "output_attentions", False):
        return True
    if _active_collector is None:  # the recorder moved: keep returning the maps
        return True
    collected = _active_collector.get()
    return bool(collected) and "attentions" in collected


class PartialBertExactSelfAttention(BertSelfAttention):
    """`BertSelfAttention` of the layers that stay exact: ``config._attn_implementation`` as in BERT, except that a
    forward asked for attention maps runs eager attention, the reference, so that ``attentions[i]`` is layer i's map
    for every layer (sdpa and flash return none, which would leave holes in the tuple)."""

    def forward(self, hidden_states, attention_mask=None, cache=None, **kwargs):
        if self.config._attn_implementation == "eager" or not _attention_weights_requested(self.config, kwargs):
            return super().forward(hidden_states, attention_mask, cache, **kwargs)
        input_shape = hidden_states.shape[:-1]
        query, key, value = _project(self, hidden_states, cache)  # (B, H, T, D) each
        if attention_mask is not None and attention_mask.dtype == torch.bool:  # built for sdpa: True = attend
            attention_mask = torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill_(
                ~attention_mask, torch.finfo(query.dtype).min)  # (B|1, 1|H, T, T): eager's additive form
        out, probs = eager_attention_forward(self, query, key, value, attention_mask, scaling=self.scaling,
                                             dropout=self.dropout.p if self.training else 0.0, **kwargs)
        return out.reshape(*input_shape, -1).contiguous(), probs  # (B, T, H·D)


def _install_partial_attention(encoder: BertEncoder, config: PartialBertConfig,
                               pattern: AttentionPattern | PatternBuckets | None) -> None:
    """Give ``encoder`` its pattern modules, one per length bucket with a pattern (starting from ``pattern``, else
    the default), and swap the self-attention of every layer: partial in ``config.partial_layers``, exact elsewhere
    (idempotent)."""
    if "partial_pattern" in encoder._modules:
        return
    if pattern is not None:
        check_buckets(config, pattern)
    for length in (None, *config.partial_buckets):
        setattr(encoder, "partial_pattern" + bucket_suffix(config, length), PartialBertPattern(config, pattern, length))
    for layer_idx, layer in enumerate(encoder.layer):
        layer.attention.self = (
            PartialBertSelfAttention(config, encoder, layer_idx=layer_idx, pattern=pattern)
            if layer_idx in config.partial_layers else PartialBertExactSelfAttention(config, layer_idx=layer_idx))


class PartialBertPreTrainedModel(BertPreTrainedModel):
    config_class = PartialBertConfig
    config: PartialBertConfig
    _bert_class = BertModel  # the upstream class whose checkpoints map one-to-one onto this one
    # Set by `hf_partial_attention.hub.register()` (auto_map, model card on save and push); None under remote
    # code, where saving and pushing are transformers' own.
    _hub: ClassVar[type | None] = None

    # The pattern a model is being built with (its constructor's ``pattern``), read by `_init_weights` while the
    # constructor runs and dropped once it returns, so the model holds no second copy of R.
    _initial_pattern: AttentionPattern | PatternBuckets | None = None

    def post_init(self):
        """BERT's ``__init__`` built the body; make its layers partial or exact (see `_install_partial_attention`),
        then BERT's post-init."""
        if isinstance(self, BertModel):
            _install_partial_attention(self.encoder, self.config, self._initial_pattern)
        super().post_init()
        self.__dict__.pop("_initial_pattern", None)  # now in P and R: no second copy of R is kept

    def _start_head(self, bert_class, config: PartialBertConfig, pattern: AttentionPattern | PatternBuckets | None,
                    add_pooling_layer: bool) -> None:
        """What ``bert_class.__init__`` does before its head: the pretrained-model set-up, then the body, built
        here as a `PartialBertModel` starting from ``pattern``."""
        super(bert_class, self).__init__(config)
        self._initial_pattern = pattern
        self.bert = PartialBertModel(config, add_pooling_layer=add_pooling_layer, pattern=pattern)

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, PartialBertPattern):
            pattern = initial_for(self.config, self._initial_pattern, module.length)
            init.copy_(module.indices, pattern.indices)
            # The layout buffers are non-persistent: a model built on the meta device (big-model loading) gets them
            # only here, derived from the P just installed.
            layout = PatternLayout.from_indices(pattern.indices)
            init.copy_(module.complement, layout.complement)
            init.copy_(module.inverse_permutation, layout.inverse_permutation)
            module.block_rows = layout.block_rows
            if getattr(module, "reconstruction", None) is not None:
                init.copy_(module.reconstruction, pattern.reconstruction)
            if getattr(module, "reconstruction_bias", None) is not None:
                init_bias(module.reconstruction_bias, pattern)
        elif isinstance(module, PartialBertSelfAttention) and "reconstruction" in module._parameters:
            for length in (None, *self.config.partial_buckets):
                pattern = initial_for(self.config, self._initial_pattern, length)
                suffix = bucket_suffix(self.config, length)
                init.copy_(getattr(module, "reconstruction" + suffix), pattern.reconstruction)
                if getattr(module, "reconstruction_bias" + suffix) is not None:
                    init_bias(getattr(module, "reconstruction_bias" + suffix), pattern)

    def set_partial_implementation(self, implementation: str) -> None:
        """Switch the kernel of the partial layers at run time: ``"auto"``, ``"gather"``, ``"fused"``, ``"tiled"`` or
        ``"triton"`` (all give the same numbers). Like ``attn_implementation`` it is a setting of
        this process, never read from a checkpoint; exact layers keep ``config._attn_implementation``."""
        check_implementation(implementation)
        self.config.partial_implementation = implementation

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, refusing a checkpoint whose P or R is missing or of the wrong shape.

        transformers would initialise such tensors afresh (the default pattern here) with only a generic note; a
        PartialBert that silently runs another pattern than the one it was trained with is wrong, so it is an error.
        """
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        model._check_loaded_pattern(info, args[0] if args else kwargs.get("pretrained_model_name_or_path"))
        return (model, info) if want_info else model

    def _partial_tensor_names(self) -> list[str]:
        return [name for name in self.state_dict() if _PARTIAL_NAME.search(f".{name}")]

    def _check_loaded_pattern(self, info: dict, source) -> None:
        names = set(self._partial_tensor_names())
        mismatched = {entry[0] if isinstance(entry, tuple) else entry for entry in info.get("mismatched_keys", [])}
        for kind, found in (("missing", names & set(info.get("missing_keys", []))), ("of the wrong shape",
                                                                                     names & mismatched)):
            if found:
                raise ValueError(
                    f"{source!s} has P/R tensors {kind}: {sorted(found)}. Loading would start them from the default "
                    "pattern and run a different model than the one saved. Load a folder written by PartialBert's "
                    "save_pretrained with the same partial_seq_len, partial_k and reconstruction, or convert a BERT "
                    "checkpoint with from_bert(path, pattern)."
                )
        # P and R must also be a valid pattern (sorted, unique, in range, finite): AttentionPattern checks that.
        for layer in self.config.partial_layers if self.config.reconstruction == "per_layer" else [None]:
            try:
                self.get_patterns(layer)
            except ValueError as err:
                raise ValueError(f"{source!s} holds an invalid P or R ({sorted(names)}): {err}") from err
        for owner in self._pattern_modules().values():
            owner.refresh_layout()

    # ------------------------------------------------------------------ pattern access
    def _partial_encoder(self) -> BertEncoder:
        return getattr(self, self.base_model_prefix, self).encoder

    def _pattern_modules(self) -> dict[int, PartialBertPattern]:
        """Bucket length -> the encoder's pattern module of that bucket (n first, then the shorter buckets)."""
        enc = self._partial_encoder()
        return {length or self.config.partial_seq_len: getattr(enc, "partial_pattern" + bucket_suffix(self.config, length))
                for length in (None, *self.config.partial_buckets)}

    def reconstruction_tensors(self) -> dict[str, torch.Tensor]:
        """Name -> R tensor: ``{"common": R}`` / ``{"fixed": R}`` or ``{"layer.3": R_3, ...}`` (per_layer); a bucket
        b < n adds ``"common.len{b}"`` / ``"layer.3.len{b}"``."""
        enc = self._partial_encoder()
        out = {}
        for length in (None, *self.config.partial_buckets):
            suffix = bucket_suffix(self.config, length)
            tag = suffix.replace("_", ".")
            if self.config.reconstruction != "per_layer":
                out[self.config.reconstruction + tag] = getattr(enc, "partial_pattern" + suffix).reconstruction
            else:
                out.update({f"layer.{l}{tag}": getattr(enc.layer[l].attention.self, "reconstruction" + suffix)
                            for l in self.config.partial_layers})
        return out

    def get_pattern(self, layer: int | None = None, length: int | None = None) -> AttentionPattern:
        """The model's P and R in bucket ``length`` (default n; of `layer` when R is per layer, the first partial
        layer by default). A bucket that runs exactly (b <= k) has no pattern: a ValueError."""
        length = length or self.config.partial_seq_len
        modules = self._pattern_modules()
        if length not in modules:
            raise ValueError(f"length={length} is not a length bucket with a pattern; the buckets with P and R are "
                             f"{sorted(modules)} (partial_lengths={self.config.partial_lengths}, partial_lengths_k="
                             f"{self.config.partial_lengths_k}: buckets with k = b run exactly).")
        suffix = bucket_suffix(self.config, length)
        owner, r_name = modules[length], "reconstruction"
        if self.config.reconstruction == "per_layer":
            layer = self.config.partial_layers[0] if layer is None else layer
            if layer not in self.config.partial_layers:
                raise ValueError(f"layer={layer} is not a partial layer; partial_layers={self.config.partial_layers}.")
            owner, r_name = self._partial_encoder().layer[layer].attention.self, "reconstruction" + suffix
        return AttentionPattern(
            modules[length].indices, getattr(owner, r_name), getattr(owner, r_name.replace("reconstruction",
                                                                                          "reconstruction_bias"), None),
            metadata={"source_model": self.config._name_or_path or "", "reconstruction": self.config.reconstruction},
        )

    def get_patterns(self, layer: int | None = None) -> PatternBuckets:
        """Every bucket's P and R (of `layer` when R is per layer) as `PatternBuckets`."""
        return PatternBuckets({b: self.get_pattern(layer, b) for b in self._pattern_modules()},
                              exact_lengths=self.config.exact_lengths, k=self.config.partial_k)

    @torch.no_grad()
    def set_pattern(self, pattern: AttentionPattern | PatternBuckets) -> None:
        """Install P and R of every bucket (R into every partial layer's reconstruction tensors, whatever the mode).

        An `AttentionPattern` is one bucket of n: for a model with one bucket (``partial_lengths == [n]``)."""
        if not isinstance(pattern, (AttentionPattern, PatternBuckets)):
            raise TypeError(f"pattern must be an AttentionPattern or PatternBuckets, got {type(pattern).__name__}.")
        try:
            buckets = check_buckets(self.config, pattern)
        except ValueError as err:
            raise ValueError(f"{err} Build the model with from_bert(..., pattern).") from err
        if buckets.has_bias != self.config.partial_use_bias:
            raise ValueError(f"pattern {'has' if buckets.has_bias else 'has no'} bias but "
                             f"config.partial_use_bias={self.config.partial_use_bias}.")
        enc = self._partial_encoder()
        for length, module in self._pattern_modules().items():
            bucket = buckets[length]
            module.indices.copy_(bucket.indices)
            module.refresh_layout()
            suffix = bucket_suffix(self.config, length)
            owners = ([(module, "")] if self.config.reconstruction != "per_layer"
                      else [(enc.layer[l].attention.self, suffix) for l in self.config.partial_layers])
            for owner, tag in owners:
                getattr(owner, "reconstruction" + tag).copy_(bucket.reconstruction)
                if bucket.bias is not None:
                    getattr(owner, "reconstruction_bias" + tag).copy_(bucket.bias)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`; with the plugin imported, `hub.save_pretrained` also completes
        ``auto_map`` and writes the model card (its ``write_model_card`` argument), also when pushing."""
        hub = PartialBertPreTrainedModel._hub
        if hub is None:
            kwargs.pop("write_model_card", None)
            return super().save_pretrained(save_directory, *args, **kwargs)
        return hub.save_pretrained(self, super().save_pretrained, save_directory, *args, **kwargs)

    def push_to_hub(self, *args, **kwargs):
        """`PreTrainedModel.push_to_hub`; with the plugin imported, `hub.push_to_hub` uploads this project's card."""
        hub = PartialBertPreTrainedModel._hub
        if hub is None:
            return super().push_to_hub(*args, **kwargs)
        return hub.push_to_hub(self, *args, **kwargs)

    # ------------------------------------------------------------------ conversion
    # `conversion.from_bert` with this class: PartialBertForMaskedLM.from_bert(bert_path_or_model, pattern, ...)
    from_bert = classmethod(from_bert)


# P, R and their biases in a state dict: the pattern modules' tensors and each partial layer's own R (per_layer).
_PARTIAL_NAME = re.compile(r"\.partial_pattern(_len\d+)?\.|attention\.self\.reconstruction(_bias)?(_len\d+)?$")


class PartialBertModel(PartialBertPreTrainedModel, BertModel):
    """`BertModel` with partial self-attention in `config.partial_layers`; ``pattern``: the P and R it starts with
    (default: `default_pattern` of the config)."""

    _bert_class = BertModel

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

    _bert_class = BertForMaskedLM

    def __init__(self, config: PartialBertConfig, pattern: AttentionPattern | PatternBuckets | None = None):
        self._start_head(BertForMaskedLM, config, pattern, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(config)
        self.post_init()


class PartialBertForSequenceClassification(PartialBertPreTrainedModel, BertForSequenceClassification):
    """`BertForSequenceClassification` on a `PartialBertModel`."""

    _bert_class = BertForSequenceClassification

    def __init__(self, config: PartialBertConfig, pattern: AttentionPattern | PatternBuckets | None = None):
        self._start_head(BertForSequenceClassification, config, pattern, add_pooling_layer=True)
        _add_classifier(self, config)
        self.post_init()


class PartialBertForTokenClassification(PartialBertPreTrainedModel, BertForTokenClassification):
    """`BertForTokenClassification` on a `PartialBertModel`."""

    _bert_class = BertForTokenClassification

    def __init__(self, config: PartialBertConfig, pattern: AttentionPattern | PatternBuckets | None = None):
        self._start_head(BertForTokenClassification, config, pattern, add_pooling_layer=False)
        _add_classifier(self, config)
        self.post_init()


class PartialBertForQuestionAnswering(PartialBertPreTrainedModel, BertForQuestionAnswering):
    """`BertForQuestionAnswering` on a `PartialBertModel`."""

    _bert_class = BertForQuestionAnswering

    def __init__(self, config: PartialBertConfig, pattern: AttentionPattern | PatternBuckets | None = None):
        self._start_head(BertForQuestionAnswering, config, pattern, add_pooling_layer=False)
        self.num_labels = config.num_labels
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

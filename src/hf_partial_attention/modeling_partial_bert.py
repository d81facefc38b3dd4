"""PartialBert: BERT with partial self-attention (Bhojanapalli et al., 2021), as transformers models.

Parameter names are BERT's, so BERT checkpoints load unchanged; the method adds (names in ``model.safetensors``,
shown for the base model, prefixed ``bert.`` in the heads):

- ``encoder.partial_pattern.indices``: P, ``(n, k)`` int64 buffer, shared by every partial layer.
- ``encoder.partial_pattern.reconstruction``: R, ``(n, n−k, k)``: a buffer (``reconstruction="fixed"``) or one
  trainable parameter (``"common"``).
- ``encoder.layer.{l}.attention.self.reconstruction``: R of layer l, trainable (``"per_layer"``).
- ``...reconstruction_bias``: beside each R when ``partial_use_bias=True``, ``(n, n−k)``.

This file, with its sibling imports, is copied next to saved checkpoints for ``trust_remote_code=True``.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from transformers import initialization as init
from transformers.models.bert.modeling_bert import (
    BertEmbeddings,
    BertEncoder,
    BertForMaskedLM,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
    BertOnlyMLMHead,
    BertPooler,
    BertPreTrainedModel,
    BertSelfAttention,
)

from .configuration_partial_bert import PartialBertConfig
from .partial_attention import PatternLayout, auto_implementation, partial_attention_forward
from .pattern import AttentionPattern

__all__ = [
    "PartialBertPreTrainedModel",
    "PartialBertModel",
    "PartialBertForMaskedLM",
    "PartialBertForSequenceClassification",
    "PartialBertForTokenClassification",
    "PartialBertForQuestionAnswering",
    "PartialBertSelfAttention",
    "PartialBertPattern",
]

_DEFAULT_PATTERNS: dict[tuple[int, int, float], AttentionPattern] = {}


def default_pattern(config: PartialBertConfig) -> AttentionPattern:
    """The pattern a model built from a config alone starts with (`AttentionPattern.local`), cached."""
    key = (config.partial_seq_len, config.partial_k, float(config.partial_default_correlation))
    if key not in _DEFAULT_PATTERNS:
        _DEFAULT_PATTERNS[key] = AttentionPattern.local(*key)
    return _DEFAULT_PATTERNS[key]


def _r_tensor(config: PartialBertConfig, trainable: bool, bias: bool) -> nn.Parameter | torch.Tensor:
    n, k = config.partial_seq_len, config.partial_k
    shape = (n, n - k) if bias else (n, n - k, k)
    tensor = torch.zeros(shape)
    return nn.Parameter(tensor) if trainable else tensor


class PartialBertPattern(nn.Module):
    """Holds P (and R unless R is per layer) for all partial layers of an encoder."""

    def __init__(self, config: PartialBertConfig):
        super().__init__()
        n, k = config.partial_seq_len, config.partial_k
        self.register_buffer("indices", torch.zeros(n, k, dtype=torch.long), persistent=True)
        self.mode = config.reconstruction
        if self.mode == "common":
            self.reconstruction = _r_tensor(config, True, False)
            self.reconstruction_bias = _r_tensor(config, True, True) if config.partial_use_bias else None
        elif self.mode == "fixed":
            self.register_buffer("reconstruction", _r_tensor(config, False, False), persistent=True)
            bias = _r_tensor(config, False, True) if config.partial_use_bias else None
            self.register_buffer("reconstruction_bias", bias, persistent=True)
        self._layout_cache: tuple | None = None

    def layout(self) -> PatternLayout:
        """Complement, inverse permutation and block structure of P; recomputed whenever P changes."""
        idx = self.indices
        stamp = (idx.data_ptr(), idx._version, idx.device)
        if self._layout_cache is None or self._layout_cache[0] != stamp:
            self._layout_cache = (stamp, PatternLayout.from_indices(idx))
        return self._layout_cache[1]


class PartialBertSelfAttention(BertSelfAttention):
    """`BertSelfAttention` (same q/k/v parameters) whose scores are computed at P and reconstructed elsewhere."""

    def __init__(self, config: PartialBertConfig, pattern: PartialBertPattern, layer_idx: int | None = None):
        super().__init__(config, layer_idx=layer_idx)
        # The pattern module is owned by the encoder; keep an unregistered reference so its tensors are
        # saved once, not once per layer.
        object.__setattr__(self, "_pattern", pattern)
        self.implementation = config.partial_implementation
        if config.reconstruction == "per_layer":
            self.reconstruction = _r_tensor(config, True, False)
            self.reconstruction_bias = _r_tensor(config, True, True) if config.partial_use_bias else None

    def _r_and_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        owner = self if "reconstruction" in self._parameters else self._pattern
        return owner.reconstruction, getattr(owner, "reconstruction_bias", None)

    def forward(self, hidden_states, attention_mask=None, cache=None, **kwargs):
        if cache is not None:
            raise ValueError("PartialBert is an encoder and does not take a cache (got cache).")
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.attention_head_size)
        query = self.query(hidden_states).view(*hidden_shape).transpose(1, 2)  # (B, H, T, D)
        key = self.key(hidden_states).view(*hidden_shape).transpose(1, 2)  # (B, H, T, D)
        value = self.value(hidden_states).view(*hidden_shape).transpose(1, 2)  # (B, H, T, D)
        recon, bias = self._r_and_bias()
        layout = self._pattern.layout()
        impl = self.implementation
        if impl == "auto":
            impl = auto_implementation(layout, self.attention_head_size)
        out, probs = partial_attention_forward(
            self, query, key, value, attention_mask, layout=layout,
            reconstruction=recon, bias=bias, scaling=self.scaling,
            dropout=self.dropout.p if self.training else 0.0, implementation=impl,
        )
        return out.reshape(*input_shape, -1).contiguous(), probs  # (B, T, H·D)


def _install_partial_attention(encoder: BertEncoder, config: PartialBertConfig) -> None:
    encoder.partial_pattern = PartialBertPattern(config)
    for layer_idx in config.partial_layers:
        encoder.layer[layer_idx].attention.self = PartialBertSelfAttention(
            config, encoder.partial_pattern, layer_idx=layer_idx
        )


class PartialBertPreTrainedModel(BertPreTrainedModel):
    config_class = PartialBertConfig
    config: PartialBertConfig
    _bert_class = BertModel  # the upstream class whose checkpoints map one-to-one onto this one

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, PartialBertPattern):
            pattern = default_pattern(self.config)
            init.copy_(module.indices, pattern.indices)
            if getattr(module, "reconstruction", None) is not None:
                init.copy_(module.reconstruction, pattern.reconstruction)
            if getattr(module, "reconstruction_bias", None) is not None:
                init.zeros_(module.reconstruction_bias)
        elif isinstance(module, PartialBertSelfAttention) and "reconstruction" in module._parameters:
            init.copy_(module.reconstruction, default_pattern(self.config).reconstruction)
            if module.reconstruction_bias is not None:
                init.zeros_(module.reconstruction_bias)

    # ------------------------------------------------------------------ pattern access
    def _partial_encoder(self) -> BertEncoder:
        return getattr(self, self.base_model_prefix, self).encoder

    def reconstruction_tensors(self) -> dict[str, torch.Tensor]:
        """Name -> R tensor: ``{"common": R}`` / ``{"fixed": R}`` or ``{"layer.3": R_3, ...}`` (per_layer)."""
        enc = self._partial_encoder()
        if self.config.reconstruction != "per_layer":
            return {self.config.reconstruction: enc.partial_pattern.reconstruction}
        return {f"layer.{l}": enc.layer[l].attention.self.reconstruction for l in self.config.partial_layers}

    def get_pattern(self, layer: int | None = None) -> AttentionPattern:
        """The model's P and R (of `layer` when R is per layer; the first partial layer by default)."""
        enc = self._partial_encoder()
        owner = enc.partial_pattern
        if self.config.reconstruction == "per_layer":
            layer = self.config.partial_layers[0] if layer is None else layer
            if layer not in self.config.partial_layers:
                raise ValueError(f"layer={layer} is not a partial layer; partial_layers={self.config.partial_layers}.")
            owner = enc.layer[layer].attention.self
        return AttentionPattern(
            enc.partial_pattern.indices, owner.reconstruction, getattr(owner, "reconstruction_bias", None),
            metadata={"source_model": self.config._name_or_path or "", "reconstruction": self.config.reconstruction},
        )

    @torch.no_grad()
    def set_pattern(self, pattern: AttentionPattern) -> None:
        """Install P and R (R into every partial layer's reconstruction tensor, whatever the mode)."""
        if not isinstance(pattern, AttentionPattern):
            raise TypeError(f"pattern must be an AttentionPattern, got {type(pattern).__name__}.")
        if pattern.scope != "per_query":
            raise ValueError(f"The model runs per-query patterns; got scope={pattern.scope!r}. "
                             "Derive the pattern with scope='per_query'.")
        n, k = self.config.partial_seq_len, self.config.partial_k
        if (pattern.seq_len, pattern.k) != (n, k):
            raise ValueError(f"pattern has seq_len={pattern.seq_len}, k={pattern.k} but the model expects "
                             f"partial_seq_len={n}, partial_k={k}; build the model with from_bert(..., pattern).")
        if (pattern.bias is not None) != self.config.partial_use_bias:
            raise ValueError(f"pattern {'has' if pattern.bias is not None else 'has no'} bias but "
                             f"config.partial_use_bias={self.config.partial_use_bias}.")
        enc = self._partial_encoder()
        enc.partial_pattern.indices.copy_(pattern.indices)
        owners = ([enc.partial_pattern] if self.config.reconstruction != "per_layer"
                  else [enc.layer[l].attention.self for l in self.config.partial_layers])
        for owner in owners:
            owner.reconstruction.copy_(pattern.reconstruction)
            if pattern.bias is not None:
                owner.reconstruction_bias.copy_(pattern.bias)

    def save_pretrained(self, save_directory, *args, write_model_card: bool | None = None, **kwargs):
        """`PreTrainedModel.save_pretrained`, plus a model card (``README.md``, see `model_card.py`).

        Args:
            write_model_card: ``None`` (default) writes a card only if the folder has no ``README.md`` yet;
                ``True`` replaces an existing one; ``False`` writes none. Only the main process writes it.
        """
        from .model_card import write_model_card as _write_model_card  # also bundles model_card.py for remote code

        # Only the saved class and its config get an auto_map entry by default; list every head so that
        # any AutoModel* class loads the folder with trust_remote_code=True.
        self.config.auto_map = dict(_AUTO_MAP)
        readme = os.path.join(os.fspath(save_directory), "README.md")
        had_readme = os.path.exists(readme)  # checked first: push_to_hub=True writes a README of its own
        result = super().save_pretrained(save_directory, *args, **kwargs)
        is_main_process = kwargs.get("is_main_process", args[0] if args else True)
        if is_main_process and (write_model_card or (write_model_card is None and not had_readme)):
            _write_model_card(self, save_directory, overwrite=True)
        return result

    # ------------------------------------------------------------------ conversion
    @classmethod
    def from_bert(cls, bert_model_or_path, pattern: AttentionPattern, **config_overrides):
        """Convert a BERT-family checkpoint (BERT, MiniLM, ...) keeping every weight, and install P and R.

        Args:
            bert_model_or_path: a `BertPreTrainedModel` instance, or a path / Hub id loadable by the
                matching `BertFor*` class (`BertModel` for `PartialBertModel`, and so on).
            pattern: a per-query `AttentionPattern`; n and k come from it.
            **config_overrides: `PartialBertConfig` fields, e.g. ``reconstruction="per_layer"``,
                ``partial_layers=[0, 1]``, ``attn_implementation="eager"`` (for non-partial layers).
        """
        if isinstance(bert_model_or_path, (str, os.PathLike)):
            source = cls._bert_class.from_pretrained(os.fspath(bert_model_or_path))
        elif isinstance(bert_model_or_path, BertPreTrainedModel):
            source = bert_model_or_path
        else:
            raise TypeError("bert_model_or_path must be a path, a Hub id or a BertPreTrainedModel, got "
                            f"{type(bert_model_or_path).__name__}.")
        if not isinstance(pattern, AttentionPattern):
            raise TypeError(f"pattern must be an AttentionPattern, got {type(pattern).__name__}.")
        attn_impl = config_overrides.pop("attn_implementation", None)
        fields = source.config.to_dict()
        for drop in ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path"):
            fields.pop(drop, None)
        fields.update(partial_seq_len=pattern.seq_len, partial_k=pattern.k, partial_use_bias=pattern.bias is not None)
        fields.update(config_overrides)
        config = PartialBertConfig(**fields)
        if attn_impl is not None:
            config._attn_implementation = attn_impl
        model = cls(config)
        _copy_bert_weights(source, model)
        model.set_pattern(pattern)
        return model


def _copy_bert_weights(source: BertPreTrainedModel, target: PartialBertPreTrainedModel) -> None:
    src_state = source.state_dict()
    if not any(key.startswith("bert.") for key in src_state):  # a bare BertModel
        src_state = {f"bert.{key}": value for key, value in src_state.items()}
    if target.base_model_prefix not in target._modules:  # target is the bare PartialBertModel
        src_state = {key.removeprefix("bert."): v for key, v in src_state.items() if key.startswith("bert.")}
    tgt_keys = set(target.state_dict())
    missing_in_target = sorted(set(src_state) - tgt_keys)
    if missing_in_target and isinstance(source, type(target)._bert_class):
        raise ValueError(f"Weights {missing_in_target[:5]} of the source have no place in {type(target).__name__}.")
    usable = {key: value for key, value in src_state.items() if key in tgt_keys}
    target.load_state_dict(usable, strict=False)


class PartialBertModel(PartialBertPreTrainedModel, BertModel):
    """`BertModel` with partial self-attention in `config.partial_layers`."""

    _bert_class = BertModel

    def __init__(self, config: PartialBertConfig, add_pooling_layer: bool = True):
        BertPreTrainedModel.__init__(self, config)
        self.config = config
        self.gradient_checkpointing = False
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        _install_partial_attention(self.encoder, config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.post_init()


class PartialBertForMaskedLM(PartialBertPreTrainedModel, BertForMaskedLM):
    """`BertForMaskedLM` on a `PartialBertModel`; `forward` is BERT's."""

    _bert_class = BertForMaskedLM

    def __init__(self, config: PartialBertConfig):
        BertPreTrainedModel.__init__(self, config)
        self.bert = PartialBertModel(config, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(config)
        self.post_init()


def _classifier_dropout(config: PartialBertConfig) -> nn.Dropout:
    p = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
    return nn.Dropout(p)


class PartialBertForSequenceClassification(PartialBertPreTrainedModel, BertForSequenceClassification):
    """`BertForSequenceClassification` on a `PartialBertModel`; `forward` is BERT's."""

    _bert_class = BertForSequenceClassification

    def __init__(self, config: PartialBertConfig):
        BertPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.config = config
        self.bert = PartialBertModel(config)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()


class PartialBertForTokenClassification(PartialBertPreTrainedModel, BertForTokenClassification):
    """`BertForTokenClassification` on a `PartialBertModel`; `forward` is BERT's."""

    _bert_class = BertForTokenClassification

    def __init__(self, config: PartialBertConfig):
        BertPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.bert = PartialBertModel(config, add_pooling_layer=False)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()


class PartialBertForQuestionAnswering(PartialBertPreTrainedModel, BertForQuestionAnswering):
    """`BertForQuestionAnswering` on a `PartialBertModel`; `forward` is BERT's."""

    _bert_class = BertForQuestionAnswering

    def __init__(self, config: PartialBertConfig):
        BertPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.bert = PartialBertModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()


AUTO_CLASSES = {
    "AutoModel": PartialBertModel,
    "AutoModelForMaskedLM": PartialBertForMaskedLM,
    "AutoModelForSequenceClassification": PartialBertForSequenceClassification,
    "AutoModelForTokenClassification": PartialBertForTokenClassification,
    "AutoModelForQuestionAnswering": PartialBertForQuestionAnswering,
}
_AUTO_MAP = {"AutoConfig": "configuration_partial_bert.PartialBertConfig"}
_AUTO_MAP.update({auto: f"modeling_partial_bert.{klass.__name__}" for auto, klass in AUTO_CLASSES.items()})

PartialBertConfig.register_for_auto_class()
for _auto_name, _klass in AUTO_CLASSES.items():
    _klass.register_for_auto_class(_auto_name)

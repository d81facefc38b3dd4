"""PartialBert: BERT with partial self-attention (Bhojanapalli et al., 2021), as transformers models.

Parameter names are BERT's, so BERT checkpoints load unchanged; the method adds (names in ``model.safetensors``,
shown for the base model, prefixed ``bert.`` in the heads):

- ``encoder.partial_pattern.indices``: P, ``(n, k)`` int64 buffer, shared by every partial layer.
- ``encoder.partial_pattern.reconstruction``: R, ``(n, n−k, k)``: a buffer (``reconstruction="fixed"``) or one
  trainable parameter (``"common"``).
- ``encoder.layer.{l}.attention.self.reconstruction``: R of layer l, trainable (``"per_layer"``).
- ``...reconstruction_bias``: beside each R when ``partial_use_bias=True``, ``(n, n−k)``.

The heads are BERT's own classes, built by BERT's own ``__init__``; `PartialBertPreTrainedModel.post_init` then
swaps the self-attention of the partial layers (docs/method.md#the-model-p-r-and-where-they-live). Attention
runs through transformers' ``AttentionInterface``: partial layers call ``partial_<kernel>`` (`partial_attention`),
exact layers honour ``config._attn_implementation``. Auto registration, ``auto_map`` and model cards live in
`hub`; this file, with its sibling imports, is copied next to saved checkpoints for ``trust_remote_code=True``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
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
    BertSelfAttention,
)

from .configuration_partial_bert import PartialBertConfig
from .conversion import PARTIAL_FIELDS, copy_weights, initial_pattern, load_source, partial_config
from .partial_attention import PatternLayout, attention_function_name, check_implementation
from .partial_pattern import PartialBertPattern, default_pattern, init_bias, initial_for, r_tensor
from .pattern import AttentionPattern
from .tiled_kernel import needs_grad, shared_rows, tie_rows

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
    "default_pattern",
    "initial_pattern",
]



class PartialBertSelfAttention(BertSelfAttention):
    """`BertSelfAttention` (same q/k/v parameters) whose scores are computed at P and reconstructed elsewhere.

    The kernel is ``config.partial_implementation`` (a runtime setting, see
    `PartialBertPreTrainedModel.set_partial_implementation`), run through transformers' ``AttentionInterface``.
    """

    def __init__(self, config: PartialBertConfig, encoder: BertEncoder, layer_idx: int | None = None):
        super().__init__(config, layer_idx=layer_idx)
        # The pattern module is owned by the encoder and looked up there at every call (an unregistered reference,
        # so its tensors are saved once, not once per layer). Calling it, rather than holding it, means that a
        # wrapper installed in its place (peft's modules_to_save) is the one that runs.
        object.__setattr__(self, "_encoder", encoder)
        if config.reconstruction == "per_layer":
            self.reconstruction = r_tensor(config, True, False)
            self.reconstruction_bias = r_tensor(config, True, True) if config.partial_use_bias else None

    def partial_tensors(self) -> tuple[PatternLayout, torch.Tensor, torch.Tensor | None]:
        """``(layout of P, R, bias or None)`` this layer reconstructs with (read by the attention functions)."""
        layout, recon, bias = self._encoder.partial_pattern()
        if "reconstruction" in self._parameters:  # per_layer
            recon, bias = self.reconstruction, self.reconstruction_bias
        if self.config.partial_tie_shared_rows and needs_grad(recon):
            recon = tie_rows(recon, shared_rows(layout.indices, recon))
        return layout, recon, bias

    def forward(self, hidden_states, attention_mask=None, cache=None, **kwargs):
        if cache is not None:
            raise ValueError("PartialBert is an encoder and does not take a cache (got cache).")
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.attention_head_size)
        query = self.query(hidden_states).view(*hidden_shape).transpose(1, 2)  # (B, H, T, D)
        key = self.key(hidden_states).view(*hidden_shape).transpose(1, 2)  # (B, H, T, D)
        value = self.value(hidden_states).view(*hidden_shape).transpose(1, 2)  # (B, H, T, D)
        # "partial_auto" picks its kernel from P inside the call (one read of the layer's P and R per call)
        name = attention_function_name(self.config.partial_implementation)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS[name]
        out, probs = attention_interface(self, query, key, value, attention_mask, scaling=self.scaling,
                                         dropout=self.dropout.p if self.training else 0.0,
                                         need_weights=_attention_weights_requested(self.config, kwargs))
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


def _install_partial_attention(encoder: BertEncoder, config: PartialBertConfig) -> None:
    """Give ``encoder`` its pattern module and swap the self-attention of every partial layer (idempotent)."""
    if "partial_pattern" in encoder._modules:
        return
    encoder.partial_pattern = PartialBertPattern(config)
    for layer_idx in config.partial_layers:
        encoder.layer[layer_idx].attention.self = PartialBertSelfAttention(config, encoder, layer_idx=layer_idx)


class PartialBertPreTrainedModel(BertPreTrainedModel):
    config_class = PartialBertConfig
    config: PartialBertConfig
    _bert_class = BertModel  # the upstream class whose checkpoints map one-to-one onto this one
    # Set by `hf_partial_attention.hub.register()` (auto_map, model card on save and push); None under remote
    # code, where saving and pushing are transformers' own.
    _hub: ClassVar[type | None] = None

    def post_init(self):
        """BERT's own ``__init__`` built the body; make its partial layers partial, then BERT's post-init."""
        body = self if isinstance(self, BertModel) else getattr(self, self.base_model_prefix)
        if not isinstance(body, PartialBertModel):
            # The head's __init__ (BERT's) built a plain BertModel body: same modules and parameter names, so it
            # becomes a PartialBertModel in place rather than being built twice.
            body.__class__ = PartialBertModel
        _install_partial_attention(body.encoder, self.config)
        super().post_init()

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, PartialBertPattern):
            pattern = initial_for(self.config)
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
            pattern = initial_for(self.config)
            init.copy_(module.reconstruction, pattern.reconstruction)
            if module.reconstruction_bias is not None:
                init_bias(module.reconstruction_bias, pattern)

    def set_partial_implementation(self, implementation: str) -> None:
        """Switch the kernel of the partial layers at run time: ``"auto"``, ``"gather"``, ``"dense"``, ``"fused"``,
        ``"tiled"`` or ``"triton"`` (all give the same numbers). Like ``attn_implementation`` it is a setting of
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
        return [name for name, _ in self.state_dict().items() if ".partial_pattern." in f".{name}"
                or name.endswith(("attention.self.reconstruction", "attention.self.reconstruction_bias"))]

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
                self.get_pattern(layer)
            except ValueError as err:
                raise ValueError(f"{source!s} holds an invalid P or R ({sorted(names)}): {err}") from err
        self._partial_encoder().partial_pattern.refresh_layout()

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
        enc.partial_pattern.refresh_layout()
        owners = ([enc.partial_pattern] if self.config.reconstruction != "per_layer"
                  else [enc.layer[l].attention.self for l in self.config.partial_layers])
        for owner in owners:
            owner.reconstruction.copy_(pattern.reconstruction)
            if pattern.bias is not None:
                owner.reconstruction_bias.copy_(pattern.bias)

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
    @classmethod
    def from_bert(cls, bert_model_or_path, pattern: AttentionPattern, *, output_loading_info: bool = False,
                  revision: str | None = None, token: str | bool | None = None, dtype=None,
                  cache_dir: str | None = None, **config_overrides):
        """Convert a BERT-family checkpoint (BERT, MiniLM, ...) keeping every weight, and install P and R.

        Args:
            bert_model_or_path: a `BertPreTrainedModel` instance, or a path / Hub id loadable by the
                matching `BertFor*` class (`BertModel` for `PartialBertModel`, and so on).
            pattern: a per-query `AttentionPattern`; n and k come from it.
            output_loading_info: also return ``{"missing_keys", "unexpected_keys", "source"}``: the target weights
                the source did not provide (a new head), source weights without a place, and the source load's own
                report.
            revision, token, dtype, cache_dir: passed to the source's ``from_pretrained``; the converted model takes
                the source's dtype.
            **config_overrides: `PartialBertConfig` fields, e.g. ``reconstruction="per_layer"``,
                ``partial_layers=[0, 1]``, ``attn_implementation="eager"`` (for non-partial layers), and BERT
                settings of the head (``num_labels=3``, ``id2label=...``), which also reach the source load.
        """
        if not isinstance(pattern, AttentionPattern):
            raise TypeError(f"pattern must be an AttentionPattern, got {type(pattern).__name__}.")
        attn_impl = config_overrides.pop("attn_implementation", None)
        settings = {k: v for k, v in config_overrides.items() if k not in PARTIAL_FIELDS}
        source, source_info = load_source(
            cls._bert_class, bert_model_or_path, settings,
            {"revision": revision, "token": token, "dtype": dtype, "cache_dir": cache_dir})
        config = partial_config(source, pattern, config_overrides)
        if attn_impl is not None:
            config._attn_implementation = attn_impl
        with initial_pattern(pattern):  # P and R go in at construction: the default is never built
            model = cls(config)
        model.to(next(source.parameters()).dtype)  # floating tensors only; P stays int64
        report = copy_weights(source, model, set(model._partial_tensor_names()))
        # Weights the source load itself initialised afresh (a new head) were copied, but are new all the same.
        report["missing_keys"] = sorted(set(report["missing_keys"]) | set(source_info.get("missing_keys", [])))
        model.set_pattern(pattern)  # also checks the pattern against the config
        return (model, {**report, "source": source_info}) if output_loading_info else model


# The heads are BERT's classes with BERT's own __init__ and forward; `PartialBertPreTrainedModel.post_init` makes
# the body partial.
class PartialBertModel(PartialBertPreTrainedModel, BertModel):
    """`BertModel` with partial self-attention in `config.partial_layers`."""

    _bert_class = BertModel

    # BertModel's own signature, spelt out: torch.export binds keyword inputs to it, the Trainer reads it to keep
    # the dataset's input columns, and transformers checks main_input_name against it.
    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, encoder_hidden_states: torch.Tensor | None = None,
                encoder_attention_mask: torch.Tensor | None = None, cache=None, use_cache: bool | None = None,
                **kwargs):
        """`BertModel.forward`. With ``output_attentions=True``, ``attentions[i]`` is layer i's map for every layer:
        exact layers run eager attention for that call (under sdpa or flash they return no map, which would shift
        the tuple to the partial layers only)."""
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                      position_ids=position_ids, inputs_embeds=inputs_embeds,
                      encoder_hidden_states=encoder_hidden_states, encoder_attention_mask=encoder_attention_mask,
                      cache=cache, use_cache=use_cache, **kwargs)
        wants_maps = kwargs.get("output_attentions")
        if wants_maps is None:
            wants_maps = self.config.output_attentions
        previous = self.config._attn_implementation
        if not wants_maps or previous == "eager":
            return super().forward(**inputs)
        self.config._attn_implementation = "eager"
        try:
            return super().forward(**inputs)
        finally:
            self.config._attn_implementation = previous


class PartialBertForMaskedLM(PartialBertPreTrainedModel, BertForMaskedLM):
    """`BertForMaskedLM` on a `PartialBertModel`."""

    _bert_class = BertForMaskedLM


class PartialBertForSequenceClassification(PartialBertPreTrainedModel, BertForSequenceClassification):
    """`BertForSequenceClassification` on a `PartialBertModel`."""

    _bert_class = BertForSequenceClassification


class PartialBertForTokenClassification(PartialBertPreTrainedModel, BertForTokenClassification):
    """`BertForTokenClassification` on a `PartialBertModel`."""

    _bert_class = BertForTokenClassification


class PartialBertForQuestionAnswering(PartialBertPreTrainedModel, BertForQuestionAnswering):
    """`BertForQuestionAnswering` on a `PartialBertModel`."""

    _bert_class = BertForQuestionAnswering

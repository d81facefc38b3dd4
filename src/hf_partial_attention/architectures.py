"""The encoders partial attention runs in: one table entry per architecture, all that is architecture-specific.

An entry (`Architecture`) says where a model's attention modules are, which module owns the pattern modules, which
layers are partial by default and which heads exist. Everything else (the attention functions, the pattern modules,
length buckets, R modes, kernels, loading checks) is shared: `partial_layer`, `partial_pattern`, `modeling_partial`.
An architecture whose attention module computes its scores itself (MPNet, DeBERTa-v2) names an adapter
(`attention_adapters`) that makes it dispatch. Decoders and attention of other kinds do not qualify (`check_supported`
refuses them, naming what is supported).

Part of the remote-code bundle (imports: transformers and siblings only).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Architecture", "ARCHITECTURES", "DEFAULT_MODEL_TYPE", "HEAD_SUFFIXES", "architecture_for",
           "check_supported", "supported_model_types", "UnsupportedModelError"]

# Auto class -> the suffix of the architecture's class for it (``RobertaForMaskedLM``, ...).
HEAD_SUFFIXES = {
    "AutoModel": "Model",
    "AutoModelForMaskedLM": "ForMaskedLM",
    "AutoModelForSequenceClassification": "ForSequenceClassification",
    "AutoModelForTokenClassification": "ForTokenClassification",
    "AutoModelForQuestionAnswering": "ForQuestionAnswering",
}


class UnsupportedModelError(ValueError):
    """A model whose attention partial attention cannot run in (a decoder, or attention of its own)."""


def _nested(module, path: str):
    for name in filter(None, path.split(".")):
        module = getattr(module, name)
    return module


@dataclass(frozen=True)
class Architecture:
    """Where partial attention goes in one architecture.

    An entry says where a model's attention modules are (`attention_modules`: ``(layer, module)`` in layer order; a
    module that serves several layers, as in ALBERT, appears once per layer), which module owns the pattern modules
    (P, and R when it is common or fixed: ``<owner>.partial_pattern``), which layers are partial by default and which
    heads exist. Every entry's attention modules call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` (MPNet's
    once adapted: ``adapter``) with q and k as the model scores them (after RoPE in ModernBERT, NomicBERT, GTE and
    EuroBERT), so P and R act on the scores the model uses.

    Args:
        model_type: the source's ``config.model_type`` (``"roberta"``).
        module: transformers' module of the architecture (``"roberta"`` for ``transformers.models.roberta``).
        prefix: the class-name prefix (``"Roberta"``: ``RobertaConfig``, ``RobertaModel``, ...).
        layers: path from the base model to its list of layers; attention: path from a layer to its attention
            module.
        attention_of: where one attention module serves several layers (ALBERT): a function of the base model
            giving ``(layer, module)`` for every layer, used instead of ``layers`` and ``attention``.
        config_methods: methods of the partial config class particular to this architecture, ``(name,
            function)`` pairs: ``shared_layer_groups`` (the layers that share one attention module) and
            ``default_partial_layers`` (the layers made partial when ``partial_layers`` is not given).
        owner: path from the base model to the module that owns the pattern modules ("" for the base model).
        heads: the Auto classes this architecture has a class for (of `HEAD_SUFFIXES`).
        note: what is particular about it, for the docs and errors.
        files: the files its partial classes are written under, ``configuration_partial_<files>.py`` and
            ``modeling_partial_<files>.py``: what its checkpoints' ``auto_map`` names (PartialBert's since 0.1).
        display_name: its name in prose (model cards): ``"RoBERTa"``.
        adapter: for attention modules that score in their own forward instead of calling an attention function
            (MPNet's, which adds a relative-position bias; DeBERTa-v2's, whose scores have position terms), the
            adapter of `attention_adapters.ADAPTERS` that makes them dispatch through ``ALL_ATTENTION_FUNCTIONS``; ""
            for the rest.
    """

    model_type: str
    module: str
    prefix: str
    layers: str = "encoder.layer"
    attention: str = "attention.self"
    owner: str = "encoder"
    heads: tuple[str, ...] = tuple(HEAD_SUFFIXES)
    note: str = ""
    files: str = "encoders"
    display_name: str = ""
    attention_of: Callable[[Any], list[tuple[int, Any]]] | None = None
    config_methods: tuple[tuple[str, Callable], ...] = ()
    adapter: str = ""

    @property
    def partial_model_type(self) -> str:
        return "partial_" + self.model_type.replace("-", "_")

    def source_class(self, auto_name: str = "AutoModel"):
        """transformers' class of this architecture for ``auto_name`` (``RobertaForMaskedLM``)."""
        return getattr(self.transformers_module(), self.prefix + HEAD_SUFFIXES[auto_name])

    def config_class(self):
        configuration = importlib.import_module(f"transformers.models.{self.module}.configuration_{self.module}")
        return getattr(configuration, self.prefix + "Config")

    def transformers_module(self):
        return importlib.import_module(f"transformers.models.{self.module}.modeling_{self.module}")

    def eager_attention(self) -> Callable:
        """The architecture's own eager attention function (``eager_attention_forward`` of its modeling file): what
        an exact bucket runs when the attention map is asked for (the adapter's, where the source has none)."""
        if self.adapter:
            from .attention_adapters import eager_attention_forward

            return eager_attention_forward
        return self.transformers_module().eager_attention_forward

    def dispatching(self, module) -> type:
        """Make an attention module of this architecture call ``ALL_ATTENTION_FUNCTIONS`` (in place, through the
        entry's adapter; nothing to do for the rest, which do). Returns the module's previous class."""
        if not self.adapter:
            return type(module)
        from .attention_adapters import adapt

        return adapt(module, self.adapter)

    def available(self) -> bool:
        """Whether the installed transformers has this architecture."""
        try:
            self.config_class()
            self.transformers_module()
        except (ImportError, AttributeError):
            return False
        return True

    def attention_modules(self, base_model) -> list[tuple[int, Any]]:
        """``(layer index, attention module)`` for every layer of ``base_model``, in layer order."""
        if self.attention_of is not None:
            return self.attention_of(base_model)
        return [(index, _nested(layer, self.attention)) for index, layer in
                enumerate(_nested(base_model, self.layers))]

    def owner_module(self, base_model):
        """The module of ``base_model`` that holds the pattern modules."""
        return _nested(base_model, self.owner)


def _albert_attention(base_model) -> list[tuple[int, Any]]:
    # ALBERT's layer i runs layer group int(i / (layers / groups)) (AlbertTransformer.forward): one group's modules
    # serve every layer of that group.
    config = base_model.config
    per_group = config.num_hidden_layers / config.num_hidden_groups
    groups = base_model.encoder.albert_layer_groups
    return [(i, layer.attention) for i in range(config.num_hidden_layers)
            for layer in groups[int(i / per_group)].albert_layers]


def _albert_groups(config) -> list[list[int]]:
    """The layers of each ALBERT layer group (they share its attention module)."""
    per_group = config.num_hidden_layers / config.num_hidden_groups
    groups: dict[int, list[int]] = {}
    for layer in range(config.num_hidden_layers):
        groups.setdefault(int(layer / per_group), []).append(layer)
    return list(groups.values())


def _every_layer(config) -> list[int]:
    # One module serves every layer of its group, so "all but the last layer" is not possible with one group: every
    # layer is partial (the paper's last exact layer does not exist in ALBERT).
    return list(range(config.num_hidden_layers))


def _global_layers_but_the_last(config) -> list[int]:
    # ModernBERT: the global (full-attention) layers but the last: a local layer scores only its window already,
    # and the paper keeps the last layer exact.
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return [i for i, kind in enumerate(types) if kind == "full_attention" and i < config.num_hidden_layers - 1]


_BERT_LIKE = "BERT's layout: encoder.layer.{i}.attention.self"
ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in (
    Architecture("bert", "bert", "Bert", note=_BERT_LIKE + " (PartialBert)", files="bert", display_name="BERT"),
    Architecture("roberta", "roberta", "Roberta", display_name="RoBERTa", note=_BERT_LIKE),
    Architecture("xlm-roberta", "xlm_roberta", "XLMRoberta", display_name="XLM-RoBERTa", note=_BERT_LIKE),
    Architecture("camembert", "camembert", "Camembert", display_name="CamemBERT", note=_BERT_LIKE),
    Architecture("electra", "electra", "Electra", display_name="ELECTRA", note=_BERT_LIKE),
    Architecture("distilbert", "distilbert", "DistilBert", display_name="DistilBERT", layers="transformer.layer",
                 attention="attention", owner="transformer", note="no layer_idx on its attention modules"),
    Architecture("albert", "albert", "Albert", display_name="ALBERT", attention="", attention_of=_albert_attention,
                 config_methods=(("shared_layer_groups", _albert_groups), ("default_partial_layers", _every_layer)),
                 note=(
        "one attention module serves every layer of a layer group: all of a group's layers are partial or none, "
        "and R cannot be per layer; every layer is partial by default")),
    Architecture("modernbert", "modernbert", "ModernBert", display_name="ModernBERT", layers="layers", attention="attn",
                 owner="", config_methods=(("default_partial_layers", _global_layers_but_the_last),), note=(
        "rotary positions; alternating global and local (sliding-window) layers: the global layers but the last are "
        "partial by default (a local layer already attends only to its window); a local layer made partial keeps "
        "its window mask on exact and reconstructed scores")),
    Architecture("nomic_bert", "nomic_bert", "NomicBert", display_name="NomicBERT", layers="layers",
                 attention="self_attn", owner="",
                 heads=("AutoModel", "AutoModelForMaskedLM", "AutoModelForSequenceClassification",
                        "AutoModelForTokenClassification"), note="rotary positions; no layer_idx"),
    Architecture("gte", "gte", "Gte", display_name="GTE", layers="layers", attention="self_attn",
                 owner="", heads=("AutoModel", "AutoModelForMaskedLM", "AutoModelForSequenceClassification",
                        "AutoModelForTokenClassification"), note="rotary positions; no layer_idx"),
    Architecture("eurobert", "eurobert", "EuroBert", display_name="EuroBERT", layers="layers", attention="self_attn",
                 owner="", heads=("AutoModel", "AutoModelForMaskedLM", "AutoModelForSequenceClassification",
                        "AutoModelForTokenClassification"), note="rotary positions"),
    Architecture("mpnet", "mpnet", "MPNet", display_name="MPNet", attention="attention.attn", adapter="mpnet", note=(
        "a relative-position bias added to every score (computed once per forward, shared by the layers): P and R "
        "act on the content scores q·k, the bias is added after R, to exact and reconstructed scores alike")),
    Architecture("deberta-v2", "deberta_v2", "DebertaV2", display_name="DeBERTa-v2", adapter="deberta-v2", note=(
        "disentangled attention: each score is content-to-content plus content-to-position and position-to-content "
        "terms (relative positions): a partial layer computes every term at P only and R reconstructs the rest from "
        "their sum")),
)}

# What a run given no model type builds (the training scripts' --model_type): the paper's architecture.
DEFAULT_MODEL_TYPE = "bert"

# Architectures whose attention transformers does not run through AttentionInterface (their own relative-position
# attention): named in the refusal so that a user knows it is not an oversight.
_OWN_ATTENTION = {"deberta", "funnel", "xlnet", "longformer", "big_bird", "reformer",
                  "squeezebert", "convbert", "mobilebert", "layoutlm", "ernie_m"}


def supported_model_types() -> list[str]:
    """The source ``model_type`` values partial attention runs in, with the installed transformers."""
    return [name for name, arch in ARCHITECTURES.items() if arch.available()]


def architecture_for(config_or_type) -> Architecture:
    """The entry of a source config (or ``model_type``); an `UnsupportedModelError` naming the model type, why, and
    what is supported otherwise. A partial config maps to its source's entry."""
    model_type = config_or_type if isinstance(config_or_type, str) else getattr(config_or_type, "model_type", None)
    for arch in ARCHITECTURES.values():
        if model_type == arch.partial_model_type:
            return arch
    check_supported(config_or_type)
    return ARCHITECTURES[model_type]


def check_supported(config_or_type) -> None:
    """Raise `UnsupportedModelError` (one line) unless partial attention can run in this model (a supported source
    type, or a partial model of one)."""
    config = None if isinstance(config_or_type, str) else config_or_type
    model_type = config_or_type if config is None else getattr(config, "model_type", None)
    supported = ", ".join(supported_model_types())
    if any(model_type == arch.partial_model_type and arch.available() for arch in ARCHITECTURES.values()):
        return  # a partial checkpoint (``partial_roberta``, ...): an encoder made partial already, never a decoder
    if model_type in ARCHITECTURES and ARCHITECTURES[model_type].available():
        if config is not None and (getattr(config, "is_decoder", False)
                                   or getattr(config, "add_cross_attention", False)):
            raise UnsupportedModelError(
                f"model type {model_type!r} is configured as a decoder (is_decoder or add_cross_attention): partial "
                "attention needs bidirectional (encoder) attention; load it as an encoder.")
        return
    readable = "`analyze` still reads its attention scores."
    if model_type in _OWN_ATTENTION:
        why = "its attention (relative positions of its own) does not run through transformers' AttentionInterface"
        readable = "`analyze` cannot read its scores either (they are computed outside AttentionInterface)."
    elif model_type in ARCHITECTURES:
        why = "the installed transformers does not have it"
    elif config is not None and _is_decoder_only(config):
        why = "it is a decoder (causal attention); partial attention is for bidirectional encoders"
    else:
        why = "it is not an encoder whose attention partial attention is known to run in"
    raise UnsupportedModelError(f"cannot make model type {model_type!r} partial: {why}. Supported model types: "
                                f"{supported}. {readable}")


def _is_decoder_only(config) -> bool:
    architectures = getattr(config, "architectures", None) or []
    return bool(getattr(config, "is_decoder", False) or any("CausalLM" in a for a in architectures)
                or getattr(config, "use_cache", False) and not getattr(config, "is_encoder_decoder", False))

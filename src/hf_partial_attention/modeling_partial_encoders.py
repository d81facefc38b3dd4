"""The partial models of every supported encoder: ``PartialBertModel``, ``PartialRobertaModel``,
``PartialModernBertForMaskedLM``, ...

For every entry of `architectures.ARCHITECTURES` that the installed transformers has, ``Partial<Prefix>PreTrainedModel``
(`_pretrained_class`) and, for every head of it (`Architecture.heads`), ``Partial<Source class name>``
(`_partial_class`, which says what it keeps and where P and R live). `partial_class_for` finds them;
``PartialRobertaModel.from_source(path, pattern)`` converts a checkpoint.

Part of the remote-code bundle (imports: torch, transformers and siblings only).
"""

from __future__ import annotations

from .architectures import ARCHITECTURES, HEAD_SUFFIXES, Architecture
from .configuration_partial_encoders import PARTIAL_CONFIG_CLASSES, file_module
from .modeling_partial import PartialModelMixin

__all__ = ["PARTIAL_MODEL_CLASSES", "partial_class_for", "partial_from_source"]


def _namespace(arch: Architecture, name: str, doc: str, **fields) -> dict:
    return {"__module__": file_module(arch, "modeling"), "__qualname__": name, "__doc__": doc,
            "config_class": PARTIAL_CONFIG_CLASSES[arch.model_type], "_partial_arch": arch, **fields}


def _pretrained_class(arch: Architecture) -> type:
    """``Partial<Prefix>PreTrainedModel``: the mixin on the source's pretrained-model base (the mixin alone where
    the architecture has none)."""
    source = getattr(arch.transformers_module(), arch.prefix + "PreTrainedModel", None)
    if source is None:
        return PartialModelMixin
    name = f"Partial{source.__name__}"
    doc = (f"The base of {arch.display_name or arch.prefix}'s partial classes: `PartialModelMixin` on "
           f"`{source.__name__}`.")
    return type(name, (PartialModelMixin, source), _namespace(arch, name, doc, _source_class=source))


def _partial_class(arch: Architecture, auto_name: str, base: type) -> type:
    """``Partial<Source class name>(Partial<Prefix>PreTrainedModel, <source class>)``: the source's ``__init__``,
    heads and ``forward`` unchanged (transformers' own classes, never copies), its attention modules made partial or
    exact in place at ``post_init`` (`modeling_partial`), P and R in ``<owner>.partial_pattern``
    (``encoder.partial_pattern.indices`` for BERT's layout, ``partial_pattern.indices`` for ModernBERT's, prefixed by
    the base model's name in the heads) and, per layer, ``<attention module>.reconstruction``. The classes are
    written under the entry's file (``modeling_partial_<files>``: PartialBert's under `modeling_partial_bert`, which
    re-exports them, as its checkpoints' ``auto_map`` names it)."""
    source = arch.source_class(auto_name)
    name = "Partial" + source.__name__
    doc = (f"`{source.__name__}` with partial attention in ``config.partial_layers`` (see "
           "`modeling_partial.PartialModelMixin`); ``pattern``: the P and R it starts with (default: the config's "
           "`default_pattern`).")
    return type(name, (base, source), _namespace(arch, name, doc, _source_class=source))


# source model_type -> Auto class name -> partial class
PARTIAL_MODEL_CLASSES: dict[str, dict[str, type]] = {}
for _arch in ARCHITECTURES.values():
    if _arch.model_type not in PARTIAL_CONFIG_CLASSES:
        continue
    _base = _pretrained_class(_arch)
    if _base is not PartialModelMixin:
        globals()[_base.__name__] = _base
        __all__.append(_base.__name__)
    for _auto in _arch.heads:
        if not hasattr(_arch.transformers_module(), _arch.prefix + HEAD_SUFFIXES[_auto]):
            continue
        _cls = _partial_class(_arch, _auto, _base)
        PARTIAL_MODEL_CLASSES.setdefault(_arch.model_type, {})[_auto] = globals()[_cls.__name__] = _cls
        __all__.append(_cls.__name__)


def partial_class_for(model_type: str, auto_name: str = "AutoModel"):
    """The partial class of a source ``model_type`` (or partial model type) for ``auto_name`` (an Auto class name:
    ``"AutoModel"``, ``"AutoModelForMaskedLM"``, ...). Refuses (one line) a model type partial attention does not run
    in, and a head the architecture does not have."""
    from .architectures import architecture_for

    classes = PARTIAL_MODEL_CLASSES[architecture_for(model_type).model_type]
    if auto_name not in classes:
        raise ValueError(f"{classes['AutoModel']._partial_arch.model_type!r} has no partial class for {auto_name}; "
                         f"it has {sorted(classes)}.")
    return classes[auto_name]


def partial_from_source(source, pattern, **config_overrides):
    """``source`` (a base model of any supported architecture: ``BertModel``, ``MPNetModel``, ...) converted into its
    partial class (``PartialBertModel``, ``PartialMPNetModel``, ...) holding ``pattern``: `from_source` of the class the
    table gives for its ``model_type``. ``config_overrides``: partial fields (``reconstruction="fixed"``, ...)."""
    return partial_class_for(source.config.model_type).from_source(source, pattern, **config_overrides)

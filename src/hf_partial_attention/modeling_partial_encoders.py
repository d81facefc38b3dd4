"""The partial models of encoders other than BERT: ``PartialRobertaModel``, ``PartialModernBertForMaskedLM``, ...

For every entry of `architectures.ARCHITECTURES` but BERT's (PartialBert is `modeling_partial_bert`) that the
installed transformers has, and every head of it (`Architecture.heads`), the class
``Partial<Source class name>(PartialModelMixin, <source class>)``: the source's ``__init__`` and ``forward``
unchanged, its attention modules made partial or exact in place at ``post_init`` (`modeling_partial`), P and R in
``<owner>.partial_pattern`` (``encoder.partial_pattern.indices`` for RoBERTa's layout, ``partial_pattern.indices`` for
ModernBERT's, prefixed by the base model's name in the heads) and, per layer, ``<attention module>.reconstruction``.
`partial_class_for` finds them; ``PartialRobertaModel.from_source(path, pattern)`` converts a checkpoint.

Part of the remote-code bundle (imports: torch, transformers and siblings only).
"""

from __future__ import annotations

from .architectures import ARCHITECTURES, HEAD_SUFFIXES, Architecture
from .configuration_partial_encoders import PARTIAL_CONFIG_CLASSES
from .modeling_partial import PartialModelMixin

__all__ = ["PARTIAL_MODEL_CLASSES", "partial_class_for"]


def _partial_class(arch: Architecture, auto_name: str):
    source = arch.source_class(auto_name)
    name = "Partial" + source.__name__
    namespace = {"__module__": __name__, "__qualname__": name, "config_class": PARTIAL_CONFIG_CLASSES[arch.model_type],
                 "_partial_arch": arch, "_source_class": source,
                 "__doc__": f"`{source.__name__}` with partial attention in ``config.partial_layers`` "
                            "(see `modeling_partial.PartialModelMixin`)."}
    return type(name, (PartialModelMixin, source), namespace)


# source model_type -> Auto class name -> partial class
PARTIAL_MODEL_CLASSES: dict[str, dict[str, type]] = {}
for _arch in ARCHITECTURES.values():
    if _arch.model_type == "bert" or _arch.model_type not in PARTIAL_CONFIG_CLASSES:
        continue
    for _auto in _arch.heads:
        if not hasattr(_arch.transformers_module(), _arch.prefix + HEAD_SUFFIXES[_auto]):
            continue
        _cls = _partial_class(_arch, _auto)
        PARTIAL_MODEL_CLASSES.setdefault(_arch.model_type, {})[_auto] = globals()[_cls.__name__] = _cls
        __all__.append(_cls.__name__)


def partial_class_for(model_type: str, auto_name: str = "AutoModel"):
    """The partial class of a source ``model_type`` (or partial model type) for ``auto_name`` (an Auto class name:
    ``"AutoModel"``, ``"AutoModelForMaskedLM"``, ...); PartialBert's classes for ``"bert"``. Refuses (one line) a
    model type partial attention does not run in, and a head the architecture does not have."""
    from .architectures import architecture_for

    arch = architecture_for(model_type)
    if arch.model_type == "bert":
        from .modeling_partial_bert import PartialBertPreTrainedModel

        classes = {auto: klass for klass in PartialBertPreTrainedModel.__subclasses__()
                   for auto, suffix in HEAD_SUFFIXES.items() if klass.__name__ == "PartialBert" + suffix}
    else:
        classes = PARTIAL_MODEL_CLASSES[arch.model_type]
    if auto_name not in classes:
        raise ValueError(f"{arch.model_type!r} has no partial class for {auto_name}; it has {sorted(classes)}.")
    return classes[auto_name]

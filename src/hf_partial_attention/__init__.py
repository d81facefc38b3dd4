"""hf-partial-attention: attention scores computed at k positions per query, the rest reconstructed.

After ``import hf_partial_attention`` the partial configs and heads of every supported encoder (PartialBert,
PartialRoberta..., `architectures.ARCHITECTURES`) are registered with ``AutoConfig`` / ``AutoModel*``, so
``AutoModel.from_pretrained(folder)`` loads their checkpoints; `partial_class_for` names the class of a model type.
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
from .architectures import UnsupportedModelError, supported_model_types
from . import configuration_partial_encoders as _configs
from . import modeling_partial_encoders as _models
from .modeling_partial_encoders import partial_class_for
from .pattern import AttentionPattern
from .version import __version__

register()

# Every architecture's partial config and classes (PartialRobertaConfig, PartialRobertaModel, ..., PartialBert's
# too), generated from the architecture table; an architecture the installed transformers lacks has none.
_GENERATED = {name: getattr(module, name) for module in (_configs, _models) for name in module.__all__
              if name.startswith("Partial")}
globals().update(_GENERATED)

# A literal list, so that linters see the re-exports above as public; the generated names follow, each name once.
__all__ = [  # PartialBert's names first
    "AttentionPattern",
    "PartialBertConfig",
    "PartialBertModel",
    "PartialBertPreTrainedModel",
    "PartialBertForMaskedLM",
    "PartialBertForSequenceClassification",
    "PartialBertForTokenClassification",
    "PartialBertForQuestionAnswering",
    "register",
    "partial_class_for",
    "supported_model_types",
    "UnsupportedModelError",
    "__version__",
]
__all__ += [name for name in _GENERATED if name not in __all__]

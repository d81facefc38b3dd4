"""The models recovery works on: the frozen exact teacher of a partial model (`exact_teacher`), the attention
modules by layer (`attention_modules`), and what layer-local attention transfer trains
(`freeze_for_attention_transfer`). `recovery` re-exports every name.
"""

from __future__ import annotations

from torch import nn

from ..conversion import PARTIAL_FIELDS
from ..partial_places import is_reconstruction_name

__all__ = ["ATTENTION_TRANSFER_PARAMETERS", "exact_teacher", "attention_modules", "freeze_for_attention_transfer",
           "is_reconstruction_parameter", "has_masked_lm_head"]

ATTENTION_TRANSFER_PARAMETERS = ("reconstruction", "query_key", "as_given")
_NOT_BERT_FIELDS = ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path")


def is_reconstruction_parameter(name: str) -> bool:
    """True for R and its bias, of n and of every shorter length bucket (`partial_places.is_reconstruction_name`)."""
    return is_reconstruction_name(name)


def _base_partial_model(model: nn.Module):
    from ..modeling_partial import PartialModelMixin

    for module in model.modules():
        if isinstance(module, PartialModelMixin):
            return module
    return None


def exact_teacher(model: nn.Module) -> nn.Module:
    """The exact twin of a partial model: its source class (``RobertaForMaskedLM`` for ``PartialRobertaForMaskedLM``,
    ...) with every weight but P and R copied, exact attention (sdpa) in every layer, in eval mode, frozen.

    Built from the model as it is now: call it on the converted model before training (the trainer does, at
    construction), so the teacher is the original exact model.

    Raises:
        TypeError: for a model that is not (or does not wrap) a partial model; pass ``teacher_model`` then.
    """
    base = _base_partial_model(model)
    if base is None or base is not model:
        what = "wraps a partial model (peft?)" if base is not None else "is not a partial model"
        raise TypeError(f"exact_teacher: {type(model).__name__} {what}; pass the exact model yourself "
                        "(PartialAttentionTrainer(teacher_model=BertForMaskedLM.from_pretrained(...))).")
    fields = {k: v for k, v in base.config.to_dict().items() if k not in PARTIAL_FIELDS and k not in _NOT_BERT_FIELDS}
    config = base._source_class.config_class(**fields)
    config._attn_implementation = "sdpa"
    teacher = base._source_class(config)
    partial = set(base._partial_tensor_names())
    state = {k: v for k, v in base.state_dict().items() if k not in partial}
    missing, unexpected = teacher.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"exact_teacher: the exact {type(teacher).__name__} does not take the model's weights "
                         f"(missing {missing[:5]}, unexpected {unexpected[:5]}); pass teacher_model yourself.")
    teacher.to(device=next(base.parameters()).device, dtype=next(base.parameters()).dtype)
    return teacher.eval().requires_grad_(False)


def attention_modules(model: nn.Module, layers=None) -> dict[int, nn.Module]:
    """``{layer index: attention module}`` of a model of a supported architecture (partial or exact), or one wrapped
    by peft / DDP, optionally only ``layers``; found through the architecture's table entry
    (`architectures.Architecture.attention_modules`) from the innermost transformers model."""
    from ..architectures import architecture_for

    inner = _base_partial_model(model)
    if inner is None:
        inner = next((m for m in model.modules() if hasattr(m, "base_model_prefix") and hasattr(m, "config")), None)
    if inner is None:
        return {}
    base = getattr(inner, inner.base_model_prefix, inner)
    found = {}
    for index, module in architecture_for(inner.config).attention_modules(base):
        if layers is None or index in layers:
            found.setdefault(index, module)
    if len({id(m) for m in found.values()}) < len(found):  # ALBERT: one module serves several layers
        raise ValueError(f"{inner.config.model_type!r} runs one attention module in several layers, so layer-local "
                         "attention transfer cannot tell its layers apart; use recovery_objective='distill' (or "
                         "'embedding').")
    return found


def freeze_for_attention_transfer(model: nn.Module, which: str) -> list[str]:
    """Leave trainable only what layer-local attention transfer trains: ``reconstruction`` (R and its bias, in
    ``common`` / ``per_layer`` models), ``query_key`` (also the partial layers' query and key weights), or
    ``as_given`` (nothing changed: LoRA adapters from peft, or a caller's own choice). Returns the trainable names.

    Raises:
        ValueError: on an unknown ``which``, or when nothing is left to train (a ``fixed`` R with ``reconstruction``).
    """
    if which not in ATTENTION_TRANSFER_PARAMETERS:
        raise ValueError(f"attention_transfer_parameters must be one of {ATTENTION_TRANSFER_PARAMETERS}, "
                         f"got {which!r}.")
    if which != "as_given":
        base = _base_partial_model(model)
        layers = set(base.config.partial_layers) if base is not None else set()
        qk = {id(p) for i, m in attention_modules(model, layers).items()
              for p in _query_key_parameters(m)} if which == "query_key" else set()
        for name, p in model.named_parameters():
            p.requires_grad_(is_reconstruction_parameter(name) or id(p) in qk)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise ValueError(f"attention_transfer_parameters={which!r} leaves nothing to train (R is fixed: its mode is "
                         "'fixed'); use reconstruction='common' or 'per_layer', or 'query_key'.")
    return trainable


def _query_key_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The query and key projections' parameters of an attention module (BERT's ``query`` / ``key``, DistilBERT's
    ``q_lin`` / ``k_lin``, ``q_proj`` / ``k_proj``); a ValueError for a fused projection (ModernBERT's ``Wqkv``)."""
    for q_name, k_name in (("query", "key"), ("q_lin", "k_lin"), ("q_proj", "k_proj")):
        if hasattr(module, q_name) and hasattr(module, k_name):
            return [*getattr(module, q_name).parameters(), *getattr(module, k_name).parameters()]
    raise ValueError(f"attention_transfer_parameters='query_key' needs separate query and key projections; "
                     f"{type(module).__name__} has none (a fused qkv projection): use 'reconstruction' or 'as_given'.")


def has_masked_lm_head(model: nn.Module) -> bool:
    """Whether ``model`` holds any architecture's MLM class (BertForMaskedLM, PartialRobertaForMaskedLM, ...), also
    inside peft / DDP wrappers."""
    return any(type(m).__name__.endswith("ForMaskedLM") for m in model.modules())

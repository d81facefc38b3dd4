"""Recovery objectives: train a converted partial model (any architecture) to behave like the exact model it came from.

The exact model is the teacher: it is free (the weights before conversion), frozen, and run once per batch. Terms
(`PartialAttentionTrainingArguments.recovery_objective`, comma-separated, summed with ``recovery_weights``):

- ``mlm``: the model's own loss (masked-language modelling with the batch's labels), no teacher.
- ``attention_transfer``: layer-local. Each partial layer's attention output (the context vectors before the output
  projection, (B, T, H·D)) on the **teacher's** input to that layer, matched to the teacher's attention output by
  MSE over the real (unpadded) tokens, averaged over the partial layers. One teacher pass gives every layer's
  input and target, so all layers train at once and an error in one layer does not reach the next (LoLCATs,
  Hedgehog). What trains is `attention_transfer_parameters`: R (and bias), also the query/key weights, or what the
  caller left trainable (LoRA adapters from peft).
- ``distill_kl``: end to end, KL(teacher ‖ student) of the MLM distributions (temperature τ, scaled by τ²) at every
  real token; needs MLM heads.
- ``distill_hidden``: end to end, MSE of every layer's hidden states (embeddings and each layer's output) over the
  real tokens, averaged over layers.
- ``distill``: ``distill_kl`` (where the model has an MLM head) plus ``distill_hidden``.
- ``embedding``: the sentence embedding, mean of the last hidden states over real tokens and L2-normalised (what
  ``sentence-transformers/all-MiniLM-L6-v2`` computes), matched by squared distance summed over the embedding:
  ``‖e_s − e_t‖² = 2 (1 − cos)``, so the term is twice the mean cosine distance to the teacher's embedding (the
  quantity a retrieval user sees; sentence-transformers' ``MSELoss`` on normalised embeddings, times the width).

Every term is a mean over the process's batch; `PartialAttentionTrainer` divides it by the accumulation steps.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..conversion import PARTIAL_FIELDS
from ..partial_places import is_reconstruction_name

__all__ = [
    "RECOVERY_TERMS",
    "ATTENTION_TRANSFER_PARAMETERS",
    "RecoveryObjective",
    "parse_recovery_objective",
    "exact_teacher",
    "attention_modules",
    "recovery_losses",
    "mean_pooled_embedding",
    "freeze_for_attention_transfer",
    "setup_recovery",
    "is_reconstruction_parameter",
]

RECOVERY_TERMS = ("mlm", "attention_transfer", "distill_kl", "distill_hidden", "embedding")
_ALIASES = {"distill": ("distill_kl", "distill_hidden")}
ATTENTION_TRANSFER_PARAMETERS = ("reconstruction", "query_key", "as_given")
_NOT_BERT_FIELDS = ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path")


@dataclass(frozen=True)
class RecoveryObjective:
    """Terms of the recovery loss and their weights (`parse_recovery_objective`)."""

    weights: dict[str, float]

    @property
    def terms(self) -> tuple[str, ...]:
        return tuple(self.weights)

    @property
    def needs_teacher(self) -> bool:
        return any(term != "mlm" for term in self.weights)

    @property
    def is_model_loss(self) -> bool:
        """Only the model's own loss (``mlm``): the trainer's plain path, nothing added."""
        return self.terms == ("mlm",)


def parse_recovery_objective(objective: str, weights: str | None = None, has_mlm_head: bool = True
                             ) -> RecoveryObjective:
    """``"attention_transfer,distill"`` → the terms and weights (``weights``: comma-separated floats, one per term
    as written, aliases counting once; default 1 each). ``distill`` drops its KL term for models without an MLM
    head.

    Raises:
        ValueError: on an unknown or repeated term, a weight list of the wrong length, or a negative weight.
    """
    written = [t.strip() for t in objective.split(",") if t.strip()]
    if not written:
        raise ValueError(f"recovery_objective={objective!r} names no term; use one or more of "
                         f"{(*RECOVERY_TERMS, *_ALIASES)}, comma-separated.")
    values = [1.0] * len(written)
    if weights not in (None, ""):
        try:
            values = [float(w) for w in weights.split(",")]
        except ValueError as err:
            raise ValueError(f"recovery_weights must be comma-separated numbers, got {weights!r}.") from err
        if len(values) != len(written):
            raise ValueError(f"recovery_weights={weights!r} has {len(values)} values for the {len(written)} terms of "
                             f"recovery_objective={objective!r}; give one per term.")
    out: dict[str, float] = {}
    for term, weight in zip(written, values):
        if weight < 0:
            raise ValueError(f"recovery_weights: the weight of {term!r} is {weight}; weights must be >= 0.")
        expanded = _ALIASES.get(term, (term,))
        for name in expanded:
            if name not in RECOVERY_TERMS:
                raise ValueError(f"recovery_objective has the unknown term {term!r}; use one or more of "
                                 f"{(*RECOVERY_TERMS, *_ALIASES)}, comma-separated.")
            if name == "distill_kl" and term == "distill" and not has_mlm_head:
                continue  # the alias means "what the model has": hidden states only without an MLM head
            if name in out:
                raise ValueError(f"recovery_objective={objective!r} lists {name!r} twice.")
            out[name] = weight
    if "distill_kl" in out and not has_mlm_head:
        raise ValueError("recovery_objective has distill_kl, which needs an MLM head (*ForMaskedLM: "
                         "BertForMaskedLM, PartialRobertaForMaskedLM, ...); use distill_hidden or embedding for this "
                         "model.")
    return RecoveryObjective(out)


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


def mean_pooled_embedding(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, hidden): the mean of ``hidden`` (B, T, hidden) over each row's real tokens, L2-normalised."""
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)  # (B, hidden)
    return F.normalize(pooled.float(), dim=-1)


def _token_mse(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over real tokens (``mask`` (B, T) true) of the squared error averaged over features."""
    err = (a.float() - b.float()).pow(2).mean(-1)  # (B, T)
    return (err * mask).sum() / mask.sum().clamp_min(1.0)


@contextmanager
def _hooks(handles: list):
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _encoder_body(model: nn.Module) -> nn.Module:
    """The encoder without its head (``model.bert`` of a ``*ForMaskedLM``, through peft / DDP wrappers): what
    attention transfer runs, so that no vocabulary logits are computed for it. A DDP-wrapped model runs whole: its
    forward is what prepares the gradient reduction."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model
    for module in model.modules():
        prefix = getattr(module, "base_model_prefix", None)
        if prefix and isinstance(getattr(module, prefix, None), nn.Module):
            return getattr(module, prefix)
        if prefix:
            return module
    return model


def _teacher_pass(teacher: nn.Module, inputs: dict, layers, want_hidden: bool, head: bool):
    """The teacher's outputs (of the whole model with ``head``, else of its encoder), with each of ``layers``'
    attention input and output captured."""
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = []
    for idx, module in attention_modules(teacher, layers).items():
        handles.append(module.register_forward_hook(
            lambda mod, args, kwargs, out, idx=idx: captured.__setitem__(idx, (args[0], out[0])), with_kwargs=True))
    with torch.no_grad(), _hooks(handles):
        out = (teacher if head else _encoder_body(teacher))(**inputs, output_hidden_states=want_hidden,
                                                             return_dict=True)
    return out, captured


def _attention_transfer(student: nn.Module, inputs: dict, captured: dict) -> torch.Tensor:
    """MSE of each partial layer's attention output on the teacher's input to that layer, averaged over layers."""
    outputs: dict[int, torch.Tensor] = {}
    handles = []
    modules = attention_modules(student, set(captured))
    for idx, module in modules.items():
        source = captured[idx][0]

        def swap(mod, args, kwargs, source=source):
            return (source, *args[1:]), kwargs  # the teacher's input to this layer, (B, T, hidden)

        handles.append(module.register_forward_pre_hook(swap, with_kwargs=True))
        handles.append(module.register_forward_hook(
            lambda mod, args, kwargs, out, idx=idx: outputs.__setitem__(idx, out[0]), with_kwargs=True))
    with _hooks(handles):
        _encoder_body(student)(**inputs, return_dict=True)
    mask = inputs["attention_mask"].bool() if "attention_mask" in inputs else None
    losses = []
    for idx in sorted(modules):
        target = captured[idx][1]  # (B, T, H·D)
        m = mask if mask is not None else torch.ones(target.shape[:2], dtype=torch.bool, device=target.device)
        losses.append(_token_mse(outputs[idx], target, m))
    return torch.stack(losses).mean()


def recovery_losses(student: nn.Module, teacher: nn.Module | None, inputs: dict, objective: RecoveryObjective,
                    partial_layers, temperature: float = 1.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted recovery loss of one batch and each term's value (detached).

    Args:
        student: the model being trained (a partial model, possibly wrapped by peft / DDP).
        teacher: the frozen exact model (`exact_teacher`); needed by every term but ``mlm``.
        inputs: the batch; ``labels`` reach only the ``mlm`` term.
        partial_layers: the layers attention transfer matches (the student's partial layers).
        temperature: τ of ``distill_kl``.
    """
    if objective.needs_teacher and teacher is None:
        raise ValueError(f"recovery_objective {objective.terms} needs a teacher: give teacher_model, or a partial "
                         "model for exact_teacher.")
    terms: dict[str, torch.Tensor] = {}
    body = {k: v for k, v in inputs.items() if k != "labels"}
    mask = body.get("attention_mask")
    if mask is None:
        mask = torch.ones(body["input_ids"].shape, dtype=torch.long, device=body["input_ids"].device)
    real = mask.bool()  # (B, T)
    end_to_end = {"distill_kl", "distill_hidden", "embedding"} & set(objective.terms)
    t_out, captured = None, {}
    if objective.needs_teacher:
        t_out, captured = _teacher_pass(teacher, body, partial_layers if "attention_transfer" in objective.terms
                                        else (), want_hidden=bool(end_to_end), head="distill_kl" in objective.terms)
    if "attention_transfer" in objective.terms:
        terms["attention_transfer"] = _attention_transfer(student, body, captured)
    if "mlm" in objective.terms or end_to_end:
        s_out = student(**(inputs if "mlm" in objective.terms else body), output_hidden_states=bool(end_to_end),
                        return_dict=True)
        if "mlm" in objective.terms:
            if s_out.get("loss") is None:
                raise ValueError("recovery_objective has mlm but the model returned no loss; "
                                 "pass labels (MlmCollator).")
            terms["mlm"] = s_out["loss"]
        if "distill_kl" in objective.terms:
            tau = temperature
            s_logp = F.log_softmax(s_out["logits"][real].float() / tau, -1)  # (tokens, vocab)
            t_logp = F.log_softmax(t_out["logits"][real].float() / tau, -1)  # (tokens, vocab)
            terms["distill_kl"] = F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean") * tau * tau
        if "distill_hidden" in objective.terms:
            pairs = list(zip(s_out["hidden_states"], t_out["hidden_states"]))
            terms["distill_hidden"] = torch.stack([_token_mse(s, t, real) for s, t in pairs]).mean()
        if "embedding" in objective.terms:
            e_s = mean_pooled_embedding(s_out["hidden_states"][-1], mask)  # (B, hidden)
            e_t = mean_pooled_embedding(t_out["hidden_states"][-1], mask)  # (B, hidden)
            terms["embedding"] = (e_s - e_t).pow(2).sum(-1).mean()
    loss = sum(objective.weights[name] * value for name, value in terms.items())
    if torch.is_grad_enabled() and not loss.requires_grad:
        # No trained weight reached the loss (R alone trains, and every sequence sits in an exact bucket): a zero
        # that depends on the trained weights, so that backward runs and the step is a no-op, not an error.
        trained = [p for p in student.parameters() if p.requires_grad]
        if trained:
            loss = loss + sum(p.sum() for p in trained) * 0.0
    return loss, {name: value.detach() for name, value in terms.items()}


def _has_mlm_head(model: nn.Module) -> bool:
    # any architecture's MLM class (BertForMaskedLM, PartialRobertaForMaskedLM, ...), also inside peft / DDP wrappers
    return any(type(m).__name__.endswith("ForMaskedLM") for m in model.modules())


def setup_recovery(model: nn.Module | None, args, teacher_model: nn.Module | None):
    """``(objective, teacher)`` for `PartialAttentionTrainer`: the parsed ``args.recovery_objective``; the teacher
    given, else the model's exact twin (`exact_teacher`) when a term needs one; and, for attention transfer alone or
    an explicit ``args.attention_transfer_parameters``, the model's parameters frozen to what it trains."""
    objective = parse_recovery_objective(getattr(args, "recovery_objective", "mlm"),
                                         getattr(args, "recovery_weights", None),
                                         has_mlm_head=model is not None and _has_mlm_head(model))
    if objective.needs_teacher:
        if model is None:
            raise ValueError(f"recovery_objective {objective.terms} needs the model at construction (model=...).")
        if teacher_model is None:
            teacher_model = exact_teacher(model)
    if teacher_model is not None:
        teacher_model.eval().requires_grad_(False)
    which = getattr(args, "attention_transfer_parameters", None)
    if model is not None and (objective.terms == ("attention_transfer",) or which is not None):
        freeze_for_attention_transfer(model, which or "reconstruction")
    return objective, teacher_model

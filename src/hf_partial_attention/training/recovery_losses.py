"""The recovery loss of one batch (`recovery_losses`): one teacher pass capturing each partial layer's attention
input and output, then each term of the objective (attention transfer, distillation, embedding matching) on the
student; the terms are described in `RecoveryObjective`. `recovery` re-exports every name.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from .recovery_objective import RecoveryObjective
from .recovery_teacher import attention_modules

__all__ = ["recovery_losses", "mean_pooled_embedding"]


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

    Every term is a mean over the process's batch; `PartialAttentionTrainer` divides it by the accumulation steps.

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

"""Recovery objectives: train a converted partial model (any architecture) to behave like the exact model it came from.

The exact model is the teacher: it is free (the weights before conversion), frozen, and run once per batch. The terms
(`PartialAttentionTrainingArguments.recovery_objective`, comma-separated, summed with ``recovery_weights``) are
described in `RecoveryObjective`; each is a mean over the process's batch (`recovery_losses`).

`setup_recovery` prepares a trainer's objective and teacher; the parts live in `recovery_objective` (the terms
parsed), `recovery_teacher` (the teacher, the attention modules, what trains) and `recovery_losses` (the loss of a
batch), and every name is imported from here.
"""

from __future__ import annotations

from torch import nn

from .recovery_losses import mean_pooled_embedding, recovery_losses
from .recovery_objective import RECOVERY_TERMS, RecoveryObjective, parse_recovery_objective
from .recovery_teacher import (ATTENTION_TRANSFER_PARAMETERS, attention_modules, exact_teacher,
                               freeze_for_attention_transfer, has_masked_lm_head, is_reconstruction_parameter)

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


def setup_recovery(model: nn.Module | None, args, teacher_model: nn.Module | None):
    """``(objective, teacher)`` for `PartialAttentionTrainer`: the parsed ``args.recovery_objective``; the teacher
    given, else the model's exact twin (`exact_teacher`) when a term needs one; and, for attention transfer alone or
    an explicit ``args.attention_transfer_parameters``, the model's parameters frozen to what it trains."""
    objective = parse_recovery_objective(getattr(args, "recovery_objective", "mlm"),
                                         getattr(args, "recovery_weights", None),
                                         has_mlm_head=model is not None and has_masked_lm_head(model))
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

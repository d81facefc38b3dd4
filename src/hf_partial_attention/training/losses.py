"""Losses and run summaries `PartialAttentionTrainer` uses: the MLM loss at labelled positions only, per-example
loss sums for the item-weighted evaluation loss, and the training paragraph of a run's model card."""

from __future__ import annotations

import torch

__all__ = ["masked_only_mlm_loss", "example_loss_sums", "training_details"]


def masked_only_mlm_loss(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{"loss", "logits"}``: an MLM model's mean cross-entropy over its M labelled positions, and the vocabulary
    logits (M, vocab) at those positions, the only ones computed (the model's own loss computes them at every
    position). Any architecture's MLM head: its body runs as usual, and a hook hands the head the M labelled
    positions' hidden states only (an MLM head maps each position on its own)."""
    base = getattr(model, "base_model", model)
    if base is model or not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        raise TypeError(f"mlm_logits_at_masked_only needs a masked-LM model (a body and a vocabulary head), got "
                        f"{type(model).__name__}; unset --mlm_logits_at_masked_only.")
    labels = inputs["labels"]  # (B, T)
    chosen = labels != -100  # (B, T)

    def labelled_only(module, args, output):
        output["last_hidden_state"] = output["last_hidden_state"][chosen][None]  # (1, M, hidden)
        return output

    handle = base.register_forward_hook(labelled_only)
    try:
        logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits[0]  # (M, vocab)
    finally:
        handle.remove()
    return {"loss": torch.nn.functional.cross_entropy(logits.float(), labels[chosen]), "logits": logits}


def example_loss_sums(logits: torch.Tensor | None, labels: torch.Tensor) -> torch.Tensor | None:
    """(B,): each example's cross-entropy summed over its labelled items (``labels != -100``), from logits
    (*labels.shape, C) at every position or (M, C) at the M labelled ones; None where they do not classify labels."""
    if not torch.is_tensor(logits) or labels.is_floating_point():
        return None
    chosen = labels.ne(-100)  # labels' shape, (B, ...)
    if logits.shape[:-1] == labels.shape:
        logits = logits[chosen]  # (M, C)
    elif logits.dim() != 2 or logits.shape[0] != int(chosen.sum()):
        return None
    token = torch.nn.functional.cross_entropy(logits.float(), labels[chosen], reduction="none")  # (M,)
    rows = chosen.nonzero()[:, 0]  # (M,): each labelled item's example, in the order of labels[chosen]
    return torch.zeros(labels.shape[0], dtype=token.dtype, device=token.device).index_add_(0, rows, token)


def training_details(args, state) -> str:
    """The model card's paragraph on a run: steps, learning rates, batch, seed, recovery objective, last metrics."""
    last = {}
    for entry in state.log_history:
        last.update({k: v for k, v in entry.items() if isinstance(v, (int, float)) and k not in ("step", "epoch")})
    metrics = ", ".join(f"{k} {v:.4g}" for k, v in sorted(last.items()) if k.startswith(("eval_", "train_loss")))
    r_lr = getattr(args, "reconstruction_learning_rate", None)
    objective = getattr(args, "recovery_objective", "mlm")
    return (f"Trained with `hf_partial_attention.training.PartialAttentionTrainer` for {state.global_step} steps: "
            f"learning rate {args.learning_rate:g} (R: {args.learning_rate if r_lr is None else r_lr:g}), "
            f"batch size {args.per_device_train_batch_size} per device × {args.world_size} processes × "
            f"{args.gradient_accumulation_steps} accumulation steps, seed {args.seed}"
            + ("." if objective == "mlm" else f", recovery objective `{objective}` against the exact teacher.")
            + (f" Last logged: {metrics}." if metrics else ""))

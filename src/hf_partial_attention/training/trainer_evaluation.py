"""The evaluation side of `PartialAttentionTrainer` (`ItemWeightedEvaluation`): an ``eval_loss`` weighted by labelled
items (each example once, the same for any eval batch size and process count) and epoch-independent MLM masks while
evaluating.
"""

from __future__ import annotations

import logging

import torch

from .losses import example_loss_sums

logger = logging.getLogger(__name__)

__all__ = ["ItemWeightedEvaluation"]


class ItemWeightedEvaluation:
    """Mixin placed before `transformers.Trainer`: `evaluation_loop`'s ``<prefix>_loss`` is the loss summed over every
    labelled item of the dataset divided by their number, and `evaluate` runs with the collator's ``epoch`` unset.

    The trainer sets ``_eval_tally`` / ``_eval_step`` / ``_warned_eval_fallback`` at construction, records each
    batch's `_example_losses` in ``compute_loss`` while ``_eval_tally`` is set, and provides ``recovery`` and
    ``_recovery_loss`` (`PartialAttentionTrainer`).
    """

    def _example_losses(self, outputs, labels: torch.Tensor, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,) summed losses and (B,) labelled-item counts of a batch's examples."""
        counts = labels.ne(-100).reshape(labels.shape[0], -1).sum(1).float()  # (B,)
        if not counts.any():  # no labelled item: nothing to add (and the model's mean is NaN)
            return torch.zeros_like(counts), counts
        logits = outputs.get("logits") if isinstance(outputs, dict) else None
        sums = example_loss_sums(logits.detach() if torch.is_tensor(logits) else None, labels)
        mean = loss.detach().float().mean()
        # Cross-entropy over the labels is these models' loss; where the model computes another (a regression, a
        # shifted causal loss) its mean is spread over the examples: exact for the batch, approximate only for the
        # repeated examples gather_for_metrics drops.
        if sums is None or not torch.allclose(sums.sum() / counts.sum(), mean, rtol=1e-3, atol=1e-5):
            if not self._warned_eval_fallback:
                logger.warning("The model's loss is not the cross-entropy of its logits and labels: eval_loss "
                               "weights each batch's mean loss by its labelled items.")
                self._warned_eval_fallback = True
            sums = mean * counts
        return sums.float(), counts

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """`Trainer.prediction_step`; adds the batch's summed loss and labelled items to the evaluation tally. With
        a recovery objective the loss is that objective's (each example weighted once), and no logits are kept."""
        self._eval_step = None
        if not self.recovery.is_model_loss:
            inputs = self._prepare_inputs(inputs)
            with torch.no_grad():
                loss = self._recovery_loss(model, inputs, False, None).detach()
            if self._eval_tally is not None:
                batch = next(iter(inputs.values())).shape[0]
                per_example = torch.stack([loss.float().expand(batch), torch.ones(batch, device=loss.device)], 1)
                self._eval_tally += self.gather_function(per_example).sum(0).double().cpu()  # (2,)
            return loss, None, None
        result = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if self._eval_tally is not None and self._eval_step is not None:
            per_example = torch.stack(self._eval_step, 1)  # (B, 2): summed loss, labelled items
            # gather_for_metrics drops the examples accelerate repeats to even out the last batch across processes,
            # so each example counts once; every process gathers, so every process holds the whole tally.
            gathered = self.gather_function(per_example)  # (examples of this step in all processes, 2)
            self._eval_tally += gathered.sum(0).double().cpu()
        return result

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix: str = "eval"):
        """`Trainer.evaluation_loop` whose ``<prefix>_loss`` is weighted by labelled items: the loss summed over
        every labelled item of the dataset, each example once, divided by their number, the same for any batch
        size and process count. With a ``compute_loss_func`` or label smoothing the stock loss is kept."""
        self._eval_tally = torch.zeros(2, dtype=torch.float64)
        try:
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                             metric_key_prefix)
            total, items = self._eval_tally.tolist()
        finally:
            self._eval_tally, self._eval_step = None, None
        key = f"{metric_key_prefix}_loss"
        if key in output.metrics and items > 0:
            output.metrics[key] = total / items
        return output

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """`Trainer.evaluate` with epoch-independent MLM masks (comparable losses across checkpoints) and an
        item-weighted loss (`evaluation_loop`)."""
        collator = self.data_collator
        saved = getattr(collator, "epoch", None)
        if hasattr(collator, "epoch"):
            collator.epoch = None
        try:
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        finally:
            if hasattr(collator, "epoch"):
                collator.epoch = saved

"""`PartialAttentionTrainer`: `transformers.Trainer` for models with partial attention (R in its own optimizer group,
R's drift logged, losses that are the same in one process and in N, recovery objectives, this project's model card;
the class docstring lists what it adds). See docs/method.md#training-with-partial-attention-built-in. Its
item-weighted evaluation is the mixin `trainer_evaluation.ItemWeightedEvaluation`.
"""

from __future__ import annotations

import logging
import math
import os

import torch
from safetensors.torch import load_file, save_file
from transformers import Trainer, TrainerCallback
from transformers.trainer_pt_utils import LengthGroupedSampler
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, has_length

from ..model_card import write_model_card
from ..modeling_partial import PartialModelMixin
from .losses import masked_only_mlm_loss, training_details
from .recovery import is_reconstruction_parameter, recovery_losses, setup_recovery
from .sampling import EpochLengthGroupedSampler, example_lengths
from .trainer_evaluation import ItemWeightedEvaluation

logger = logging.getLogger(__name__)

__all__ = ["PartialAttentionTrainer", "RECONSTRUCTION_INITIAL_NAME", "is_reconstruction_parameter"]

RECONSTRUCTION_INITIAL_NAME = "reconstruction_initial.safetensors"


class _CollatorEpoch(TrainerCallback):
    """Tells a collator with an ``epoch`` attribute (`MlmCollator`) which epoch starts."""

    def __init__(self, trainer: "PartialAttentionTrainer"):
        self.trainer = trainer

    def on_epoch_begin(self, args, state, control, **kwargs):
        collator = self.trainer.data_collator
        if hasattr(collator, "epoch"):
            collator.epoch = int(math.floor((state.epoch or 0.0) + 1e-6))


class PartialAttentionTrainer(ItemWeightedEvaluation, Trainer):
    """`Trainer` for partial models of every architecture (works for any model; the R features switch off without R).

    What it adds to `Trainer`:

    - R's parameters in their own optimizer group (`reconstruction_learning_rate`, `reconstruction_weight_decay`).
    - R statistics in the training logs: ``reconstruction_drift/<name>`` = ‖R − R₀‖_F / ‖R₀‖_F against R at the
      start of the run (R₀ travels with each checkpoint in ``reconstruction_initial.safetensors``), and R's
      learning rate.
    - A loss that is the same number in one process and in N: each process returns its summed loss divided by the
      number of labelled items in the whole (all processes, all accumulation steps) batch. BERT's heads return a
      mean and ignore ``num_items_in_batch``; the stock Trainer then multiplies their loss by the world size
      (transformers5 notes, section 3). Here the mean is turned back into a sum first, so the scaling is right.
    - Deterministic MLM masks across resumes: sets `MlmCollator.epoch` each epoch, and `None` while evaluating.
    - Length-grouped batches (``--train_sampling_strategy group_by_length``) whose order is a function of the seed and
      the epoch, so a resumed run sees the uninterrupted run's batches (`sampling.EpochLengthGroupedSampler`), with
      lengths read from the length column or the input ids in one Arrow pass (`sampling.example_lengths`).
    - An evaluation loss weighted by labelled items: ``eval_loss`` is the cross-entropy summed over every labelled item
      (masked token) of the evaluation set, each example once, divided by their number, so it is the same for any
      eval batch size and process count. The stock loop averages per-batch means weighted by the batch size, lets
      the training normaliser ``num_items_in_batch`` rescale them, and counts the examples accelerate repeats to even
      out the last batch across processes.
    - Recovery objectives beside the model's own loss (``--recovery_objective``, `recovery`): attention transfer,
      distillation and embedding matching against a frozen exact teacher (``teacher_model``, default the model's
      exact twin taken at construction), each term logged as ``recovery/<term>``.
    - This project's model card (P, R, cost, base model, training details) from `create_model_card`, so
      ``trainer.push_to_hub()`` uploads it instead of the Trainer's template.

    P is a persistent buffer and R a buffer or parameters, so both are in every checkpoint's ``model.safetensors``
    and R's AdamW moments in ``optimizer.pt``; ``resume_from_checkpoint`` restores them like any weight.

    Use it with `PartialAttentionTrainingArguments`; plain `TrainingArguments` also work (R then shares the
    main learning rate, with no weight decay, and statistics are logged).

    Example:

    ```python
    >>> args = PartialAttentionTrainingArguments("out", reconstruction_learning_rate=1e-3, use_cpu=True)
    >>> trainer = PartialAttentionTrainer(model=model, args=args, train_dataset=train, data_collator=collator)
    >>> trainer.train()
    ```
    """

    def __init__(self, model=None, args=None, *rest, teacher_model: torch.nn.Module | None = None, **kwargs):
        # Before Trainer moves the model or a checkpoint is loaded into it: the teacher is the model as converted.
        self.recovery, teacher_model = setup_recovery(model, args, teacher_model)
        super().__init__(model, args, *rest, **kwargs)
        self.teacher_model = teacher_model
        self._recovery_tally: dict[str, float] = {}
        self._recovery_count = 0
        # compute_loss normalises by the global item count itself (see the module docstring), so the Trainer
        # must count items and must not divide by the accumulation steps again.
        self.model_accepts_loss_kwargs = True
        self.add_callback(_CollatorEpoch(self))
        self._r_initial: dict[str, torch.Tensor] | None = None
        # While evaluation_loop runs: (summed loss, labelled items) over the examples seen so far, all processes.
        self._eval_tally: torch.Tensor | None = None
        self._eval_step: tuple[torch.Tensor, torch.Tensor] | None = None  # this step's per-example (sums, counts)
        self._warned_eval_fallback = False

    # ------------------------------------------------------------------ R access
    def _r_params(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in model.named_parameters() if p.requires_grad and is_reconstruction_parameter(n)]

    def _reconstruction_tensors(self) -> dict[str, torch.Tensor]:
        model = self.accelerator.unwrap_model(self.model)
        if not hasattr(model, "reconstruction_tensors"):
            return {}
        tensors = {}
        for name, tensor in model.reconstruction_tensors().items():
            if hasattr(tensor, "full_tensor"):  # a DTensor under FSDP2: gather (log runs on every rank)
                tensor = tensor.full_tensor()
            tensors[name] = tensor.detach()
        return tensors

    # ------------------------------------------------------------------ optimizer
    def create_optimizer(self, model=None):
        """AdamW (or ``--optim``) with three groups: decayed weights, undecayed weights, and R."""
        if self.optimizer is not None:
            return self.optimizer
        opt_model = self.model if model is None else model
        r_params = self._r_params(opt_model)
        cls, kwargs = (self.optimizer_cls_and_kwargs if self.optimizer_cls_and_kwargs is not None
                       else self.get_optimizer_cls_and_kwargs(self.args, opt_model))
        if not r_params or {"params", "model", "optimizer_dict"} & set(kwargs):
            if r_params:
                logger.warning("--optim %s builds its own parameter groups: R uses the main learning rate.",
                               self.args.optim)
            return super().create_optimizer(model)
        decay = set(self.get_decay_parameter_names(opt_model))
        r_ids = {id(p) for _, p in r_params}
        rest = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad and id(p) not in r_ids]
        r_group = {"params": [p for _, p in r_params],
                   "weight_decay": getattr(self.args, "reconstruction_weight_decay", 0.0)}
        r_lr = getattr(self.args, "reconstruction_learning_rate", None)
        if r_lr is not None:
            r_group["lr"] = r_lr  # the scheduler scales each group's own initial lr
        groups = [
            {"params": [p for n, p in rest if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in rest if n not in decay], "weight_decay": 0.0},
            r_group,
        ]
        self.optimizer = cls([g for g in groups if g["params"]], **kwargs)
        return self.optimizer

    # ------------------------------------------------------------------ loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The model's loss, normalised by the labelled items of the whole global batch while training.

        With ``num_items_in_batch`` (training, labels present) the per-process mean ``L`` over its own ``m``
        labelled items becomes ``L·m / num_items_in_batch`` (times the world size when Trainer averages
        gradients over processes): the sum of all processes' terms is the global mean, whatever the split.
        While evaluating, the loss is the batch's own mean, and each example's summed loss is recorded for
        `evaluation_loop`'s item-weighted ``eval_loss``.
        """
        if self.label_smoother is not None or self.compute_loss_func is not None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if not self.recovery.is_model_loss:
            return self._recovery_loss(model, inputs, return_outputs, num_items_in_batch)
        if getattr(self.args, "mlm_logits_at_masked_only", False) and inputs.get("labels") is not None:
            outputs = masked_only_mlm_loss(self.accelerator.unwrap_model(model), inputs)
        else:
            outputs = model(**inputs)
        if isinstance(outputs, dict) and "loss" not in outputs:
            raise ValueError(f"The model returned no loss (keys {list(outputs.keys())}); pass labels.")
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        labels = inputs.get("labels")
        if self._eval_tally is not None and labels is not None:
            # prediction_step passes num_items_in_batch too (gathered across processes): a training normaliser,
            # which must not rescale an evaluation loss.
            self._eval_step = self._example_losses(outputs, labels, loss)
        elif num_items_in_batch is not None and labels is not None:
            local = labels.ne(-100).sum()
            # A process whose batch holds no labelled item has a NaN mean: give it a zero loss and zero gradient.
            loss = torch.where(local > 0, loss * local / num_items_in_batch, torch.zeros_like(loss))
            if self.args.average_tokens_across_devices and self.accelerator.num_processes > 1:
                loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        return (loss, outputs) if return_outputs else loss

    def _recovery_loss(self, model, inputs, return_outputs, num_items_in_batch):
        """`recovery.recovery_losses` of the batch: a mean over this process's batch, divided by the accumulation
        steps while training (the Trainer leaves that to a loss that gets ``num_items_in_batch``)."""
        teacher = self.teacher_model
        device = next(model.parameters()).device
        if next(teacher.parameters()).device != device:
            teacher.to(device)
        layers = getattr(self.accelerator.unwrap_model(model).config, "partial_layers", ())
        loss, terms = recovery_losses(model, teacher, inputs, self.recovery, layers,
                                      temperature=getattr(self.args, "distill_temperature", 1.0))
        if model.training:
            for name, value in terms.items():
                self._recovery_tally[name] = self._recovery_tally.get(name, 0.0) + float(value)
            self._recovery_count += 1
            if num_items_in_batch is not None:
                loss = loss / self.current_gradient_accumulation_steps
        return (loss, {"loss": loss}) if return_outputs else loss

    # ------------------------------------------------------------------ samplers
    def _model_input_name(self) -> str:
        names = getattr(self.processing_class, "model_input_names", None)
        return names[0] if names else "input_ids"

    def _get_train_sampler(self, train_dataset=None):
        """`Trainer`'s sampler; for ``group_by_length`` an `EpochLengthGroupedSampler` (epoch-seeded order, so resume
        is exact) over lengths from the length column of the dataset given to the Trainer, else the input ids."""
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if self.args.train_sampling_strategy != "group_by_length" or dataset is None or not has_length(dataset):
            return super()._get_train_sampler(train_dataset)
        column = self.args.length_column_name
        # The Trainer hands over the dataset without the columns the model does not take (the length column too).
        source = self.train_dataset if column in getattr(self.train_dataset, "column_names", ()) else dataset
        lengths = example_lengths(source, column, self._model_input_name())  # (examples,)
        if len(lengths) != len(dataset):
            lengths = example_lengths(dataset, column, self._model_input_name())
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        return EpochLengthGroupedSampler(self.args.train_batch_size * self.args.gradient_accumulation_steps,
                                         lengths, seed=seed)

    def _get_eval_sampler(self, eval_dataset):
        """`Trainer`'s sampler; for ``group_by_length`` its seeded `LengthGroupedSampler`, with the lengths of
        `example_lengths` (one Arrow pass instead of one row at a time). The evaluation loss does not depend on the
        order (`evaluation_loop`)."""
        if (self.args.train_sampling_strategy != "group_by_length" or eval_dataset is None
                or not has_length(eval_dataset)):
            return super()._get_eval_sampler(eval_dataset)
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        lengths = example_lengths(eval_dataset, self.args.length_column_name, self._model_input_name())
        return LengthGroupedSampler(self.args.eval_batch_size, lengths=lengths,
                                    generator=torch.Generator().manual_seed(seed))

    # ------------------------------------------------------------------ train / resume
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """`Trainer.train`; also records R₀ (or reads it back from the checkpoint) for the drift statistics."""
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)
            if checkpoint is None:
                raise ValueError(f"No checkpoint found in output_dir={self.args.output_dir!r} to resume from.")
        elif checkpoint is False:
            checkpoint = None
        self._r_initial = {name: t.clone() for name, t in self._reconstruction_tensors().items()}
        if checkpoint is not None:
            saved = os.path.join(checkpoint, RECONSTRUCTION_INITIAL_NAME)
            if os.path.isfile(saved):
                self._r_initial = load_file(saved)
            elif self._r_initial:
                logger.warning("%s has no %s: R drift is measured from R before loading the checkpoint.",
                               checkpoint, RECONSTRUCTION_INITIAL_NAME)
        return super().train(resume_from_checkpoint=checkpoint, trial=trial,
                             ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save and self._r_initial:
            folder = os.path.join(self._get_output_dir(trial=trial),
                                  f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            if os.path.isdir(folder):
                save_file({k: v.contiguous().cpu() for k, v in self._r_initial.items()},
                          os.path.join(folder, RECONSTRUCTION_INITIAL_NAME))

    # ------------------------------------------------------------------ logging / evaluation
    def reconstruction_stats(self) -> dict[str, float]:
        """``reconstruction_drift/<name>`` = ‖R − R₀‖_F / ‖R₀‖_F per R tensor, their mean, and R's current lr."""
        stats: dict[str, float] = {}
        if not self._r_initial:
            return stats
        drifts = []
        for name, r in self._reconstruction_tensors().items():
            r0 = self._r_initial.get(name)
            if r0 is None or r0.shape != r.shape:
                continue  # sharded (FSDP1 flat parameters) or renamed: no statistic
            r0 = r0.to(r.device, r.dtype)
            drift = float((r - r0).norm() / r0.norm().clamp_min(torch.finfo(r.dtype).tiny))
            stats[f"reconstruction_drift/{name}"] = drift
            drifts.append(drift)
        if len(drifts) > 1:
            stats["reconstruction_drift/mean"] = sum(drifts) / len(drifts)
        r_ids = {id(p) for _, p in self._r_params(self.model)}
        for group in getattr(self.optimizer, "param_groups", []):
            if r_ids and any(id(p) in r_ids for p in group["params"]):
                stats["reconstruction_learning_rate"] = float(group["lr"])
                break
        return stats

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and getattr(self.args, "log_reconstruction_stats", True):
            logs.update(self.reconstruction_stats())
        if "loss" in logs and self._recovery_count:
            logs.update({f"recovery/{name}": total / self._recovery_count
                         for name, total in self._recovery_tally.items()})
            self._recovery_tally, self._recovery_count = {}, 0
        super().log(logs, start_time)

    def create_model_card(self, language: str | None = None, license: str | None = None, tags=None,
                          model_name: str | None = None, finetuned_from: str | None = None, tasks=None,
                          dataset_tags=None, dataset=None, dataset_args=None, eval_results=None) -> None:
        """This project's card for a partial model (`model_card.build_model_card`: P, R, cost, base model,
        tags, the run's hyper-parameters and last metrics); `Trainer`'s template for any other model.

        ``eval_results``: `huggingface_hub.EvalResult` objects or their keyword dicts, for the ``model-index``.
        """
        model = self.accelerator.unwrap_model(self.model)
        if not isinstance(model, PartialModelMixin):
            return super().create_model_card(language=language, license=license, tags=tags, model_name=model_name,
                                             finetuned_from=finetuned_from, tasks=tasks, dataset_tags=dataset_tags,
                                             dataset=dataset, dataset_args=dataset_args)
        if not self.is_world_process_zero():
            return None
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        write_model_card(model, self.args.output_dir, overwrite=True,
                         model_name=model_name or os.path.basename(os.path.normpath(self.args.output_dir)),
                         base_model=finetuned_from, datasets=dataset, license=license, language=language or "en",
                         tags=[*(model.model_tags or []), *tags], eval_results=eval_results,
                         training_details=training_details(self.args, self.state), repo_id=self.hub_model_id)
        return None

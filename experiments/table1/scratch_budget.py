"""The from-scratch study's wall-time estimate (`estimate_seconds`), made from one measured pretraining step of the
exact model (`measure_step_seconds`) before the study starts.
"""

from __future__ import annotations

import time

import torch

from .scratch_spec import ScratchArguments

__all__ = ["estimate_seconds", "measure_step_seconds"]


def estimate_seconds(a: ScratchArguments, step_seconds: float, pair_fraction: float = 0.35) -> float:
    """The study's wall time from one measured pretraining step: every from-scratch arm's steps, the convert-train
    arms' tenth, the curves' evaluations (a forward is about a third of a step), the fine-tuning runs (pairs are
    about ``pair_fraction`` of n long) and a tenth more for the analysis, the evaluations and the timing; all of it
    once per pretraining seed, and the trained-R arms once more per further candidate of R's own rate."""
    arms = a.arm_list()
    pretrain = sum(a.pretrain_steps for arm in arms if arm.from_scratch)
    pretrain += sum(a.convert_train_steps() for arm in arms if arm.kind == "convert_train")
    batches = a.pretrain_batch_size
    curve = len([arm for arm in arms if arm.from_scratch or arm.kind == "convert_train"]) * \
        (a.pretrain_steps // a.eval_every + 1) * a.curve_windows / batches / 3
    finetune = len(arms) * len(a.seed_list()) * a.finetune_steps * a.finetune_batch_size / batches * pair_fraction
    # R's own rate chosen on the first seed: its trained-R arms run once per candidate rate, not once
    rates = len(a.reconstruction_lr_list())
    extra = 0 if rates < 2 else (rates - 1) * sum(
        (a.convert_train_steps() if arm.kind == "convert_train" else a.pretrain_steps) + curve / len(arms)
        for arm in arms if arm.trains_r)
    return 1.1 * step_seconds * ((pretrain + curve + finetune) * len(a.pretrain_seed_list()) + extra)


def measure_step_seconds(study) -> float:
    """The median time of a few pretraining steps of the exact model of ``study`` (a `scratch` study of one seed):
    forward, backward, AdamW."""
    from hf_partial_attention.training.trainer import masked_only_mlm_loss

    model = study.new_model(study.arms["exact"]).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    from hf_partial_attention.training import MlmCollator

    batch = MlmCollator(study.data.tokenizer, study.a.mlm_probability, seed=0)(
        [study.data.windows["train"][i] for i in range(study.a.pretrain_batch_size)])
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        masked_only_mlm_loss(model, batch)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]

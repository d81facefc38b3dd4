"""The Table-1 study's units of work: phase-2 training (MLM or a recovery objective against the exact teacher),
per-example MLM evaluation, fine-tuning, timing.

Every function takes what it needs explicitly (no study state), so the tests can run each one alone.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import torch
from transformers import DataCollatorWithPadding, set_seed

from hf_partial_attention.training import MlmCollator, PartialAttentionTrainer, PartialAttentionTrainingArguments
from hf_partial_attention.training.trainer import masked_only_mlm_loss

logger = logging.getLogger(__name__)

__all__ = ["train_args", "train_mlm", "mlm_window_losses", "finetune", "time_models"]


def train_args(out: str, steps: int, batch: int, lr: float, seed: int, data_seed: int, bf16: bool = False,
               reconstruction_learning_rate: float | None = None, mlm: bool = False, group_by_length: bool = False,
               recovery_objective: str = "mlm"):
    """The arguments every arm shares: linear decay after 6 % warm-up, AdamW, no checkpoints, no reports.
    ``recovery_objective`` other than ``mlm`` (`training.recovery`) trains every weight against a teacher."""
    return PartialAttentionTrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=batch, per_device_eval_batch_size=64,
        learning_rate=lr, warmup_steps=0.06, weight_decay=0.01, logging_steps=max(1, steps // 5),
        save_strategy="no", report_to="none", seed=seed, data_seed=data_seed, disable_tqdm=True,
        dataloader_num_workers=0, bf16=bf16, reconstruction_learning_rate=reconstruction_learning_rate,
        train_sampling_strategy="group_by_length" if group_by_length else "random",
        mlm_logits_at_masked_only=mlm, use_cpu=not torch.cuda.is_available(), recovery_objective=recovery_objective)


def train_mlm(model, tokenizer, train_windows, out: str, steps: int, batch: int, lr: float, seed: int,
              objective: str = "mlm", teacher=None, **kwargs) -> tuple[Any, dict[str, Any]]:
    """Phase-2 training for `steps` with masks and data order fixed by `seed` (the same for every arm): MLM, or
    the recovery `objective` (e.g. ``attention_transfer,distill``) against `teacher` on the same masked batches
    (the distill terms ignore the labels).

    Returns (model, record): ``r_drift`` (mean relative R drift ‖R − R₀‖/‖R₀‖ over the R tensors at the end; None
    without trained R), ``r_drift_max``, ``r_drift_by_tensor`` (n's R and each bucket's, ``common.len32``, ...),
    ``train_losses``, ``train_log`` (each logged step's loss and ``recovery/<term>`` values), ``train_seconds``
    (wall-clock of the training loop alone) and ``steps``.
    """
    args = train_args(out, steps, batch, lr, seed, seed, mlm=True, recovery_objective=objective, **kwargs)
    trainer = PartialAttentionTrainer(model=model, args=args, data_collator=MlmCollator(tokenizer, seed=seed),
                                      train_dataset=train_windows, teacher_model=teacher)
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    stats = trainer.reconstruction_stats()
    drifts = {key.split("/", 1)[1]: v for key, v in stats.items()
              if key.startswith("reconstruction_drift/") and not key.endswith("/mean")}
    log = [{k: v for k, v in h.items() if k in ("step", "loss") or k.startswith("recovery/")}
           for h in trainer.state.log_history if "loss" in h]
    return trainer.model, {
        "r_drift": sum(drifts.values()) / len(drifts) if drifts else None,
        "r_drift_max": max(drifts.values()) if drifts else None, "r_drift_by_tensor": drifts,
        "train_losses": [h["loss"] for h in log], "train_log": log, "train_seconds": seconds, "steps": steps,
        "objective": objective}


@torch.no_grad()
def mlm_window_losses(model, tokenizer, windows, seed: int, batch_size: int = 64) -> dict[str, list[float]]:
    """Per held-out example: the summed MLM cross-entropy and the number of masked tokens.

    `windows` is any dataset of ``input_ids`` (with ``attention_mask`` and ``token_type_ids`` if it has them):
    n-token windows, or sentence pairs at their own lengths (the collator pads each batch to its longest). The
    masks are the collator's evaluation masks (a function of the example and `seed` only), so two models evaluated
    here are scored on the very same tokens and their losses can be compared example by example.
    """
    collator = MlmCollator(tokenizer, seed=seed, epoch=None)
    model.eval()
    sums, counts = [], []
    for start in range(0, len(windows), batch_size):
        batch = collator([windows[i] for i in range(start, min(start + batch_size, len(windows)))])
        labels = batch["labels"]  # (B, T)
        chosen = labels != -100  # (B, T)
        hidden = model.bert(**{k: v for k, v in batch.items() if k != "labels"}).last_hidden_state  # (B, T, h)
        token_loss = torch.nn.functional.cross_entropy(model.cls(hidden[chosen]).float(), labels[chosen],
                                                       reduction="none")  # (M,)
        rows = chosen.nonzero()[:, 0]  # (M,): the window of each masked token
        sums += torch.zeros(labels.shape[0]).index_add_(0, rows, token_loss).tolist()
        counts += chosen.sum(dim=1).tolist()
    return {"loss_sums": sums, "token_counts": counts}


def finetune(model, tokenizer, train_pairs, eval_pairs, out: str, steps: int, batch: int, lr: float, seed: int,
             **kwargs) -> dict[str, Any]:
    """Fine-tune a sequence classifier for `steps`; accuracy and per-example correctness on `eval_pairs`.

    `seed` fixes the data order, dropout and (through the caller, who builds the model after `set_seed`) the
    new head's initialisation: the same for every arm at one seed.
    """
    # group_by_length: batches of similar lengths pad less (the sampler's order is fixed by the seed)
    args = train_args(out, steps, batch, lr, seed, seed, group_by_length=True, **kwargs)
    trainer = PartialAttentionTrainer(model=model, args=args, data_collator=DataCollatorWithPadding(tokenizer),
                                      train_dataset=train_pairs)
    t0 = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - t0
    prediction = trainer.predict(eval_pairs)
    correct = (torch.as_tensor(prediction.predictions).argmax(-1) == torch.as_tensor(prediction.label_ids)).int()
    return {"accuracy": float(correct.float().mean()), "correct": "".join(map(str, correct.tolist())),
            "train_seconds": train_seconds, "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "trainer": trainer}


def _median_ms(times: list[float]) -> float:
    return 1000 * statistics.median(times)


def time_models(models: dict[str, Any], batch: int, n: int, repeats: int, vocab_size: int,
                seed: int = 0) -> dict[str, dict[str, float]]:
    """Median wall-clock (ms) of an encoder forward (inference) and of an MLM training step (forward +
    backward, masked-only logits, no optimizer) for each model, interleaved model by model in every repeat so
    that machine noise hits all alike. One warm-up round is not timed."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, vocab_size, (batch, n), generator=gen)  # (B, n)
    labels = torch.where(torch.rand(batch, n, generator=gen) < 0.15, ids, torch.full_like(ids, -100))  # (B, n)
    mask = torch.ones_like(ids)
    times: dict[str, dict[str, list[float]]] = {name: {"inference": [], "train_step": []} for name in models}
    for r in range(repeats + 1):
        for name, model in models.items():
            model.eval()
            with torch.no_grad():
                t0 = time.perf_counter()
                model.bert(input_ids=ids, attention_mask=mask)
                t1 = time.perf_counter()
            model.train()
            t2 = time.perf_counter()
            masked_only_mlm_loss(model, {"input_ids": ids, "attention_mask": mask, "labels": labels})["loss"].backward()
            t3 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            if r:  # round 0 warms up
                times[name]["inference"].append(t1 - t0)
                times[name]["train_step"].append(t3 - t2)
    return {name: {kind: _median_ms(v) for kind, v in t.items()} for name, t in times.items()}


def seeded(seed: int, build):
    """``build()`` after `transformers.set_seed(seed)`: new heads get the same initial weights in every arm."""
    set_seed(seed)
    return build()

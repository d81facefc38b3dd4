"""Jobs of the recall study: small encoders trained from scratch on each task through the project's own model
classes (`build_model`) and `PartialAttentionTrainer`, every arm's learning rate chosen on a validation split.

`RecallStudy` lists the jobs of a task, in order: the exact model's sweep, the patterns from it, every other arm's
sweep, the other seeds. A job's result is stored, so a killed run started again continues with the job it was in.
"""

from __future__ import annotations

import logging
import os
import time

import torch
from transformers import PrinterCallback, set_seed

from ..store import JobStore
from .spec import RecallArguments, RecallArm
from .tasks import RecallTask, TaskDataset, task_tensors

logger = logging.getLogger(__name__)

__all__ = ["RecallStudy", "accuracy", "job_name", "sweep", "chosen", "VALIDATION_SPLIT", "TEST_SPLIT"]

VALIDATION_SPLIT, TEST_SPLIT, TRAIN_SPLIT = 1, 2, 1000  # the seeds of the splits' generators (train: + run seed)


@torch.no_grad()
def accuracy(model, data: dict[str, torch.Tensor], batch_size: int = 256) -> float:
    """The fraction of labelled positions whose argmax over the whole vocabulary is the label."""
    model.eval()
    right = total = 0
    for start in range(0, data["input_ids"].shape[0], batch_size):
        batch = {name: t[start:start + batch_size] for name, t in data.items()}  # (b, n) each
        labels = batch.pop("labels")
        logits = model(**batch).logits  # (b, n, V)
        mask = labels != -100
        right += int((logits.argmax(-1)[mask] == labels[mask]).sum())
        total += int(mask.sum())
    return right / total


class RecallStudy:
    """The study's state: its arguments, job store, and the tasks' evaluation splits (made once).

    Per task, in order:

    1. ``exact/<task>/lr<lr>_s<seed0>``: the exact model at each learning rate (first seed); the rate with the best
       validation accuracy is the exact arm's.
    2. ``patterns/<task>``: the chosen exact model's per-query score covariance (second moment, pooled over layers
       and heads) on training examples of the task; for each k, the band of the k nearest keys with its optimal R,
       and the greedy's P with its R. Every partial arm starts from these (the paper's protocol: R at its optimum).
    3. ``<arm>/<task>/lr<lr>[_r<ratio>]_s<seed0>``: every other arm at each rate (and, with a trained R, each ratio
       of R's rate to the body's); the best on validation is the arm's.
    4. ``<arm>/<task>/s<seed>``: the other seeds at the arm's chosen rates.

    A job's result (validation and test accuracy, training seconds, final loss) is a JSON under ``run_dir/jobs``: a
    killed run started again continues with the job it was in.
    """

    def __init__(self, a: RecallArguments, store: JobStore):
        self.a, self.store = a, store
        self.arms = {arm.name: arm for arm in a.arm_list()}
        self.tasks = {task.name: task for task in a.task_list()}
        self._splits: dict[tuple[str, int, int], dict[str, torch.Tensor]] = {}

    def split(self, task: RecallTask, seed: int, count: int) -> dict[str, torch.Tensor]:
        key = (task.name, seed, count)
        if key not in self._splits:
            self._splits[key] = task_tensors(task, seed, count)
        return self._splits[key]

    # ------------------------------------------------------------------ models
    def pattern_path(self, arm: RecallArm, task: RecallTask) -> str:
        return os.path.join(self.a.run_dir, "patterns", task.name,
                            f"{'greedy' if arm.greedy else 'band'}_k{arm.k}.safetensors")

    def partial_layers(self, arm: RecallArm) -> list[int]:
        """Every layer, or every layer but the last (``_last_exact``)."""
        layers = self.a.num_hidden_layers
        return list(range(layers - 1 if arm.last_exact else layers))

    def new_model(self, arm: RecallArm, task: RecallTask, seed: int):
        """The arm's model before training: the exact class's initialisation for ``seed``, converted with the
        arm's P and R (`build_model`), or P alone installed."""
        from hf_partial_attention.training import ModelArguments, build_model

        set_seed(seed)
        exact = arm.kind in ("exact", "p_only")
        layers = self.partial_layers(arm)
        args = ModelArguments(model_type="bert", config_overrides=self.a.config_overrides(task),
                              attention="exact" if exact else "partial",
                              pattern=None if exact else self.pattern_path(arm, task),
                              reconstruction=arm.reconstruction,
                              partial_layers=None if exact else ",".join(map(str, layers)))
        model = build_model("masked_lm", args, max_seq_length=self.a.seq_len).model
        if arm.kind == "p_only":
            from hf_partial_attention.pattern import AttentionPattern

            from ..table1.p_only import install_p_only

            install_p_only(model, AttentionPattern.load(self.pattern_path(arm, task)).indices, layers)
        elif not exact:
            model.set_partial_implementation("auto")
        return model

    # ------------------------------------------------------------------ jobs
    def train(self, arm: RecallArm, task: RecallTask, lr: float, ratio: float | None, seed: int,
              save: str | None = None) -> dict:
        """One run: train from scratch on fresh examples (one per step and batch row), then the validation and
        test accuracy."""
        from hf_partial_attention.training import PartialAttentionTrainer

        from ..table1.steps import train_args

        a = self.a
        steps = a.steps_of()[task.name]
        model = self.new_model(arm, task, seed)
        r_lr = lr * ratio if ratio is not None else None
        args = train_args(os.path.join(a.run_dir, "tmp"), steps, a.batch_size, lr, seed, seed,
                          reconstruction_learning_rate=r_lr)
        train = TaskDataset(task, TRAIN_SPLIT + seed, steps * a.batch_size)
        trainer = PartialAttentionTrainer(model=model, args=args, train_dataset=train)
        trainer.remove_callback(PrinterCallback)  # its log lines, hundreds of runs of them, say nothing the job keeps
        t0 = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - t0
        model = trainer.model
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        stats = trainer.reconstruction_stats() if arm.reconstruction else {}
        drift = {k.split("/", 1)[1]: v for k, v in stats.items() if k.startswith("reconstruction_drift/")}
        if save:
            model.save_pretrained(save)
        return {"lr": lr, "r_lr": r_lr, "seed": seed, "steps": steps, "train_seconds": seconds,
                "train_losses": losses, "r_drift": drift,
                "validation": accuracy(model, self.split(task, VALIDATION_SPLIT, a.validation_examples)),
                "test": accuracy(model, self.split(task, TEST_SPLIT, a.test_examples))}

    def patterns(self, task: RecallTask, exact_dir: str) -> dict:
        """P and R for every k of the partial arms, from the exact model's scores on training examples."""
        from transformers import BertForMaskedLM

        from hf_partial_attention.analysis.capture import capture_scores
        from hf_partial_attention.analysis.covariance import ScoreCovariance
        from hf_partial_attention.analysis.selection import fit_pattern, select_pattern
        from hf_partial_attention.reconstruction import nearest_keys

        a = self.a
        model = BertForMaskedLM.from_pretrained(exact_dir).eval()
        data = task_tensors(task, TRAIN_SPLIT, a.covariance_examples)
        data.pop("labels")
        # collect_covariance's own loop passes input ids alone; MQAR's values are token types, so the forwards
        # are run here, under the same capture (second moment, pooled: the paper's)
        cov = ScoreCovariance(a.seq_len, ("per_query",), "pooled", centered=False)
        with torch.no_grad(), capture_scores(model, cov.update):
            for start in range(0, a.covariance_examples, 64):
                model(**{name: t[start:start + 64] for name, t in data.items()})  # (b, n) each
        cov.num_sequences = a.covariance_examples
        out = {"windows": a.covariance_examples, "error": {}}
        for arm in self.arms.values():
            if arm.k is None or os.path.exists(self.pattern_path(arm, task)):
                continue
            pattern = (select_pattern(cov, arm.k, "per_query") if arm.greedy
                       else fit_pattern(cov, nearest_keys(a.seq_len, arm.k), "per_query"))
            os.makedirs(os.path.dirname(self.pattern_path(arm, task)), exist_ok=True)
            pattern.save(self.pattern_path(arm, task))
            name = f"{'greedy' if arm.greedy else 'band'}_k{arm.k}"
            out["error"][name] = pattern.metadata.get("normalized_error")
            # how far the greedy's P reaches: the mean |i - j| over its keys (a band's is about k / 4)
            idx = pattern.indices  # (n, k)
            out.setdefault("mean_distance", {})[name] = float(
                (idx - torch.arange(a.seq_len)[:, None]).abs().float().mean())
        return out


def job_name(arm: RecallArm, task: RecallTask, lr: float | None = None, ratio: float | None = None,
             seed: int = 0) -> str:
    """``<arm>/<task>/lr<lr>[_r<ratio>]_s<seed>`` in the sweep, ``<arm>/<task>/s<seed>`` after it."""
    rate = "" if lr is None else f"lr{lr:g}" + ("" if ratio is None else f"_r{ratio:g}") + "_"
    return f"{arm.name}/{task.name}/{rate}s{seed}"


def sweep(a: RecallArguments, arm) -> list[tuple[float, float | None]]:
    """The (learning rate, R's ratio) pairs an arm's first seed tries: R's ratio only where R is trained."""
    ratios = a.ratio_list() if arm.kind == "trained" else [None]
    return [(lr, ratio) for lr in a.lr_list() for ratio in ratios]


def chosen(store: JobStore, arm, task, a: RecallArguments) -> tuple[float, float | None]:
    """The arm's (learning rate, R's ratio) with the best validation accuracy of its first seed's sweep (ties to
    the first tried)."""
    seed = a.seed_list()[0]
    results = [(store.load(job_name(arm, task, lr, ratio, seed))["validation"], -i, (lr, ratio))
               for i, (lr, ratio) in enumerate(sweep(a, arm))]
    return max(results)[2]

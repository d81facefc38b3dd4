"""Table 1 of Bhojanapalli et al. (2021) on a real pretrained model, v2 (issue 24): does converting an exactly trained
model to partial attention lose accuracy, at the inputs' own lengths, and does training with partial attention built
in (MLM, or attention transfer + distillation from the exact model) recover it? ``python -m experiments table1``
(`make table1`); the protocol is `run_table1`'s docstring; the jobs are in `conversion_jobs`, the arms in `spec`, the
report in `report`, the wall-time estimate in `budget` (the defaults: about 2.4 h on 2 cores). Resumable: every job's
result is a JSON file under ``run_dir/jobs``.
"""

from __future__ import annotations

import logging
import shlex

import torch

from ..store import JobStore
from ..flags import portable_argv
from .conversion_jobs import (
    ConversionStudy, converted, finetune_arm, fit_patterns, phase1, phase2, select_rate, timing,
)
from .data import load_study_data
from .report import write_report
from .runner import JobRunner
from .spec import COMMAND, StudyArguments, job_names

logger = logging.getLogger(__name__)

__all__ = ["StudyArguments", "run_table1"]


def run_table1(a: StudyArguments, argv: list[str] | None = None) -> dict:
    """Run (or resume) the study and write its report; returns the report dict (see `report`).

    Protocol (every number is a flag of `StudyArguments`; ``python -m experiments table1 --help``):

    1. **Phase 1, exact** (job ``phase1``). The pretrained encoder (default: the real all-MiniLM-L6-v2, 6 layers, 12
       heads, d_h = 32) gets an MLM head, and the whole model is trained with exact attention on the training windows.
    2. **P and R** (``patterns``) from that model's per-query score statistics, pooled over all layers and heads, for
       each k: the *zero-fill* pattern from n-token training windows (greedy P, optimal R: the paper's protocol; shorter
       inputs use it with zero scores for their missing keys), and *length buckets* (`analysis.lengths`: P and R per
       bucket, Fisher objective) from the training documents' sentences and paragraphs at their own lengths.
    3. **R's learning rate** (``rlr``): the ``--rlr_arm`` (k = 16, common R, distill) is trained once per candidate of
       ``--reconstruction_learning_rates`` and scored by its MLM loss on the *selection* split (training documents used
       for nothing else); the lowest wins, and is used for every trained R after. This job runs before any job that
       reads the test split, and its winner's model is reused as that arm's phase 2 (the same training).
    4. **Phase 2, one arm per (k, R mode, recovery)** at equal budgets (``arm_steps`` at one batch size, the same
       data order and masks; measured wall-clock recorded beside): the phase-1 weights converted with the buckets and
       trained with MLM (``mlm_<arm>``) or with ``--distill_objective`` against the frozen phase-1 model (every weight
       trains), R fixed, common or per layer; the exact arm continues MLM as long. Every converted arm's held-out MLM
       loss is recorded on test windows and on the test pairs at their own lengths before (the paper's "performs
       poorly") and after; arms with recovery ``none`` get only the first (``conv_<arm>``, which also scores the
       zero-fill conversion of its k). One zero-fill arm (``--zero_fill_control``) is the control of the buckets.
    5. **Fine-tuning** (``ft_<arm>_s<seed>``) of every arm on a sentence-pair task at the pairs' own lengths (each
       partial arm with its buckets, the control with its zero fill), several seeds; test accuracy per seed and per
       example.
    6. **Cost** (``timing``): each configuration's measured inference / training-step time beside the exact model
       (eager and SDPA) at n.

    Every job's result is a JSON file under ``run_dir/jobs``: a killed run started again continues where it stopped.
    `report` turns the jobs into ``table1.md``, ``table1.json``, the verdicts, the gap decomposition
    (`gaps`) and the arms' model cards; the arms are `spec.Arm` values, which all modules take from
    `spec`. `budget` estimates the wall time of a set of arguments (the defaults: about 2.4 h on 2 cores).
    """
    command = " ".join([COMMAND, *(shlex.quote(x) for x in portable_argv(argv or []))])
    if a.threads:
        torch.set_num_threads(a.threads)
    store = JobStore(a.run_dir, a.result_fields())
    data = load_study_data(a)
    study = ConversionStudy(a, store, data)
    jobs = job_names(a)
    job = JobRunner(store, "table1", len(jobs), sum(store.done(j) for j in jobs), a.progress)
    _run_jobs(study, job)
    job.close()
    return write_report(a, store, data, command)


def _run_jobs(study: ConversionStudy, job: JobRunner) -> None:
    """Every job of the study in the protocol's order (`run_table1`), each run or, when finished, loaded."""
    a = study.a
    arms = a.arms()
    job("phase1", lambda: phase1(study))
    job("patterns", lambda: fit_patterns(study))
    rlr = job("rlr", lambda: select_rate(study))  # before any job that reads the test split
    r_lr = rlr["chosen"]
    job("phase1_eval", lambda: study.evaluate(study.exact_mlm()))
    first_of_k = {}
    for arm in arms.converted:
        first_of_k.setdefault(arm.k, arm)
    for arm in arms.converted:
        job(f"conv_{arm.name}", lambda arm=arm: converted(study, arm, first_of_k[arm.k] == arm))
    for arm in arms.mlm:
        job(f"mlm_{arm.name}", lambda arm=arm: phase2(study, arm, rlr))
    for arm in arms.finetune:
        for seed in a.seeds:
            job(f"ft_{arm.name}_s{seed}", lambda arm=arm, seed=seed: finetune_arm(study, arm, seed, r_lr))
    job("timing", lambda: timing(study))

"""`run_recall`: the recall study's jobs in order (`study`), resumable, then its report (`report`)."""

from __future__ import annotations

import logging
import os
import shlex
import time

import torch
from tqdm.auto import tqdm

from ..store import JobStore
from .report import write_recall_report
from .spec import COMMAND, RecallArguments
from .study import RecallStudy, chosen, job_name, sweep

logger = logging.getLogger(__name__)

__all__ = ["run_recall", "estimate_seconds", "VERDICT_TASKS"]

VERDICT_TASKS = ("mqar", "far_copy")  # the tasks the verdicts read: their cells run first


def estimate_seconds(a: RecallArguments, step_seconds: float) -> float:
    """Every run's steps at ``step_seconds`` a step (the sweeps on the first seed, the other seeds once), a tenth
    more for evaluations and covariances."""
    steps = a.steps_of()
    runs = sum(len(sweep(a, arm)) + len(a.seed_list()) - 1 for arm in a.arm_list())
    return 1.1 * step_seconds * runs * sum(steps[t.name] for t in a.task_list())


def _step_seconds(study: RecallStudy) -> float:
    """The median of a few training steps of the exact model on the first task (forward, backward, AdamW)."""
    task = next(iter(study.tasks.values()))
    model = study.new_model(study.arms["exact"], task, 0).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = study.split(task, 0, study.a.batch_size)
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _claim(path: str) -> bool:
    """Take the job whose lock file is ``path`` for this process: False where a live process holds it (a lock
    left by a killed process is taken over)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                with open(path) as f:
                    os.kill(int(f.read() or 0), 0)  # raises where the holder is gone
                return False
            except (ProcessLookupError, ValueError, FileNotFoundError):
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass
                continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True
    return False


def _result_flags(argv: list[str]) -> list[str]:
    """The command line without the flags that do not shape results (--threads, --report_only, --progress) and
    their values."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
            continue
        name = x.split("=", 1)[0]
        if name in ("--threads", "--report_only", "--progress"):
            skip = "=" not in x
            continue
        out.append(x)
    return out


def run_recall(a: RecallArguments, argv: list[str] | None = None) -> dict:
    """Run (or resume) the study and write ``recall.md`` and ``recall.json`` into ``a.output_dir``.

    Jobs run in phases: the exact arm's sweep, then P and R and its other seeds, then the other arms in cells of two
    arms and one task (their sweeps, then their other seeds), the verdicts' cells first. Several processes
    may run the same command on one ``run_dir`` (``make recall`` starts one per core): each takes the jobs no other
    holds, and waits at a phase's end for the jobs the next phase needs.
    """
    command = " ".join([COMMAND, *(shlex.quote(x) for x in _result_flags(argv or []))])
    if a.threads:
        torch.set_num_threads(a.threads)
    store = JobStore(a.run_dir, a.result_fields())
    if a.report_only:
        return write_recall_report(a, store, command)
    study = RecallStudy(a, store)
    arms, tasks = list(study.arms.values()), list(study.tasks.values())
    exact, others = arms[0], arms[1:]
    jobs = _Jobs(study, tqdm(desc="recall jobs", disable=not a.progress))
    jobs.job("estimate", lambda: {"step_seconds": (s := _step_seconds(study)),
                                  "estimate_seconds": estimate_seconds(a, s)})
    jobs.wait(["estimate"])
    estimate = store.load("estimate")
    logger.warning("recall: estimated %.1f h for the whole study in one process on this machine (%.3f s a step); "
                   "it resumes after a kill.", estimate["estimate_seconds"] / 3600, estimate["step_seconds"])
    jobs.sweeps([exact], tasks)
    if others:
        for task in tasks:
            lr, ratio = chosen(store, exact, task, a)
            exact_dir = store.model_dir(job_name(exact, task, lr, ratio, jobs.seeds[0]))
            jobs.job(f"patterns/{task.name}", lambda task=task, exact_dir=exact_dir: study.patterns(task, exact_dir))
        jobs.wait([f"patterns/{task.name}" for task in tasks])
    names = jobs.other_seeds([exact], tasks)
    for pair, task in _cells(others, tasks):
        jobs.sweeps(pair, [task])
        names += jobs.other_seeds(pair, [task])
    jobs.wait(names)
    jobs.bar.close()
    return write_recall_report(a, store, command)


def _cells(others: list, tasks: list) -> list[tuple[list, object]]:
    """The (two arms, one task) cells in the order they run, each finished (sweeps and seeds) before the next, so a
    run stopped early has whole cells: first the verdicts' (MQAR, then far copy, for the first four arms: P + R
    trained and P alone, every layer partial and the last exact), then the rest two arms at a time, the band's arms
    before the greedy's."""
    ordered = [arm for arm in others if not arm.greedy] + [arm for arm in others if arm.greedy]
    pairs = [ordered[i:i + 2] for i in range(0, len(ordered), 2)]
    first = [(pair, task) for task in tasks if task.name in VERDICT_TASKS for pair in pairs[:2]]
    return first + [(pair, task) for pair in pairs for task in tasks
                    if not any(pair is p and task is t for p, t in first)]


class _Jobs:
    """The study's jobs in one process among several on one ``run_dir``: a job runs here only when no other process
    holds it (its lock file), and a phase waits for the jobs others hold."""

    def __init__(self, study: RecallStudy, bar):
        self.study, self.a, self.store, self.bar = study, study.a, study.store, bar
        self.seeds = self.a.seed_list()

    def job(self, name, fn) -> None:
        if self.store.done(name) or not _claim(lock := os.path.join(self.a.run_dir, "locks", f"{name}.lock")):
            return
        try:
            self.store.run(name, fn, self.bar, "recall")
        finally:
            os.remove(lock)

    def wait(self, names) -> None:  # for jobs another process holds
        while not all(self.store.done(n) for n in names):
            time.sleep(5)

    def sweeps(self, arm_list, task_list) -> None:
        """The learning-rate sweeps of the arms on the tasks (first seed), waited for."""
        names, seeds = [], self.seeds
        for arm in arm_list:
            for task in task_list:
                for lr, ratio in sweep(self.a, arm):
                    name = job_name(arm, task, lr, ratio, seeds[0])
                    save = self.store.model_dir(name) if arm.kind == "exact" else None
                    self.job(name, lambda arm=arm, task=task, lr=lr, ratio=ratio, save=save:
                             self.study.train(arm, task, lr, ratio, seeds[0], save))
                    names.append(name)
        self.wait(names)

    def other_seeds(self, arm_list, task_list) -> list[str]:
        """The other seeds' runs of the arms on the tasks at their chosen rates; returns their job names."""
        names = []
        for arm in arm_list:
            for task in task_list:
                lr, ratio = chosen(self.store, arm, task, self.a)
                for seed in self.seeds[1:]:
                    name = job_name(arm, task, seed=seed)
                    self.job(name, lambda arm=arm, task=task, lr=lr, ratio=ratio, seed=seed:
                             self.study.train(arm, task, lr, ratio, seed))
                    names.append(name)
        return names

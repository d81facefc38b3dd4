"""The recall study's report: ``recall.json`` (``rows[arm][task]``, ``verdicts``) and ``recall.md``, from the jobs
a run has finished (an unfinished run is reported as far as it got, and says so).

Rules, stated in the report as well: an arm's rates are chosen on the validation split of its first seed; the
accuracy reported is the test split's, mean ± standard error over seeds (run-to-run variance); a difference is
called a difference when it exceeds twice its standard error (√(se₁² + se₂²)); a task counts as solved by exact
when exact's mean validation accuracy reaches ``solved_accuracy``, and a verdict on a task exact does not solve
is void.
"""

from __future__ import annotations

import math
import os

from ..store import JobStore, write_study
from .spec import RecallArguments
from .study import chosen, job_name, sweep

__all__ = ["write_recall_report", "mean_se"]


def mean_se(values: list[float]) -> dict:
    """``{"mean", "se", "values"}``; se is the standard error of the mean (None for one value)."""
    m = sum(values) / len(values)
    se = (math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1) / len(values)) if len(values) > 1
          else None)
    return {"mean": m, "se": se, "values": values}


def _row(store: JobStore, a: RecallArguments, arm, task) -> dict | None:
    seeds = a.seed_list()
    if not all(store.done(job_name(arm, task, lr, ratio, seeds[0])) for lr, ratio in sweep(a, arm)):
        return None
    lr, ratio = chosen(store, arm, task, a)
    runs = [store.load(job_name(arm, task, lr, ratio, seeds[0]))]
    runs += [store.load(job_name(arm, task, seed=s)) for s in seeds[1:] if store.done(job_name(arm, task, seed=s))]
    # every candidate's validation accuracy on the first seed, the rates it chose among
    tried = {f"lr{lr_:g}" + ("" if r is None else f"_r{r:g}"): store.load(job_name(arm, task, lr_, r, seeds[0]))[
        "validation"] for lr_, r in sweep(a, arm)}
    return {"accuracy": mean_se([r["test"] for r in runs]), "validation": mean_se([r["validation"] for r in runs]),
            "sweep_validation": tried,
            "lr": lr, "r_lr": runs[0]["r_lr"], "seeds": [r["seed"] for r in runs],
            "train_seconds": sum(r["train_seconds"] for r in runs)}


def _difference(x: dict, y: dict) -> dict | None:
    """x − y with its standard error and whether it exceeds twice that (None where either lacks an se)."""
    if x is None or y is None:
        return None
    xa, ya = x["accuracy"], y["accuracy"]
    if xa["se"] is None or ya["se"] is None:
        return {"difference": xa["mean"] - ya["mean"], "se": None, "distinct": None}
    se = math.sqrt(xa["se"] ** 2 + ya["se"] ** 2)
    d = xa["mean"] - ya["mean"]
    return {"difference": d, "se": se, "distinct": abs(d) > 2 * se}


def _holds(comparisons: dict, rule) -> bool | None:
    """Whether ``rule(name, comparison)`` holds for every comparison; None (undecided) while any has no standard
    error yet (one seed finished) or there is none."""
    if not comparisons or any(c is None or c["se"] is None for c in comparisons.values()):
        return None
    return all(rule(n, c) for n, c in comparisons.items())


def _verdicts(rows: dict, solved: dict, a: RecallArguments) -> dict:
    arms = {arm.name: arm for arm in a.arm_list()}
    out = {}

    def pairs(task, want):  # (partial arm, its partner) for the arms present with rows on `task`
        return [(n, want(arm)) for n, arm in arms.items() if arm.k and rows.get(n, {}).get(task)
                and want(arm) in rows and rows[want(arm)].get(task)]

    # (e1) far by position: P + R (fixed or trained) against P alone of the same P and layers
    if solved.get("far_copy"):
        out["e1"] = {"task": "far_copy", "rule": "P + R ahead of P alone by more than 2 se", "comparisons": {
            n: _difference(rows[n]["far_copy"], rows[p]["far_copy"])
            for n, p in pairs("far_copy", lambda arm: arm.name.replace(f"_{arm.kind}", "_p_only", 1))
            if arms[n].kind != "p_only"}}
        out["e1"]["holds"] = _holds(out["e1"]["comparisons"],
                                    lambda n, c: c["distinct"] and c["difference"] > 0)
    # (e2) recall by content beyond P: exact only, every layer partial below exact
    if solved.get("mqar") and rows.get("exact", {}).get("mqar"):
        every = {n: _difference(rows["exact"]["mqar"], rows[n]["mqar"]) for n, arm in arms.items()
                 if arm.k and not arm.last_exact and rows.get(n, {}).get("mqar")}
        out["e2"] = {"task": "mqar", "rule": "exact ahead of every arm whose layers are all partial by more than "
                     "2 se", "comparisons": every,
                     "holds": _holds(every, lambda n, c: c["distinct"] and c["difference"] > 0)}
    # (e3) one exact layer restores it: the _last_exact arms within 2 se of exact
        last = {n: _difference(rows["exact"]["mqar"], rows[n]["mqar"]) for n, arm in arms.items()
                if arm.k and arm.last_exact and rows.get(n, {}).get("mqar")}
        out["e3"] = {"task": "mqar", "rule": "every arm with the last layer exact within 2 se of exact (or its "
                     "mean at least solved_accuracy)", "comparisons": last,
                     "holds": _holds(last, lambda n, c: not c["distinct"] or rows[n]["mqar"]["accuracy"]["mean"]
                                     >= a.solved_accuracy)}
    return out


def _cell(row: dict | None) -> str:
    if row is None:
        return "—"
    acc = row["accuracy"]
    return f"{100 * acc['mean']:.1f}" + (f" ± {100 * acc['se']:.1f}" if acc["se"] is not None else "")


def write_recall_report(a: RecallArguments, store: JobStore, command: str) -> dict:
    """Write ``recall.json`` and ``recall.md`` (and the figure) from the finished jobs; returns the result."""
    arms, tasks = a.arm_list(), a.task_list()
    rows = {arm.name: {task.name: _row(store, a, arm, task) for task in tasks} for arm in arms}
    solved = {t.name: bool(rows["exact"][t.name]) and rows["exact"][t.name]["validation"]["mean"] >= a.solved_accuracy
              for t in tasks}
    jobs = [job_name(arm, t, lr, r, a.seed_list()[0]) for t in tasks for arm in arms for lr, r in sweep(a, arm)]
    jobs += [job_name(arm, t, seed=s) for t in tasks for arm in arms for s in a.seed_list()[1:]]
    finished = [j for j in jobs if store.done(j)]
    wall = sum(store.load(j)["seconds"] for j in finished)
    patterns = {t.name: store.load(f"patterns/{t.name}") for t in tasks if store.done(f"patterns/{t.name}")}
    estimate = store.load("estimate") if store.done("estimate") else None
    result = {"command": command, "arguments": a.result_fields(), "complete": len(finished) == len(jobs),
              "jobs": {"finished": len(finished), "total": len(jobs)}, "wall_seconds": wall,
              "estimate_seconds": estimate and estimate["estimate_seconds"],
              "chance": {t.name: t.chance() for t in tasks}, "exact_solved": solved, "patterns": patterns,
              "rows": rows, "verdicts": _verdicts(rows, solved, a)}
    figure = _figure(result, tasks, arms, os.path.join(a.output_dir, "recall.png"))
    lines = [
        "# What R earns: tasks where attention matters", "",
        f"`{command}` ({len(finished)} of {len(jobs)} runs finished"
        + ("" if result["complete"] else ": **incomplete**, the run resumes where it stopped")
        + f"; {wall / 3600:.2f} h of training and evaluation"
        + (f", estimated {estimate['estimate_seconds'] / 3600:.1f} h at the start" if estimate else "") + ").", "",
        f"Encoders of {a.num_hidden_layers} layers, width {a.hidden_size}, {a.num_attention_heads} heads, n = "
        f"{a.seq_len}, trained from scratch per task and arm through `build_model` and `PartialAttentionTrainer` "
        f"(batch {a.batch_size}, a fresh example per row and step; steps {a.steps}). Tasks: "
        + "; ".join(f"`{t.name}` (chance {100 * t.chance():.1f} %)" for t in tasks) + " (experiments/recall/tasks.py).",
        "",
        "Rules: each arm's learning rate (and a trained R's rate, as a fraction of it) is chosen among "
        f"{a.lr_list()} (× {a.ratio_list()}) on the validation split of seed {a.seed_list()[0]}; accuracies are "
        f"the test split's ({a.test_examples} examples), mean ± standard error over seeds {a.seed_list()}; a "
        "difference counts when it exceeds twice its standard error; exact solves a task when its validation "
        f"accuracy reaches {100 * a.solved_accuracy:.0f} %, and a verdict on a task it does not solve is void.", "",
        "## Test accuracy (%)", "",
        "| arm | " + " | ".join(t.name for t in tasks) + " |", "|---|" + "---|" * len(tasks),
    ]
    lines += [f"| {arm.name} | " + " | ".join(_cell(rows[arm.name][t.name]) for t in tasks) + " |" for arm in arms]
    lines += ["", "Exact solves: " + ", ".join(f"{t}: {'yes' if s else 'no'}" for t, s in solved.items()) + ".", ""]
    if figure:
        lines += [f"![accuracy per task and arm]({os.path.basename(figure)})", ""]
    lines += ["## Verdicts", "", *_verdict_lines(result["verdicts"])]
    if patterns:
        lines += ["", "## P and R from the exact model", "",
                  "Predicted normalised error of R on the exact model's scores, and P's mean key distance |i − j|:", ""]
        for t, p in patterns.items():
            lines.append(f"- {t}: " + ", ".join(f"{name} {err:.3f} (distance {p['mean_distance'][name]:.1f})"
                                                for name, err in p["error"].items()))
    write_study(a.output_dir, "recall", result, "\n".join(lines) + "\n")
    return result


def _verdict_lines(verdicts: dict) -> list[str]:
    """One line per verdict: holds, does not hold, undecided or void, with its rule and the differences behind it."""
    lines = []
    names = {"e1": "(e1) R earns its cost on far-by-position dependencies (P + R ahead of P alone)",
             "e2": "(e2) recall by content beyond P: exact only", "e3": "(e3) one exact layer restores it"}
    for key, text in names.items():
        v = verdicts.get(key)
        if v is None:
            lines.append(f"- {text}: void (exact does not solve its task, or its arms did not run).")
            continue
        parts = [f"{n}: {100 * c['difference']:+.1f}" + (f" ± {100 * c['se']:.1f}" if c["se"] is not None else "")
                 for n, c in v["comparisons"].items() if c]
        state = {True: "holds", False: "does not hold", None: "undecided: its runs have not all finished"}[v["holds"]]
        lines.append(f"- {text}: **{state}** ({v['rule']}; points: " + (", ".join(parts) or "none yet") + ").")
    return lines


def _figure(result: dict, tasks, arms, path: str) -> str | None:
    """Grouped bars: tasks × arms, test accuracy with its standard error."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    if not any(rows[arm.name][t.name] for arm in arms for t in tasks):
        return None
    fig, ax = plt.subplots(figsize=(max(7, 0.35 * len(tasks) * len(arms)), 4))
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        cells = [rows[arm.name][t.name] for t in tasks]
        xs = [j + i * width for j, c in enumerate(cells) if c]
        if not xs:  # not run yet: no bar, no legend entry
            continue
        ys = [100 * c["accuracy"]["mean"] for c in cells if c]
        errs = [100 * (c["accuracy"]["se"] or 0) for c in cells if c]
        ax.bar(xs, ys, width, yerr=errs, label=arm.name, color=plt.cm.tab20(i % 20))
    for j, t in enumerate(tasks):  # chance, across each task's group of bars
        ax.hlines(100 * result["chance"][t.name], j - width / 2, j + 0.8 - width / 2, colors="k", linestyles=":")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tasks))], [t.name for t in tasks])
    ax.set_ylabel("test accuracy (%); dotted: chance")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


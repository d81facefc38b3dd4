"""The lengths study's arms after `make recover`'s recipe: ``python -m experiments granularity-recover``.

`granularity_lengths` fits P and R pooled, per layer and per head, with one k or a k per layer at k = 16's saving, on
length buckets (Fisher objective), and measures them converted. This study takes each arm's bucket file from that
run (``<lengths_run>/fit/patterns/``), converts MiniLM with it (R per layer: each layer's R, or its heads' R, trains)
and recovers it by `recover`'s recipe (distillation against the exact model, 300 steps, query/key weights and R
trained), then measures converted and recovered on the held-out prose `recover` uses: one `recover` run per arm
(``<results>/<arm>/recovery.md``, its command in it), and one table of every arm beside the others (this module's
``granularity_recover.md``). An arm whose result exists for the same bucket file, steps and held-out size is read
back, not run again (``--rerun`` runs it again). ``--arms`` takes the five or others of the same run's folder:
``head_exact4`` is the file `granularity-layers` writes for its exact-layer arm.
"""

from __future__ import annotations

import json
import os
import time

from .lengths import ARMS, arm_patterns_file
from ..store import write_study

__all__ = ["run_granularity_recover", "render", "GOAL"]

GOAL = 0.03  # issue 34: after recovery, 1 − cos ≤ 0.03 at every bucket


def _tag(arm: str) -> str:
    return arm.replace(" ", "_")


def _existing(path: str, buckets: str, steps: int, max_heldout: int) -> dict | None:
    """The arm's recovery result at ``path`` if it used this bucket file, these steps and this held-out size."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        result = json.load(f)
    heldout = max(len(r["lengths"]) for r in result["rows"] if r["bucket"] == "all")
    same = (result["buckets_source"] == os.path.basename(buckets) and result["steps"] == steps
            and heldout == max_heldout)
    return result if same else None


def run_granularity_recover(lengths_run: str = "runs/granularity_lengths", out: str = "runs/granularity_recover",
                            results: str = "results/recovery/granularity", model: str | None = None, *, k: int = 16,
                            objective: str = "fisher", arms=ARMS, steps: int = 300, batch_size: int = 32,
                            train_inputs: int | None = None, max_heldout: int = 150, rerun: bool = False,
                            progress: bool = True, command: str | None = None) -> dict:
    """Recover and measure every arm (module docstring); writes ``results``/granularity_recover.json and .md."""
    from ..lengths.recover import run_recover

    start = time.perf_counter()
    per_arm = {}
    for granularity, choice in arms:
        arm = f"{granularity} {choice}"
        buckets = arm_patterns_file(os.path.join(lengths_run, "fit"), granularity, choice, k, objective)
        if not os.path.isfile(buckets):
            raise ValueError(f"arm {arm!r}: no bucket file {buckets}; run `python -m experiments granularity-lengths "
                             f"--out {lengths_run}` with --k {k} first (or pass --lengths-run).")
        arm_results = os.path.join(results, _tag(arm))
        found = None if rerun else _existing(os.path.join(arm_results, "recovery.json"), buckets, steps, max_heldout)
        if found is None:
            argv = ["python", "-m", "experiments", "recover", "--max-heldout", str(max_heldout), "--steps", str(steps),
                    "--buckets", buckets, "--out", os.path.join(out, _tag(arm)), "--results", arm_results]
            found = run_recover(os.path.join(out, _tag(arm)), arm_results, model, k=k, buckets=buckets, steps=steps,
                                batch_size=batch_size, train_inputs=train_inputs, max_heldout=max_heldout,
                                progress=progress, command=" ".join(argv))
        per_arm[arm] = found
    first = next(iter(per_arm.values()))
    result = {"command": command or "python -m experiments granularity-recover", "model": first["model"], "k": k,
              "lengths": first["lengths"], "steps": steps, "arms": list(per_arm),
              "recipe": {key: first[key] for key in ("objective", "batch_size", "learning_rate",
                                                     "reconstruction_learning_rate", "train_inputs", "trainable")},
              "per_arm": {arm: {"command": r["command"], "buckets_source": r["buckets_source"],
                                "r_drift": r["r_drift"], "train_seconds": r["train_seconds"], "rows": r["rows"]}
                          for arm, r in per_arm.items()}}
    result["goals"] = goals(result)
    result["total_seconds"] = round(time.perf_counter() - start, 1)
    write_study(results, "granularity_recover", result, render(result))
    return result


def goals(result: dict) -> dict:
    """Per arm: the worst recovered 1 − cos over every bucket of every kind, where, and whether it is ≤ `GOAL`."""
    out = {}
    for arm, data in result["per_arm"].items():
        rows = [r for r in data["rows"] if r["model"] == "recovered" and r["bucket"] != "all"]
        worst = max(rows, key=lambda r: r["one_minus_cos"])
        out[arm] = {"worst_one_minus_cos": worst["one_minus_cos"], "at": [worst["inputs_kind"], worst["bucket"]],
                    "met": worst["one_minus_cos"] <= GOAL}
    return out


def render(result: dict) -> str:
    """Markdown: the setup, converted and recovered 1 − cos (rows: kind and bucket; columns: arms), recovered
    Spearman, and the goal per arm."""
    arms = result["arms"]
    recipe = result["recipe"]
    lines = [f"# The lengths study's arms converted and recovered, `{result['model']}` at k = {result['k']}'s saving",
             "", f"Command ({len(arms)} arms, {sum(d['train_seconds'] for d in result['per_arm'].values()) / 60:.0f} "
             "min of recovery training in all, each arm run by its own `recover` command (in its file) or read back "
             "where it had run):", "", "```",
             result["command"], "```", "",
             "- Arms: P and R from `make granularity-lengths` (buckets "
             f"{result['lengths']}, Fisher objective): pooled, per layer or per head, one k or a k per layer at the "
             "same saving. Each is converted with R per layer and recovered by `make recover`'s recipe: "
             f"`{recipe['objective']}` against the exact model, {result['steps']} steps, batch {recipe['batch_size']}, "
             f"lr {recipe['learning_rate']}, R's lr {recipe['reconstruction_learning_rate']}, "
             f"{recipe['train_inputs']} sentences and paragraphs of the demo text, trained: {recipe['trainable']}.",
             "- Held out: prose of installed packages' descriptions (never seen in fitting or recovery); 1 − cos: mean "
             "over inputs of 1 − cosine of the mean-pooled embedding to the original model's; Spearman: of all "
             "pairwise cosine similarities against the original's.",
             "- Each arm's own run (its command, R drift, training log): "
             + ", ".join(f"[`{arm}`]({_tag(arm)}/recovery.md)" for arm in arms) + ".", ""]
    by = {(arm, r["model"], r["inputs_kind"], r["bucket"]): r for arm, data in result["per_arm"].items()
          for r in data["rows"]}
    keys = sorted({(r["inputs_kind"], r["bucket"]) for data in result["per_arm"].values() for r in data["rows"]},
                  key=lambda kb: (kb[0], 10**9 if kb[1] == "all" else kb[1]))
    for model, metric, title, fmt in (("converted", "one_minus_cos", "1 − cos, converted", "{:.4f}"),
                                      ("recovered", "one_minus_cos", "1 − cos, recovered", "{:.4f}"),
                                      ("recovered", "spearman", "pairwise Spearman, recovered", "{:.3f}")):
        lines += [f"## {title}", "", "| inputs | bucket | inputs | " + " | ".join(arms) + " |",
                  "|---|---:|---:|" + "---:|" * len(arms)]
        for kind, b in keys:
            cells = [fmt.format(by[(arm, model, kind, b)][metric]) if (arm, model, kind, b) in by else "–"
                     for arm in arms]
            count = len(by[(arms[0], model, kind, b)]["lengths"])
            lines.append(f"| {kind} | {b} | {count} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [f"## Goal (issue 34: after recovery, 1 − cos ≤ {GOAL} at every bucket)", ""]
    for arm, g in result["goals"].items():
        lines.append(f"- `{arm}`: worst {g['worst_one_minus_cos']:.4f} ({g['at'][0]}, b = {g['at'][1]}): "
                     f"**{'met' if g['met'] else 'not met'}**.")
    lines.append("")
    return "\n".join(lines)

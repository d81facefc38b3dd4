"""The Table-1 report's gap decomposition and goals (issue 24): where between the exact model and a fine-tuned
partial one the accuracy goes.

Per k, each step (conversion at full windows, at the pairs' lengths, recovery, fine-tuning) is a difference with its
standard error, naming the two report entries it is the difference of (`gap_decomposition` lists the steps);
`goals` states issue 24's goals as met or not. This module imports the spec and the statistics, never the runner.
"""

from __future__ import annotations

from typing import Any

from .spec import Arm, StudyArms
from .stats import ArmLosses, accuracy_difference, fmt_difference, paired_loss_difference

__all__ = ["gap_decomposition", "goals", "render_gaps", "render_goals", "GOALS_ACCURACY", "GOAL_MLM"]

# Issue 24's goals: accuracy within this many points (as fractions) of exact at k, MLM gap after recovery at k.
GOALS_ACCURACY = {16: 0.01, 8: 0.03}
GOAL_MLM = (16, 0.03)


def _mlm(a: dict, b: dict, of: str, minus: str) -> dict:
    diff, se = paired_loss_difference(a, b)
    return {"diff": diff, "se": se, "of": of, "minus": minus}


def _acc(runs_a: list, runs_b: list, of: str, minus: str) -> dict:
    diff, se = accuracy_difference(runs_a, runs_b)
    return {"diff": diff, "se": se, "of": of, "minus": minus}


def _mode(arms: StudyArms) -> str:
    modes = [arm.reconstruction for arm in arms.finetune if not arm.is_exact]
    return "common" if "common" in modes else modes[0]


def gap_decomposition(arms: StudyArms, losses: dict[str, ArmLosses], phase1: dict, finetune: dict[str, list],
                      zero_fill: dict[str, dict]) -> dict[str, dict[str, Any]]:
    """``{str(k): {"mode", "steps": [{"step", "comparison", "windows", "pairs", "accuracy"}, ...], "accuracy_steps",
    "loses_most", "sentence"}}``; a measure is None where it does not apply, a k without partial arms is left out.
    ``accuracy_steps`` is the accuracy chain the sentence reads: conversion (the arm without recovery − exact), each
    recovery's change from no recovery, zero-fill − buckets; ``loses_most`` its most negative step.

    ``zero_fill[str(k)]``: the zero-fill conversion's test losses ``{"windows", "pairs"}`` at k (absent: not run).

    Per k, with the study's common R (else its first R mode), each step is a difference with its standard error, MLM
    losses paired over the test windows or test pairs (`paired_loss_difference`), accuracies over seeds and examples
    (`accuracy_difference`):

    - (i) conversion at full windows: converted − exact (phase 1) MLM loss on the windows, zero-fill and buckets;
    - (ii) conversion at the pairs' lengths: the same on the pairs, and buckets − zero-fill;
    - (iii) recovery: MLM loss after phase 2 − the exact arm's after phase 2, for recovery none (the converted model
      against phase 1, its source), mlm, distill and the zero-fill control, on windows and pairs;
    - (iv) fine-tuning: accuracy − the exact arm's, per recovery, and the zero-fill control − its buckets twin.

    Every measure names the two report entries it is the difference of (``of`` − ``minus``: paths into the report,
    ``rows.<arm>.mlm_converted_pairs``, ``phase1_mlm_loss.pairs``, ``zero_fill_converted.<k>.windows``, ...), and
    the accuracy steps name the one that loses most.
    """
    out = {}
    for k in dict.fromkeys(arm.k for arm in arms.finetune if not arm.is_exact):
        mode = _mode(arms)
        steps = []
        _conversion_steps(steps, k, arms, losses, phase1, zero_fill.get(str(k)))
        twins = {recovery: Arm(k, mode, recovery) for recovery in ("none", "mlm", "distill")}
        controls = [arm for arm in arms.finetune if arm.k == k and arm.lengths == "zero_fill"]
        _recovery_steps(steps, arms, losses, phase1, twins, controls)
        accuracy_steps = _accuracy_steps(steps, arms, finetune, twins, controls)
        loser = min(accuracy_steps, key=lambda s: s[1]["diff"]) if accuracy_steps else None
        out[str(k)] = {"k": k, "mode": mode, "steps": steps,
                       "accuracy_steps": [{"step": name, **m} for name, m in accuracy_steps],
                       "loses_most": None if loser is None else {"step": loser[0], **loser[1]},
                       "sentence": _sentence(k, loser, accuracy_steps)}
    return out


def _add(steps: list, step, comparison, windows=None, pairs=None, accuracy=None) -> None:
    steps.append({"step": step, "comparison": comparison, "windows": windows, "pairs": pairs, "accuracy": accuracy})


def _conversion_steps(steps: list, k: int, arms: StudyArms, losses: dict[str, ArmLosses], phase1: dict,
                      zf: dict | None) -> None:
    """Steps (i) and (ii): the zero-fill and the buckets conversion of k against the exact model, on full windows and
    at the pairs' lengths, and buckets against zero fill there (``zf``: the zero-fill losses, None: not run)."""
    buckets = next((arm for arm in arms.finetune if arm.k == k and arm.lengths == "buckets"
                    and losses[arm.name].converted is not None), None)
    for kind in ("windows", "pairs"):
        step = "(i) conversion at full windows" if kind == "windows" else "(ii) conversion at the pairs' lengths"
        if zf is not None:
            _add(steps, step, "zero-fill converted − exact (phase 1)", **{kind: _mlm(
                zf[kind], phase1[kind], f"zero_fill_converted.{k}.{kind}", f"phase1_mlm_loss.{kind}")})
        if buckets is not None:
            _add(steps, step, "buckets converted − exact (phase 1)", **{kind: _mlm(
                losses[buckets.name].converted[kind], phase1[kind], f"rows.{buckets.name}.mlm_converted_{kind}",
                f"phase1_mlm_loss.{kind}")})
    if zf is not None and buckets is not None:
        _add(steps, "(ii) conversion at the pairs' lengths", "buckets − zero-fill (converted)", pairs=_mlm(
            losses[buckets.name].converted["pairs"], zf["pairs"], f"rows.{buckets.name}.mlm_converted_pairs",
            f"zero_fill_converted.{k}.pairs"))


def _recovery_steps(steps: list, arms: StudyArms, losses: dict[str, ArmLosses], phase1: dict, twins: dict[str, Arm],
                    controls: list[Arm]) -> None:
    """Step (iii): each recovery twin's and zero-fill control's MLM gap to the exact model (after phase 2 when the
    arm trains, else as converted)."""
    by_name, exact = arms.by_name(), Arm().name
    exact_after = losses[exact].recovered
    for arm in [*(a for a in twins.values() if a.name in by_name), *controls]:
        own = losses[arm.name]
        label = f"{arm.recovery}" + (" (zero-fill control)" if arm.lengths == "zero_fill" else "")
        if arm.trains:
            _add(steps, "(iii) recovery", f"{label}: {arm.name} after − exact after phase 2", **{kind: _mlm(
                own.recovered[kind], exact_after[kind], f"rows.{arm.name}.mlm_{kind}", f"rows.{exact}.mlm_{kind}")
                for kind in ("windows", "pairs")})
        else:
            _add(steps, "(iii) recovery", f"{label}: {arm.name} (converted) − exact (phase 1)", **{kind: _mlm(
                own.converted[kind], phase1[kind], f"rows.{arm.name}.mlm_converted_{kind}",
                f"phase1_mlm_loss.{kind}") for kind in ("windows", "pairs")})


def _accuracy_steps(steps: list, arms: StudyArms, finetune: dict[str, list], twins: dict[str, Arm],
                    controls: list[Arm]) -> list[tuple[str, dict]]:
    """Step (iv), fine-tuned accuracy differences; returns the accuracy chain (name, difference): zero fill instead
    of buckets, then conversion and what each recovery changes."""
    by_name, exact = arms.by_name(), Arm().name
    accuracy_steps, versus_exact = [], {}
    for recovery, arm in twins.items():
        if arm.name in by_name:
            _add(steps, "(iv) fine-tuning", f"{recovery}: {arm.name} − exact", accuracy=_acc(
                finetune[arm.name], finetune[exact], f"rows.{arm.name}.accuracy.mean",
                f"rows.{exact}.accuracy.mean"))
            versus_exact[recovery] = steps[-1]["accuracy"]
    for arm in controls:
        twin = arm.twin(lengths="buckets").name
        _add(steps, "(iv) fine-tuning", f"zero-fill control: {arm.name} − {twin}", accuracy=_acc(
            finetune[arm.name], finetune[twin], f"rows.{arm.name}.accuracy.mean", f"rows.{twin}.accuracy.mean"))
        accuracy_steps.append((f"zero-fill instead of buckets ({arm.name} − {twin})", steps[-1]["accuracy"]))
    if "none" in versus_exact:  # the accuracy chain: conversion, then what each recovery changes
        none = twins["none"].name
        accuracy_steps.append((f"conversion ({none}, fine-tuned without recovery, − exact)", versus_exact["none"]))
        for recovery in ("mlm", "distill"):
            arm = twins[recovery].name
            if arm in by_name:
                accuracy_steps.append((f"recovery by {recovery} instead of none ({arm} − {none})", _acc(
                    finetune[arm], finetune[none], f"rows.{arm}.accuracy.mean", f"rows.{none}.accuracy.mean")))
    return accuracy_steps


def _sentence(k: int, loser, accuracy_steps) -> str:
    if loser is None:
        return f"At k = {k} no accuracy step is measured (the study has no arm without recovery and no control)."
    name, m = loser
    if m["diff"] >= 0:
        return f"At k = {k} no step loses accuracy: every measured step is ≥ 0 ({len(accuracy_steps)} steps)."
    real = abs(m["diff"]) > 2 * m["se"]
    others = "; ".join(f"{n}: {fmt_difference(s['diff'], s['se'], 'acc')}" for n, s in accuracy_steps if n != name)
    return (f"At k = {k} the step that loses the most accuracy is {name}: {fmt_difference(m['diff'], m['se'], 'acc')}"
            f" ({'more' if real else 'not more'} than twice its standard error)" + (f"; beside it {others}." if others
                                                                                     else "."))


def goals(arms: StudyArms, losses: dict[str, ArmLosses], finetune: dict[str, list]) -> list[dict[str, Any]]:
    """Issue 24's goals, met or not from the numbers: the best buckets arm of k = 16 (k = 8) within 1 (3) points of
    the exact arm's accuracy, and the best recovered buckets arm of k = 16 within 0.03 nats of the exact arm's MLM
    loss after phase 2 on the windows and on the pairs."""
    exact = Arm().name
    out = []
    for k, tolerance in GOALS_ACCURACY.items():
        candidates = [arm.name for arm in arms.finetune if arm.k == k and arm.lengths == "buckets"
                      and arm.granularity == "pooled"]
        goal = f"k = {k}: accuracy within {100 * tolerance:.0f} point{'s' if tolerance > 0.01 else ''} of exact"
        if not candidates:
            out.append({"goal": goal, "met": None, "arm": None})
            continue
        diffs = {name: accuracy_difference(finetune[name], finetune[exact]) for name in candidates}
        best = max(diffs, key=lambda name: diffs[name][0])
        out.append({"goal": goal, "arm": best, "diff": diffs[best][0], "se": diffs[best][1],
                    "met": diffs[best][0] >= -tolerance})
    forms = [arm.name for arm in arms.finetune if arm.k == 16 and arm.granularity != "pooled"]
    if forms:  # issue 34: the best k = 16 arm of any form (pooled, per layer, per head, budgeted) within 3 points
        diffs = {name: accuracy_difference(finetune[name], finetune[exact])
                 for name in [*forms, *(a.name for a in arms.finetune if a.k == 16 and a.lengths == "buckets"
                                       and a.granularity == "pooled")]}
        best = max(diffs, key=lambda name: diffs[name][0])
        out.append({"goal": "k = 16, any form of P and R (issue 34): accuracy within 3 points of exact", "arm": best,
                    "diff": diffs[best][0], "se": diffs[best][1], "met": diffs[best][0] >= -0.03})
    k, tolerance = GOAL_MLM
    goal = f"k = {k}: MLM loss after recovery within {tolerance} nats of exact on windows and pairs"
    recovered = [arm.name for arm in arms.finetune if arm.k == k and arm.trains and arm.lengths == "buckets"
                 and arm.granularity == "pooled"]
    if not recovered:
        out.append({"goal": goal, "met": None, "arm": None})
        return out
    gaps = {name: {kind: paired_loss_difference(losses[name].recovered[kind], losses[exact].recovered[kind])
                   for kind in ("windows", "pairs")} for name in recovered}
    best = min(gaps, key=lambda name: max(g[0] for g in gaps[name].values()))
    out.append({"goal": goal, "arm": best, "windows": gaps[best]["windows"], "pairs": gaps[best]["pairs"],
                "met": all(g[0] <= tolerance for g in gaps[best].values())})
    return out


def _cell(m: dict | None, unit: str) -> str:
    return "" if m is None else fmt_difference(m["diff"], m["se"], unit)


def render_gaps(decomposition: dict[str, dict]) -> list[str]:
    """The ``## Gap decomposition`` section of table1.md."""
    lines = ["## Gap decomposition", "",
             "Each step is a difference ± its standard error (MLM: nats per masked token, paired over the test windows "
             "or the test pairs at their own lengths; accuracy: seeds and examples). Exact (phase 1) is the model "
             "every arm was converted from; the exact arm after phase 2 had the same recovery budget (MLM).", ""]
    for k, d in decomposition.items():
        lines += [f"### k = {k}, R {d['mode']}", "", "| step | comparison | windows | pairs | accuracy |",
                  "|---|---|---|---|---|"]
        for s in d["steps"]:
            lines.append(f"| {s['step']} | {s['comparison']} | {_cell(s['windows'], 'nats')} | "
                         f"{_cell(s['pairs'], 'nats')} | {_cell(s['accuracy'], 'acc')} |")
        lines += ["", d["sentence"], ""]
    return lines


def render_goals(goal_rows: list[dict]) -> list[str]:
    """The ``## Goals`` section of table1.md."""
    lines = ["## Goals (issue 24)", ""]
    for g in goal_rows:
        if g["met"] is None:
            lines.append(f"- {g['goal']}: **not run** (no such arm).")
        elif "diff" in g:
            lines.append(f"- {g['goal']}: **{'met' if g['met'] else 'not met'}** (best arm {g['arm']}: "
                         f"{fmt_difference(g['diff'], g['se'], 'acc')}).")
        else:
            lines.append(f"- {g['goal']}: **{'met' if g['met'] else 'not met'}** (best arm {g['arm']}: windows "
                         f"{fmt_difference(*g['windows'])}, pairs {fmt_difference(*g['pairs'])}).")
    return [*lines, ""]

"""Statistics of the Table-1 study: MLM losses compared example by example (test windows, or test pairs at their
own lengths), accuracies over seeds and examples, and the verdict on each of the paper's claims.

A difference counts as real when it exceeds twice its standard error; otherwise the verdict says it is not
distinguishable at this scale.

The verdicts read each arm's losses as `ArmLosses`: ``converted`` and ``recovered``, each ``{"windows": ...,
"pairs": ...}`` of `mlm_window_losses` results (None where the arm has none: the exact arm was never converted,
an arm with recovery ``none`` never recovered), and its R drift.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .spec import Arm, StudyArms

__all__ = ["mlm_loss", "paired_loss_difference", "accuracy_summary", "accuracy_difference", "verdicts",
           "ArmLosses", "MIN_EFFECT_NATS", "MIN_EFFECT_ACCURACY", "MIN_DRIFT", "fmt_difference"]


def mlm_loss(result: dict[str, list[float]]) -> float:
    """Mean cross-entropy per masked token of a `mlm_window_losses` result."""
    return sum(result["loss_sums"]) / sum(result["token_counts"])


def paired_loss_difference(a: dict, b: dict) -> tuple[float, float]:
    """(loss(a) − loss(b), its standard error) on the same windows and masks.

    The difference is a ratio estimate ``Σ_w (s_a,w − s_b,w) / Σ_w c_w``; its standard error comes from the
    per-window residuals ``e_w = s_a,w − s_b,w − diff · c_w`` (the delta method for a ratio of sums).
    """
    if a["token_counts"] != b["token_counts"]:
        raise ValueError("The two MLM evaluations were not made on the same windows and masks.")
    counts = a["token_counts"]
    total = sum(counts)
    diff = (sum(a["loss_sums"]) - sum(b["loss_sums"])) / total
    residuals = [sa - sb - diff * c for sa, sb, c in zip(a["loss_sums"], b["loss_sums"], counts)]
    w = len(residuals)
    se = math.sqrt(w / max(w - 1, 1) * sum(e * e for e in residuals)) / total
    return diff, se


def seeds_loss_difference(a_jobs: list[dict], b_jobs: list[dict]) -> tuple[float, float]:
    """(loss(a) − loss(b), its standard error) over pretraining seeds, each seed's pair of jobs (``{"test": ...}``)
    evaluated on the same windows and masks: one seed, its paired difference; several, the mean of their paired
    differences with a standard error that adds the seeds' spread (run-to-run variance) to their own paired errors
    (conservative: the spread already holds some of those)."""
    pairs = [paired_loss_difference(x["test"], y["test"]) for x, y in zip(a_jobs, b_jobs, strict=True)]
    if len(pairs) == 1:
        return pairs[0]
    n = len(pairs)
    diffs = [d for d, _ in pairs]
    mean = sum(diffs) / n
    spread = sum((d - mean) ** 2 for d in diffs) / (n - 1)
    return mean, math.sqrt(spread / n + sum(se ** 2 for _, se in pairs) / n ** 2)


def accuracy_summary(runs: list[dict]) -> dict[str, Any]:
    """Mean, sample sd over seeds, the per-seed values and one run's binomial standard error."""
    values = [r["accuracy"] for r in runs]
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else float("nan")
    size = len(runs[0]["correct"])
    return {"mean": mean, "sd": sd, "values": values, "n_eval": size,
            "binomial_se": math.sqrt(mean * (1 - mean) / size)}


def accuracy_difference(runs_a: list[dict], runs_b: list[dict]) -> tuple[float, float]:
    """(mean accuracy of a − of b, a conservative standard error).

    Two sources of noise, added: the seeds (sd² / seeds of each arm) and the examples (per held-out example,
    the difference of the two arms' correctness averaged over seeds, its sd / √N), which the seed term alone
    misses because every run is scored on the same examples.
    """
    sa, sb = accuracy_summary(runs_a), accuracy_summary(runs_b)
    seed_var = sum((s["sd"] ** 2 / len(s["values"])) if len(s["values"]) > 1 else 0.0 for s in (sa, sb))
    n = len(runs_a[0]["correct"])
    mean_a = [sum(int(r["correct"][i]) for r in runs_a) / len(runs_a) for i in range(n)]
    mean_b = [sum(int(r["correct"][i]) for r in runs_b) / len(runs_b) for i in range(n)]
    d = [x - y for x, y in zip(mean_a, mean_b)]
    dm = sum(d) / n
    example_var = sum((x - dm) ** 2 for x in d) / max(n - 1, 1) / n
    return sa["mean"] - sb["mean"], math.sqrt(seed_var + example_var)


# Smallest MLM-loss difference (nats per token) that counts as an effect: below it two arms are the same model
# for practical purposes, however small the standard error (R that barely moves gives 1e-4-nat differences that
# are many standard errors wide).
MIN_EFFECT_NATS = 0.01
MIN_EFFECT_ACCURACY = 0.01  # one point
# Smallest relative R drift ‖R − R₀‖/‖R₀‖ (the largest over an arm's R tensors) that counts as R having trained.
MIN_DRIFT = 0.01


def _verdict(diff: float, se: float, better_when_negative: bool = True, floor: float = MIN_EFFECT_NATS) -> str:
    """'supported' / 'contradicted' / 'not distinguishable' for a claim that `diff` is below (or above) zero."""
    if abs(diff) <= max(2 * se, floor):
        return "not distinguishable"
    return "supported" if (diff < 0) == better_when_negative else "contradicted"


def fmt_difference(diff: float, se: float, unit: str = "nats") -> str:
    """``+0.1234 ± 0.0056 nats`` or (``unit="acc"``, fractions) ``-12.9 ± 1.8 points``."""
    return f"{diff:+.4f} ± {se:.4f} {unit}" if unit == "nats" else f"{100 * diff:+.1f} ± {100 * se:.1f} points"


_fmt = fmt_difference


def _combine(verdicts: list[str]) -> str:
    if all(v == "supported" for v in verdicts):
        return "supported"
    if all(v == "contradicted" for v in verdicts):
        return "contradicted"
    if {"supported", "partly supported"} & set(verdicts) and "contradicted" not in verdicts:
        return "partly supported"
    return "not distinguishable" if set(verdicts) == {"not distinguishable"} else "mixed"


@dataclass(frozen=True)
class ArmLosses:
    """An arm's test MLM losses before (``converted``) and after phase 2 (``recovered``), each ``{"windows",
    "pairs"}`` of per-example results or None, and its R drift after phase 2 (mean and largest over R tensors)."""

    converted: dict | None = None
    recovered: dict | None = None
    r_drift: float | None = None
    r_drift_max: float | None = None


def _drift_note(losses: dict[str, ArmLosses], names: list[str]) -> str:
    """Whether R measurably trained in the arms ``names`` that train R (largest drift >= `MIN_DRIFT`)."""
    drifts = [losses[n].r_drift_max for n in names if losses[n].r_drift_max is not None]
    if not drifts:
        return "no arm here trains R"
    moved = sum(d >= MIN_DRIFT for d in drifts)
    return (f"R measurably trained (largest drift >= {MIN_DRIFT:.0%}) in {moved} of {len(drifts)} arms with trained R "
            f"(largest drifts {min(drifts):.3f}–{max(drifts):.3f})")


def verdicts(arms: StudyArms, losses: dict[str, ArmLosses], phase1: dict,
             finetune: dict[str, list[dict]]) -> dict[str, dict[str, Any]]:
    """One verdict per claim of the paper, with the numbers behind it.

    ``losses[name]`` are the arms' `ArmLosses` (every arm of ``arms.finetune``), ``phase1`` the phase-1 model's
    test losses ``{"windows", "pairs"}``, ``finetune[name]`` the fine-tuning runs of every arm. MLM losses on the
    test windows decide (they are measured far more precisely than accuracies); the pairs' losses and accuracy
    differences are reported beside them. Claims (a) and (b) are judged on the arms with length buckets (and (a)
    also on the zero-fill conversion); (c) and (d) on the recovered arms, distill and MLM, and say whether R
    measurably trained.
    """
    # the paper's claims are about one pooled P and R: arms with P and R per layer or head are reported beside them
    partial = [arm for arm in arms.finetune if not arm.is_exact and arm.granularity == "pooled"]
    recovered = [arm for arm in partial if arm.trains and arm.lengths == "buckets"]
    ks = list(dict.fromkeys(arm.k for arm in partial))
    modes = list(dict.fromkeys(arm.reconstruction for arm in partial))
    recoveries = [r for r in ("distill", "mlm") if any(arm.recovery == r for arm in recovered)]
    return {"a": _claim_conversion_loses(partial, losses, phase1, finetune),
            "b": _claim_training_recovers(recovered, losses, phase1, finetune),
            "c": _claim_trained_r(recoveries, ks, modes, losses, finetune),
            "d": _claim_common_vs_per_layer(recoveries, ks, modes, losses, finetune)}


def _claim_conversion_loses(partial: list[Arm], losses: dict[str, ArmLosses], phase1: dict,
                            finetune: dict[str, list[dict]]) -> dict[str, Any]:
    """Claim (a), conversion alone loses: converted loss above the exact model it was converted from (the same
    weights for every R mode of one k and pattern: one line each)."""
    exact = Arm().name
    lines, votes, seen = [], [], set()
    for arm in partial:
        if (arm.k, arm.lengths) in seen or losses[arm.name].converted is None:
            continue
        seen.add((arm.k, arm.lengths))
        conv = losses[arm.name].converted
        diff, se = paired_loss_difference(conv["windows"], phase1["windows"])
        pairs = paired_loss_difference(conv["pairs"], phase1["pairs"])
        votes.append(_verdict(-diff, se))  # the claim: converted loss is higher
        lines.append(f"k={arm.k} {arm.lengths.replace('_', '-')}: converted − exact {_fmt(diff, se)} on windows, "
                     f"{_fmt(*pairs)} on the pairs")
    for arm in [a for a in partial if not a.trains]:
        diff, se = accuracy_difference(finetune[arm.name], finetune[exact])
        lines.append(f"{arm.name} fine-tuned without recovery − exact: {_fmt(diff, se, 'acc')}")
    return {"claim": "inserting the approximation into an exactly trained model loses accuracy",
            "verdict": _combine(votes) if votes else "not run", "evidence": lines}


def _claim_training_recovers(recovered: list[Arm], losses: dict[str, ArmLosses], phase1: dict,
                             finetune: dict[str, list[dict]]) -> dict[str, Any]:
    """Claim (b), training recovers: the gap to the exact arm after phase 2 is smaller than right after
    conversion, by at least half ("most"), and the fine-tuned accuracy is not distinguishable from the exact arm's."""
    exact = Arm().name
    lines, votes, acc_lost = [], [], []
    for arm in recovered:
        own = losses[arm.name]
        before, se_b = paired_loss_difference(own.converted["windows"], phase1["windows"])
        after, se_a = paired_loss_difference(own.recovered["windows"], losses[exact].recovered["windows"])
        pairs_before = paired_loss_difference(own.converted["pairs"], phase1["pairs"])[0]
        pairs_after = paired_loss_difference(own.recovered["pairs"], losses[exact].recovered["pairs"])[0]
        shrink, se = after - before, math.sqrt(se_a ** 2 + se_b ** 2)
        share = 1 - after / before if before > 0 else float("nan")
        vote = _verdict(shrink, se)
        votes.append("partly supported" if vote == "supported" and not share >= 0.5 else vote)
        acc = accuracy_difference(finetune[arm.name], finetune[exact])
        if acc[0] < -max(2 * acc[1], MIN_EFFECT_ACCURACY):  # more than twice its error, and more than one point
            acc_lost.append(arm.name)
        lines.append(f"{arm.name}: MLM gap to exact on windows {before:.4f} → {after:.4f} nats ({100 * share:.0f} % "
                     f"recovered; change {_fmt(shrink, se)}), on the pairs {pairs_before:.4f} → {pairs_after:.4f}; "
                     f"accuracy − exact {_fmt(*acc, 'acc')}")
    verdict = _combine(votes) if votes else "not run"
    if acc_lost:
        verdict += (f" for the MLM loss; the accuracy is not recovered ({len(acc_lost)} of {len(recovered)} arms "
                    "below the exact arm by more than twice the standard error)")
    return {"claim": "training with partial attention built in recovers most of what conversion loses",
            "verdict": verdict, "evidence": lines}


def _claim_trained_r(recoveries: list[str], ks: list[int], modes: list[str], losses: dict[str, ArmLosses],
                     finetune: dict[str, list[dict]]) -> dict[str, Any]:
    """Claim (c): trained R beats fixed R, per recovery."""
    lines, votes, trained_names = [], [], []
    for recovery in recoveries:
        for k in ks:
            fixed = Arm(k, "fixed", recovery).name
            if fixed not in losses:
                continue
            for mode in [m for m in modes if m != "fixed"]:
                trained = Arm(k, mode, recovery).name
                own = losses[trained]
                diff, se = paired_loss_difference(own.recovered["windows"], losses[fixed].recovered["windows"])
                votes.append(_verdict(diff, se))
                trained_names.append(trained)
                acc = accuracy_difference(finetune[trained], finetune[fixed])
                lines.append(f"{recovery}, k={k} {mode} − fixed: MLM {_fmt(diff, se)}, accuracy {_fmt(*acc, 'acc')}; "
                             f"R drift {own.r_drift_max:.3f} (largest)")
    verdict = _combine(votes) if votes else "not run"
    return {"claim": "trained R beats fixed R", "verdict": verdict + (f"; {_drift_note(losses, trained_names)}"
                                                                      if votes else ""), "evidence": lines}


def _claim_common_vs_per_layer(recoveries: list[str], ks: list[int], modes: list[str],
                               losses: dict[str, ArmLosses], finetune: dict[str, list[dict]]) -> dict[str, Any]:
    """Claim (d): common R better at the smallest k, per-layer R at the largest, per recovery."""
    lines, votes, trained_names = [], [], []
    if {"common", "per_layer"} <= set(modes) and len(ks) > 1:
        for recovery in recoveries:
            for k, common_better in ((min(ks), True), (max(ks), False)):
                common, per_layer = Arm(k, "common", recovery).name, Arm(k, "per_layer", recovery).name
                diff, se = paired_loss_difference(losses[common].recovered["windows"],
                                                  losses[per_layer].recovered["windows"])
                votes.append(_verdict(diff, se, better_when_negative=common_better))
                trained_names += [common, per_layer]
                acc = accuracy_difference(finetune[common], finetune[per_layer])
                lines.append(f"{recovery}, k={k} common − per_layer: MLM {_fmt(diff, se)}, accuracy "
                             f"{_fmt(*acc, 'acc')}")
    verdict = _combine(votes) if votes else "not run"
    return {"claim": "a common R is better at small k, per-layer R at larger k",
            "verdict": verdict + (f"; {_drift_note(losses, trained_names)}" if votes else ""), "evidence": lines}

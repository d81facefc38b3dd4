"""Statistics of the Table-1 study: MLM losses compared window by window, accuracies over seeds and examples,
and the verdict on each of the paper's claims.

A difference counts as real when it exceeds twice its standard error; otherwise the verdict says it is not
distinguishable at this scale.
"""

from __future__ import annotations

import math
from typing import Any

from .table1_spec import Arm, StudyArms

__all__ = ["mlm_loss", "paired_loss_difference", "accuracy_summary", "accuracy_difference", "verdicts",
           "MIN_EFFECT_NATS"]


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


def _verdict(diff: float, se: float, better_when_negative: bool = True, floor: float = MIN_EFFECT_NATS) -> str:
    """'supported' / 'contradicted' / 'not distinguishable' for a claim that `diff` is below (or above) zero."""
    if abs(diff) <= max(2 * se, floor):
        return "not distinguishable"
    return "supported" if (diff < 0) == better_when_negative else "contradicted"


def _fmt(diff: float, se: float, unit: str = "nats") -> str:
    return f"{diff:+.4f} ± {se:.4f} {unit}" if unit == "nats" else f"{100 * diff:+.1f} ± {100 * se:.1f} points"


def _combine(verdicts: list[str]) -> str:
    if all(v == "supported" for v in verdicts):
        return "supported"
    if all(v == "contradicted" for v in verdicts):
        return "contradicted"
    if {"supported", "partly supported"} & set(verdicts) and "contradicted" not in verdicts:
        return "partly supported"
    return "not distinguishable" if set(verdicts) == {"not distinguishable"} else "mixed"


def verdicts(arms: StudyArms, mlm: dict[str, dict], phase1: dict,
             finetune: dict[str, list[dict]]) -> dict[str, dict[str, Any]]:
    """One verdict per claim of the paper, with the numbers behind it.

    ``mlm[name]`` are the phase-2 jobs of ``arms.mlm`` by arm name (with ``converted`` for partial arms),
    ``phase1`` the phase-1 job, ``finetune[name]`` the fine-tuning runs of ``arms.finetune``. MLM losses decide
    (they are measured far more precisely than accuracies); accuracy differences are reported beside them.
    """
    out: dict[str, dict[str, Any]] = {}
    exact = Arm().name
    partial = [arm.name for arm in arms.mlm if not arm.is_exact]
    ks = list(dict.fromkeys(arm.k for arm in arms.mlm if not arm.is_exact))
    modes = list(dict.fromkeys(arm.reconstruction for arm in arms.mlm if not arm.is_exact))
    # (a) conversion alone loses: converted loss above the exact model it was converted from.
    lines, votes = [], []
    for arm in partial:
        diff, se = paired_loss_difference(mlm[arm]["converted"], phase1)
        votes.append(_verdict(-diff, se))  # the claim: converted loss is higher
        lines.append(f"{arm}: converted − exact {_fmt(diff, se)}")
    for arm in [a.name for a in arms.finetune if not a.recovery]:
        diff, se = accuracy_difference(finetune[arm], finetune[exact])
        lines.append(f"{arm} fine-tuned without recovery − exact: {_fmt(diff, se, 'acc')}")
    out["a"] = {"claim": "inserting the approximation into an exactly trained model loses accuracy",
                "verdict": _combine(votes), "evidence": lines}
    # (b) training recovers: the gap to the exact arm after phase 2 is smaller than right after conversion, by at
    # least half ("most"), and the fine-tuned accuracy is not distinguishable from the exact arm's.
    lines, votes, acc_lost = [], [], []
    for arm in partial:
        before, se_b = paired_loss_difference(mlm[arm]["converted"], phase1)
        after, se_a = paired_loss_difference(mlm[arm], mlm[exact])
        shrink, se = after - before, math.sqrt(se_a ** 2 + se_b ** 2)
        recovered = 1 - after / before if before > 0 else float("nan")
        vote = _verdict(shrink, se)
        votes.append("partly supported" if vote == "supported" and not recovered >= 0.5 else vote)
        acc = accuracy_difference(finetune[arm], finetune[exact])
        if acc[0] < -max(2 * acc[1], 0.01):  # more than twice its error, and more than one point
            acc_lost.append(arm)
        lines.append(f"{arm}: MLM gap to exact {before:.4f} → {after:.4f} nats ({100 * recovered:.0f} % recovered; "
                     f"change {_fmt(shrink, se)}); accuracy − exact {_fmt(*acc, 'acc')}")
    verdict = _combine(votes)
    if acc_lost:
        verdict += (f" for the MLM loss; the accuracy is not recovered ({len(acc_lost)} of {len(partial)} arms "
                    "below the exact arm by more than twice the standard error)")
    out["b"] = {"claim": "training with partial attention built in recovers most of what conversion loses",
                "verdict": verdict, "evidence": lines}
    # (c) trained R beats fixed R.
    lines, votes = [], []
    for k in ks:
        fixed = Arm(k, "fixed").name
        if fixed not in mlm:
            continue
        for mode in [m for m in modes if m != "fixed"]:
            trained = Arm(k, mode).name
            diff, se = paired_loss_difference(mlm[trained], mlm[fixed])
            votes.append(_verdict(diff, se))
            acc = accuracy_difference(finetune[trained], finetune[fixed])
            lines.append(f"k={k} {mode} − fixed: MLM {_fmt(diff, se)}, accuracy {_fmt(*acc, 'acc')}")
    out["c"] = {"claim": "trained R beats fixed R", "verdict": _combine(votes) if votes else "not run",
                "evidence": lines}
    # (d) common R better at the smallest k, per-layer R at the largest.
    lines, votes = [], []
    if {"common", "per_layer"} <= set(modes) and len(ks) > 1:
        for k, common_better in ((min(ks), True), (max(ks), False)):
            common, per_layer = Arm(k, "common").name, Arm(k, "per_layer").name
            diff, se = paired_loss_difference(mlm[common], mlm[per_layer])
            votes.append(_verdict(diff, se, better_when_negative=common_better))
            acc = accuracy_difference(finetune[common], finetune[per_layer])
            lines.append(f"k={k} common − per_layer: MLM {_fmt(diff, se)}, accuracy {_fmt(*acc, 'acc')}")
    out["d"] = {"claim": "a common R is better at small k, per-layer R at larger k",
                "verdict": _combine(votes) if votes else "not run", "evidence": lines}
    return out

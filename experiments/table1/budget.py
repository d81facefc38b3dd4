"""The Table-1 study's wall-time estimate for a set of arguments, from step times measured on 2 CPU cores.

The unit costs were measured on the packaged MiniLM (6 layers, d_h = 32) with 2 torch threads at n = 128, and
checked against the first study's measured phases (`results/table1/table1.md` of v1: phase 2 about 200 s per
60-step MLM arm at batch 32, fine-tuning about 140 s per run of 120 steps at batch 32 with 2,600 held-out pairs).
Attention transfer + distill costs about 6.5 MLM steps: its KL needs the vocabulary logits at every token of the
teacher and of the student, where MLM computes them at the masked 15 % only, and the attention-transfer pass runs
the student's encoder a second time. Window costs scale with n / 128 (the quadratic part is small at these n).
"""

from __future__ import annotations

from .spec import StudyArguments

__all__ = ["estimate_seconds", "UNIT_SECONDS", "BUDGET_SECONDS"]

BUDGET_SECONDS = 3 * 3600  # issue 24: the whole study in <= 3 h on 2 cores

UNIT_SECONDS = {
    "mlm_window": 0.095,  # one n-token window through an MLM training step (forward + backward, masked-only logits)
    "distill_window": 0.63,  # the same through attention_transfer,distill (teacher pass, two student passes)
    "eval_window": 0.022,  # one window through an MLM evaluation (forward only)
    "eval_pair": 0.0094,  # one sentence pair (about 50 tokens) through a forward pass
    "finetune_pair": 0.035,  # one pair through a fine-tuning step
    "covariance_window": 0.06,  # one window through the score-statistics collection
    "bucket_fit": 90.0,  # analyze_lengths on all training sentences and paragraphs (about 8,000 inputs)
    "timing_round": 40.0,  # one interleaved round of `time_models` over the exact and 2 x |ks| partial models
    "job": 3.0,  # loading and saving a model, per job
}


def estimate_seconds(a: StudyArguments) -> dict[str, float]:
    """Estimated seconds of each phase of the study and their ``total`` on 2 cores."""
    u, scale = UNIT_SECONDS, a.max_seq_length / 128
    arms = a.arms()
    steps_windows = a.arm_steps * a.pretrain_batch_size * scale  # windows of one phase-2 run (times n / 128)
    evaluation = a.mlm_eval_windows * scale * u["eval_window"] + a.mlm_eval_pairs * u["eval_pair"]  # both test sets

    def train(arm) -> float:
        return steps_windows * u["distill_window" if arm.recovery == "distill" else "mlm_window"]

    selection = a.selection_arm
    rlr = len(a.learning_rate_list) * (train(selection) + u["job"]) if selection else 0.0
    phase2 = sum((0.0 if arm == selection else train(arm)) + (2 if not arm.is_exact else 1) * evaluation + u["job"]
                 for arm in arms.mlm)
    conv = sum(evaluation * (2 if i == 0 or arm.k != arms.converted[i - 1].k else 1) + u["job"]
               for i, arm in enumerate(arms.converted))
    eval_pairs = a.max_finetune_eval or 10000
    finetune = len(arms.finetune) * len(a.seeds) * (a.finetune_steps * a.finetune_batch_size * u["finetune_pair"]
                                                     + eval_pairs * u["eval_pair"] + u["job"])
    out = {"phase1": a.phase1_steps * a.phase1_batch_size * scale * u["mlm_window"] + u["job"],
           "patterns": a.covariance_windows * scale * u["covariance_window"] + u["bucket_fit"],
           "rlr": rlr, "phase1_eval": evaluation, "conv": conv, "phase2": phase2, "finetune": finetune,
           "timing": (a.timing_repeats + 1) * u["timing_round"] * len(a.k_list) / 2}
    out["total"] = sum(out.values())
    return out

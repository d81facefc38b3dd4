"""Which selection objective reaches the output: the paper's squared score error against shift-invariant and
Fisher-weighted objectives (`score_metrics.objective_metric`), judged by what the converted model outputs.

For each k and objective: P by the greedy for that objective, R optimal (the same formula for every objective),
the original model converted with ``from_bert`` (no retraining), then on the analysis folder's held-out windows:
the cosine of mean-pooled embeddings to the original model's and, per layer, the relative error of the hidden
states ``‖h' − h‖ / ‖h‖``. `python -m experiments objectives DIR` runs it and writes ``objectives.json`` and
``objectives.md``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from safetensors.torch import load_file
from tqdm.auto import tqdm

from hf_partial_attention.analysis.collect import display_name, load_model_and_tokenizer
from hf_partial_attention.analysis.covariance import ScoreCovariance
from hf_partial_attention.analysis.embeddings import embedding_cosines, summarize_cosines, window_batches
from hf_partial_attention.analysis.selection import OBJECTIVES, select_pattern

from ..store import write_study

__all__ = ["compare_objectives", "objectives_markdown", "model_outputs"]


@torch.no_grad()
def model_outputs(model, batches, progress: bool, desc: str):
    """Mean-pooled embeddings ``(N, hidden)`` and every layer's hidden states, batch by batch."""
    pooled, layers = [], []
    for batch in tqdm(batches, desc=desc, disable=not progress, leave=False):
        out = model(**batch, output_hidden_states=True)
        mask = batch["attention_mask"].unsqueeze(-1).to(out.last_hidden_state.dtype)  # (b, T, 1)
        pooled.append((out.last_hidden_state * mask).sum(1) / mask.sum(1).clamp_min(1.0))
        layers.append(out.hidden_states[1:])  # one (b, T, hidden) per layer
    return torch.cat(pooled), [torch.cat([b[i] for b in layers]) for i in range(len(layers[0]))]


def compare_objectives(analysis_dir: str, ks=(8, 16), objectives=OBJECTIVES, *, out: str | None = None,
                       max_windows: int | None = None, batch_size: int = 16, progress: bool = True) -> dict:
    """Embedding cosine and per-layer output error of converted models, one per (k, objective).

    Args:
        analysis_dir: a folder written by `workflow.analyze` (covariance and held-out windows).
        ks: exact scores per query. objectives: names of `selection.OBJECTIVES`.
        out: where to write ``objectives.json`` / ``objectives.md`` (nothing written when None).
        max_windows: use at most this many held-out windows.
    """
    from hf_partial_attention.modeling_partial_encoders import partial_from_source

    start = time.perf_counter()
    cov = ScoreCovariance.load(os.path.join(analysis_dir, "covariance.safetensors"))
    held = os.path.join(analysis_dir, "heldout_windows.safetensors")
    if not os.path.isfile(held):
        raise FileNotFoundError(f"{analysis_dir!r} has no held-out windows; run analyze with held-out data.")
    windows = load_file(held)["input_ids"][:max_windows]
    original, _ = load_model_and_tokenizer(cov.metadata["model"], load_tokenizer=False)
    batches = window_batches(windows, batch_size)
    ref_pooled, ref_layers = model_outputs(original, batches, progress, "original")
    rows = []
    for k in sorted(set(ks)):
        for objective in objectives:
            pattern = select_pattern(cov, k, objective=objective)
            model = partial_from_source(original, pattern).eval()
            pooled, layers = model_outputs(model, batches, progress, f"k={k} {objective}")
            cos = summarize_cosines(embedding_cosines(ref_pooled, pooled))
            layer_err = [float((h - r).norm() / r.norm()) for h, r in zip(layers, ref_layers)]
            rows.append({"k": k, "objective": objective, "score_error": pattern.normalized_error,
                         "objective_error": pattern.metadata.get("objective_normalized_error",
                                                                 pattern.normalized_error),
                         "one_minus_cos": 1.0 - cos["mean"], "cos_min": cos["min"], "layer_error": layer_err})
    for row in rows:
        paper = next(r for r in rows if r["k"] == row["k"] and r["objective"] == "paper")
        row["vs_paper"] = row["one_minus_cos"] / paper["one_minus_cos"] if paper["one_minus_cos"] else None
    result: dict[str, Any] = {"model": cov.metadata.get("model_id") or display_name(cov.metadata.get("model", "")),
                              "seq_len": cov.seq_len, "fit_windows": cov.num_sequences,
                              "heldout_windows": int(windows.shape[0]), "rows": rows,
                              "seconds": round(time.perf_counter() - start, 1)}
    if out is not None:
        write_study(out, "objectives", result, objectives_markdown(result))
    return result


def objectives_markdown(result: dict) -> str:
    """The comparison as a Markdown table, with the verdict against the goal (halve 1 − cos at the same k)."""
    layers = len(result["rows"][0]["layer_error"])
    head = ["k", "objective", "score error (paper's)", "own objective error", "1 − cos (embeddings)",
            "vs paper", "min cos", *[f"layer {i} rel. error" for i in range(layers)]]
    lines = [f"# Selection objectives on `{result['model']}`: what reaches the output", "",
             f"n = {result['seq_len']}; P and R fitted on {result['fit_windows']} windows, measured on "
             f"{result['heldout_windows']} held-out windows (other documents); converted without retraining. "
             "Score errors are predicted from the covariance (normalised); 1 − cos is the mean over windows of one "
             "minus the cosine between mean-pooled embeddings of the converted and the original model; layer errors "
             "are ‖h' − h‖ / ‖h‖ of each layer's hidden states. 'vs paper' = 1 − cos over the paper objective's "
             "at the same k (goal: ≤ 0.5).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        vs = "–" if r["vs_paper"] is None else f"{r['vs_paper']:.2f}"
        cells = [str(r["k"]), r["objective"], f"{r['score_error']:.4f}", f"{r['objective_error']:.4f}",
                 f"{r['one_minus_cos']:.4f}", vs, f"{r['cos_min']:.4f}", *[f"{e:.4f}" for e in r["layer_error"]]]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for k in sorted({r["k"] for r in result["rows"]}):
        best = min((r for r in result["rows"] if r["k"] == k), key=lambda r: r["one_minus_cos"])
        met = best["vs_paper"] is not None and best["vs_paper"] <= 0.5
        ratio = "" if best["vs_paper"] is None else format(best["vs_paper"], ".2f") + "× "
        lines.append(f"- k = {k}: lowest embedding error with `{best['objective']}` "
                     f"(1 − cos {best['one_minus_cos']:.4f}, {ratio}the paper objective's); "
                     f"goal of halving it {'met' if met else 'not met'}.")
    lines.append(f"\nWall time {result['seconds']} s. Reproduce: `make objectives` (runs `make demo` first if "
                 "needed, then `python -m experiments objectives runs/demo --k 8 16 --out results/objectives`).\n")
    return "\n".join(lines)

"""One P and R for all layers and heads (the paper's), one per layer, or one per (layer, head), at the same k (the same
QKᵀ cost), judged by what the converted model outputs on held-out text.

For each k and selection objective: the three granularities fitted on one analysis (``analyze --granularity head``:
a covariance per (layer, head), which sums to the per-layer and the pooled ones), the original model converted
with each (``from_source``, R fixed, no retraining; the paper's partial layers: all but the last), then on the
analysis' held-out windows: the mean over windows of 1 − cos between mean-pooled embeddings of the converted and the
original model, the Spearman correlation of all pairwise cosine similarities between windows (converted vs
original), and each layer's relative hidden-state error ``‖h' − h‖ / ‖h‖``. `python -m experiments granularity OUT`
runs the analysis into OUT (kept: a second run reuses it) and writes ``granularity.json`` / ``granularity.md``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from safetensors.torch import load_file

from hf_partial_attention import partial_class_for
from hf_partial_attention.analysis.collect import display_name, load_model_and_tokenizer
from hf_partial_attention.analysis.corpus import default_texts
from hf_partial_attention.analysis.covariance import ScoreCovariance
from hf_partial_attention.analysis.defaults import resolve_model
from hf_partial_attention.analysis.embeddings import embedding_cosines, window_batches
from hf_partial_attention.analysis.selection import select_pattern
from hf_partial_attention.analysis.workflow import COVARIANCE_FILE, HELDOUT_FILE, analyze
from hf_partial_attention.pattern_layers import LayerPatterns

from ..lengths.study import spearman
from ..objectives.study import model_outputs
from ..store import write_study

__all__ = ["run_granularity", "granularity_markdown", "GRANULARITIES", "GOAL_ONE_MINUS_COS"]

GRANULARITIES = ("pooled", "layer", "head")
GOAL_ONE_MINUS_COS = 0.050  # issue 34's goal for converted MiniLM at k = 16 on held-out windows


def _pairwise(embeddings: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of every pair of windows (upper triangle, flattened)."""
    unit = torch.nn.functional.normalize(embeddings.double(), dim=-1)
    sims = unit @ unit.T  # (N, N)
    i, j = torch.triu_indices(len(unit), len(unit), offset=1)
    return sims[i, j]


def patterns_for(cov: ScoreCovariance, k: int, objective: str, granularity: str):
    """P and R at ``granularity`` from one per-head covariance (the per-layer and pooled ones are its sums)."""
    if granularity == "pooled":
        return select_pattern(cov, k, objective=objective)
    if granularity == "layer":
        return LayerPatterns({layer: select_pattern(cov, k, layer=layer, objective=objective) for layer in cov.layers})
    return LayerPatterns({layer: [select_pattern(cov, k, layer=layer, head=head, objective=objective)
                                  for head in cov.heads] for layer in cov.layers})


def run_granularity(out: str, model: str | None = None, *, ks=(16,), objectives=("paper", "fisher"),
                    granularities=GRANULARITIES, seq_len: int = 128, fit_sequences: int = 320,
                    heldout_sequences: int = 64, batch_size: int = 16, results: str | None = None,
                    progress: bool = True) -> dict:
    """Analyse ``model`` (default: the demo's MiniLM, on CPython's pydoc text, the demo's windows) per head into
    ``out`` unless it holds that analysis, then compare the granularities (module docstring); writes
    ``granularity.json`` / ``.md`` into ``results`` (default ``out``)."""
    start = time.perf_counter()
    path, model_id = resolve_model(model)
    cov_path = os.path.join(out, COVARIANCE_FILE)
    if not (os.path.isfile(cov_path) and ScoreCovariance.load(cov_path).granularity == "head"):
        analyze(path, default_texts(), out, seq_len=seq_len, max_sequences=fit_sequences,
                heldout_sequences=heldout_sequences, model_id=model_id, granularity="head",
                batch_size=batch_size // 2 or 1, progress=progress)
    cov = ScoreCovariance.load(cov_path)
    windows = load_file(os.path.join(out, HELDOUT_FILE))["input_ids"]
    original, _ = load_model_and_tokenizer(cov.metadata["model"], load_tokenizer=False)
    original = original.eval()
    batches = window_batches(windows, batch_size)
    ref_pooled, ref_layers = model_outputs(original, batches, progress, "original")
    ref_pairs = _pairwise(ref_pooled)
    cls = partial_class_for(original.config.model_type)
    rows = []
    for k in sorted(set(ks)):
        for objective in objectives:
            for granularity in granularities:
                t = time.perf_counter()
                pattern = patterns_for(cov, k, objective, granularity)
                converted = cls.from_source(original, pattern, reconstruction="fixed").eval()
                pooled, layers = model_outputs(converted, batches, progress, f"k={k} {objective} {granularity}")
                cos = embedding_cosines(ref_pooled, pooled)
                rows.append({"k": k, "objective": objective, "granularity": granularity,
                             "one_minus_cos": float(1 - cos.mean()), "cos_min": float(cos.min()),
                             "spearman": spearman(ref_pairs, _pairwise(pooled)),
                             "layer_error": [float((h - r).norm() / r.norm()) for h, r in zip(layers, ref_layers)],
                             "seconds": round(time.perf_counter() - t, 1)})
    result: dict[str, Any] = {
        "model": cov.metadata.get("model_id") or display_name(cov.metadata.get("model", "")),
        "seq_len": cov.seq_len, "fit_windows": cov.num_sequences, "heldout_windows": int(windows.shape[0]),
        "partial_layers": list(converted.config.partial_layers), "rows": rows,
        "seconds": round(time.perf_counter() - start, 1)}
    dest = results or out
    write_study(dest, "granularity", result, granularity_markdown(result))
    return result


def granularity_markdown(result: dict) -> str:
    """The comparison as a Markdown table, with issue 34's goal (1 − cos ≤ 0.050 at k = 16) stated as met or not."""
    layers = len(result["rows"][0]["layer_error"])
    head = ["k", "objective", "P and R", "1 − cos (embeddings)", "min cos", "pairwise Spearman",
            *[f"layer {i} rel. error" for i in range(layers)]]
    lines = [f"# One P and R, per layer or per head, on `{result['model']}`", "",
             f"n = {result['seq_len']}; P and R fitted on {result['fit_windows']} windows of CPython's pydoc text "
             f"(one covariance per (layer, head), summed for the per-layer and pooled fits), measured on "
             f"{result['heldout_windows']} held-out windows (other documents); converted without retraining, R "
             f"fixed, partial layers {result['partial_layers']}; the same k (QKᵀ cost) for every granularity. "
             "1 − cos: mean over windows of one minus the cosine between mean-pooled embeddings of the converted and "
             "the original model; pairwise Spearman: rank correlation of the cosine similarities of all pairs of "
             "windows, converted vs original; layer errors: ‖h' − h‖ / ‖h‖ of each layer's hidden states.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        cells = [str(r["k"]), r["objective"], r["granularity"], f"{r['one_minus_cos']:.4f}", f"{r['cos_min']:.4f}",
                 f"{r['spearman']:.4f}", *[f"{e:.4f}" for e in r["layer_error"]]]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for k in sorted({r["k"] for r in result["rows"]}):
        best = min((r for r in result["rows"] if r["k"] == k), key=lambda r: r["one_minus_cos"])
        pooled = [r for r in result["rows"] if r["k"] == k and r["objective"] == best["objective"]
                  and r["granularity"] == "pooled"]
        vs = f", {best['one_minus_cos'] / pooled[0]['one_minus_cos']:.2f}× the pooled fit's" if pooled else ""
        met = "met" if best["one_minus_cos"] <= GOAL_ONE_MINUS_COS else "not met"
        goal = f"; issue 34's goal (≤ {GOAL_ONE_MINUS_COS:.3f}) {met}" if k == 16 else ""
        lines.append(f"- k = {k}: lowest embedding error per `{best['granularity']}` with `{best['objective']}` "
                     f"(1 − cos {best['one_minus_cos']:.4f}{vs}, pairwise Spearman {best['spearman']:.4f}){goal}.")
    lines.append(f"\nWall time {result['seconds']} s. Reproduce: `make granularity` (`python -m experiments "
                 "granularity runs/granularity --results results/granularity`).\n")
    return "\n".join(lines)

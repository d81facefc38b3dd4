"""P and R pooled, per layer or per head, one k or a k per layer at the same saving, with length buckets, on held-out
inputs of real lengths (issue 34): ``python -m experiments granularity-lengths`` (`make granularity-lengths`) ->
``results/granularity_lengths/`` (granularity_lengths.json, .md).

Each arm is the original model (MiniLM by default) converted without retraining at k's saving in every bucket,
measured as the lengths study measures; `run_granularity_lengths` says how it fits, the arms and what it measures.
Issue 34's goals are stated as met or not.
"""

from __future__ import annotations

import logging
import os
import re
import time

from hf_partial_attention.analysis.derive import derive_budget
from hf_partial_attention.analysis.collect import load_model_and_tokenizer
from hf_partial_attention.analysis.corpus import default_texts
from hf_partial_attention.analysis.covariance import ScoreCovariance
from hf_partial_attention.analysis.defaults import resolve_model
from hf_partial_attention.analysis.lengths import analyze_lengths, bucket_covariance_files
from hf_partial_attention.analysis.workflow import COVARIANCE_FILE, analyze
from hf_partial_attention.cost import distribution_saving
from hf_partial_attention.modeling_partial_encoders import partial_class_for
from hf_partial_attention.pattern_buckets import PatternBuckets
from hf_partial_attention.pattern_layers import LayerPatterns

from .study import patterns_for
from ..lengths.study import LENGTHS, fit_documents, held_out_inputs
from ..lengths.recover import measure
from ..store import write_study

logger = logging.getLogger(__name__)

__all__ = ["run_granularity_lengths", "render", "arm_patterns_file", "parse_arm", "exact_layers_of", "ARMS",
           "GOALS"]

ARMS = (("pooled", "uniform"), ("layer", "uniform"), ("layer", "budget"), ("head", "uniform"), ("head", "budget"))
# An arm beside them: ``exact<l>`` (``exact1and4``), a budget with those layers exact (``derive --exact-layers``).
_EXACT = re.compile(r"exact(\d+(?:and\d+)*)")


def parse_arm(text: str) -> tuple[str, str]:
    """``"head_budget"`` -> ``("head", "budget")``: pooled_uniform, layer or head with uniform, budget or exact<l>
    (``head_exact4``); a ValueError naming the forms otherwise."""
    granularity, _, choice = text.partition("_")
    if (granularity, choice) not in ARMS and not (granularity in ("layer", "head") and _EXACT.fullmatch(choice)):
        raise ValueError(f"arm {text!r}: use one of {[f'{g}_{c}' for g, c in ARMS]} or layer_/head_exact<l> (a budget "
                         "with layer l exact, e.g. head_exact4).")
    return granularity, choice


def exact_layers_of(choice: str) -> list[int]:
    """The layers an ``exact<l>`` arm leaves exact (none for uniform / budget)."""
    match = _EXACT.fullmatch(choice)
    return [int(layer) for layer in match[1].split("and")] if match else []
# Issue 34's goals for converted MiniLM at k = 16's saving: 1 − cos on held-out windows, Spearman in every bucket.
GOALS = {"windows_one_minus_cos": 0.050, "spearman_every_bucket": 0.95}


def _fit(out: str, model_path: str, model_id: str, lengths, fit_inputs, fit_windows: int, batch_size: int,
         progress: bool) -> dict:
    """Per-head bucket covariances (collected into ``out/buckets`` unless there already), the longest bucket's merged
    with ``fit_windows`` windows of n tokens of the demo text (``out/windows``): ``{b: path}`` in ``out/fit``."""
    folder = os.path.join(out, "buckets")
    paths = bucket_covariance_files(folder)
    # a bucket with no fit input is skipped by analyze_lengths (its inputs run the next bucket up)
    if (not paths or max(paths) != lengths[-1] or not set(paths) <= set(lengths)
            or any(ScoreCovariance.load(p).granularity != "head" for p in paths.values())):
        analyze_lengths(model_path, fit_documents(), folder, lengths=list(lengths), kind="sentence",
                        model_id=model_id, max_inputs=fit_inputs, progress=progress, batch_size=batch_size,
                        granularity="head")
        paths = bucket_covariance_files(folder)
    fit = os.path.join(out, "fit")
    os.makedirs(fit, exist_ok=True)
    n = max(paths)
    for b, path in paths.items():
        cov = ScoreCovariance.load(path)
        if b == n and fit_windows:
            windows = os.path.join(out, "windows")
            if not os.path.isfile(os.path.join(windows, COVARIANCE_FILE)):
                analyze(model_path, default_texts(), windows, seq_len=n, max_sequences=fit_windows,
                        heldout_sequences=0, granularity="head", model_id=model_id, batch_size=batch_size // 2 or 1,
                        progress=progress)
            cov = cov.merge(ScoreCovariance.load(os.path.join(windows, COVARIANCE_FILE)))
        cov.save(os.path.join(fit, os.path.basename(path)))
    return bucket_covariance_files(fit)


def arm_patterns_file(fit: str, granularity: str, choice: str, k: int, objective: str) -> str:
    """Where an arm's bucket file lies in the fit folder: ``derive --saving k<k>``'s files for the per-layer and
    per-head arms, the pooled arm's beside them."""
    name = (f"pooled_k{k}" if granularity == "pooled" else f"{granularity}_savingk{k}_{choice}")
    return os.path.join(fit, "patterns", f"buckets_per_query_{objective}_{name}.safetensors")


def _pooled_buckets(paths: dict, lengths, k: int, objective: str) -> PatternBuckets:
    """One P and R per bucket for every layer and head (the pooled covariance: the per-head ones summed)."""
    partial = [b for b in lengths if min(k, b) < b]
    fitted = {b: patterns_for(ScoreCovariance.load(paths[b]), k, objective, "pooled") for b in partial}
    return PatternBuckets(fitted, [b for b in lengths if b not in partial], k=k)


def _layer_savings(pattern, layers, lengths, d_head: int, real) -> dict:
    """The QKᵀ saving of ``layers`` over inputs of lengths ``real``: each layer's at its own ks, their mean."""
    ks = {layer: (pattern.layer_lengths_k(layer) if layer in pattern.layers else list(lengths))  # absent: exact
          if isinstance(pattern, LayerPatterns) else pattern.lengths_k for layer in layers}
    per_layer = {str(layer): distribution_saving(lengths, ks[layer], d_head, real) for layer in layers}
    return {"heldout": sum(per_layer.values()) / len(per_layer), "per_layer": per_layer,
            "ks": {str(layer): ks[layer] for layer in layers}}


def _arm_patterns(arms, paths: dict, lengths: tuple[int, ...], k: int, objective: str) -> tuple[dict, dict]:
    """Each arm's P and R (``{(granularity, choice): buckets}``): the pooled buckets (saved for
    `granularity-recover`), or the per-layer / per-head uniform or budgeted sets of `derive_budget`, whose results
    (``{name: result}``) come back beside them."""
    sets, budgets = {}, {}
    for granularity, choice in arms:
        if granularity == "pooled":
            if choice != "uniform":
                raise ValueError(f"arm ({granularity!r}, {choice!r}): one pooled P has one k; use 'uniform'.")
            sets[(granularity, choice)] = _pooled_buckets(paths, lengths, k, objective)
            # saved for `granularity-recover` (the per-layer and per-head arms' files are derive's)
            pooled_file = arm_patterns_file(os.path.dirname(paths[lengths[-1]]), granularity, choice, k, objective)
            os.makedirs(os.path.dirname(pooled_file), exist_ok=True)
            sets[(granularity, choice)].save(pooled_file)
            continue
        fit_dir = os.path.dirname(paths[lengths[-1]])
        if exact := exact_layers_of(choice):  # its own budget file, beside the plain one
            budgets[f"{granularity} {choice}"] = derive_budget(fit_dir, f"k{k}", granularity=granularity,
                                                               objective=objective, exact_layers=exact)
            sets[(granularity, choice)] = LayerPatterns.load(budgets[f"{granularity} {choice}"]["budget_path"])
            continue
        if granularity not in budgets:
            budgets[granularity] = derive_budget(fit_dir, f"k{k}", granularity=granularity, objective=objective)
        sets[(granularity, choice)] = LayerPatterns.load(budgets[granularity][f"{choice}_path"])
    return sets, budgets


def run_granularity_lengths(out: str = "runs/granularity_lengths", results: str = "results/granularity_lengths",
                            model: str | None = None, *, k: int = 16, lengths=LENGTHS, objective: str = "fisher",
                            arms=ARMS, fit_inputs: int | None = None, fit_windows: int = 320, max_heldout: int = 600,
                            heldout_windows: int = 64, batch_size: int = 16, progress: bool = True,
                            command: str | None = None) -> dict:
    """Fit, derive, convert and measure every arm; writes ``results``/granularity_lengths.json and .md and returns
    the result.

    Fit (as the lengths study, `experiments.lengths`): the demo text's sentences and paragraphs at their own lengths,
    one covariance per (layer, head) per bucket (``analyze_lengths(granularity="head")``; the per-layer and pooled
    ones are its sums); the longest bucket's also holds ``fit_windows`` windows of n tokens of the same text (the
    demo's 320; its sentences and paragraphs of 65–128 tokens are few for n = 128 positions per head). Arms, each the
    original MiniLM converted without retraining (R fixed; the paper's partial layers: all but the last), greedy with
    the Fisher objective, at k = 16's saving in every bucket:

    - ``pooled`` / ``layer`` / ``head`` × ``uniform``: k = min(16, b) in every layer (pooled: one P and R for every
      layer, the buckets of `make recover`);
    - ``layer`` / ``head`` × ``budget``: a k per layer (`analysis.derive.derive_budget`, ``derive --saving k16``),
      costing no more than the uniform k in every bucket.

    Measured as the lengths study measures (`recover.measure`): per kind of input (sentences, paragraphs,
    adjacent-sentence pairs, 128-token windows of them) and bucket, the mean 1 − cos of the mean-pooled embeddings to
    the original model's and the Spearman correlation of all pairwise cosine similarities with the original's; the
    QKᵀ saving over the held-out inputs' own lengths."""
    start, steps = time.perf_counter(), {}
    model_path, model_id = resolve_model(model)
    lengths = tuple(sorted(int(b) for b in lengths))
    t = time.perf_counter()
    paths = _fit(out, model_path, model_id, lengths, fit_inputs, fit_windows, batch_size, progress)
    lengths = tuple(sorted(paths))
    steps["analyses (per head)"] = time.perf_counter() - t
    t = time.perf_counter()
    sets, budgets = _arm_patterns(arms, paths, lengths, k, objective)
    steps["P and R (uniform and budgeted)"] = time.perf_counter() - t

    t = time.perf_counter()
    original, tok = load_model_and_tokenizer(model_path)
    original.eval()
    tokens, windows = held_out_inputs(tok, max_heldout, heldout_windows, lengths[-1])
    partial_class = partial_class_for(original.config.model_type)  # the source's architecture (MiniLM: BERT)
    models = {f"{g} {c}": partial_class.from_source(original, pattern, reconstruction="fixed").eval()
              for (g, c), pattern in sets.items()}
    # the budget's layers: every arm's partial layers and the exact arms' exact ones (their savings count them as 0)
    partial_layers = sorted({layer for m in models.values() for layer in m.config.partial_layers}
                            | {layer for _, choice in sets for layer in exact_layers_of(choice)})
    rows = measure(original, models, {**tokens, "windows": windows}, lengths, batch_size)
    steps["held-out measurement"] = time.perf_counter() - t
    d_head = original.config.hidden_size // original.config.num_attention_heads
    real = [int(x) for tk in tokens.values() for x in tk.lengths]
    saving = {f"{g} {c}": _layer_savings(pattern, partial_layers, list(lengths), d_head, real)
              for (g, c), pattern in sets.items()}
    result = {"command": command or "python -m experiments granularity-lengths", "model": model_id, "k": k,
              "lengths": list(lengths), "objective": objective, "partial_layers": partial_layers,
              "arms": [f"{g} {c}" for g, c in arms], "rows": rows, "saving": saving, "head_dim": d_head,
              "budget": {g: {key: b[key] for key in ("buckets", "layers_k", "budget_layers")}
                         for g, b in budgets.items()},
              "fit_inputs": {str(b): ScoreCovariance.load(p).num_sequences for b, p in paths.items()},
              "fit_windows": fit_windows,
              "heldout_inputs": {kind: len(tk.lengths) for kind, tk in tokens.items()},
              "heldout_windows": len(windows.lengths),
              "seconds": {name: round(s, 1) for name, s in steps.items()}}
    result["goals"] = goals(result)
    result["total_seconds"] = round(time.perf_counter() - start, 1)
    write_study(results, "granularity_lengths", result, render(result))
    return result


def goals(result: dict) -> dict:
    """Per arm: 1 − cos on the held-out windows, the lowest Spearman over every bucket of every kind, and whether each
    of `GOALS` is met."""
    out = {}
    for arm in result["arms"]:
        rows = [r for r in result["rows"] if r["model"] == arm and r["bucket"] != "all"]
        windows = [r for r in rows if r["inputs_kind"] == "windows"]
        cos = windows[0]["one_minus_cos"] if windows else None
        spearmen = [(r["spearman"], r["inputs_kind"], r["bucket"]) for r in rows if r["spearman"] is not None]
        worst = min(spearmen)
        out[arm] = {"windows_one_minus_cos": cos, "worst_spearman": worst[0], "worst_spearman_at": list(worst[1:]),
                    "windows_met": cos is not None and cos <= GOALS["windows_one_minus_cos"],
                    "spearman_met": worst[0] >= GOALS["spearman_every_bucket"]}
    return out


def render(result: dict) -> str:
    """The study as Markdown: setup, one table per metric (rows: kind and bucket; columns: arms), the savings, the
    budgeted ks and the goals."""
    arms = result["arms"]
    lines = [f"# P and R pooled, per layer or per head, one k or a k per layer, with length buckets, on "
             f"`{result['model']}`", "",
             f"Command (wall time {result['total_seconds'] / 60:.1f} min: "
             + ", ".join(f"{name} {s:.0f} s" for name, s in result["seconds"].items()) + "):", "", "```",
             result["command"], "```", "",
             f"- Buckets {result['lengths']}, P and R per bucket (greedy, objective `{result['objective']}`) fitted on "
             "the demo text's sentences and paragraphs at their own lengths (inputs per bucket "
             f"{result['fit_inputs']}; the longest bucket's includes {result['fit_windows']} windows of n tokens of "
             "the same text), one covariance per (layer, head) summed for the per-layer and pooled fits; "
             f"converted without retraining, R fixed, partial layers {result['partial_layers']}.",
             f"- `uniform`: k = min({result['k']}, b) in every layer; `budget`: a k per layer from `derive --saving "
             f"k{result['k']}` (the greedy's error curves; never more QKᵀ work than `uniform` in any bucket).",
             f"- Held out: installed packages' descriptions (documents the fit never saw), {result['heldout_inputs']} "
             "inputs, and 128-token windows of them. 1 − cos: mean over inputs of 1 − cosine of the mean-pooled "
             "embeddings to the original model's; Spearman: of all pairwise cosine similarities with the original's.",
             ""]
    by = {(r["model"], r["inputs_kind"], r["bucket"]): r for r in result["rows"]}
    keys = sorted({(r["inputs_kind"], r["bucket"]) for r in result["rows"]},
                  key=lambda kb: (kb[0], 10**9 if kb[1] == "all" else kb[1]))
    for metric, title, fmt in (("one_minus_cos", "1 − cos", "{:.4f}"), ("spearman", "pairwise Spearman", "{:.3f}")):
        lines += [f"## {title}", "", "| inputs | bucket | inputs | " + " | ".join(arms) + " |",
                  "|---|---:|---:|" + "---:|" * len(arms)]
        for kind, b in keys:
            cells = []
            for arm in arms:
                value = by.get((arm, kind, b), {}).get(metric)
                cells.append("–" if value is None else fmt.format(value))
            count = len(by[(arms[0], kind, b)]["lengths"])
            lines.append(f"| {kind} | {b} | {count} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## QKᵀ saving over the held-out inputs' own lengths (partial layers' mean)", "",
              "| arm | saving | k per partial layer (each bucket) |", "|---|---:|---|"]
    for arm in arms:
        s = result["saving"][arm]
        ks = "; ".join(f"{layer}: {k}" for layer, k in s["ks"].items())
        lines.append(f"| {arm} | {100 * s['heldout']:.1f} % | {ks} |")
    lines += ["", f"## Goals (issue 34, converted, at k = {result['k']}'s saving)", ""]
    for arm, g in result["goals"].items():
        cos = g["windows_one_minus_cos"]
        lines.append(f"- `{arm}`: windows 1 − cos {cos:.4f} (≤ {GOALS['windows_one_minus_cos']}: "
                     f"**{'met' if g['windows_met'] else 'not met'}**); lowest Spearman {g['worst_spearman']:.3f} at "
                     f"{g['worst_spearman_at'][0]} b = {g['worst_spearman_at'][1]} (≥ {GOALS['spearman_every_bucket']} "
                     f"in every bucket: **{'met' if g['spearman_met'] else 'not met'}**).")
    lines.append("")
    return "\n".join(lines)

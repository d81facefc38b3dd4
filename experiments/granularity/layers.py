"""Where the per-head conversion's error comes from, layer by layer, and a k per layer calibrated by it:
``python -m experiments granularity-layers`` (`make granularity-layers`) -> ``results/granularity_layers/``.

`derive --saving` spends the budget where each layer's objective (the greedy's Fisher-weighted residual of the
scores) falls most, as if a unit of objective cost the same embedding error in every layer. This study measures what
it costs, weights each layer's objective by it, and picks a layer to leave exact; `run_granularity_layers` says how.
"""

from __future__ import annotations

import os
import time

import torch

from hf_partial_attention.analysis.budget import objective_curve
from hf_partial_attention.analysis.derive import derive_budget
from hf_partial_attention.analysis.collect import load_model_and_tokenizer
from hf_partial_attention.analysis.corpus import default_texts, make_windows
from hf_partial_attention.analysis.covariance import ScoreCovariance
from hf_partial_attention.analysis.defaults import resolve_model
from hf_partial_attention.analysis.lengths import bucket_covariance_files
from hf_partial_attention.modeling_partial_encoders import partial_from_source
from hf_partial_attention.pattern_layers import LayerPatterns

from .lengths import arm_patterns_file
from ..lengths.study import held_out_inputs
from ..lengths.recover import measure
from ..store import write_study

__all__ = ["run_granularity_layers", "render", "load_per_head_run"]


def _embeddings(model, ids: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Mean-pooled last hidden states of full windows ``(W, n)`` -> ``(W, hidden)``."""
    with torch.no_grad():
        return torch.cat([model(input_ids=ids[i:i + batch_size]).last_hidden_state.mean(1)
                          for i in range(0, len(ids), batch_size)])


def _error(reference: torch.Tensor, got: torch.Tensor) -> float:
    return float((1 - torch.nn.functional.cosine_similarity(reference, got, dim=-1)).mean())


def load_per_head_run(lengths_run: str, model: str | None, k: int, objective: str):
    """``(file, LayerPatterns, original model in eval mode, tokenizer, model id)``: the one-k per-head buckets of a
    granularity-lengths run and the model they were fitted on; a ValueError naming the command when they are missing."""
    uniform_file = arm_patterns_file(os.path.join(lengths_run, "fit"), "head", "uniform", k, objective)
    if not os.path.isfile(uniform_file):
        raise ValueError(f"no per-head buckets at {uniform_file}; run `python -m experiments granularity-lengths --out "
                         f"{lengths_run} --k {k}` first (or pass --lengths-run).")
    model_path, model_id = resolve_model(model)
    original, tok = load_model_and_tokenizer(model_path)
    return uniform_file, LayerPatterns.load(uniform_file), original.eval(), tok, model_id


def _layer_k(path: str, layer: int) -> list[int] | str:
    """The ks per bucket of ``layer`` in the buckets file ``path``, or ``"exact"`` where the file leaves it exact."""
    patterns = LayerPatterns.load(path)
    return patterns.layer_lengths_k(layer) if layer in patterns.layers else "exact"


def _arm_files(fit: str, uniform_file: str, calibrated_file: str, exact_layer: int, k: int,
               objective: str) -> tuple[dict[str, str], str | None]:
    """The arms' bucket files (uniform, budget, calibrated, and ``exact_layer`` left exact at the same saving), and
    why the last is missing (None: it is there)."""
    arms = {"head uniform": uniform_file, "head budget": arm_patterns_file(fit, "head", "budget", k, objective),
            "head calibrated": calibrated_file}
    try:
        arms[f"head exact{exact_layer}"] = derive_budget(fit, f"k{k}", granularity="head", objective=objective,
                                                         exact_layers=[exact_layer])["budget_path"]
        exact_skipped = None
    except ValueError as error:  # a saving too high to pay for a dense layer (small k at short lengths)
        exact_skipped = str(error)
    return arms, exact_skipped


def run_granularity_layers(lengths_run: str = "runs/granularity_lengths", results: str = "results/granularity_layers",
                           model: str | None = None, *, k: int = 16, objective: str = "fisher",
                           calibration_windows: int = 64, max_heldout: int = 600, heldout_windows: int = 64,
                           batch_size: int = 16, command: str | None = None) -> dict:
    """The ablation, the weights and the calibrated budget; writes ``results``/granularity_layers.json and .md and
    returns the result.

    It starts from the per-head P and R of a `granularity-lengths` run (its fit covariances and its one-k buckets).
    With every budget layer partial, then with each layer alone partial, then with each layer left exact and the
    others partial, it measures 1 − cos of the mean-pooled embeddings to the original model's on the calibration
    windows and on held-out windows. The calibration windows are n-token windows of the demo text, the fit's own
    text. The held-out windows are the installed packages' descriptions.

    Weights, from the calibration windows only: ``w_l`` is the error layer l adds in context (all partial minus l
    exact) over its objective at the one k in the longest bucket. The budget spread with them
    (`derive_budget(layer_weights=w, name="calibrated")`, at the same saving) is measured on every held-out kind and
    bucket beside the one k and the plain budget, as `granularity-lengths` measures its arms.

    An exact layer, also chosen on the calibration windows only: the layer whose being left exact lowers the error
    most is left exact at the same saving (`derive_budget(exact_layers=[l])`, ``derive --saving k16 --exact-layers
    l``): it pays dense attention's cost out of the budget, and the other layers share the rest by the plain
    allocation."""
    start = time.perf_counter()
    fit = os.path.join(lengths_run, "fit")
    uniform_file, uniform, original, tok, model_id = load_per_head_run(lengths_run, model, k, objective)
    layers = sorted(uniform.layers)[:-1]  # the budget layers (derive's default: all but the last)
    paths = bucket_covariance_files(fit)
    n = max(paths)
    tokens, held = held_out_inputs(tok, max_heldout, heldout_windows, n)
    windows = {"calibration": make_windows(tok, default_texts(), n, calibration_windows),  # (W, n)
               "held_out": held.input_ids}  # (W, n)
    reference = {name: _embeddings(original, ids, batch_size) for name, ids in windows.items()}

    def errors(partial_layers) -> dict:
        converted = partial_from_source(original, uniform, reconstruction="fixed",
                                               partial_layers=list(partial_layers)).eval()
        return {name: _error(reference[name], _embeddings(converted, ids, batch_size)) for name, ids in windows.items()}

    everything = errors(layers)
    alone = {str(layer): errors([layer]) for layer in layers}
    exact = {str(layer): errors([x for x in layers if x != layer]) for layer in layers}
    cov = ScoreCovariance.load(paths[n])
    k_n = uniform.layer_lengths_k(layers[0])[-1]
    objective_at_k = {layer: float(sum(objective_curve(cov, k_n, layer=layer, head=head, objective=objective)[k_n - 1]
                                       for head in cov.heads)) for layer in layers}
    added = {layer: everything["calibration"] - exact[str(layer)]["calibration"] for layer in layers}
    if any(value <= 0 for value in added.values()):
        raise ValueError(f"a layer left exact did not lower the calibration error ({added}); more calibration windows "
                         "(--calibration-windows) give a steadier measurement.")
    weights = {layer: added[layer] / objective_at_k[layer] for layer in layers}
    budget = derive_budget(fit, f"k{k}", granularity="head", objective=objective, layer_weights=weights,
                           name="calibrated")
    # the layer whose exactness lowers the calibration error most, left exact at the same saving (its dense cost
    # taken out of the budget, the rest spread over the other layers)
    exact_layer = min(layers, key=lambda layer: exact[str(layer)]["calibration"])
    arms, exact_skipped = _arm_files(fit, uniform_file, budget["budget_path"], exact_layer, k, objective)
    models = {arm: partial_from_source(original, LayerPatterns.load(path), reconstruction="fixed").eval()
              for arm, path in arms.items()}
    rows = measure(original, models, {**tokens, "windows": held}, sorted(paths), batch_size)
    result = {"command": command or "python -m experiments granularity-layers", "model": model_id, "k": k,
              "objective": objective, "lengths": sorted(paths), "layers": layers, "k_longest": k_n,
              "calibration_windows": len(windows["calibration"]), "heldout_windows": len(windows["held_out"]),
              "ablation": {"all": everything, "alone": alone, "exact": exact},
              "objective_at_k": {str(layer): v for layer, v in objective_at_k.items()},
              "weights": {str(layer): w for layer, w in weights.items()},
              "exact_layer": exact_layer, "exact_skipped": exact_skipped,
              "layers_k": {arm: {str(layer): _layer_k(path, layer) for layer in layers} for arm, path in arms.items()},
              "arms": list(arms), "rows": rows}
    result["total_seconds"] = round(time.perf_counter() - start, 1)
    write_study(results, "granularity_layers", result, render(result))
    return result


def render(result: dict) -> str:
    """Markdown: the ablation table, the weights and ks, and the three arms' held-out errors."""
    lines = [f"# Where the per-head error comes from, layer by layer, on `{result['model']}`", "",
             f"Command (wall time {result['total_seconds'] / 60:.1f} min):", "", "```", result["command"], "```", "",
             f"- P and R per head, one k (k = {result['k']} in bucket {result['lengths'][-1]}, objective "
             f"`{result['objective']}`), from the granularity-lengths run; converted without retraining, R fixed.",
             f"- 1 − cos of the mean-pooled embeddings to the original model's on {result['calibration_windows']} "
             "calibration windows (the demo text, the fit's own) and on "
             f"{result['heldout_windows']} held-out windows (installed packages' descriptions).", "",
             "## Ablation", "", "| partial layers | calibration 1 − cos | held-out 1 − cos |", "|---|---:|---:|"]
    ablation = result["ablation"]
    lines.append(f"| all of {result['layers']} | {ablation['all']['calibration']:.4f} | "
                 f"{ablation['all']['held_out']:.4f} |")
    for layer in map(str, result["layers"]):
        lines.append(f"| only {layer} | {ablation['alone'][layer]['calibration']:.4f} | "
                     f"{ablation['alone'][layer]['held_out']:.4f} |")
    for layer in map(str, result["layers"]):
        lines.append(f"| all but {layer} | {ablation['exact'][layer]['calibration']:.4f} | "
                     f"{ablation['exact'][layer]['held_out']:.4f} |")
    summed = sum(ablation["alone"][str(layer)]["calibration"] for layer in result["layers"])
    more = [layer for layer in map(str, result["layers"]) if ablation["all"]["calibration"]
            - ablation["exact"][layer]["calibration"] > ablation["alone"][layer]["calibration"]]
    lines += ["", f"On the calibration windows the layers alone add {summed:.4f} in all, and together they give "
              f"{ablation['all']['calibration']:.4f}. Layers whose error adds more with the others partial than alone "
              f"(all minus 'all but l' above 'only l'): {', '.join(more) or 'none'}. " + (
                  f"Left exact in `head exact{result['exact_layer']}` (its dense cost out of the same budget, the "
                  f"other layers sharing the rest): layer {result['exact_layer']}, whose 'all but' error on the "
                  "calibration windows is the lowest." if not result["exact_skipped"] else
                  f"No exact-layer arm: {result['exact_skipped']}"),
              "", "## Weights and each layer's k per bucket", "",
              "| layer | objective at k | weight (error added in context / objective) | " +
              " | ".join(f"k {arm}" for arm in result["arms"]) + " |", "|---|---:|---:|" + "---|" * len(result["arms"])]
    for layer in map(str, result["layers"]):
        lines.append(f"| {layer} | {result['objective_at_k'][layer]:.1f} | {result['weights'][layer]:.3g} | " +
                     " | ".join(str(result["layers_k"][arm][layer]) for arm in result["arms"]) + " |")
    by = {(r["model"], r["inputs_kind"], r["bucket"]): r for r in result["rows"]}
    keys = sorted({(r["inputs_kind"], r["bucket"]) for r in result["rows"]},
                  key=lambda kb: (kb[0], 10**9 if kb[1] == "all" else kb[1]))
    for metric, title, fmt in (("one_minus_cos", "1 − cos, held out", "{:.4f}"),
                               ("spearman", "pairwise Spearman, held out", "{:.3f}")):
        lines += ["", f"## {title}", "", "| inputs | bucket | " + " | ".join(result["arms"]) + " |",
                  "|---|---:|" + "---:|" * len(result["arms"])]
        for kind, b in keys:
            cells = [fmt.format(by[(arm, kind, b)][metric]) if by.get((arm, kind, b), {}).get(metric) is not None
                     else "–" for arm in result["arms"]]
            lines.append(f"| {kind} | {b} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)

"""`derive_layers`: P and R per layer (``derive --granularity layer``), each fitted on its own layer's covariance,
with held-out errors per layer and pooled beside the pooled pattern's at the same k (the same QKᵀ cost).

Needs an analysis collected with ``analyze --granularity layer`` (or ``head``): one covariance per layer. Writes
``patterns/<scope>[_<family>][_<objective>]_layer_k<k>.safetensors`` (`pattern_layers.LayerPatterns`, every layer of
the model; `convert` installs the partial layers' own) and the ``derive_layer_<tag>`` section of ``results.json``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from safetensors.torch import load_file

from ..pattern_layers import LayerPatterns
from .collect import load_model_and_tokenizer, run_windows
from .covariance import ScoreCovariance
from .evaluation import ErrorMeter, LinearReconstructor
from .fit_checks import fit_size_warning
from .selection import select_patterns

logger = logging.getLogger(__name__)

__all__ = ["derive_layers", "LayerErrorMeter"]


class LayerErrorMeter:
    """Held-out errors of per-layer reconstructors: layer l's scores through layer l's methods; the pooled error
    of a set is its summed squared error over the pooled held-out variance, the denominator of a pooled pattern's
    error (`ErrorMeter`), so that the two compare.

    Args:
        methods: ``{layer: {name: reconstructor}}``; every layer the same names.
        pooled_methods: ``{name: reconstructor}`` run on every layer's scores (the pooled pattern).
    """

    def __init__(self, methods: dict[int, dict], pooled_methods: dict | None = None):
        self.per_layer = {layer: ErrorMeter(m) for layer, m in methods.items()}
        self.pooled = ErrorMeter(pooled_methods or {})

    def sink(self, layer: int, scores) -> None:
        """Capture sink signature (``capture_scores``)."""
        if layer in self.per_layer:
            self.per_layer[layer].update(scores, layer)
        self.pooled.update(scores, layer)

    def results(self) -> dict[str, Any]:
        """``{"layers": {layer: {name: normalized error}}, "pooled": {name: pooled normalized error}}`` (the pooled
        patterns' own errors included under their names)."""
        layers = {layer: {name: r["normalized_error"] for name, r in meter.results().items()}
                  for layer, meter in self.per_layer.items()}
        names = next(iter(self.per_layer.values())).methods if self.per_layer else {}
        count, tv = self.pooled.count, self.pooled.total_variance
        pooled = {name: sum(m.sse[name] for m in self.per_layer.values()) / count / tv for name in names}
        pooled.update({name: r["normalized_error"] for name, r in self.pooled.results().items()})
        return {"layers": layers, "pooled": pooled}


def derive_layers(out: str, ks, *, family: str = "per_query", objective: str = "paper", centered: bool | None = None,
                  evaluate: bool = True, batch_size: int = 8, progress: bool = True) -> dict:
    """Per-layer patterns for each k of ``ks`` from ``out/covariance.safetensors`` (collected per layer), saved as
    `LayerPatterns`; with held-out windows present, each layer's held-out error and the pooled one, beside the pooled
    pattern of the same k (fitted on the same covariance, summed over layers).

    Raises ValueError for a covariance collected pooled (naming ``analyze --granularity layer``) and for a k
    outside [1, n]."""
    from .workflow import COVARIANCE_FILE, HELDOUT_FILE, load_results, update_results

    start = time.perf_counter()
    cov = ScoreCovariance.load(os.path.join(out, COVARIANCE_FILE))
    if cov.granularity == "pooled":
        raise ValueError(f"{out!r} holds a covariance pooled over layers: P and R per layer need each layer's own; "
                         "rerun `hf-partial-attention analyze --granularity layer` into it.")
    n = cov.seq_len
    ks = sorted({int(k) for k in ks})
    if not ks or not 1 <= ks[0] <= ks[-1] <= n:
        raise ValueError(f"k must be in [1, {n}] at n={n} (the seq_len of {out!r}), got {ks}; pass --k values in "
                         "that range.")
    if warning := fit_size_warning(cov.num_sequences, n):
        logger.warning(warning)
    tag = "_".join(["per_query", *([family] if family != "per_query" else []),
                    *([objective] if objective != "paper" else []), "layer"])
    kwargs = dict(family=family, centered=centered, objective=objective)
    per_layer = {layer: select_patterns(cov, ks, "per_query", layer=layer, **kwargs) for layer in cov.layers}
    pooled = select_patterns(cov, ks, "per_query", **kwargs)
    os.makedirs(os.path.join(out, "patterns"), exist_ok=True)
    source = cov.metadata.get("model")
    rows, sets = [], {}
    for k in ks:
        layers = LayerPatterns({layer: fitted[k] for layer, fitted in per_layer.items()},
                               metadata={"source_model": source, "granularity": "layer", "objective": objective,
                                         "family": family})
        sets[k] = layers
        variances = {layer: cov.total_variance(layer=layer, centered=centered) for layer in per_layer}
        predicted = {layer: per_layer[layer][k].normalized_error for layer in per_layer}
        rows.append({"k": k, "path": os.path.join(out, "patterns", f"{tag}_k{k}.safetensors"),
                     "predicted_per_layer": predicted,
                     # Σ_l ε_l Tr(C_l) / Σ_l Tr(C_l): the error the set leaves, over all layers' variance
                     "predicted": sum(predicted[l] * variances[l] for l in per_layer) / sum(variances.values()),
                     "predicted_pooled_pattern": pooled[k].normalized_error})
    result: dict[str, Any] = {"granularity": "layer", "seq_len": n, "layers": list(per_layer), "patterns": rows}
    held_path = os.path.join(out, HELDOUT_FILE)
    if evaluate and os.path.isfile(held_path):
        windows = load_file(held_path)["input_ids"]
        model, _ = load_model_and_tokenizer(cov.metadata["model"], load_tokenizer=False)
        meter = LayerErrorMeter({layer: {f"k={k}": LinearReconstructor(sets[k][layer][n]) for k in ks}
                                 for layer in per_layer},
                                {f"pooled k={k}": LinearReconstructor(pooled[k]) for k in ks})
        run_windows(model, windows, meter.sink, batch_size=batch_size, progress=progress, desc="held-out")
        measured = meter.results()
        result["heldout_windows"] = int(windows.shape[0])
        for row in rows:
            k = row["k"]
            row["heldout_per_layer"] = {layer: errors[f"k={k}"] for layer, errors in measured["layers"].items()}
            row["heldout"] = measured["pooled"][f"k={k}"]
            row["heldout_pooled_pattern"] = measured["pooled"][f"pooled k={k}"]
            for layer, patterns in sets[k].layers.items():
                patterns[n].metadata.update(heldout_normalized_error=float(row["heldout_per_layer"][layer]),
                                            heldout_windows=int(windows.shape[0]))
            sets[k].metadata.update(heldout_normalized_error=float(row["heldout"]),
                                    heldout_pooled_pattern=float(row["heldout_pooled_pattern"]))
    for row in rows:
        sets[row["k"]].save(row["path"])
    result["seconds"] = round(time.perf_counter() - start, 1)
    previous = load_results(out).get(f"derive_{tag}")
    if previous:  # keep the rows of earlier ks whose files remain
        kept = [r for r in previous.get("patterns", []) if r["k"] not in ks and os.path.isfile(r["path"])]
        result["patterns"] = sorted([*kept, *rows], key=lambda r: r["k"])
    update_results(out, f"derive_{tag}", result)
    return result

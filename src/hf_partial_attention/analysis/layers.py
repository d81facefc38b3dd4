"""P and R per layer or per (layer, head) (``derive --granularity layer|head``; `derive.derive_layers`,
`derive.derive_layer_buckets`): each group fitted on its own covariance, and `record_groups` measures held-out errors
per group and pooled beside the pooled pattern's at the same k (the same QKᵀ cost).

Needs an analysis collected with ``analyze --granularity layer`` (per layer; or ``head``) or ``head`` (per head):
one covariance per group. Writes ``patterns/<scope>[_<family>][_<objective>]_<granularity>_k<k>.safetensors``
(`pattern_layers.LayerPatterns`, every layer of the model; `convert` installs the partial layers' own) and the
``derive_<tag>`` section of ``results.json`` (length buckets: ``patterns/buckets_<tag>_k<k>`` and ``lengths_<tag>``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from safetensors.torch import load_file

from .collect import load_model_and_tokenizer, run_windows
from .derive_files import keep_previous_rows
from .folder import HELDOUT_FILE, load_results
from .evaluation import ErrorMeter, LinearReconstructor

logger = logging.getLogger(__name__)

__all__ = ["record_groups", "LayerErrorMeter"]


class LayerErrorMeter:
    """Held-out errors of per-group reconstructors: the scores of layer l (head h) through that group's methods; the
    pooled error of a set is its summed squared error over the pooled held-out variance, the denominator of a pooled
    pattern's error (`ErrorMeter`), so that the two compare.

    Args:
        methods: ``{(layer, head or None): {name: reconstructor}}``; every group the same names.
        pooled_methods: ``{name: reconstructor}`` run on every layer's scores (the pooled pattern).
    """

    def __init__(self, methods: dict[tuple, dict], pooled_methods: dict | None = None):
        self.groups = {group: ErrorMeter(m) for group, m in methods.items()}
        self.per_head = any(head is not None for _, head in self.groups)
        self.pooled = ErrorMeter(pooled_methods or {})

    def sink(self, layer: int, scores) -> None:
        """Capture sink signature (``capture_scores``): scores ``(B, H, n, n)``."""
        if self.per_head:
            for head in range(scores.shape[1]):
                if (layer, head) in self.groups:
                    self.groups[(layer, head)].update(scores[:, head], layer)
        elif (layer, None) in self.groups:
            self.groups[(layer, None)].update(scores, layer)
        self.pooled.update(scores, layer)

    def results(self) -> dict[str, Any]:
        """``{"groups": {(layer, head): {name: normalized error}}, "pooled": {name: pooled normalized error}}`` (the
        pooled patterns' own errors included under their names)."""
        groups = {group: {name: r["normalized_error"] for name, r in meter.results().items()}
                  for group, meter in self.groups.items()}
        names = next(iter(self.groups.values())).methods if self.groups else {}
        count, tv = self.pooled.count, self.pooled.total_variance
        pooled = {name: sum(m.sse[name] for m in self.groups.values()) / count / tv for name in names}
        pooled.update({name: r["normalized_error"] for name, r in self.pooled.results().items()})
        return {"groups": groups, "pooled": pooled}


def _name(layer: int, head: int | None) -> str:
    return str(layer) if head is None else f"{layer}.{head}"


def _weighted(errors: dict, variances: dict) -> float:
    """Σ_g ε_g Tr(C_g) / Σ_g Tr(C_g): the error a set leaves, over all its groups' variance."""
    return sum(errors[g] * variances[g] for g in errors) / sum(variances.values())


def record_groups(out: str, source, groups: list[tuple], sets, built: dict, fitted: dict, req, path) -> dict:
    """The files and section of P and R per layer or head (`derive.derive_patterns`): on the fixed windows
    (``derive_<tag>``) each set's predicted error per group and weighted over them, beside the pooled pattern's, and
    the held-out errors on the analysis' windows; on length buckets (``lengths_<tag>``) the same per bucket, held out
    at real positions."""
    tag, ks, n = req.tag, [s.k for s in sets], source.n
    if source.kind == "buckets":
        lengths = source.lengths
        variances = {b: {g: cov.total_variance(layer=g[0], head=g[1], centered=req.centered) for g in groups}
                     for b, cov in source.covs.items()}
        rows = []
        for s in sets:
            predicted = {}
            for b in lengths:
                k = s.k_of(b, None)
                predicted[str(b)] = 0.0 if k >= b else _weighted(
                    {g: fitted[(b, *g)][k].normalized_error for g in groups}, variances[b])
            rows.append({"k": s.k, "path": path(s), "lengths_k": [s.k_of(b, None) for b in lengths],
                         "predicted_per_bucket": predicted, "_sets": built[s.name]})
        if req.evaluate:
            _bucket_heldout(out, source.meta, lengths, groups, rows, fitted, req.batch_size or 16, req.progress)
        for row in rows:
            row.pop("_sets").save(row["path"])  # after the held-out errors went into each group's metadata
        section = f"lengths_{tag}"
        result = {"granularity": req.granularity, "lengths": lengths, "patterns": rows}
    else:
        cov = source.covs[n]
        variances = {g: cov.total_variance(layer=g[0], head=g[1], centered=req.centered) for g in groups}
        rows = []
        for s in sets:
            predicted = {g: fitted[(n, *g)][s.k].normalized_error for g in groups}
            rows.append({"k": s.k, "path": path(s), "predicted_per_group": {_name(*g): e for g, e in predicted.items()},
                         "predicted": _weighted(predicted, variances),
                         "predicted_pooled_pattern": fitted[(n, None, None)][s.k].normalized_error})
        result = {"granularity": req.granularity, "seq_len": n, "layers": list(cov.layers),
                  "heads": None if req.granularity == "layer" else list(cov.heads), "patterns": rows}
        held_path = os.path.join(out, HELDOUT_FILE)
        if req.evaluate and os.path.isfile(held_path):
            result["heldout_windows"] = _window_heldout(cov, groups, sets, built, fitted, rows, held_path,
                                                        req.batch_size or 8, req.progress)
        for s in sets:
            built[s.name].save(path(s))
        section = f"derive_{tag}"
    result["patterns"] = keep_previous_rows(load_results(out).get(section), rows, ks)
    result["_section"] = section
    return result


def _window_heldout(cov, groups, sets, built, fitted, rows, held_path, batch_size, progress) -> int:
    """Held-out errors on the analysis' windows of each set (per group, pooled) and of the pooled pattern of its k,
    into ``rows`` and each group's pattern metadata; returns the number of windows."""
    n = cov.seq_len
    windows = load_file(held_path)["input_ids"]
    model, _ = load_model_and_tokenizer(cov.metadata["model"], load_tokenizer=False)
    meter = LayerErrorMeter({g: {f"k={s.k}": LinearReconstructor(built[s.name].group(*g)[n]) for s in sets}
                             for g in groups},
                            {f"pooled k={s.k}": LinearReconstructor(fitted[(n, None, None)][s.k]) for s in sets})
    run_windows(model, windows, meter.sink, batch_size=batch_size, progress=progress, desc="held-out")
    measured = meter.results()
    for s, row in zip(sets, rows):
        k = s.k
        row["heldout_per_group"] = {_name(*g): errors[f"k={k}"] for g, errors in measured["groups"].items()}
        row["heldout"] = measured["pooled"][f"k={k}"]
        row["heldout_pooled_pattern"] = measured["pooled"][f"pooled k={k}"]
        for g in groups:
            built[s.name].group(*g)[n].metadata.update(
                heldout_normalized_error=float(row["heldout_per_group"][_name(*g)]),
                heldout_windows=int(windows.shape[0]))
        built[s.name].metadata.update(heldout_normalized_error=float(row["heldout"]),
                                      heldout_pooled_pattern=float(row["heldout_pooled_pattern"]))
    return int(windows.shape[0])


def _bucket_heldout(out, meta, lengths, groups, rows, fitted, batch_size, progress) -> None:
    """Held-out errors at real positions of each row's set (``row["_sets"]``), bucket by bucket on the analysis'
    held-out inputs: per group (``heldout_per_group[b]``), pooled (``heldout[b]``: Σ over groups of the squared error
    over the pooled held-out variance) and the pooled pattern's of the same k (``heldout_pooled_pattern[b]``)."""
    import torch

    from ..pattern_buckets import bucket_for
    from .length_eval import PaddedPattern, RealPositionMeter, run_inputs
    from .lengths import load_heldout_inputs

    held = load_heldout_inputs(out)
    if held is None or not len(held):
        return
    model, _ = load_model_and_tokenizer(meta["model"], load_tokenizer=False)
    fits = held.lengths <= lengths[-1]
    bucket = torch.tensor([bucket_for(lengths, int(t)) if ok else -1
                           for t, ok in zip(held.lengths.tolist(), fits.tolist())], dtype=torch.long)
    for row in rows:
        row.update(heldout={}, heldout_pooled_pattern={}, heldout_per_group={})
    for b in lengths:
        index = torch.nonzero(bucket == b).flatten()
        partial = [row for row in rows if row["lengths_k"][lengths.index(b)] < b]
        if not len(index) or not partial:
            continue
        meters = {(row["k"], group): RealPositionMeter(b, {"set": PaddedPattern(row["_sets"].group(*group)[b])})
                  for row in partial for group in groups}
        pooled_meter = RealPositionMeter(b, {row["k"]: PaddedPattern(fitted[(b, None, None)][row["lengths_k"][
            lengths.index(b)]]) for row in partial})  # the pooled pattern of the same k

        def sink(layer, scores, lens):
            pooled_meter.update(layer, scores, lens)
            for (k, (g_layer, head)), meter in meters.items():
                if g_layer == layer:
                    meter.update(layer, scores if head is None else scores[:, head:head + 1], lens)

        run_inputs(model, held, index, b, sink, batch_size, progress=progress, desc=f"held-out b={b}")
        total, own = pooled_meter.total_variance, pooled_meter.results()
        for row in partial:
            k = row["k"]
            row["heldout_per_group"][str(b)] = {_name(*g): meters[(k, g)].results()["set"] for g in groups}
            for g in groups:
                row["_sets"].group(*g)[b].metadata.update(heldout_normalized_error=row["heldout_per_group"][str(b)][
                    _name(*g)], heldout_inputs=len(index))
            row["heldout"][str(b)] = sum(meters[(k, g)].sse["set"] for g in groups) / total
            row["heldout_pooled_pattern"][str(b)] = own[k]
            row.setdefault("heldout_inputs", {})[str(b)] = len(index)

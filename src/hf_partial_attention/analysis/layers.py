"""`derive_layers`: P and R per layer or per (layer, head) (``derive --granularity layer|head``), each fitted on its
own group's covariance, with held-out errors per group and pooled beside the pooled pattern's at the same k (the
same QKᵀ cost).

Needs an analysis collected with ``analyze --granularity layer`` (per layer; or ``head``) or ``head`` (per head):
one covariance per group. Writes ``patterns/<scope>[_<family>][_<objective>]_<granularity>_k<k>.safetensors``
(`pattern_layers.LayerPatterns`, every layer of the model; `convert` installs the partial layers' own) and the
``derive_<tag>`` section of ``results.json``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from safetensors.torch import load_file

from ..cost import memory_warning
from ..pattern_layers import LayerPatterns
from .collect import load_model_and_tokenizer, run_windows
from .covariance import ScoreCovariance
from .derive_files import bucket_k_suffix, check_granularity, check_ks, file_tag, keep_previous_rows
from .evaluation import ErrorMeter, LinearReconstructor
from .fit_checks import fit_size_warning
from .selection import select_patterns

logger = logging.getLogger(__name__)

__all__ = ["derive_layers", "derive_layer_buckets", "LayerErrorMeter"]


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


def derive_layers(out: str, ks, *, granularity: str = "layer", family: str = "per_query", objective: str = "paper",
                  centered: bool | None = None, evaluate: bool = True, batch_size: int = 8,
                  progress: bool = True) -> dict:
    """Patterns per layer (``granularity="layer"``) or per (layer, head) (``"head"``) for each k of ``ks`` from
    ``out/covariance.safetensors`` (collected per layer or head), saved as `LayerPatterns`; with held-out windows
    present, each group's held-out error and the pooled one, beside the pooled pattern of the same k (fitted on the
    same covariance, summed over groups).

    Raises ValueError for a covariance collected more coarsely than ``granularity`` (naming ``analyze
    --granularity``) and for a k outside [1, n]."""
    from .workflow import COVARIANCE_FILE, HELDOUT_FILE, load_results, update_results

    start = time.perf_counter()
    if granularity not in ("layer", "head"):
        raise ValueError(f"granularity must be 'layer' or 'head', got {granularity!r}.")
    cov = ScoreCovariance.load(os.path.join(out, COVARIANCE_FILE))
    check_granularity([cov], granularity, out, f"P and R per {granularity}")
    n = cov.seq_len
    ks = check_ks(ks, n, out, f"n = {n}, the seq_len")
    if warning := fit_size_warning(cov.num_sequences, n):
        logger.warning(warning)
    heads_per_layer = len(cov.heads) if granularity == "head" else None
    for k in ks:  # stated before anything is fitted: the file holds every layer's R
        if warning := memory_warning(n, k, len(cov.layers), heads_per_layer):
            logger.warning("k=%d: %s", k, warning)
    tag = file_tag("per_query", family, objective, granularity)
    kwargs = dict(family=family, centered=centered, objective=objective)
    heads = cov.heads if granularity == "head" else [None]
    fitted = {(layer, head): select_patterns(cov, ks, "per_query", layer=layer, head=head, **kwargs)
              for layer in cov.layers for head in heads}
    pooled = select_patterns(cov, ks, "per_query", **kwargs)
    os.makedirs(os.path.join(out, "patterns"), exist_ok=True)
    source = cov.metadata.get("model")
    rows, sets = [], {}
    variances = {group: cov.total_variance(layer=group[0], head=group[1], centered=centered) for group in fitted}
    for k in ks:
        layers = LayerPatterns({layer: fitted[(layer, None)][k] if granularity == "layer" else
                                [fitted[(layer, head)][k] for head in heads] for layer in cov.layers},
                               metadata={"source_model": source, "granularity": granularity, "objective": objective,
                                         "family": family})
        sets[k] = layers
        predicted = {group: fitted[group][k].normalized_error for group in fitted}
        rows.append({"k": k, "path": os.path.join(out, "patterns", f"{tag}_k{k}.safetensors"),
                     "predicted_per_group": {_name(*g): e for g, e in predicted.items()},
                     # Σ_g ε_g Tr(C_g) / Σ_g Tr(C_g): the error the set leaves, over all groups' variance
                     "predicted": sum(predicted[g] * variances[g] for g in fitted) / sum(variances.values()),
                     "predicted_pooled_pattern": pooled[k].normalized_error})
    result: dict[str, Any] = {"granularity": granularity, "seq_len": n, "layers": list(cov.layers),
                              "heads": None if granularity == "layer" else list(heads), "patterns": rows}
    held_path = os.path.join(out, HELDOUT_FILE)
    if evaluate and os.path.isfile(held_path):
        windows = load_file(held_path)["input_ids"]
        model, _ = load_model_and_tokenizer(cov.metadata["model"], load_tokenizer=False)
        meter = LayerErrorMeter({group: {f"k={k}": LinearReconstructor(sets[k].group(*group)[n]) for k in ks}
                                 for group in fitted},
                                {f"pooled k={k}": LinearReconstructor(pooled[k]) for k in ks})
        run_windows(model, windows, meter.sink, batch_size=batch_size, progress=progress, desc="held-out")
        measured = meter.results()
        result["heldout_windows"] = int(windows.shape[0])
        for row in rows:
            k = row["k"]
            row["heldout_per_group"] = {_name(*g): errors[f"k={k}"] for g, errors in measured["groups"].items()}
            row["heldout"] = measured["pooled"][f"k={k}"]
            row["heldout_pooled_pattern"] = measured["pooled"][f"pooled k={k}"]
            for group in fitted:
                sets[k].group(*group)[n].metadata.update(
                    heldout_normalized_error=float(row["heldout_per_group"][_name(*group)]),
                    heldout_windows=int(windows.shape[0]))
            sets[k].metadata.update(heldout_normalized_error=float(row["heldout"]),
                                    heldout_pooled_pattern=float(row["heldout_pooled_pattern"]))
    for row in rows:
        sets[row["k"]].save(row["path"])
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["patterns"] = keep_previous_rows(load_results(out).get(f"derive_{tag}"), rows, ks)
    update_results(out, f"derive_{tag}", result)
    return result


def derive_layer_buckets(out: str, ks, *, granularity: str = "layer", family: str = "per_query",
                         objective: str = "paper", centered: bool | None = None,
                         bucket_k: dict[int, int] | None = None, evaluate: bool = True, batch_size: int = 16,
                         progress: bool = True) -> dict:
    """Length buckets per layer or per (layer, head): for each k, every group's P and R of every bucket b (k_b < b;
    the others run exactly) from that bucket's covariance (``analyze --inputs ... --granularity layer|head``), saved
    as `LayerPatterns` of `PatternBuckets` in ``patterns/buckets_<tag>_k<k>.safetensors``; ``predicted`` errors per
    bucket (the groups' variance-weighted mean) and, with the analysis' held-out inputs (``evaluate``), each bucket's
    held-out error at real positions per group and pooled, beside the pooled pattern's of the same k, go into the
    ``lengths_<tag>`` section of ``results.json``."""
    from .lengths import bucket_covariance_files
    from .workflow import load_results, update_results
    from ..pattern_buckets import PatternBuckets

    start = time.perf_counter()
    covs = {b: ScoreCovariance.load(p) for b, p in bucket_covariance_files(out).items()}
    if not covs:
        raise ValueError(f"{out!r} holds no covariance_len*.safetensors; run `analyze --inputs ...` into it first.")
    check_granularity(covs.values(), granularity, out, f"P and R per {granularity}", inputs=True)
    lengths, n = list(covs), max(covs)
    bucket_k = {int(b): int(k) for b, k in (bucket_k or {}).items()}
    ks = check_ks(ks, n - 1, out, f"below the longest bucket, {n},")
    longest = covs[n]
    heads = longest.heads if granularity == "head" else [None]
    groups = [(layer, head) for layer in longest.layers for head in heads]
    tag = file_tag("per_query", family, objective, granularity)
    meta = longest.metadata
    rows = []
    os.makedirs(os.path.join(out, "patterns"), exist_ok=True)
    for k in ks:
        k_of = {b: bucket_k.get(b, k) if b != n else k for b in lengths}
        fitted = {(b, group): select_patterns(covs[b], [k_of[b]], "per_query", layer=group[0], head=group[1],
                                              family=family, centered=centered, objective=objective)[k_of[b]]
                  for b in lengths if k_of[b] < b for group in groups}
        exact = [b for b in lengths if k_of[b] >= b]

        def buckets(group):
            return PatternBuckets({b: fitted[(b, group)] for b in lengths if (b, group) in fitted}, exact, k=k)

        sets = LayerPatterns({layer: buckets((layer, None)) if granularity == "layer" else
                              [buckets((layer, head)) for head in heads] for layer in longest.layers},
                             metadata={"source_model": meta.get("model"), "source_model_id": meta.get("model_id"),
                                       "granularity": granularity, "objective": objective, "family": family,
                                       "lengths": lengths, "kind": meta.get("kind")})
        path = os.path.join(out, "patterns", f"buckets_{tag}_k{k}{bucket_k_suffix(bucket_k)}.safetensors")
        predicted = {}
        for b in lengths:
            if k_of[b] >= b:
                predicted[str(b)] = 0.0
                continue
            var = {g: covs[b].total_variance(layer=g[0], head=g[1], centered=centered) for g in groups}
            predicted[str(b)] = sum(fitted[(b, g)].normalized_error * var[g] for g in groups) / sum(var.values())
        rows.append({"k": k, "path": path, "lengths_k": [k_of[b] for b in lengths], "predicted_per_bucket": predicted,
                     "_sets": sets})
    if evaluate:
        _bucket_heldout(out, longest.metadata, lengths, groups, rows, n, family, centered, objective, covs,
                        batch_size, progress)
    for row in rows:
        row.pop("_sets").save(row["path"])  # after the held-out errors went into each group's metadata
    result = {"granularity": granularity, "lengths": lengths, "patterns": rows,
              "seconds": round(time.perf_counter() - start, 1)}
    result["patterns"] = keep_previous_rows(load_results(out).get(f"lengths_{tag}"), rows, ks)
    update_results(out, f"lengths_{tag}", result)
    return result


def _bucket_heldout(out, meta, lengths, groups, rows, n, family, centered, objective, covs, batch_size,
                    progress) -> None:
    """Held-out errors at real positions of each row's set (``row["_sets"]``), bucket by bucket on the analysis'
    held-out inputs: per group (``heldout_per_group[b]``), pooled (``heldout[b]``: Σ over groups of the squared error
    over the pooled held-out variance) and the pooled pattern's of the same k (``heldout_pooled_pattern[b]``)."""
    import torch

    from ..pattern_buckets import bucket_for
    from .length_eval import PaddedPattern, RealPositionMeter, run_inputs
    from .lengths import _load_heldout

    held = _load_heldout(out)
    if held is None or not len(held):
        return
    model, _ = load_model_and_tokenizer(meta["model"], load_tokenizer=False)
    fits = held.lengths <= n
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
        pooled = {row["k"]: select_patterns(covs[b], [row["lengths_k"][lengths.index(b)]], "per_query", family=family,
                                            centered=centered, objective=objective) for row in partial}
        pooled_meter = RealPositionMeter(b, {k: PaddedPattern(next(iter(p.values()))) for k, p in pooled.items()})

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

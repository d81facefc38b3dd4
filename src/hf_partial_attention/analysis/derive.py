"""`derive`, one pipeline for every combination of its axes.

A `DeriveRequest` carries every axis (one field per flag of ``hf-partial-attention derive``, which maps its flags onto
one); `derive_patterns` runs it (its docstring gives the pipeline's steps and the files written). `derive`,
`derive_lengths`, `derive_layers`, `derive_layer_buckets` and `derive_budget` are that request for one combination,
under the names the studies and the Python API use.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from ..pattern_buckets import PatternBuckets
from ..pattern_layers import LayerPatterns
from .budget import budget_sets, parse_saving
from .derive_files import DeriveRequest, Group, PatternSet, Source
from .derive_plan import fit_groups, load_source, pattern_sets, set_form, source_kinds
from .derive_windows import curve_ks, record_windows
from .folder import update_results
from .layers import record_groups
from .lengths import HELDOUT_INPUTS_FILE, record_buckets
from .selection import select_patterns

__all__ = ["DeriveRequest", "derive_patterns", "derive", "derive_lengths", "derive_layers", "derive_layer_buckets",
           "derive_budget"]


def derive(out: str, ks, scope: str = "per_query", *, evaluate: bool = True, baselines: bool = True,
           centered: bool | None = None, batch_size: int = 8, progress: bool = True, seed: int = 0,
           section: str | None = None, family: str = "per_query", curve_scopes=None,
           objective: str = "paper") -> dict:
    """Greedy patterns for each k from ``out/covariance.safetensors`` (Fig. 8–9), saved as `AttentionPattern`
    files, and, with held-out windows present, their measured error beside the equal-cost baselines (the pooled fixed
    windows' run of `derive.derive_patterns`).

    ``family`` (per_query scope): a constrained greedy whose exact part is a fast dense computation
    (``"columns"``, ``"blocks"``, ``"windows"``, ``"bands"``; see `selection`); files are then named
    ``per_query_<family>_k<k>.safetensors`` and the unconstrained greedy's curve stays as the reference.
    ``objective``: the error the greedy minimises (`selection.OBJECTIVES`; ``"paper"``: eq. 8); another one adds
    ``_<objective>`` to the file names. ``curve_scopes``: the scopes whose error curves (Fig. 9) are drawn; default
    every collected scope.

    The measured held-out error of each pattern goes into its file (``metadata["heldout_normalized_error"]``).
    Rows of an earlier derive into the same section are kept for the ks not derived again whose files remain, so
    the report lists every pattern of the folder. Warnings are logged for a per-query k that saves no work
    (`cost.saving_warning`) and for a covariance fitted on too few windows (`fit_size_warning`)."""
    request = DeriveRequest(ks=tuple(ks), scope=scope, family=family, objective=objective, centered=centered,
                            evaluate=evaluate, baselines=baselines, batch_size=batch_size, progress=progress,
                            seed=seed, section=section, curve_scopes=curve_scopes, inputs="windows")
    return derive_patterns(out, request)[0][1]


def derive_lengths(out: str, ks, *, family: str = "per_query", objective: str = "paper",
                   centered: bool | None = None, evaluate: bool = True, batch_size: int = 16, progress: bool = True,
                   section: str = "derive_lengths", bucket_k: Mapping[int, int] | None = None) -> dict:
    """For each k: P and R of every bucket of ``out`` (b > k; b <= k exact) in ``patterns/buckets_k{k}.safetensors``,
    each bucket's held-out error at real positions in its metadata (``heldout_normalized_error``), and, on the same
    inputs, the zero fill of the fixed-window pattern of n (``patterns/per_query_k{k}.safetensors``, when `derive`
    wrote one into ``out``) and the conditional R (`conditional`) of the n-window and of the bucket covariance (the
    pooled buckets' run of `derive.derive_patterns`).

    ``family``, ``objective``, ``centered``: as in `workflow.derive` (each bucket's greedy). ``bucket_k``: ``{b: k_b}``,
    a bucket (not the longest) that takes k_b instead of each k (``partial_lengths_k``); the files are then named
    ``buckets_k{k}_b{b}k{k_b}``."""
    request = DeriveRequest(ks=tuple(ks), family=family, objective=objective, centered=centered, evaluate=evaluate,
                            batch_size=batch_size, progress=progress, section=section, bucket_k=bucket_k,
                            inputs="buckets")
    return derive_patterns(out, request)[0][1]


def derive_layers(out: str, ks, *, granularity: str = "layer", family: str = "per_query", objective: str = "paper",
                  centered: bool | None = None, evaluate: bool = True, batch_size: int = 8,
                  progress: bool = True) -> dict:
    """Patterns per layer (``granularity="layer"``) or per (layer, head) (``"head"``) for each k of ``ks`` from
    ``out/covariance.safetensors`` (collected per layer or head), saved as `LayerPatterns`; with held-out windows
    present, each group's held-out error and the pooled one, beside the pooled pattern of the same k (fitted on the
    same covariance, summed over groups). The fixed windows' run of `derive.derive_patterns` per layer or head.

    Raises ValueError for a covariance collected more coarsely than ``granularity`` (naming ``analyze
    --granularity``) and for a k outside [1, n]."""
    return _derive_groups(out, ks, "windows", granularity=granularity, family=family, objective=objective,
                          centered=centered, evaluate=evaluate, batch_size=batch_size, progress=progress)


def derive_layer_buckets(out: str, ks, *, granularity: str = "layer", family: str = "per_query",
                         objective: str = "paper", centered: bool | None = None,
                         bucket_k: dict[int, int] | None = None, evaluate: bool = True, batch_size: int = 16,
                         progress: bool = True) -> dict:
    """Length buckets per layer or per (layer, head): for each k, every group's P and R of every bucket b (k_b < b;
    the others run exactly) from that bucket's covariance (``analyze --inputs ... --granularity layer|head``), saved
    as `LayerPatterns` of `PatternBuckets` in ``patterns/buckets_<tag>_k<k>.safetensors``; ``predicted`` errors per
    bucket (the groups' variance-weighted mean) and, with the analysis' held-out inputs (``evaluate``), each bucket's
    held-out error at real positions per group and pooled, beside the pooled pattern's of the same k, go into the
    ``lengths_<tag>`` section of ``results.json``. The buckets' run of `derive.derive_patterns` per layer or head."""
    return _derive_groups(out, ks, "buckets", granularity=granularity, family=family, objective=objective,
                          centered=centered, bucket_k=bucket_k, evaluate=evaluate, batch_size=batch_size,
                          progress=progress)


def _derive_groups(out: str, ks, inputs: str, **fields) -> dict:
    if fields["granularity"] not in ("layer", "head"):
        raise ValueError(f"granularity must be 'layer' or 'head', got {fields['granularity']!r}.")
    return derive_patterns(out, DeriveRequest(ks=tuple(ks), inputs=inputs, **fields))[0][1]


def derive_budget(out: str, saving: str | float, *, granularity: str = "layer", objective: str = "paper",
                  family: str = "per_query", centered: bool | None = None, layers=None,
                  layer_weights: dict[int, float] | None = None, name: str | None = None,
                  exact_layers=None) -> dict[str, Any]:
    """A k per layer at ``saving`` (`budget.parse_saving`) from the analysis in ``out`` (length buckets when it
    holds ``covariance_len*``, else the fixed windows' covariance), beside the uniform k at the same saving (the
    budget's run of `derive.derive_patterns`).

    Args:
        granularity: ``"layer"`` or ``"head"`` (P and R per layer or per head; the heads of a layer share its k).
        layers: the layers the budget is spread over (default: every layer but the last, the default partial
            layers); the others get the uniform k.
        layer_weights: a positive weight per budget layer that multiplies its error curve, e.g. what a unit of the
            layer's objective costs at the model's output (`experiments.granularity.layers` measures it); default
            equal weights.
        name: the budgeted file's suffix (``..._saving<S>_<name>.safetensors``) and its entry in ``results.json``
            (``<S>`` for ``"budget"``, ``<S>_<name>`` otherwise), so that a weighted budget sits beside the plain one;
            default ``"budget"``, or ``"exact<l>"`` (``"exact1and4"``) with ``exact_layers``.
        exact_layers: budget layers left exact: each costs b·d_h per query row of the same budget (dense attention),
            and the rest of the budget is spread over the other budget layers. The file holds no P and R for them and
            records them (``metadata["exact_layers"]``), so that a conversion leaves them out of ``partial_layers``.

    Raises ValueError for the pooled granularity (one P has one k), a covariance collected more coarsely than
    ``granularity`` and an unreachable saving."""
    request = DeriveRequest(saving=parse_saving(saving), granularity=granularity, objective=objective, family=family,
                            centered=centered, budget_layers=layers, layer_weights=layer_weights, name=name,
                            exact_layers=exact_layers)
    return derive_patterns(out, request)[0][1]


def derive_patterns(out: str, request: DeriveRequest) -> list[tuple[str, dict[str, Any]]]:
    """Run ``request`` on the analysis in ``out``: ``[(source, result)]``, one per source run (``"windows"``,
    ``"buckets"``), each result also stored in ``out/results.json`` (and the report re-rendered). Every combination
    of the request's axes is checked before anything is fitted (a ValueError naming the flag to change).

    The pipeline::

        the analysis' covariances: the fixed windows of n, or length buckets          `source_kinds`, `load_source`
        → the groups fitted: pooled, per layer, per (layer, head)                     `fit_groups`
        → the sets written, each a k per (bucket, layer): one k per file, a bucket's  `pattern_sets`
          own k (``bucket_k``), or a budget over layers (``saving``, exact layers)    (`budget.budget_sets`)
        → one greedy run per (bucket, group) for every k the sets need, and R         `_fit`
        → each set's P and R as the object its file holds                             `_build`
        → held-out errors, the files and the results.json section                     `_record`: `derive_windows`,
                                                                                        `lengths`, `layers`, `budget`

    The first three steps are `derive_plan`'s (each checked before anything is fitted).

    The files and report sections are those each combination wrote before it was one pipeline
    (`tests/test_derive_golden.py`): ``patterns/<tag>_k<k>`` (fixed windows: an `AttentionPattern`, or
    `LayerPatterns` per layer or head), ``patterns/buckets_k<k>`` (pooled buckets: `PatternBuckets`),
    ``patterns/buckets_<tag>_k<k>`` (`LayerPatterns` of `PatternBuckets`) and
    ``patterns/[buckets_]<tag>_saving<S>_<name>`` (a budget); the tag is `derive_files.file_tag`."""
    plans = []  # every run planned (and so checked) before the first is fitted
    for kind in source_kinds(out, request):
        if request.saving is not None:  # its allocation runs the greedy: its time counts from here
            plans.append((kind, time.perf_counter(), *budget_sets(out, request)))
            continue
        source = load_source(out, kind)
        groups = fit_groups(out, source, request)
        plans.append((kind, None, source, groups, pattern_sets(out, source, groups, request), None))
    results = []
    for kind, start, source, groups, sets, record in plans:
        start = start or time.perf_counter()
        fitted = _fit(out, source, groups, sets, request, getattr(record, "orders", None))
        built = {s.name: _build(source, groups, s, fitted, request, form=set_form(source, request)) for s in sets}
        result = _record(out, source, groups, sets, built, fitted, request, record)
        result["rank_deficient"] = _rank_deficient(source, groups)
        result["seconds"] = round(time.perf_counter() - start, 1)
        section, stored = result.pop("_section"), result.pop("_stored", None)
        update_results(out, section, result if stored is None else stored)
        results.append((kind, result))
    return results


def _rank_deficient(source: Source, groups: list[Group]) -> list[int]:
    """The window lengths (n, or each bucket b) whose group covariances are rank-deficient: fewer score rows than
    positions, a group's rows being the score matrices it pools (the fitted windows times its layers and heads).
    There P rests on the greedy's tie rule (`greedy.TIE_RTOL`) and R is the minimum-norm solution."""
    return sorted(int(b) for b, cov in source.covs.items() if cov.count / len(groups) < int(b))


def _fit(out: str, source: Source, groups: list[Group], sets: list[PatternSet], req: DeriveRequest,
         orders: dict | None) -> dict[tuple, dict[int, Any]]:
    """``{(b, layer, head): {k: pattern}}``: every k any set needs of each (bucket, group), from one greedy run per
    (bucket, group) (``orders``: runs already made, by the budget's allocation). Beside the groups, the pooled
    pattern at the same k on the same covariance (what a layer's or head's own is compared with: in the report's
    predicted errors on the fixed windows, and in the held-out measure on buckets); on the pooled fixed windows, the
    error curve's ks too (the greedy is nested: one run gives both)."""
    wanted: dict[tuple, set[int]] = {}
    form = set_form(source, req)
    reference = req.saving is None and (form == "pattern" or (
        req.evaluate and os.path.isfile(os.path.join(out, HELDOUT_INPUTS_FILE))))
    for s in sets:
        for b in source.lengths:
            for layer, head in groups:
                if s.layers is not None and layer not in s.layers:
                    continue
                k = s.k_of(b, layer)
                if form == "pattern" or k < b:
                    wanted.setdefault((b, layer, head), set()).add(k)
                    if layer is not None and reference:
                        wanted.setdefault((b, None, None), set()).add(k)
    scope = req.scope
    if source.kind == "windows" and groups == [(None, None)]:
        cov, pooled = source.covs[source.n], wanted[(source.n, None, None)]
        if req.family == "per_query" and req.objective == "paper" and scope in (req.curve_scopes or cov.scopes):
            pooled |= set(curve_ks(scope, cov.seq_len, pooled))
    bucket_meta = (lambda b: {"bucket": b, "num_inputs": source.covs[b].num_sequences}) if (
        source.kind == "buckets" and groups == [(None, None)]) else (lambda b: None)
    return {(b, layer, head): select_patterns(source.covs[b], sorted(ks), scope, layer=layer, head=head,
                                              metadata=bucket_meta(b), order=(orders or {}).get((b, layer, head)),
                                              **req.fit)
            for (b, layer, head), ks in wanted.items()}


def _build(source: Source, groups: list[Group], s: PatternSet, fitted: dict, req: DeriveRequest, form: str):
    """The object of ``s``'s file: an `AttentionPattern` (pooled windows), a `PatternBuckets` (pooled buckets) or
    `LayerPatterns` of either (per layer or head)."""
    n, lengths, meta = source.n, source.lengths, source.meta

    def group(layer, head):
        if form == "pattern":
            return fitted[(n, layer, head)][s.k_of(n, layer)]
        by_bucket = {b: fitted[(b, layer, head)][s.k_of(b, layer)] for b in lengths if s.k_of(b, layer) < b}
        pooled = (layer, head) == (None, None)
        return PatternBuckets(by_bucket, [b for b in lengths if s.k_of(b, layer) >= b and (not pooled or b < n)],
                              k=s.k_of(n, layer), metadata={
                                  "source_model": meta.get("model", ""), "source_model_id": meta.get("model_id", ""),
                                  "kind": meta.get("kind"), "lengths": lengths, "family": req.family,
                                  "objective": req.objective,
                                  "num_inputs": {str(b): c.num_sequences for b, c in source.covs.items()}}
                              if pooled else None)

    if groups == [(None, None)]:
        return group(None, None)
    layers = [layer for layer in dict.fromkeys(layer for layer, _ in groups) if s.layers is None or layer in s.layers]
    heads = [head for layer, head in groups if layer == layers[0]]
    file_meta = {"source_model": meta.get("model"), "granularity": req.granularity, "objective": req.objective,
                 "family": req.family}
    if form == "buckets":
        file_meta = {"source_model": meta.get("model"), "source_model_id": meta.get("model_id"), **file_meta,
                     "lengths": lengths, "kind": meta.get("kind"), **s.meta}
    return LayerPatterns({layer: group(layer, None) if req.granularity == "layer" else
                          [group(layer, head) for head in heads] for layer in layers}, metadata=file_meta)


def _record(out, source, groups, sets, built, fitted, req, record) -> dict[str, Any]:
    """Held-out errors (when asked and the analysis kept held-out data), the files saved after them (each pattern's
    own error goes into its metadata), and the result with its section (``_section``)."""
    os.makedirs(os.path.join(out, "patterns"), exist_ok=True)
    path = lambda s: os.path.join(out, "patterns", f"{s.name}.safetensors")  # noqa: E731
    if record is not None:
        return record.write(out, built, path)
    if groups == [(None, None)]:
        if source.kind == "windows":
            return record_windows(out, source.covs[source.n], sets, built, fitted, req, path)
        return record_buckets(out, source.covs, sets, built, fitted, req, path)
    return record_groups(out, source, groups, sets, built, fitted, req, path)

"""`derive`, one pipeline for every combination of its axes.

    the analysis' covariances: the fixed windows of n, or length buckets            `_kinds`, `_source`
    → the groups fitted: pooled, per layer, per (layer, head)                        `_groups`
    → the sets written, each a k per (bucket, layer): one k per file, a bucket's     `_sets`
      own k (``bucket_k``), or a budget over layers (``saving``, exact layers)       (`budget.budget_sets`)
    → one greedy run per (bucket, group) for every k the sets need, and R            `_fit`
    → each set's P and R as the object its file holds                               `_build`
    → held-out errors, the files and the results.json section                       `_record`: `derive_windows`,
                                                                                     `lengths`, `layers`, `budget`

A `DeriveRequest` carries every axis (one field per flag of ``hf-partial-attention derive``, which maps its flags onto
one); `derive_patterns` runs it. `derive`, `derive_lengths`, `derive_layers`, `derive_layer_buckets` and
`derive_budget` are that request for one combination, under the names the studies and the Python API use. The files
and report sections are those each combination wrote before it was one pipeline (`tests/test_derive_golden.py`):
``patterns/<tag>_k<k>`` (fixed windows: an `AttentionPattern`, or `LayerPatterns` per layer or head),
``patterns/buckets_k<k>`` (pooled buckets: `PatternBuckets`), ``patterns/buckets_<tag>_k<k>`` (`LayerPatterns` of
`PatternBuckets`) and ``patterns/[buckets_]<tag>_saving<S>_<name>`` (a budget); the tag is `derive_files.file_tag`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from ..cost import memory_warning
from ..pattern_buckets import PatternBuckets
from ..pattern_layers import LayerPatterns
from .budget import budget_sets, parse_saving
from .covariance import ScoreCovariance
from .derive_files import DeriveRequest, Group, PatternSet, Source, bucket_k_suffix, check_granularity, check_ks
from .derive_windows import checked_ks, curve_ks, record_windows
from .fit_checks import fit_size_warning
from .folder import COVARIANCE_FILE, update_results
from .layers import record_groups
from .lengths import HELDOUT_INPUTS_FILE, bucket_covariance_files, record_buckets
from .selection import select_patterns

logger = logging.getLogger(__name__)

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
    """A k per layer at ``saving`` (`budget`'s module docstring) from the analysis in ``out`` (length buckets when it
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
    of the request's axes is checked before anything is fitted (a ValueError naming the flag to change)."""
    plans = []  # every run planned (and so checked) before the first is fitted
    for kind in _kinds(out, request):
        if request.saving is not None:  # its allocation runs the greedy: its time counts from here
            plans.append((kind, time.perf_counter(), *budget_sets(out, request)))
            continue
        source = _source(out, kind)
        groups = _groups(out, source, request)
        plans.append((kind, None, source, groups, _sets(out, source, groups, request), None))
    results = []
    for kind, start, source, groups, sets, record in plans:
        start = start or time.perf_counter()
        fitted = _fit(out, source, groups, sets, request, getattr(record, "orders", None))
        built = {s.name: _build(source, groups, s, fitted, request, form=_form(source, request)) for s in sets}
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


def _kinds(out: str, req: DeriveRequest) -> list[str]:
    """The sources to run, in order; the combinations that cannot run refused in one line."""
    if req.inputs not in ("auto", "windows", "buckets"):
        raise ValueError(f"inputs must be 'auto', 'windows' or 'buckets', got {req.inputs!r}.")
    if req.saving is not None and req.inputs != "auto":
        raise ValueError(f"inputs={req.inputs!r} with a saving: a budget fits on the length buckets when the folder "
                         "has them, else on the fixed windows; leave inputs='auto'.")
    if req.inputs != "auto":
        return [req.inputs]
    buckets = bool(bucket_covariance_files(out))
    if req.saving is not None:
        if req.scope != "per_query" or req.bucket_k:
            raise ValueError("--saving chooses every bucket's k per layer itself: drop --scope and --bucket-k.")
        return ["buckets" if buckets else "windows"]
    if req.exact_layers:
        raise ValueError("--exact-layers leaves layers exact out of a --saving budget: give --saving too.")
    if req.bucket_k and not buckets:
        raise ValueError(f"--bucket-k {sorted(req.bucket_k.items())} needs length buckets: {out!r} holds no "
                         "covariance_len*.safetensors (run `analyze --inputs ...` into it first).")
    if buckets and req.scope != "per_query":
        raise ValueError(f"--scope {req.scope} with length buckets: buckets hold per-query patterns; drop --scope or "
                         "derive from a folder without covariance_len*.safetensors.")
    if req.granularity != "pooled":
        if req.scope != "per_query":
            raise ValueError(f"--granularity {req.granularity} fits per-query patterns; drop --scope {req.scope}.")
        return ["buckets" if buckets else "windows"]
    # the fixed windows first: their per_query_k<k> patterns are what the buckets are compared with
    windows = os.path.isfile(os.path.join(out, COVARIANCE_FILE)) or not buckets
    return ["windows"] * windows + ["buckets"] * buckets


def _source(out: str, kind: str) -> Source:
    if kind == "windows":
        cov = ScoreCovariance.load(os.path.join(out, COVARIANCE_FILE))
        return Source(kind, {cov.seq_len: cov})
    files = bucket_covariance_files(out)
    if not files:
        raise ValueError(f"{out!r} holds no covariance_len*.safetensors; run `analyze --inputs ...` into it first.")
    return Source(kind, {b: ScoreCovariance.load(p) for b, p in files.items()})


def _groups(out: str, source: Source, req: DeriveRequest) -> list[Group]:
    """``[(None, None)]`` pooled; every (layer, None) or (layer, head) of the analysis otherwise, checked to have
    been collected that finely."""
    if req.granularity == "pooled":
        if req.family != "per_query" and req.scope != "per_query":
            raise ValueError(f"family={req.family!r} constrains per-query patterns; use scope='per_query'.")
        return [(None, None)]
    if req.granularity not in ("layer", "head"):
        raise ValueError(f"granularity must be 'pooled', 'layer' or 'head', got {req.granularity!r}.")
    check_granularity(source.covs.values(), req.granularity, out, f"P and R per {req.granularity}",
                      inputs=source.kind == "buckets")
    longest = source.covs[source.n]
    heads = longest.heads if req.granularity == "head" else [None]
    return [(layer, head) for layer in longest.layers for head in heads]


def _sets(out: str, source: Source, groups: list[Group], req: DeriveRequest) -> list[PatternSet]:
    """One set per k of ``req.ks``, each k checked against the analysis (warnings logged for a fit on too few
    windows, a k that saves nothing and R that needs much memory)."""
    n, pooled = source.n, groups == [(None, None)]
    if source.kind == "windows":
        if pooled:
            ks = checked_ks(source.covs[n], out, req.ks, req.scope)
        else:
            ks = check_ks(req.ks, n, out, f"n = {n}, the seq_len")
            cov = source.covs[n]
            if warning := fit_size_warning(cov.num_sequences, n):
                logger.warning(warning)
            heads = len(cov.heads) if req.granularity == "head" else None
            for k in ks:  # stated before anything is fitted: the file holds every layer's R
                if warning := memory_warning(n, k, len(cov.layers), heads):
                    logger.warning("k=%d: %s", k, warning)
        return [PatternSet(f"{req.tag}_k{k}", lambda b, layer, k=k: k, k) for k in ks]
    lengths = source.lengths
    bucket_k = {int(b): int(k) for b, k in (req.bucket_k or {}).items()}
    bad = {b: k for b, k in bucket_k.items() if b not in lengths[:-1] or not 1 <= k <= b}
    if bad:
        raise ValueError(f"bucket_k={bad}: each entry must be a bucket of {lengths[:-1]} (not the longest, whose k is "
                         "--k) with its k in [1, b]; give e.g. {64: 24}.")
    if pooled:
        ks = check_ks(req.ks, n, out, "the longest bucket")
        for b, cov in source.covs.items():
            if any(bucket_k.get(b, k) < b for k in ks) and (warning := fit_size_warning(cov.num_sequences, b)):
                logger.warning("Bucket %d: %s", b, warning)
    else:
        ks = check_ks(req.ks, n - 1, out, f"below the longest bucket, {n},")
    stem, suffix = "buckets" if pooled else f"buckets_{req.tag}", bucket_k_suffix(bucket_k)
    return [PatternSet(f"{stem}_k{k}{suffix}", lambda b, layer, k=k: bucket_k.get(b, k), k) for k in ks]


def _form(source: Source, req: DeriveRequest) -> str:
    """What a set's file holds per group: ``"pattern"`` (one k per file on the fixed windows: every k is fitted, k = n
    included) or ``"buckets"`` (a `PatternBuckets`: the buckets with k < b fitted, the others exact)."""
    return "pattern" if source.kind == "windows" and req.saving is None else "buckets"


def _fit(out: str, source: Source, groups: list[Group], sets: list[PatternSet], req: DeriveRequest,
         orders: dict | None) -> dict[tuple, dict[int, Any]]:
    """``{(b, layer, head): {k: pattern}}``: every k any set needs of each (bucket, group), from one greedy run per
    (bucket, group) (``orders``: runs already made, by the budget's allocation). Beside the groups, the pooled
    pattern at the same k on the same covariance (what a layer's or head's own is compared with: in the report's
    predicted errors on the fixed windows, and in the held-out measure on buckets); on the pooled fixed windows, the
    error curve's ks too (the greedy is nested: one run gives both)."""
    wanted: dict[tuple, set[int]] = {}
    form = _form(source, req)
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

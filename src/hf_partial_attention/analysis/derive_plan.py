"""What a derive request runs on, each part checked before anything is fitted (a ValueError naming the flag to
change): the sources (fixed windows of n, length buckets), the groups fitted (pooled, per layer, per head) and the
sets written (a k per bucket and layer), and what each set's file holds. Used by `derive.derive_patterns`.
"""

from __future__ import annotations

import logging
import os

from ..cost import memory_warning
from .covariance import ScoreCovariance
from .derive_files import DeriveRequest, Group, PatternSet, Source, bucket_k_suffix, check_granularity, check_ks
from .derive_windows import checked_ks
from .fit_checks import fit_size_warning
from .folder import COVARIANCE_FILE
from .lengths import bucket_covariance_files

logger = logging.getLogger(__name__)

__all__ = ["source_kinds", "load_source", "fit_groups", "pattern_sets", "set_form"]


def source_kinds(out: str, req: DeriveRequest) -> list[str]:
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


def load_source(out: str, kind: str) -> Source:
    if kind == "windows":
        cov = ScoreCovariance.load(os.path.join(out, COVARIANCE_FILE))
        return Source(kind, {cov.seq_len: cov})
    files = bucket_covariance_files(out)
    if not files:
        raise ValueError(f"{out!r} holds no covariance_len*.safetensors; run `analyze --inputs ...` into it first.")
    return Source(kind, {b: ScoreCovariance.load(p) for b, p in files.items()})


def fit_groups(out: str, source: Source, req: DeriveRequest) -> list[Group]:
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


def pattern_sets(out: str, source: Source, groups: list[Group], req: DeriveRequest) -> list[PatternSet]:
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


def set_form(source: Source, req: DeriveRequest) -> str:
    """What a set's file holds per group: ``"pattern"`` (one k per file on the fixed windows: every k is fitted, k = n
    included) or ``"buckets"`` (a `PatternBuckets`: the buckets with k < b fitted, the others exact)."""
    return "pattern" if source.kind == "windows" and req.saving is None else "buckets"

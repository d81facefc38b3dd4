"""Choosing P and fitting R from a score covariance: the one place patterns are selected.

`select_pattern` turns (covariance, k, family) into an `AttentionPattern`: greedy P (`greedy_select`), then
the optimal R for it (`fit_pattern`, eq. 7) with its predicted error (eq. 8) normalised by Tr(C_a). The greedy
takes an optional sharing constraint, which is how the pattern families are built (`select_patterns` lists them).

The objective the greedy minimises is `score_metrics.objective_metric` (re-exported here).
`error_curve` gives Fig. 9's greedy error against its eigenvector reference and the cost model (`..cost`).
Equal-cost baselines (other choices of P at the same cost) are in `baselines`, built on `fit_pattern`.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from ..attention_common import PatternStructure
from ..cost import SCOPES, dense_cost, score_cost
from ..pattern import AttentionPattern
from ..reconstruction import solve_reconstruction
from ._threads import single_thread
from .covariance import ScoreCovariance
from .greedy import greedy_select
from .score_metrics import OBJECTIVES, objective_metric
from .shared_blocks import fit_shared_blocks, pooled_blocks
from .spectra import eigh_desc, top_eigh

logger = logging.getLogger(__name__)

__all__ = ["FAMILIES", "FAMILY_STRUCTURE", "DEFAULT_BLOCK_ROWS", "OBJECTIVES", "covariance_for", "greedy_select",
           "family_constraint", "window_indices", "objective_metric", "fit_pattern", "select_pattern",
           "select_patterns", "greedy_order", "error_curve"]

FAMILIES = ("per_query", "columns", "blocks", "bands", "windows", "shared_blocks")
# The structure each family's patterns have (what the kernels and `auto` read from a pattern's layout, where it is
# computed from P and R): bands are per-query key sets; windows blocks of k rows sharing keys; shared_blocks rows
# sharing P and R when their blocks hold at least `attention_common.MIN_SHARED_ROWS` rows.
FAMILY_STRUCTURE = {"per_query": PatternStructure.PER_QUERY, "columns": PatternStructure.BLOCKS_SHARING_KEYS,
                    "blocks": PatternStructure.BLOCKS_SHARING_KEYS, "bands": PatternStructure.PER_QUERY,
                    "windows": PatternStructure.BLOCKS_SHARING_KEYS,
                    "shared_blocks": PatternStructure.ROWS_SHARING_P_AND_R}
DEFAULT_BLOCK_ROWS = 32  # rows per block of the blocks and shared_blocks families (at most: gcd(n, 32))


def covariance_for(cov: ScoreCovariance | torch.Tensor, scope: str, centered: bool | None = None,
                   mean: torch.Tensor | None = None, layer: int | None = None, head: int | None = None):
    """``(C, mean or None, centered)``: per_query ``(n, n, n)`` / ``(n, n)``, whole ``(n², n²)`` / ``(n²,)``.

    ``cov`` may be a `ScoreCovariance` or a ready covariance tensor (then ``mean`` is taken as given).
    """
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}.")
    if isinstance(cov, torch.Tensor):
        want = 3 if scope == "per_query" else 2
        if cov.dim() != want:
            raise ValueError(f"a {scope} covariance tensor must have {want} dims, got shape {tuple(cov.shape)}.")
        mean = None if mean is None else mean.to(torch.float64)
        return cov.to(torch.float64), mean, bool(centered if centered is not None else mean is not None)
    if not isinstance(cov, ScoreCovariance):
        raise TypeError(f"cov must be a ScoreCovariance or a tensor, got {type(cov).__name__}.")
    centered = cov.centered if centered is None else centered
    if scope == "per_query":
        return cov.per_query(layer, head, centered), cov.mean_per_query(layer, head), centered
    return cov.whole(layer, head, centered), cov.mean_whole(layer, head), centered


def window_indices(n: int, k: int) -> torch.Tensor:
    """Block-local windows: rows of block b (k rows each) compute the keys of block b exactly. Needs k | n."""
    if n % k:
        raise ValueError(f"family='windows' needs k to divide n; got n={n}, k={k}.")
    return torch.arange(n).view(n // k, k).repeat_interleave(k, 0)  # (n, k)


def _block_rows(n: int, block_rows: int | None) -> int:
    rows = block_rows or math.gcd(n, DEFAULT_BLOCK_ROWS)  # [ours] default: blocks of 32 rows (when 32 divides n)
    if rows < 1 or n % rows:
        raise ValueError(f"block_rows must divide n={n}, got {rows}.")
    return rows


def family_constraint(n: int, family: str, block_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(groups (n,), candidates (n, c))`` for `greedy_select` that make its P belong to ``family``."""
    if family not in FAMILIES or family in ("windows", "shared_blocks"):
        raise ValueError(f"family must be one of {tuple(f for f in FAMILIES if f not in ('windows', 'shared_blocks'))}"
                         f" for a constrained per-row greedy, got {family!r} (windows are fixed: see window_indices; "
                         "shared_blocks run the greedy on pooled blocks: see select_patterns).")
    keys = torch.arange(n).expand(n, n)
    if family == "per_query":
        return torch.arange(n), keys
    if family == "columns":
        return torch.zeros(n, dtype=torch.long), keys
    if family == "blocks":
        return torch.arange(n) // _block_rows(n, block_rows), keys
    offsets = (torch.arange(n)[:, None] + torch.arange(n)[None, :]) % n  # bands: (row, offset) -> key
    return torch.zeros(n, dtype=torch.long), offsets


def fit_pattern(cov, indices: torch.Tensor, scope: str = "per_query", *, centered: bool | None = None,
                bias: bool | None = None, mean: torch.Tensor | None = None, ridge: float = 1e-6,
                layer: int | None = None, head: int | None = None, metadata: dict[str, Any] | None = None,
                _prepared=None) -> AttentionPattern:
    """Optimal R (eq. 7) for a given P, with its predicted error (eq. 8) normalised by Tr(C_a).

    Args:
        cov: `ScoreCovariance`, or a covariance tensor (per_query ``(n, n, n)``, whole ``(n², n²)``).
        indices: P: per_query ``(n, k)``, whole ``(k,)`` over row-major pairs ``i·n + j``.
        centered: covariance (with a bias ``μ_P̄ − R μ_P``) or second moment (pure ``R a_P``); default the
            covariance's own flag.
        bias: store the bias (default: when centred). The predicted error is exact for (centred, bias) and
            (second moment, no bias).
        ridge: relative Tikhonov term of the Cholesky solve (see `solve_reconstruction`).
    """
    c, mu, centered = _prepared or covariance_for(cov, scope, centered, mean, layer, head)
    bias = centered if bias is None else bias
    if bias and mu is None:
        raise ValueError("bias=True needs the mean; pass mean=<tensor> with a covariance tensor "
                         "or use a ScoreCovariance.")
    n = c.shape[0] if scope == "per_query" else int(round(c.shape[0] ** 0.5))
    indices = torch.sort(indices.to(torch.int64), dim=-1).values
    with single_thread(scope == "per_query" or c.shape[-1] <= 2048):  # small problems: see _threads
        recon, b, err = solve_reconstruction(c, indices, mu if bias else None, ridge=ridge)
    total = _trace(c)
    meta = {**_fit_metadata(cov, scope, centered, ridge, total, layer, head),
            "normalized_error": float(err.sum()) / total, "k_bar": int(indices.numel()), "seq_len": n,
            **(metadata or {})}
    return AttentionPattern(indices, recon, b if bias else None, scope=scope, seq_len=n, metadata=meta)


def _fit_metadata(cov, scope, centered, ridge, total, layer, head) -> dict[str, Any]:
    """What every fitted pattern records about its fit and, for a `ScoreCovariance`, its source."""
    meta = {"scope": scope, "covariance": "centered" if centered else "second_moment", "ridge": ridge,
            "total_variance": total}
    if isinstance(cov, ScoreCovariance):
        meta.update(source_model=cov.metadata.get("model", ""), source_model_id=cov.metadata.get("model_id", ""),
                    num_sequences=cov.num_sequences, layer=layer, head=head)
    return meta


def _trace(c: torch.Tensor) -> float:
    return float(torch.diagonal(c, dim1=-2, dim2=-1).sum())


def _greedy(c: torch.Tensor, k: int, scope: str, family: str, block_rows: int | None,
            metric: torch.Tensor | None = None, order: bool = False):
    """Greedy indices and residual of ``c`` (already prepared by `covariance_for`) for a scope and family."""
    if scope == "whole":
        with single_thread(c.shape[-1] <= 2048):  # small problems: see _threads
            return greedy_select(c, k, order=order)
    n = c.shape[0]
    if c.shape != (n, n, n):
        raise ValueError(f"per-query covariances must be (n, n, n), got {tuple(c.shape)}.")
    groups, candidates = family_constraint(n, family, block_rows)
    with single_thread(True):
        return greedy_select(c, k, groups, candidates, metric=metric, order=order)


def select_pattern(cov, k: int, scope: str = "per_query", **kwargs) -> AttentionPattern:
    """P chosen for ``k`` and its optimal R, as an `AttentionPattern`: `select_patterns` for one k."""
    return select_patterns(cov, [k], scope, **kwargs)[k]


def greedy_order(cov, k_max: int, *, family: str = "per_query", objective: str = "paper",
                 centered: bool | None = None, layer: int | None = None, head: int | None = None,
                 block_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(picks, path)``, each ``(n, k_max)``: one per-query greedy run of ``cov`` (layer, head) within ``family`` for
    ``objective``, its picks in the order taken and the objective's residual after each (its sum over rows is the
    error curve). `select_patterns(..., order=...)` turns any k <= k_max of it into a pattern without a second run."""
    if family in ("windows", "shared_blocks"):
        raise ValueError(f"family={family!r} has no per-row greedy order; use per_query, columns, blocks or bands.")
    c, mean, _ = covariance_for(cov, "per_query", centered, None, layer, head)
    return _greedy(c, k_max, "per_query", family, block_rows, objective_metric(objective, c.shape[0], mean),
                   order=True)


def select_patterns(cov, ks, scope: str = "per_query", *, family: str = "per_query",
                    block_rows: int | None = None, centered: bool | None = None, bias: bool | None = None,
                    mean: torch.Tensor | None = None, ridge: float = 1e-6, layer: int | None = None,
                    head: int | None = None, metadata: dict[str, Any] | None = None,
                    objective: str = "paper", order: tuple[torch.Tensor, torch.Tensor] | None = None,
                    ) -> dict[int, AttentionPattern]:
    """For each k of ``ks``: P (greedy within ``family``, for ``objective``) and its optimal R, as an
    `AttentionPattern`, from one greedy run to the largest k (the greedy is nested: its first k picks are its
    answer for k).

    Args:
        cov: `ScoreCovariance` (or a covariance tensor, see `fit_pattern`).
        ks: exact scores per query (per_query) or in total (whole, k̄ = k).
        scope: ``"per_query"`` (each row i its own P_i from Q^i; k̄ = n·k) or ``"whole"`` (one P over n² pairs).
        family: with scope per_query, a constraint on P that makes its exact part a fast dense computation: rows
            of a group take the same candidate at every step, and each candidate maps to a key per row
            (docs/method.md#greedy-choice-of-p):

            - ``"per_query"``: no constraint, each query its own P_i (the paper's setting);
            - ``"columns"``: one key set shared by every query (the exact part is one GEMM, Q·K_Cᵀ);
            - ``"blocks"``: consecutive rows in blocks of ``block_rows`` (default gcd(n, 32)) share one key set;
            - ``"bands"``: diagonal offsets shared by every query, P_i = {(i + o) mod n : o ∈ O} [ours: circular
              at the edges, so every row keeps exactly k distinct keys];
            - ``"windows"``: no greedy: block-local windows, rows of block b (k rows each) compute the keys of
              block b;
            - ``"shared_blocks"``: blocks of ``block_rows`` rows share P *and* R (`shared_blocks`): the greedy and
              eq. 7 run on each block's pooled covariance, and the `tiled` kernel runs it as plain matrix products.
        centered, bias, mean, ridge, layer, head: as in `fit_pattern`.
        objective: the error the greedy minimises (`objective_metric`): ``"paper"`` (all scores alike),
            ``"shift"`` (modulo a per-row constant) or ``"fisher"`` (weighted by the attention probabilities).
            ``metadata["objective_normalized_error"]`` is that error of the result over its value with no exact
            score; ``metadata["normalized_error"]`` stays the paper's, so patterns of any objective compare.
        order: ``(picks, path)`` of an earlier `greedy_order` run on this covariance with the same family and
            objective, to at least the largest k: its first k picks are used instead of running the greedy again
            (the greedy is nested, so the patterns are the same).

    Returns:
        ``{k: pattern}``; ``metadata["normalized_error"]`` is the predicted error Σε / Tr(C_a) of its R, and
        ``metadata["greedy_normalized_error"]`` the greedy residual Tr(S) / Tr(C_a) (equal up to the ridge).
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}.")
    if family != "per_query" and scope != "per_query":
        raise ValueError(f"family={family!r} constrains per-query patterns; use scope='per_query'.")
    prepared = covariance_for(cov, scope, centered, mean, layer, head)
    c = prepared[0]
    l = c.shape[-1]
    ks = _checked_ks(ks, l, scope, family, objective)
    if family == "shared_blocks":
        return _select_shared(cov, prepared, ks, block_rows, bias, ridge, layer, head, metadata)
    metric = objective_metric(objective, c.shape[0], prepared[1]) if scope == "per_query" else None
    if family != "windows":
        if order is not None and order[0].shape[-1] >= ks[-1]:
            picks, path = order  # (..., k_max) each
        else:
            picks, path = _greedy(c, ks[-1], scope, family, block_rows, metric, order=True)  # (..., k_max) each
        norm = _trace(c) if metric is None else float((metric * c).sum())
    patterns = {}
    for k in ks:
        error = {}
        if family == "windows":
            indices = window_indices(c.shape[0], k)
        else:
            indices = torch.sort(picks[..., :k], dim=-1).values
            key = "greedy_normalized_error" if metric is None else "objective_normalized_error"
            error[key] = float(path[..., k - 1].sum()) / norm
        meta = _selection_metadata(k, error, family, objective, c.shape[0], block_rows, metadata)
        patterns[k] = fit_pattern(cov, indices, scope, centered=prepared[2], bias=bias, mean=mean, ridge=ridge,
                                  layer=layer, head=head, metadata=meta, _prepared=prepared)
    return patterns


def _checked_ks(ks, l: int, scope: str, family: str, objective: str) -> list[int]:
    """`select_patterns`' ks, sorted, each in [1, l]; its objective checked against the scope and family."""
    ks = sorted({int(k) for k in ks})
    if not ks or not 1 <= ks[0] <= ks[-1] <= l:
        raise ValueError(f"k must be in [1, {l}] for scope={scope!r} at this seq_len, got k={ks}.")
    if objective != "paper" and scope != "per_query":
        raise ValueError(f"objective={objective!r} is defined for per-query rows; use scope='per_query'.")
    if family == "shared_blocks" and objective != "paper":
        raise ValueError(f"family='shared_blocks' selects with objective='paper' only, got {objective!r}.")
    return ks


def _selection_metadata(k: int, error: dict[str, float], family: str, objective: str, n: int,
                        block_rows: int | None, metadata: dict[str, Any] | None) -> dict[str, Any]:
    """What a selected pattern records of how it was chosen (its method, k, the greedy's ``error``, objective,
    family), then ``metadata``."""
    meta: dict[str, Any] = {"method": "greedy" if family == "per_query" else f"greedy_{family}", "k": k, **error}
    if objective != "paper":
        meta["objective"] = objective
    if family != "per_query":
        meta["family"] = family
    if family == "blocks":
        meta["block_rows"] = _block_rows(n, block_rows)
    return {**meta, **(metadata or {})}


def _select_shared(cov, prepared, ks, block_rows, bias, ridge, layer, head, metadata) -> dict[int, AttentionPattern]:
    """`select_patterns` for ``family="shared_blocks"``: greedy and R on each block's pooled covariance."""
    c, mu, centered = prepared
    bias = centered if bias is None else bias
    n = c.shape[0]
    rows = _block_rows(n, block_rows)
    with single_thread(True):
        picks, path = greedy_select(pooled_blocks(c, rows), ks[-1], order=True)  # (n / rows, k_max) each
    total = _trace(c)
    patterns = {}
    for k in ks:
        meta = {**_fit_metadata(cov, "per_query", centered, ridge, total, layer, head),
                "method": "greedy_shared_blocks", "k": k, "family": "shared_blocks",
                "greedy_normalized_error": float(path[:, k - 1].sum()) / total, **(metadata or {})}
        patterns[k] = fit_shared_blocks(c, mu, picks[:, :k], rows, bias=bias, ridge=ridge, total=total, meta=meta)
    return patterns


def error_curve(cov, ks, scope: str = "per_query", *, centered: bool | None = None, layer: int | None = None,
                head: int | None = None, d_head: int | None = None,
                patterns: dict[int, AttentionPattern] | None = None) -> dict[str, list]:
    """Fig. 9: greedy error and the eigenvector reference for each k, normalised by Tr(C_a).

    ``patterns``: the unconstrained greedy's patterns of these ks from `select_patterns` on the same covariance,
    whose ``greedy_normalized_error`` is the curve's value (the greedy is then not run a second time).
    Returns lists keyed ``k``, ``k_bar`` (n·k per-query, k whole), ``greedy``, ``eigen`` and, when ``d_head``
    is given, ``relative_cost`` (multiply-adds over dense QKᵀ, `..cost.score_cost`).
    """
    c, _, _ = covariance_for(cov, scope, centered, None, layer, head)
    total = _trace(c)
    ks = sorted({int(k) for k in ks})
    if scope == "per_query":
        n = c.shape[0]
        vals, _ = eigh_desc(c)  # (n, n)
        eigen = [float(vals[:, k:].sum()) / total for k in ks]
        k_bar = [n * k for k in ks]
    else:
        n = int(round(c.shape[0] ** 0.5))
        vals, _ = top_eigh(c, max(ks))
        eigen = [max(0.0, 1.0 - float(vals[:k].sum()) / total) for k in ks]
        k_bar = list(ks)
    if patterns is not None:
        greedy = [patterns[k].metadata["greedy_normalized_error"] for k in ks]
    else:
        _, path = _greedy(c, max(ks), scope, "per_query", None, order=True)  # one nested run for every k
        greedy = [float(path[..., k - 1].sum()) / total for k in ks]
    out = {"k": ks, "k_bar": k_bar, "greedy": greedy, "eigen": eigen, "scope": scope, "seq_len": n}
    if d_head is not None:
        out["relative_cost"] = [score_cost(n, k, d_head, scope).total / dense_cost(n, d_head) for k in ks]
    return out

"""The pooled fixed windows' part of `derive.derive_patterns` (``derive`` without buckets or groups): the ks checked
against the analysis, the error curves (Fig. 9), the figures and the held-out errors beside the equal-cost baselines,
into the ``derive_<tag>`` section."""

from __future__ import annotations

import logging
import os
from typing import Any

from safetensors.torch import load_file

from ..cost import saving_warning, score_cost
from . import plots
from .baselines import build_methods
from .collect import load_model_and_tokenizer, run_windows
from .covariance import ScoreCovariance
from .evaluation import ErrorMeter, LinearReconstructor
from .fit_checks import fit_size_warning
from .folder import HELDOUT_FILE, load_results
from .selection import error_curve

logger = logging.getLogger(__name__)

__all__ = ["record_windows", "checked_ks", "curve_ks"]


def curve_ks(scope: str, n: int, ks) -> list[int]:
    """The ks of the error curve (Fig. 9) drawn for ``scope`` beside the patterns of ``ks``."""
    if scope == "per_query":
        base = [1, 2, 4, 8, 16, 32, 64]
        return sorted({k for k in [*base, *ks] if k <= n})
    # each whole-matrix greedy step reads the n²×n² covariance once: the curve stops at k̄ = 2048
    cap = min(n * n, 2048)
    return sorted({k for k in [n // 4, n // 2, n, 2 * n, 4 * n, 8 * n, *ks] if 1 <= k <= cap})


def record_windows(out: str, cov: ScoreCovariance, sets, built: dict, fitted: dict, req, path) -> dict:
    """The pooled fixed windows' files and ``derive_<tag>`` section (`derive.derive_patterns`): each k's pattern, its
    predicted error, the error curves, the figures and, with held-out windows, the measured errors beside the
    equal-cost baselines."""
    scope, n, d_head = req.scope, cov.seq_len, cov.metadata.get("head_dim")
    ks = [s.k for s in sets]
    curves_at = {s: curve_ks(s, n, ks if s == scope else []) for s in (req.curve_scopes or cov.scopes)}
    # the unconstrained greedy is nested: the patterns' run gave this scope's curve (the paper's objective)
    same_run = req.family == "per_query" and req.objective == "paper" and scope in curves_at
    curves = [error_curve(cov, ks_s, s, d_head=d_head, centered=req.centered,
                          patterns=fitted[(n, None, None)] if same_run and s == scope else None)
              for s, ks_s in curves_at.items()]
    patterns = {s.k: built[s.name] for s in sets}
    rows = {k: {"k": k, "k_bar": p.indices.numel(), "path": path(s), "predicted": p.normalized_error,
                "greedy": p.metadata.get("greedy_normalized_error"),
                "relative_cost": score_cost(n, k, d_head, scope).relative if d_head else None}
            for s, (k, p) in zip(sets, patterns.items())}
    fig_dir = os.path.join(out, "figures")
    result: dict[str, Any] = {"scope": scope, "seq_len": n, "head_dim": d_head, "patterns": list(rows.values()),
                              "curves": curves, "figures": {}}
    result["figures"]["patterns"] = plots.plot_patterns(
        [(f"{scope}, k={k}" if scope == "per_query" else f"whole, k̄={k}", plots.pattern_mask(p))
         for k, p in patterns.items()],
        os.path.join(fig_dir, f"patterns_{scope}.png"))
    result["figures"]["error_curves"] = plots.plot_error_curves(
        curves, os.path.join(fig_dir, f"error_curves_{scope}.png"))
    held_path = os.path.join(out, HELDOUT_FILE)
    if req.evaluate and os.path.isfile(held_path):
        result["heldout"] = _evaluate(cov, patterns, scope, held_path,
                                      req.baselines and scope == "per_query" and d_head, req.batch_size or 8,
                                      req.progress, req.seed, req.centered)
        for m in result["heldout"]["methods"]:
            if m["method"] == "greedy P + R":  # beside the predicted error wherever the pattern is shown
                rows[m["k"]]["heldout"] = m["heldout"]
                patterns[m["k"]].metadata.update(heldout_normalized_error=float(m["heldout"]),
                                                 heldout_windows=result["heldout"]["windows"])
        series: dict[str, list] = {}
        for entry in result["heldout"]["methods"]:
            series.setdefault(entry["method"], []).append((entry["relative_cost"], entry["heldout"]))
        result["figures"]["baselines"] = plots.plot_baselines(
            series, os.path.join(fig_dir, f"baselines_{scope}.png"), f"Held-out error at equal cost (n={n})")
    for s in sets:
        patterns[s.k].save(path(s))
    section = req.section or f"derive_{req.tag}"
    _keep_previous(load_results(out).get(section), result, out)
    result["_section"] = section
    return result


def checked_ks(cov: ScoreCovariance, out: str, ks, scope: str) -> list[int]:
    """The user's ks, sorted, each checked against n (a ValueError naming the range and the fix); warnings logged for
    a per-query covariance fitted on too few windows and for a k that saves no work."""
    if scope not in cov.scopes:
        raise ValueError(f"scope={scope!r} was not collected in {out!r} (scopes {cov.scopes}); "
                         f"rerun analyze with --scopes {scope}.")
    n, d_head = cov.seq_len, cov.metadata.get("head_dim")
    ks = sorted({int(k) for k in ks})
    limit = n if scope == "per_query" else n * n
    bad = [k for k in ks if not 1 <= k <= limit]
    if not ks or bad:  # the user's values only: the curve's own ks are added by derive, within range
        raise ValueError(f"k must be in [1, {limit}] for scope={scope!r} at n={n} (the seq_len of {out!r}), got "
                         f"k={', '.join(map(str, bad)) or 'none'}; pass --k values in that range or rerun analyze "
                         "with a larger --seq-len.")
    if scope == "per_query":
        if warning := fit_size_warning(cov.num_sequences, n):
            logger.warning(warning)
        for k in ks if d_head else []:
            if warning := saving_warning(n, k, d_head):
                logger.warning(warning)
    return ks


def _keep_previous(previous: dict | None, result: dict, out: str) -> None:
    """Carry an earlier derive's rows of the same section into ``result`` for the ks not derived again whose
    files remain (a second ``derive --k`` adds to the report instead of hiding the first one's patterns)."""
    if not previous or previous.get("scope") != result["scope"]:
        return
    new_ks = {p["k"] for p in result["patterns"]}
    kept = []
    for p in previous.get("patterns", []):
        path = os.path.join(out, "patterns", os.path.basename(p["path"]))  # this folder, whatever the cwd was then
        if p["k"] not in new_ks and os.path.isfile(path):
            kept.append({**p, "path": path})
    if not kept:
        return
    result["patterns"] = sorted([*kept, *result["patterns"]], key=lambda p: p["k"])
    kept_ks = {p["k"] for p in kept}
    old_methods = [m for m in previous.get("heldout", {}).get("methods", []) if m["k"] in kept_ks]
    if old_methods:
        held = result.setdefault("heldout", {**previous["heldout"], "methods": []})
        held["methods"] = sorted([*old_methods, *held["methods"]], key=lambda m: m["k"])  # stable within a k


def _evaluate(cov, patterns: dict, scope: str, held_path: str, with_baselines, batch_size, progress, seed,
              centered) -> dict:
    windows = load_file(held_path)["input_ids"]
    model, _ = load_model_and_tokenizer(cov.metadata["model"], load_tokenizer=False)
    n, d_head = cov.seq_len, cov.metadata.get("head_dim")
    methods, info = {}, {}
    for k, pattern in patterns.items():
        if with_baselines:
            for name, m in build_methods(cov, k, d_head, seed=seed, centered=centered, greedy=pattern).items():
                methods[(name, k)] = m["reconstructor"]
                info[(name, k)] = m
        else:
            methods[("greedy P + R", k)] = LinearReconstructor(pattern)
            cost = score_cost(n, k, d_head, scope).relative if d_head else None
            info[("greedy P + R", k)] = {"predicted": pattern.normalized_error,
                                         "param": f"k={k}" if scope == "per_query" else f"k̄={k}",
                                         "relative_cost": cost}
    meter = ErrorMeter(methods)
    run_windows(model, windows, meter.sink, batch_size=batch_size, progress=progress, desc="held-out")
    measured = meter.results()
    rows = [{"method": name, "k": k, "param": info[(name, k)]["param"],
             "relative_cost": info[(name, k)]["relative_cost"], "predicted": info[(name, k)]["predicted"],
             "heldout": measured[(name, k)]["normalized_error"],
             "heldout_shift": measured[(name, k)]["normalized_error_shift"]} for name, k in methods]
    return {"windows": int(windows.shape[0]), "scope": scope, "score_matrices": meter.count,
            "total_variance": meter.total_variance,
            "train_total_variance": cov.total_variance(centered=True), "methods": rows}

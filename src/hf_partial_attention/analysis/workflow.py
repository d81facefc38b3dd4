"""The analyze → derive → convert steps behind the CLI; each writes into one output folder.

Layout of a folder: ``covariance.safetensors`` (accumulators), ``heldout_windows.safetensors`` (held-out
token windows), ``patterns/*.safetensors``, ``figures/*.png``, ``results.json`` (every number of the report)
and ``report.md`` (rendered from ``results.json`` after each step).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..cost import saving_warning, score_cost
from . import plots, spectra
from .baselines import build_methods
from .collect import collect_covariance, display_name, hub_id, load_model_and_tokenizer, run_windows
from .corpus import load_texts, make_windows, split_heldout
from .covariance import ScoreCovariance
from .derive_files import file_tag
from .distributed import process_info
from .evaluation import ErrorMeter, LinearReconstructor
from .fit_checks import MIN_WINDOWS_PER_POSITION, check_seq_len, fit_size_warning
from .report import write_report
from .convert import convert  # noqa: F401 (workflow.convert: analyze -> derive -> convert in one place)
from .selection import error_curve, select_patterns

logger = logging.getLogger(__name__)

__all__ = ["analyze", "derive", "convert", "spectra_summary", "load_results", "update_results",
           "fit_size_warning", "COVARIANCE_FILE", "HELDOUT_FILE", "MIN_WINDOWS_PER_POSITION"]

COVARIANCE_FILE = "covariance.safetensors"
HELDOUT_FILE = "heldout_windows.safetensors"
RESULTS_FILE = "results.json"
ENERGY_KS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def load_results(out: str) -> dict:
    path = os.path.join(out, RESULTS_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def update_results(out: str, section: str, data: dict) -> dict:
    """Store ``data`` under ``section`` in ``results.json`` and re-render ``report.md``."""
    os.makedirs(out, exist_ok=True)
    results = load_results(out)
    results[section] = data
    with open(os.path.join(out, RESULTS_FILE), "w") as f:
        json.dump(results, f, indent=1)
    write_report(results, os.path.join(out, "report.md"))
    return results


def spectra_summary(cov: ScoreCovariance, fig_dir: str, max_k: int = 512, prefix: str = "") -> dict:
    """Per-query spectra (Fig. 6–7) and, when collected, whole-matrix ones (Fig. 3, 5, 6): figures and numbers."""
    n = cov.seq_len
    total = cov.total_variance()
    fig = lambda name: os.path.join(fig_dir, f"{prefix}{name}.png")  # noqa: E731
    out: dict[str, Any] = {"seq_len": n, "total_variance": total, "figures": {}}
    if "per_query" in cov.scopes:
        vals, vecs = spectra.per_query_spectra(cov.per_query())  # (n, n), (n, n, n)
        share = spectra.top_eigenvalue_share(vals)
        rows = sorted({0, 1, n // 2, n - 2, n - 1})
        out["top_eigenvalue_share"] = {str(i): float(share[i]) for i in rows}
        out["top_eigenvalue_share_inner_mean"] = float(share[1:-1].mean()) if n > 2 else float(share.mean())
        out["per_query_energy"] = {str(k): 1 - float(vals[:, k:].sum()) / total for k in ENERGY_KS if k <= n}
        out["figures"]["per_query_spectra"] = plots.plot_per_query_spectra(vals, share, fig("per_query_spectra"))
        images = spectra.per_query_top_eigenvectors(vecs, 5)
        out["figures"]["per_query_eigenvectors"] = plots.plot_images(
            images, fig("per_query_eigenvectors"), [f"eigenvector {r + 1}" for r in range(5)],
            "Top-5 per-query eigenvectors (row i: eigenvector of Q^i)", cols=5)
    if "whole" in cov.scopes:
        glob = cov.whole()
        g_vals, g_vecs = spectra.top_eigh(glob, min(max_k, n * n))
        del glob
        g_curve = spectra.cumulative_energy(g_vals, total)
        out["global_energy"] = {str(k): float(g_curve[k - 1]) for k in ENERGY_KS if k <= len(g_curve)}
        out["figures"]["global_eigenvectors"] = plots.plot_images(
            spectra.eigenvector_images(g_vecs, n, 8), fig("global_eigenvectors"),
            [f"eigenvector {r + 1}" for r in range(8)], f"Top global eigenvectors of C_a (n={n})")
        curves = {"global C_a": g_curve}
        if "per_query" in cov.scopes:
            pooled = spectra.pooled_per_query_energy(vals, total)[: len(g_curve)]
            curves["per-query eigenvalues pooled"] = pooled
            out["pooled_per_query_energy"] = {str(k): float(pooled[k - 1]) for k in ENERGY_KS if k <= len(pooled)}
        out["figures"]["energy_global_vs_per_query"] = plots.plot_energy_comparison(
            curves, fig("energy_global_vs_per_query"), f"Cumulative energy (n={n})")
        if cov.layers:
            g_curve_l, layers = spectra.layer_projections(cov, min(max_k, n * n))
            ks = [k for k in (8, 32, 128, 512) if k <= len(g_curve_l)]
            out["layer_projection"] = [{"layer": lp.layer, **{f"own@{k}": float(lp.own[k - 1]) for k in ks},
                                        **{f"global@{k}": float(lp.on_global[k - 1]) for k in ks}} for lp in layers]
            out["figures"]["layer_projection"] = plots.plot_layer_projection(
                g_curve_l, layers, fig("layer_projection"), f"Per-layer covariance on the global eigenspace (n={n})")
    return out


def analyze(model: Any, texts: Any = None, out: str = "runs/analysis", *, tokenizer: Any = None, seq_len: int = 128,
            max_sequences: int | None = None, heldout_every: int = 5, heldout_sequences: int = 64,
            scopes=("per_query",), granularity: str = "pooled", centered: bool = True, batch_size: int = 8,
            resume: bool = True, max_k: int = 512, progress: bool = True, section: str = "analyze",
            text_split: str = "paragraph", model_id: str | None = None) -> dict:
    """Collect the covariance of ``model``'s scores on ``texts``, save it and the held-out windows, draw the spectra.

    Texts are split by document (a text file into paragraphs, ``text_split``): every ``heldout_every``-th text is
    held out, and up to ``heldout_sequences`` windows of them are kept for measuring reconstruction error later
    (`derive`). When held-out data is asked for (``heldout_every`` and ``heldout_sequences`` > 0) but none results,
    this is an error; ``heldout_every=0`` fits on everything and measures nothing. ``model_id`` is how reports name
    the model (default: ``model`` itself when it is a Hub id, the folder's name when it is a local path).

    A ``seq_len`` beyond the model's positions and a corpus without held-out windows are refused before any
    score is collected, and ``out`` is created only then (a folder this call created is removed again if the
    collection fails before writing into it). Fitting on fewer than ``MIN_WINDOWS_PER_POSITION · seq_len``
    windows logs a warning (`fit_size_warning`: the per-query covariance is then unstable).
    """
    start = time.perf_counter()
    model_obj, tok = load_model_and_tokenizer(model, tokenizer)
    check_seq_len(model_obj, seq_len)
    all_texts = load_texts(texts, split=text_split) if not isinstance(texts, torch.Tensor) else texts
    want_heldout = bool(heldout_every and heldout_sequences)
    if want_heldout and not isinstance(all_texts, torch.Tensor):
        fit_texts, held_texts = split_heldout(all_texts, heldout_every)
        if not held_texts:
            raise ValueError(f"No held-out data: {len(all_texts)} text(s), of which every {heldout_every}th is held "
                             "out, leave none. Pass more documents (a text file is split into paragraphs by "
                             "blank lines), a smaller heldout_every (--heldout-every), or heldout_every=0 to skip "
                             "the held-out measurement.")
    else:
        fit_texts, held_texts = all_texts, []
    windows = None
    if held_texts:  # before the collection: a corpus too short for held-out windows fails in seconds, not after it
        try:
            windows = make_windows(tok, held_texts, seq_len, heldout_sequences)
        except ValueError as err:
            raise ValueError(f"No held-out windows of {seq_len} tokens from {len(held_texts)} held-out text(s): "
                             f"{err} Pass more text or heldout_every=0 to skip the held-out measurement.") from err
    cov_path = os.path.join(out, COVARIANCE_FILE)
    created = not os.path.exists(out)
    os.makedirs(out, exist_ok=True)
    try:
        cov = collect_covariance(model_obj, fit_texts, tok, seq_len, max_sequences, scopes, granularity, centered,
                                 batch_size, resume_from=cov_path if resume else None, checkpoint_path=cov_path,
                                 progress=progress)
    except BaseException:
        if created and not os.listdir(out):  # nothing written: leave no empty folder behind
            os.rmdir(out)
        raise
    if process_info()[0] != 0:  # under accelerate launch the main process writes the outputs
        return {}
    if "per_query" in cov.scopes and (warning := fit_size_warning(cov.num_sequences, cov.seq_len)):
        logger.warning(warning)
    if isinstance(model, (str, os.PathLike)):
        cov.metadata["model"] = os.fspath(model)
        cov.metadata["model_id"] = model_id or hub_id(model) or ""  # a Hub id or nothing: never a folder's name
        cov.save(cov_path)
    held = 0
    if windows is not None:
        save_file({"input_ids": windows}, os.path.join(out, HELDOUT_FILE), metadata={"model": cov.metadata["model"]})
        held = windows.shape[0]
    summary = spectra_summary(cov, os.path.join(out, "figures"), max_k=max_k)
    summary.update(model=cov.metadata.get("model_id") or display_name(cov.metadata.get("model", "")),
                   num_sequences=cov.num_sequences, count=cov.count,
                   heldout_sequences=held, scopes=list(cov.scopes), granularity=cov.granularity,
                   head_dim=cov.metadata.get("head_dim"), num_layers=cov.metadata.get("num_layers"),
                   num_heads=cov.metadata.get("num_heads"), centered=cov.centered,
                   seconds=round(time.perf_counter() - start, 1))
    update_results(out, section, summary)
    return summary


def _curve_ks(scope: str, n: int, ks) -> list[int]:
    if scope == "per_query":
        base = [1, 2, 4, 8, 16, 32, 64]
        return sorted({k for k in [*base, *ks] if k <= n})
    # each whole-matrix greedy step reads the n²×n² covariance once: the curve stops at k̄ = 2048
    cap = min(n * n, 2048)
    return sorted({k for k in [n // 4, n // 2, n, 2 * n, 4 * n, 8 * n, *ks] if 1 <= k <= cap})


def derive(out: str, ks, scope: str = "per_query", *, evaluate: bool = True, baselines: bool = True,
           centered: bool | None = None, batch_size: int = 8, progress: bool = True, seed: int = 0,
           section: str | None = None, family: str = "per_query", curve_scopes=None,
           objective: str = "paper") -> dict:
    """Greedy patterns for each k from ``out/covariance.safetensors`` (Fig. 8–9), saved as `AttentionPattern`
    files, and, with held-out windows present, their measured error beside the equal-cost baselines.

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
    if family != "per_query" and scope != "per_query":
        raise ValueError(f"family={family!r} constrains per-query patterns; use scope='per_query'.")
    start = time.perf_counter()
    cov = ScoreCovariance.load(os.path.join(out, COVARIANCE_FILE))
    ks = _checked_ks(cov, out, ks, scope)
    n, d_head = cov.seq_len, cov.metadata.get("head_dim")
    os.makedirs(os.path.join(out, "patterns"), exist_ok=True)
    curve_ks = {s: _curve_ks(s, n, ks if s == scope else []) for s in (curve_scopes or cov.scopes)}
    # The unconstrained greedy is nested: one run gives this scope's patterns and its curve (the paper's objective).
    same_run = family == "per_query" and objective == "paper" and scope in curve_ks
    fitted = select_patterns(cov, sorted(set(ks) | set(curve_ks[scope] if same_run else [])), scope, family=family,
                             centered=centered, objective=objective)
    curves = [error_curve(cov, ks_s, s, d_head=d_head, centered=centered,
                          patterns=fitted if same_run and s == scope else None) for s, ks_s in curve_ks.items()]
    patterns, rows = {}, {}
    tag = file_tag(scope, family, objective)
    for k, pattern in ((k, fitted[k]) for k in ks):
        path = os.path.join(out, "patterns", f"{tag}_k{k}.safetensors")
        pattern.save(path)
        patterns[k] = pattern
        rows[k] = {"k": k, "k_bar": pattern.indices.numel(), "path": path, "predicted": pattern.normalized_error,
                   "greedy": pattern.metadata.get("greedy_normalized_error"),
                   "relative_cost": score_cost(n, k, d_head, scope).relative if d_head else None}
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
    if evaluate and os.path.isfile(held_path):
        result["heldout"] = _evaluate(cov, patterns, scope, held_path, baselines and scope == "per_query" and d_head,
                                      batch_size, progress, seed, centered)
        for m in result["heldout"]["methods"]:
            if m["method"] == "greedy P + R":  # beside the predicted error wherever the pattern is shown
                rows[m["k"]]["heldout"] = m["heldout"]
                patterns[m["k"]].metadata.update(heldout_normalized_error=float(m["heldout"]),
                                                 heldout_windows=result["heldout"]["windows"])
                patterns[m["k"]].save(rows[m["k"]]["path"])
        series: dict[str, list] = {}
        for entry in result["heldout"]["methods"]:
            series.setdefault(entry["method"], []).append((entry["relative_cost"], entry["heldout"]))
        result["figures"]["baselines"] = plots.plot_baselines(
            series, os.path.join(fig_dir, f"baselines_{scope}.png"), f"Held-out error at equal cost (n={n})")
    result["seconds"] = round(time.perf_counter() - start, 1)
    section = section or f"derive_{tag}"
    _keep_previous(load_results(out).get(section), result, out)
    update_results(out, section, result)
    return result


def _checked_ks(cov: ScoreCovariance, out: str, ks, scope: str) -> list[int]:
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

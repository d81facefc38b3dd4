"""The analyze → derive → convert steps behind the CLI; each writes into one output folder.

Layout of a folder: ``covariance.safetensors`` (accumulators), ``heldout_windows.safetensors`` (held-out
token windows), ``patterns/*.safetensors``, ``figures/*.png``, ``results.json`` (every number of the report)
and ``report.md`` (rendered from ``results.json`` after each step).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
from safetensors.torch import save_file

from . import plots, spectra
from .collect import collect_covariance, display_name, hub_id, load_model_and_tokenizer
from .corpus import load_texts, make_windows, split_heldout
from .covariance import ScoreCovariance
from .distributed import process_info
from .fit_checks import MIN_WINDOWS_PER_POSITION, check_seq_len, fit_size_warning
from .convert import convert  # noqa: F401 (workflow.convert: analyze -> derive -> convert in one place)
from .derive import derive  # noqa: F401 (workflow.derive: the pooled fixed windows' derive)
from .folder import COVARIANCE_FILE, HELDOUT_FILE, RESULTS_FILE, load_results, update_results  # noqa: F401

logger = logging.getLogger(__name__)

__all__ = ["analyze", "derive", "convert", "spectra_summary", "load_results", "update_results",
           "fit_size_warning", "COVARIANCE_FILE", "HELDOUT_FILE", "RESULTS_FILE", "MIN_WINDOWS_PER_POSITION"]

ENERGY_KS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


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
    fit_texts, held_texts = _fit_and_heldout_texts(texts, text_split, heldout_every, heldout_sequences)
    windows = None
    if held_texts:  # before the collection: a corpus too short for held-out windows fails in seconds, not after it
        windows = _heldout_windows(tok, held_texts, seq_len, heldout_sequences)
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


def _fit_and_heldout_texts(texts: Any, text_split: str, heldout_every: int, heldout_sequences: int) -> tuple:
    """(texts to fit on, held-out texts): every ``heldout_every``-th text held out when held-out data is asked for
    (a ValueError when none results), else every text fitted on; ready windows (a tensor) are all fitted on."""
    all_texts = load_texts(texts, split=text_split) if not isinstance(texts, torch.Tensor) else texts
    want_heldout = bool(heldout_every and heldout_sequences)
    if not want_heldout or isinstance(all_texts, torch.Tensor):
        return all_texts, []
    fit_texts, held_texts = split_heldout(all_texts, heldout_every)
    if not held_texts:
        raise ValueError(f"No held-out data: {len(all_texts)} text(s), of which every {heldout_every}th is held "
                         "out, leave none. Pass more documents (a text file is split into paragraphs by "
                         "blank lines), a smaller heldout_every (--heldout-every), or heldout_every=0 to skip "
                         "the held-out measurement.")
    return fit_texts, held_texts


def _heldout_windows(tok, held_texts: list, seq_len: int, heldout_sequences: int) -> torch.Tensor:
    """Up to ``heldout_sequences`` windows of ``seq_len`` tokens from the held-out texts (a ValueError naming the
    remedy when there are none)."""
    try:
        return make_windows(tok, held_texts, seq_len, heldout_sequences)
    except ValueError as err:
        raise ValueError(f"No held-out windows of {seq_len} tokens from {len(held_texts)} held-out text(s): "
                         f"{err} Pass more text or heldout_every=0 to skip the held-out measurement.") from err

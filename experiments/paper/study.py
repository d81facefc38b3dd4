"""`make paper` (``python -m experiments paper``): the analysis at the paper's scale, whole matrix at n = 128,
on the real MiniLM and the demo's text.

Each step is a section of ``results.json`` / ``report.md`` (figures in ``figures/``): covariances and spectra,
whole-matrix greedy patterns, per-layer projections, across datasets and across training (`run_paper` lists them).
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import time

import torch

from hf_partial_attention.analysis import plots, spectra
from hf_partial_attention.analysis.collect import (
    collect_covariance, load_model_and_tokenizer, prepare_windows, run_windows,
)
from hf_partial_attention.analysis.corpus import default_texts, package_readmes, split_heldout
from hf_partial_attention.analysis.covariance import ScoreCovariance
from hf_partial_attention.analysis.defaults import resolve_model
from hf_partial_attention.analysis.workflow import COVARIANCE_FILE, analyze, derive, load_results, update_results

logger = logging.getLogger(__name__)

__all__ = ["run_paper"]

_KS = (8, 32, 128, 512)


def _at(curve: torch.Tensor, ks=(1, 8, 32, 128, 512, 2048)) -> dict[str, float]:
    return {str(k): float(curve[k - 1]) for k in ks if k <= len(curve)}


def _layer_projections(model, tok, texts, out: str, n: int, fit_sequences: int, max_k: int, batch_size: int,
                       progress: bool) -> dict:
    """Fig. 3 with one n²×n² accumulator at a time: the global eigenvectors first, then layer by layer."""
    pooled = ScoreCovariance.load(os.path.join(out, COVARIANCE_FILE))
    glob = pooled.whole()
    del pooled
    g_vals, g_vecs = spectra.top_eigh(glob, max_k)  # (K,), (n², K)
    g_curve = spectra.cumulative_energy(g_vals, float(torch.trace(glob)))
    del glob
    fit_texts, _ = split_heldout(texts)
    windows = prepare_windows(fit_texts, tok, n, fit_sequences)  # the windows `analyze` fitted on
    num_layers = model.config.num_hidden_layers
    layers = []
    for layer in range(num_layers):
        acc = ScoreCovariance(n, ("whole",))
        run_windows(model, windows,
                    lambda idx, scores, layer=layer, acc=acc: acc.update(0, scores) if idx == layer else None,
                    batch_size=batch_size, progress=progress, desc=f"layer {layer}")
        c_l = acc.whole()
        del acc
        vals, _ = spectra.top_eigh(c_l, max_k)
        layers.append(spectra.LayerProjection(layer, spectra.cumulative_energy(vals, float(torch.trace(c_l))),
                                              spectra.projection_energy(g_vecs, c_l)))
        del c_l
    figure = plots.plot_layer_projection(g_curve, layers, os.path.join(out, "figures", "layer_projection.png"),
                                         f"Per-layer covariance on the global eigenspace (n={n})")
    rows = [{"layer": lp.layer, **{f"own@{k}": float(lp.own[k - 1]) for k in _KS if k <= len(lp.own)},
             **{f"global@{k}": float(lp.on_global[k - 1]) for k in _KS if k <= len(lp.on_global)}} for lp in layers]
    return {"layer_projection": rows, "figure": figure}


def _overlap(model, tok, out: str, n: int, sequences: int, max_k: int, batch_size: int, progress: bool) -> dict:
    """Fig. 4: a second real corpus (installed packages' READMEs) on the pydoc eigenspace."""
    other = collect_covariance(model, package_readmes(), tok, seq_len=n, max_sequences=sequences, scopes=("whole",),
                               batch_size=batch_size, distributed=False, progress=progress)
    cov_b = other.whole()
    windows_b = other.num_sequences
    del other
    pooled = ScoreCovariance.load(os.path.join(out, COVARIANCE_FILE))
    cov_a = pooled.whole()
    del pooled
    result = spectra.subspace_overlap(cov_a, cov_b, max_k)
    figure = plots.plot_overlap(
        {"READMEs on pydoc eigenvectors": result["b_on_a"], "READMEs own eigenvectors": result["b_own"],
         "pydoc own eigenvectors": result["a_own"]},
        os.path.join(out, "figures", "dataset_overlap.png"), f"Overlap across datasets (n={n})")
    return {"a": "pydoc topics", "b": "package READMEs", "b_windows": windows_b, "b_on_a": _at(result["b_on_a"]),
            "b_own": _at(result["b_own"]), "figure": figure}


def run_paper(out: str = "runs/paper", results_dir: str | None = "results/paper", model: str | None = None, *,
              seq_len: int = 128, fit_sequences: int = 320, heldout_sequences: int = 64,
              whole_ks=(32, 64, 128, 256, 512, 1024, 2048), query_ks=(8, 16, 32), max_k: int = 512,
              second_sequences: int = 160, batch_size: int = 8, progress: bool = True,
              table1_dir: str = "runs/table1", command: str = "run_paper") -> dict:
    """Run every step into ``out`` and copy the report, ``results.json`` and the figures to ``results_dir``.

    1. per-query and whole-matrix covariances (n² × n² = 16384², 2 GiB in float64), pooled over layers and heads;
       spectra, the top global eigenvectors reshaped n × n (Fig. 5), global vs per-query energy (Fig. 6);
    2. whole-matrix greedy patterns for k̄ up to 2048 (Fig. 8) and the whole vs per-query error curves on the same
       axis of exact scores k̄ (Fig. 9), with held-out errors of each pattern (documents never fitted on);
    3. each layer's covariance projected on the global eigenspace beside its own spectrum (Fig. 3), one layer at a
       time so that memory holds two n² × n² matrices, not one per layer;
    4. across datasets (Fig. 4): installed packages' READMEs projected on the pydoc eigenspace;
    5. across training: the Table-1 study's checkpoints on the original eigenspace, when that study has run.

    ``command`` is the command line the report cites (the CLI passes what was typed).
    """
    start = time.perf_counter()
    model, model_id = resolve_model(model)
    texts = default_texts()
    seconds = {}
    t = time.perf_counter()
    analyze(model, texts, out, seq_len=seq_len, max_sequences=fit_sequences, heldout_sequences=heldout_sequences,
            scopes=("per_query", "whole"), batch_size=batch_size, max_k=max_k, progress=progress,
            section=f"analyze_n{seq_len}", model_id=model_id)
    seconds["covariances and spectra (Fig. 5, 6, 7)"] = time.perf_counter() - t
    t = time.perf_counter()
    derive(out, whole_ks, "whole", baselines=False, batch_size=batch_size, progress=progress,
           section=f"derive_whole_n{seq_len}")
    derive(out, query_ks, "per_query", baselines=False, batch_size=batch_size, progress=progress,
           section=f"derive_per_query_n{seq_len}", curve_scopes=("per_query",))  # the whole curve is drawn above
    seconds["greedy patterns, error curves, held-out errors (Fig. 8, 9)"] = time.perf_counter() - t
    model_obj, tok = load_model_and_tokenizer(model)
    t = time.perf_counter()
    section = load_results(out)[f"analyze_n{seq_len}"]
    projection = _layer_projections(model_obj, tok, texts, out, seq_len, fit_sequences, max_k, batch_size, progress)
    section["layer_projection"] = projection["layer_projection"]
    section["figures"]["layer_projection"] = projection["figure"]
    seconds["per-layer projections (Fig. 3)"] = time.perf_counter() - t
    t = time.perf_counter()
    overlap = _overlap(model_obj, tok, out, seq_len, second_sequences, max_k, batch_size, progress)
    section["figures"]["dataset_overlap"] = overlap.pop("figure")
    section["overlap"] = overlap
    seconds["across datasets (Fig. 4)"] = time.perf_counter() - t
    update_results(out, f"analyze_n{seq_len}", section)
    notes = [
        f"Command: `{command}`"
        f" (`make paper`). Wall time {time.perf_counter() - start:.0f} s on {torch.get_num_threads()} threads "
        f"({platform.processor() or platform.machine()}; torch {torch.__version__}): "
        + ", ".join(f"{name}: {s:.0f} s" for name, s in seconds.items()) + ".",
        f"Model `{model_id or os.path.basename(os.path.normpath(model))}`, text: CPython's `pydoc_data.topics` prose, "
        f"n = {seq_len}, {fit_sequences} fit windows, held-out windows from every 5th document.",
        "Across training (Fig. 3's checkpoints): " + (
            f"the Table-1 study's checkpoints are in `{table1_dir}`; project them with "
            "`spectra.projection_energy` on this run's eigenvectors." if os.path.isdir(table1_dir) else
            f"skipped: the Table-1 study has not run here (no `{table1_dir}`); run `make table1` "
            "(`python -m experiments table1`) first."),
        "Cost axis of Fig. 9: k̄, the number of exactly computed scores per score matrix (per-query k̄ = n·k); "
        "the multiply-add cost of each setting is in the error-curve tables (`relative_cost`).",
    ]
    results = update_results(out, "notes", notes)
    if results_dir is not None:
        _copy_results(out, results_dir)
    return results


def _copy_results(out: str, results_dir: str) -> None:
    """The report, ``results.json`` (with the run folder's name in place of this machine's paths) and the figures
    of ``out`` copied to ``results_dir``."""
    os.makedirs(results_dir, exist_ok=True)
    shutil.copyfile(os.path.join(out, "report.md"), os.path.join(results_dir, "report.md"))
    with open(os.path.join(out, "results.json")) as f:  # paths of this machine become paths in the run folder
        text = f.read().replace(os.path.abspath(out), os.path.basename(os.path.normpath(out)))
    with open(os.path.join(results_dir, "results.json"), "w") as f:
        f.write(text.replace(out, os.path.basename(os.path.normpath(out))))
    shutil.copytree(os.path.join(out, "figures"), os.path.join(results_dir, "figures"), dirs_exist_ok=True)

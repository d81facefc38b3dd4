"""Can a better R close the per-head conversion's gap without training? ``python -m experiments granularity-refit``
(`make granularity-refit`) -> ``results/granularity_refit/``.

It starts from the per-head P and R of a `granularity-lengths` run, one k (its ``head uniform`` arm), keeps every P
and refits R and its bias, in the longest bucket, three ways that differ only in the data the fit sees (`ARMS`;
`run_granularity_refit` describes them). Each arm is converted without retraining (R fixed) and measured as
`granularity-lengths` measures its arms, on the held-out inputs of the longest bucket (the only one refit) and
held-out windows.
"""

from __future__ import annotations

import copy
import time

import torch

from hf_partial_attention.analysis.corpus import default_texts, make_windows
from hf_partial_attention.modeling_partial_encoders import partial_from_source
from hf_partial_attention.pattern import AttentionPattern
from hf_partial_attention.pattern_buckets import bucket_for
from hf_partial_attention.pattern_layers import LayerPatterns
from hf_partial_attention.reconstruction import solve_reconstruction
from hf_partial_attention.training.pair_task import stdlib_docstring_documents

from .layers import load_per_head_run
from ..lengths.study import held_out_inputs
from ..lengths.recover import measure
from ..store import write_study

__all__ = ["run_granularity_refit", "refit_layer", "render", "ARMS"]

ARMS = ("fit", "refit", "refit with docstrings", "refit in context")


def _scores(original, layer: int, hidden: torch.Tensor) -> torch.Tensor:
    """Layer ``layer``'s pre-softmax scores of the original model's weights on ``hidden`` ``(B, n, d)`` ->
    ``(B, H, n, n)`` float64 (full windows: no padding)."""
    attention = original.encoder.layer[layer].attention.self
    b, n, _ = hidden.shape
    heads, d_head = attention.num_attention_heads, attention.attention_head_size
    q = attention.query(hidden).view(b, n, heads, d_head).transpose(1, 2)  # (B, H, n, d_h)
    k = attention.key(hidden).view(b, n, heads, d_head).transpose(1, 2)  # (B, H, n, d_h)
    return (q.double() @ k.double().transpose(-1, -2)) * attention.scaling  # (B, H, n, n)


@torch.no_grad()
def _layer_input(model, layer: int, ids: torch.Tensor) -> torch.Tensor:
    """The hidden states ``(B, n, d)`` that enter ``layer`` of ``model`` on full windows ``ids``."""
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True).hidden_states[layer]


@torch.no_grad()
def refit_layer(original, patterns: LayerPatterns, layer: int, windows: torch.Tensor, *, context=None,
                batch_size: int = 16) -> list[AttentionPattern]:
    """Each head's R and bias of ``layer`` in the longest bucket refit on full windows ``(W, n)``, P kept.

    The regressors are the exact scores at P of ``context`` (a converted model: what the layer sees once the layers
    before it are partial) or, without it, of ``original``; the targets are ``original``'s scores at P̄. Per head and
    query i, the joint vector ``z = [x_P, y_P̄]`` has its mean and covariance accumulated in float64, and
    `solve_reconstruction` maps its first k entries to the rest: the estimator of the fit (``fit_pattern``) on this
    data. Returns one pattern per head, with the metadata of the fitted one plus ``refit`` and ``refit_windows``.
    """
    n = patterns.seq_len
    if windows.dim() != 2 or windows.shape[1] != n:
        raise ValueError(f"windows must be (W, {n}) token ids (the longest bucket's n), got {tuple(windows.shape)}.")
    fitted = [patterns.group(layer, head)[n] for head in range(patterns.heads)]
    if any(p is None for p in fitted):
        raise ValueError(f"layer {layer} runs bucket {n} exactly: nothing to refit.")
    indices = torch.stack([p.indices for p in fitted])  # (H, n, k)
    order = torch.cat([indices, torch.stack([p.complement for p in fitted])], dim=-1)  # (H, n, n): P then P̄
    total = torch.zeros(patterns.heads, n, n, dtype=torch.float64)  # Σz per (head, query)
    outer = torch.zeros(patterns.heads, n, n, n, dtype=torch.float64)  # Σzzᵀ per (head, query)
    for start in range(0, len(windows), batch_size):
        ids = windows[start:start + batch_size]
        target = _scores(original, layer, _layer_input(original, layer, ids))  # (B, H, n, n)
        source = target if context is None else _scores(original, layer, _layer_input(context, layer, ids))
        k = indices.shape[-1]
        z = torch.gather(target, -1, order.expand(len(ids), -1, -1, -1))  # (B, H, n, n): original, P then P̄
        z[..., :k] = torch.gather(source, -1, indices.expand(len(ids), -1, -1, -1))  # (B, H, n, k): the exact ones
        total += z.sum(0)
        outer += torch.einsum("bhia,bhic->hiac", z, z)
    mean = total / len(windows)  # (H, n, n)
    cov = outer / len(windows) - mean.unsqueeze(-1) * mean.unsqueeze(-2)  # (H, n, n, n)
    first = torch.arange(k).expand(patterns.heads, n, k)  # (H, n, k): z's first k entries are x_P
    ridge = float(fitted[0].metadata.get("ridge", 1e-6))
    recon, bias, _ = solve_reconstruction(cov, first, mean, ridge=ridge)  # (H, n, n−k, k), (H, n, n−k)
    how = "original" if context is None else "in context"
    return [AttentionPattern(p.indices, recon[h], bias[h], metadata={**p.metadata, "refit": how,
                                                                     "refit_windows": len(windows)})
            for h, p in enumerate(fitted)]


def _with(patterns: LayerPatterns, layer: int, heads: list[AttentionPattern]) -> LayerPatterns:
    """A copy of ``patterns`` whose ``layer`` has ``heads`` in the longest bucket."""
    layers = {lay: [copy.copy(b) for b in group] for lay, group in patterns.layers.items()}
    for head, pattern in enumerate(heads):
        buckets = layers[layer][head]
        buckets.patterns = {**buckets.patterns, patterns.seq_len: pattern}
    return LayerPatterns(layers, patterns.metadata)


def refit_arm(original, patterns: LayerPatterns, layers, windows: torch.Tensor, *, in_context: bool = False,
              batch_size: int = 16) -> LayerPatterns:
    """``patterns`` with every layer of ``layers`` refit (`refit_layer`), in order; ``in_context``: each layer on the
    model converted with the layers before it already refit."""
    for layer in layers:
        context = (partial_from_source(original, patterns, reconstruction="fixed").eval() if in_context
                   else None)
        patterns = _with(patterns, layer, refit_layer(original, patterns, layer, windows, context=context,
                                                      batch_size=batch_size))
    return patterns


def run_granularity_refit(lengths_run: str = "runs/granularity_lengths", results: str = "results/granularity_refit",
                          model: str | None = None, *, k: int = 16, objective: str = "fisher", windows: int = 320,
                          max_heldout: int = 600, heldout_windows: int = 64, batch_size: int = 16,
                          command: str | None = None) -> dict:
    """Refit, convert and measure every arm; writes ``results``/granularity_refit.json and .md.

    Each refit is the least-squares estimator of the fit (`reconstruction.solve_reconstruction`, centred, the fit's
    ridge). Only the data it sees changes:

    - ``refit``: the original model's scores on ``windows`` n-token windows of the demo text (the fit's own text,
      without its sentences and paragraphs). It is the control for the data the other two use.
    - ``refit with docstrings``: the same on as many windows again of the standard library's docstrings, a second
      real-English text. It asks whether the gap on held-out text comes from the one text the fit saw.
    - ``refit in context``: layer by layer, from the first partial layer up. The exact scores at P come from the
      model converted so far (the earlier layers refit in context already), that is, what the layer sees once
      converted. The targets at P̄ are the original model's scores there. It asks whether the error that compounds
      through the layers can be taken out by R. Layer 0's inputs are the original's, so its R is the plain refit's.
    """
    start, steps = time.perf_counter(), {}
    _, fitted, original, tok, model_id = load_per_head_run(lengths_run, model, k, objective)
    n = fitted.seq_len
    # the layers a conversion runs partially (the paper's: all but the last), each with a pattern in bucket n
    partial = partial_from_source(original, fitted, reconstruction="fixed").config.partial_layers
    layers = [layer for layer in sorted(partial) if fitted.group(layer, 0)[n] is not None]
    demo = make_windows(tok, default_texts(), n, windows)  # (W, n)
    docstrings = make_windows(tok, ["\n\n".join(d) for d in stdlib_docstring_documents()], n, windows)  # (W, n)
    t = time.perf_counter()
    arms = {"fit": fitted, "refit": refit_arm(original, fitted, layers, demo, batch_size=batch_size),
            "refit with docstrings": refit_arm(original, fitted, layers, torch.cat([demo, docstrings]),
                                          batch_size=batch_size),
            "refit in context": refit_arm(original, fitted, layers, demo, in_context=True, batch_size=batch_size)}
    steps["refits"] = time.perf_counter() - t
    t = time.perf_counter()
    tokens, held = held_out_inputs(tok, max_heldout, heldout_windows, n)
    lengths = fitted.lengths
    longest = {kind: tk.subset([i for i, x in enumerate(tk.lengths.tolist()) if bucket_for(lengths, x) == n])
               for kind, tk in tokens.items()}
    models = {arm: partial_from_source(original, p, reconstruction="fixed").eval() for arm, p in arms.items()}
    rows = [r for r in measure(original, models, {**longest, "windows": held}, lengths, batch_size)
            if r["bucket"] == n]
    steps["held-out measurement"] = time.perf_counter() - t
    result = {"command": command or "python -m experiments granularity-refit", "model": model_id, "k": k, "n": n,
              "objective": objective, "layers": layers, "lengths": lengths, "arms": list(arms),
              "windows": {"demo": len(demo), "docstrings": len(docstrings)}, "heldout_windows": len(held.lengths),
              "heldout_inputs": {kind: len(tk) for kind, tk in longest.items()}, "rows": rows,
              # the fit's predicted error in bucket n, ε / Tr(C) of each head (method.md, eq. 8), per layer its mean
              "predicted_error": {str(layer): sum(float(fitted.group(layer, h)[n].metadata["normalized_error"])
                                                  for h in range(fitted.heads)) / fitted.heads for layer in layers},
              "seconds": {name: round(s, 1) for name, s in steps.items()}}
    result["total_seconds"] = round(time.perf_counter() - start, 1)
    write_study(results, "granularity_refit", result, render(result))
    return result


def render(result: dict) -> str:
    """Markdown: the arms' held-out 1 − cos and Spearman in the longest bucket."""
    n = result["n"]
    lines = [f"# Refitting R without training: P and R per head on `{result['model']}`", "",
             f"Command (wall time {result['total_seconds'] / 60:.1f} min):", "", "```", result["command"], "```", "",
             f"- P per head, one k (k = {result['k']} in bucket {n}, objective `{result['objective']}`) from the "
             "granularity-lengths run; its R and bias (`fit`: from the bucket's sentences, paragraphs and windows of "
             f"the demo text) refit in bucket {n} in layers {result['layers']}, P kept, centred least squares:",
             f"  - `refit`: the original model's scores on {result['windows']['demo']} windows of the demo text;",
             f"  - `refit with docstrings`: the same plus {result['windows']['docstrings']} windows of the standard "
             "library's docstrings;",
             "  - `refit in context`: layer by layer, the exact scores at P from the model converted so far, the "
             "targets the original's; the demo windows.",
             "- The fit's predicted error in bucket n (ε / Tr C, eq. 8, the mean over each layer's heads): " +
             ", ".join(f"layer {layer} {e:.2f}" for layer, e in result["predicted_error"].items()) + ".",
             f"- Converted without retraining (R fixed); held out: installed packages' descriptions, the inputs of "
             f"bucket {n} ({result['heldout_inputs']}) and {result['heldout_windows']} windows of {n} tokens.", ""]
    by = {(r["model"], r["inputs_kind"]): r for r in result["rows"]}
    kinds = sorted({r["inputs_kind"] for r in result["rows"]})
    for metric, title, fmt in (("one_minus_cos", "1 − cos", "{:.4f}"), ("spearman", "pairwise Spearman", "{:.3f}")):
        lines += [f"## {title}", "", "| inputs | " + " | ".join(result["arms"]) + " |",
                  "|---|" + "---:|" * len(result["arms"])]
        for kind in kinds:
            cells = [fmt.format(by[(arm, kind)][metric]) if by.get((arm, kind), {}).get(metric) is not None else "–"
                     for arm in result["arms"]]
            lines.append(f"| {kind} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)

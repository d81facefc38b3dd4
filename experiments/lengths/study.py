"""Zero-fill vs length buckets vs conditional R on held-out inputs of real lengths (issue 23): ``python -m experiments
lengths`` -> ``results/lengths/`` (lengths.json, lengths.md, figures).

Fit on the demo's text, measure on documents the fit never saw (installed packages' descriptions), each arm
converted from the same MiniLM without retraining, k = 8 and 16: the zero-fill pattern, length buckets, and the
conditional R. `run_lengths` describes the fit, the arms and the measures.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from importlib import metadata

import torch

from hf_partial_attention.analysis.collect import load_model_and_tokenizer
from hf_partial_attention.analysis.conditional import ConditionalReconstructor
from hf_partial_attention.analysis.corpus import default_texts, make_windows, pydoc_paragraphs
from hf_partial_attention.analysis.covariance import ScoreCovariance
from hf_partial_attention.analysis.defaults import resolve_model
from hf_partial_attention.analysis.inputs import TokenizedInputs, split_sentences, tokenize_inputs
from hf_partial_attention.analysis.derive import derive_lengths
from hf_partial_attention.analysis.lengths import analyze_lengths, bucket_covariance_files, bucket_k_suffix
from hf_partial_attention.analysis.workflow import COVARIANCE_FILE, analyze, derive
from hf_partial_attention.cost import bucket_savings, distribution_saving
from hf_partial_attention.modeling_partial_encoders import partial_from_source
from hf_partial_attention.pattern import AttentionPattern
from hf_partial_attention.pattern_buckets import PatternBuckets, bucket_for

from .report import plot_against_length, render
from ..store import write_study

logger = logging.getLogger(__name__)

__all__ = ["run_lengths", "held_out_documents", "held_out_inputs", "fit_documents", "spearman", "run_inputs",
           "embedding_metrics"]

LENGTHS = (16, 32, 64, 128)
README_PACKAGES = ("tqdm", "torch", "transformers", "datasets", "huggingface_hub", "tokenizers", "accelerate",
                   "peft", "safetensors", "sentence-transformers", "numpy", "pandas", "scipy", "matplotlib")


def _prose(block: str) -> bool:
    """A paragraph of prose: at least 8 words, mostly letters, not code, a table or a list of links."""
    words = block.split()
    letters = sum(c.isalpha() for c in block)
    return (len(words) >= 8 and letters >= 0.7 * len(block.replace(" ", "")) and "```" not in block
            and not block.lstrip().startswith(("|", "<", "#", "[", "!", "$", ">>>")))


def held_out_documents(packages=README_PACKAGES) -> list[list[str]]:
    """Paragraphs of prose from the long descriptions of installed packages, one document per package: English the
    fit (pydoc topics) never saw."""
    docs = []
    for name in packages:
        try:
            payload = metadata.metadata(name).get_payload() or ""
        except metadata.PackageNotFoundError:
            continue
        blocks = [" ".join(re.sub(r"[*_`]|\[([^\]]*)\]\([^)]*\)", r"\1", b).split())
                  for b in re.split(r"\n\s*\n", payload)]
        paragraphs = [b for b in blocks if _prose(b)]
        if paragraphs:
            docs.append(paragraphs)
    return docs


def held_out_inputs(tok, max_heldout: int, heldout_windows: int, n: int = LENGTHS[-1]):
    """``({"sentences", "paragraphs", "pairs": TokenizedInputs}, windows)``: at most ``max_heldout`` inputs of each
    kind from `held_out_documents` (evenly spaced), truncated to n tokens, and ``heldout_windows`` windows of n (None
    for 0)."""
    docs = held_out_documents()
    kinds = {"sentences": [s for d in docs for p in d for s in split_sentences(p)],
             "paragraphs": [p for d in docs for p in d],
             "pairs": [(a, b) for d in docs for p in d for a, b in zip(split_sentences(p), split_sentences(p)[1:])]}
    kinds = {name: inputs[:: max(1, len(inputs) // max_heldout)][:max_heldout] for name, inputs in kinds.items()}
    tokens = {name: tokenize_inputs(tok, inputs, n) for name, inputs in kinds.items()}
    if not heldout_windows:
        return tokens, None
    window_ids = make_windows(tok, [" ".join(p for p in d) for d in docs], n, heldout_windows)  # (W, n)
    windows = TokenizedInputs(window_ids, torch.zeros_like(window_ids),
                              torch.full((len(window_ids),), window_ids.shape[1], dtype=torch.long))
    return tokens, windows


def fit_documents() -> list[list[str]]:
    """The demo text's documents (pydoc topics), each as its sentences and its paragraphs (real inputs of both)."""
    docs = []
    for topic in pydoc_paragraphs():
        paragraphs = [" ".join(p.split()) if isinstance(p, str) else " ".join(p) for p in topic]
        sentences = [s for p in paragraphs for s in split_sentences(p)]
        docs.append(sentences + [p for p in paragraphs if len(p.split()) > 12])
    return docs


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation of two 1-D tensors (ties broken by position: the similarities are continuous)."""
    ra = torch.argsort(torch.argsort(a)).double()
    rb = torch.argsort(torch.argsort(b)).double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


@torch.no_grad()
def _encode(model, batch: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = model(**batch, output_hidden_states=True)
    mask = batch["attention_mask"].unsqueeze(-1).double()  # (B, T, 1)
    emb = (out.last_hidden_state.double() * mask).sum(1) / mask.sum(1)  # (B, hidden)
    return emb, [h.double() * mask for h in out.hidden_states[1:]]  # per layer, zero at padding


def run_inputs(model, tokens, index: list[int], batch_size: int, install=None):
    """Embeddings ``(S, hidden)`` of the inputs ``index`` and each layer's hidden states (real positions only),
    in batches of inputs of similar length; ``install(T)``: called before each batch of one length T (conditional)."""
    order = sorted(index, key=lambda i: int(tokens.lengths[i]))
    groups = ([[i for i in order if int(tokens.lengths[i]) == t]
               for t in sorted({int(tokens.lengths[i]) for i in order})]
              if install else [order[s:s + batch_size] for s in range(0, len(order), batch_size)])
    embs, hidden = {}, {}
    for group in groups:
        for start in range(0, len(group), batch_size):
            part = group[start:start + batch_size]
            width = int(tokens.lengths[part].max())
            if install:
                install(width)
            emb, layers = _encode(model, tokens.batch(part, width))
            for j, i in enumerate(part):
                embs[i] = emb[j]
                hidden[i] = [h[j, :int(tokens.lengths[i])] for h in layers]
    return torch.stack([embs[i] for i in index]), [hidden[i] for i in index]


def embedding_metrics(ref, arm) -> dict:
    (e0, h0), (e1, h1) = ref, arm
    cos = torch.nn.functional.cosine_similarity(e0, e1, dim=-1)
    n0, n1 = torch.nn.functional.normalize(e0, dim=-1), torch.nn.functional.normalize(e1, dim=-1)
    upper = torch.triu_indices(len(e0), len(e0), 1)
    s0, s1 = (n0 @ n0.T)[upper[0], upper[1]], (n1 @ n1.T)[upper[0], upper[1]]
    layers = len(h0[0])
    hidden = [float(sum(((a[l] - b[l]) ** 2).sum() for a, b in zip(h0, h1))
                    / sum((a[l] ** 2).sum() for a in h0)) ** 0.5 for l in range(layers)]
    return {"inputs": len(e0), "one_minus_cos": float(1 - cos.mean()), "spearman": spearman(s0, s1) if len(e0) > 2
            else None, "hidden_error": hidden, "one_minus_cos_each": (1 - cos).tolist()}


def _conditional_installer(model, buckets: PatternBuckets, reconstructors: dict):
    """``install(T)``: the model's buckets with bucket(T)'s R replaced by the conditional R_i(T) of
    ``reconstructors[b]`` (the keys of [T, b) are left out instead of reconstructed); an exact bucket installs
    nothing. The ``conditional`` arm runs it on n's one bucket, ``bucket-conditional`` on the length buckets."""

    def install(t: int) -> None:
        b = buckets.bucket_for(t)
        if buckets[b] is None:
            return
        reconstruction, bias = reconstructors[b].params(t)  # cached per t
        patterns = {bb: buckets[bb] for bb in buckets.partial_lengths}
        patterns[b] = AttentionPattern(buckets[b].indices, reconstruction, bias)
        model.set_pattern(PatternBuckets(patterns, buckets.exact_lengths, k=buckets.k, metadata=buckets.metadata))
    return install


def run_lengths(out: str = "runs/lengths", results: str = "results/lengths", model: str | None = None, *,
                ks=(8, 16), lengths=LENGTHS, objective: str = "paper", fit_windows: int = 320,
                heldout_windows: int = 64, fit_inputs: int | None = None, max_heldout: int = 600, batch_size: int = 16,
                progress: bool = True, command: str | None = None, bucket_k: dict[int, int] | None = None) -> dict:
    """Fit, convert and measure; writes ``results``/lengths.json, lengths.md, figures.
    ``bucket_k``: ``{b: k_b}``, buckets that take their own k in place of each k (`derive_lengths`).

    Fit (the demo's text, `pydoc_data.topics`): the fixed-window analysis of n = 128 (`analyze` + `derive`: the
    zero-fill pattern) and the bucket analysis on the text's sentences and paragraphs at their own lengths
    (`analyze_lengths` + `derive_lengths`). Measure on documents the fit never saw, of another kind of English (the
    long descriptions of installed packages: `held_out_documents`): their sentences, paragraphs and
    adjacent-sentence pairs, and 128-token windows of them. Arms, each converted from the same MiniLM without
    retraining, k = 8 and 16:

    - ``zero-fill``: n's P and R fitted on windows, an input of T < n tokens padded with zero scores (format 1);
    - ``buckets``: P and R per bucket fitted on real inputs of that length (the smallest bucket >= T);
    - ``conditional``: n's P, and for each T the conditional R_i(T) = C_US C_SS⁻¹ of the window covariance
      (`analysis.conditional`), installed per input length;
    - ``bucket-conditional``: the buckets, with bucket(T)'s R replaced by the conditional R_i(T) of that bucket's
      covariance: the keys of [T, b) are left out instead of reconstructed.

    Per bucket: mean 1 − cos of mean-pooled embeddings to the original model's, the Spearman correlation of all
    pairwise cosine similarities with the original's, each layer's relative hidden-state error at real positions;
    and the held-out normalised score error of `derive_lengths`."""
    bucket_k = {int(b): int(v) for b, v in (bucket_k or {}).items()}
    start = time.perf_counter()
    model_path, model_id = resolve_model(model)
    lengths = tuple(sorted(int(b) for b in lengths))
    if lengths[-1] != LENGTHS[-1]:
        raise ValueError(f"lengths={list(lengths)} must end with n = {LENGTHS[-1]} (the windows' length).")
    windows_dir = os.path.join(out, "windows")
    buckets_dir = os.path.join(out, "buckets_" + "_".join(map(str, lengths))
                               + ("" if objective == "paper" else f"_{objective}"))
    steps = {}
    t = time.perf_counter()
    analyze(model_path, default_texts(), windows_dir, seq_len=LENGTHS[-1], max_sequences=fit_windows,
            heldout_sequences=heldout_windows, model_id=model_id, progress=progress)
    derive(windows_dir, ks, "per_query", baselines=False, progress=progress)
    steps["windows: analyze + derive"] = time.perf_counter() - t
    t = time.perf_counter()
    derived = _fit_buckets(model_path, model_id, windows_dir, buckets_dir, ks, lengths, objective, fit_inputs,
                           batch_size, progress, bucket_k)
    steps["buckets: analyze_lengths + derive_lengths"] = time.perf_counter() - t

    t = time.perf_counter()
    original, tok = load_model_and_tokenizer(model_path)
    original.eval()
    tokens, windows = held_out_inputs(tok, max_heldout, heldout_windows)
    cov = ScoreCovariance.load(os.path.join(windows_dir, COVARIANCE_FILE))
    inputs, rows = [*tokens.items(), ("windows", windows)], []
    for k in ks:
        rows += _measure_k(k, original, cov, windows_dir, buckets_dir, bucket_k, inputs, lengths, batch_size)
    steps["held-out measurement"] = time.perf_counter() - t
    d_head = original.config.hidden_size // original.config.num_attention_heads
    real = [int(x) for tk in tokens.values() for x in tk.lengths]  # every held-out real input's length
    result = {"command": command or "python -m experiments lengths", "model": model_id, "lengths": list(lengths),
              "ks": list(ks), "objective": objective,
              "bucket_k": {str(b): v for b, v in sorted(bucket_k.items())},
              "fit": {"windows": fit_windows, "bucket_inputs": json.loads(json.dumps(
                  {row["length"]: row["fit_inputs"] for row in derived["ks"][str(ks[0])]["buckets"]}))},
              "score_errors": derived["ks"], "rows": rows, "head_dim": d_head,
              "saving": _savings(ks, lengths, bucket_k, d_head, real),
              "heldout_lengths": {"median": sorted(real)[len(real) // 2], "p10": sorted(real)[len(real) // 10],
                                  "p90": sorted(real)[9 * len(real) // 10]},
              "seconds": {name: round(s, 1) for name, s in steps.items()},
              "total_seconds": round(time.perf_counter() - start, 1)}
    os.makedirs(os.path.join(results, "figures"), exist_ok=True)
    figures = plot_against_length(rows, os.path.join(results, "figures"))
    result["figures"] = {name: os.path.relpath(path, results) for name, path in figures.items()}  # no machine paths
    write_study(results, "lengths", result, render(result))
    return result


def _fit_buckets(model_path: str, model_id: str, windows_dir: str, buckets_dir: str, ks, lengths: tuple[int, ...],
                 objective: str, fit_inputs: int | None, batch_size: int, progress: bool,
                 bucket_k: dict[int, int]) -> dict:
    """P and R per length bucket (`analyze_lengths` + `derive_lengths`), the windows' zero-fill patterns copied
    beside them; returns `derive_lengths`' result."""
    analyze_lengths(model_path, fit_documents(), buckets_dir, lengths=lengths, kind="sentence", model_id=model_id,
                    max_inputs=fit_inputs, progress=progress, batch_size=batch_size)
    os.makedirs(os.path.join(buckets_dir, "patterns"), exist_ok=True)
    for k in ks:  # the zero-fill reference of derive_lengths' score errors
        AttentionPattern.load(os.path.join(windows_dir, "patterns", f"per_query_k{k}.safetensors")).save(
            os.path.join(buckets_dir, "patterns", f"per_query_k{k}.safetensors"))
    return derive_lengths(buckets_dir, ks, objective=objective, progress=progress,  # the buckets' greedy objective
                          bucket_k=bucket_k)


def _measure_k(k: int, original, cov: ScoreCovariance, windows_dir: str, buckets_dir: str, bucket_k: dict[int, int],
               inputs: list, lengths: tuple[int, ...], batch_size: int) -> list[dict]:
    """The rows of k: each arm (zero-fill, buckets, and their conditional R) against the original model on each
    kind of held-out ``inputs`` (``(kind, tokens)``), per length bucket with at least 3 inputs."""
    zero = AttentionPattern.load(os.path.join(windows_dir, "patterns", f"per_query_k{k}.safetensors"))
    buckets = PatternBuckets.load(os.path.join(buckets_dir, "patterns",
                                               f"buckets_k{k}{bucket_k_suffix(bucket_k)}.safetensors"))
    arms = {"zero-fill": partial_from_source(original, zero, reconstruction="fixed").eval(),
            "buckets": partial_from_source(original, buckets, reconstruction="fixed").eval(),
            "conditional": partial_from_source(original, zero, reconstruction="fixed").eval(),
            "bucket-conditional": partial_from_source(original, buckets, reconstruction="fixed").eval()}
    bucket_covs = bucket_covariance_files(buckets_dir)
    installers = {
        "conditional": _conditional_installer(arms["conditional"], PatternBuckets.single(zero), {
            zero.seq_len: ConditionalReconstructor.for_pattern(cov, zero)}),
        "bucket-conditional": _conditional_installer(arms["bucket-conditional"], buckets, {
            b: ConditionalReconstructor.for_pattern(ScoreCovariance.load(bucket_covs[b]), buckets[b])
            for b in buckets.partial_lengths})}
    rows = []
    for kind, tk in inputs:
        bucket_of = [bucket_for(list(lengths), int(x)) for x in tk.lengths]
        for b in lengths:
            index = [i for i, bb in enumerate(bucket_of) if bb == b]
            if len(index) < 3:
                continue
            ref = run_inputs(original, tk, index, batch_size)
            for arm, m in arms.items():
                install = installers.get(arm)
                got = run_inputs(m, tk, index, batch_size, install)
                row = {"k": k, "arm": arm, "inputs_kind": kind, "bucket": b,
                       "lengths": [int(tk.lengths[i]) for i in index], **embedding_metrics(ref, got)}
                rows.append(row)
                logger.info("k=%d %s %s b=%d: 1-cos %.4f, spearman %s", k, arm, kind, b, row["one_minus_cos"],
                            row["spearman"])
    return rows


def _savings(ks, lengths: tuple[int, ...], bucket_k: dict[int, int], d_head: int, real: list[int]) -> dict:
    """QKᵀ savings per k at the held-out inputs' own lengths (``real``): the buckets, zero fill, each bucket."""
    lengths_k = {k: [bucket_k.get(b, k) for b in lengths] for k in ks}  # each bucket's k (min(k, b) in cost)
    return {str(k): {"buckets": distribution_saving(lengths, lengths_k[k], d_head, real),
                     "zero_fill": distribution_saving([lengths[-1]], k, d_head, real),
                     "per_bucket": {str(b): v for b, v in bucket_savings(lengths, lengths_k[k], d_head).items()}}
            for k in ks}

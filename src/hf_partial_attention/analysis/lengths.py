"""P and R per length bucket, fitted on the inputs a user has (method spec §5, "Real inputs are shorter than n").

`analyze_lengths` runs the model on real inputs (sentences, paragraphs or sentence pairs, `inputs`) at their own
length, one covariance per bucket (its docstring says how an input enters one, and the folder layout).
`derive.derive_lengths` fits, for each k, the greedy P and optimal R of every bucket with b > k (buckets with b <= k
run exactly) into one `PatternBuckets` file, and `record_buckets` measures each bucket on its held-out inputs at
real positions beside the zero fill of a fixed-window pattern of n and the conditional R (`conditional`).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import time
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..cost import score_cost
from ..pattern import AttentionPattern
from ..pattern_buckets import bucket_for, check_lengths
from . import plots
from .collect import display_name, hub_id, load_model_and_tokenizer, model_shape
from .conditional import ConditionalReconstructor
from .corpus import split_heldout
from .covariance import ScoreCovariance
from .derive_files import bucket_k_suffix, file_tag
from .fit_checks import check_seq_len, fit_size_warning
from .folder import update_results
from .inputs import DEFAULT_PAIR_COLUMNS, TokenizedInputs, flatten, load_inputs, tokenize_inputs
from .length_eval import PaddedPattern, RealPositionMeter, run_inputs

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_LENGTHS", "default_lengths", "analyze_lengths", "record_buckets", "bucket_k_suffix",
           "bucket_covariance_files", "load_heldout_inputs", "HELDOUT_INPUTS_FILE"]

DEFAULT_LENGTHS = (16, 32, 64, 128)
HELDOUT_INPUTS_FILE = "heldout_inputs.safetensors"
_COV_FILE = re.compile(r"covariance_len(\d+)\.safetensors$")


def default_lengths(model: Any, lengths=None) -> list[int]:
    """The buckets for ``model``: ``lengths`` (default `DEFAULT_LENGTHS`); a sentence-transformers folder gets buckets
    up to its ``max_seq_length`` (sentence_bert_config.json): the defaults up to it and it, and no bucket above it
    (its `encode` truncates there)."""
    cap = None
    if isinstance(model, (str, os.PathLike)):
        settings = os.path.join(os.fspath(model), "sentence_bert_config.json")
        if os.path.isfile(settings):
            with open(settings, encoding="utf-8") as f:
                cap = json.load(f).get("max_seq_length")
    if lengths is None:
        base = list(DEFAULT_LENGTHS)
        if cap:
            base = sorted({b for b in base if b < cap} | {b for b in (256, 512) if b < cap} | {int(cap)})
        return check_lengths(base)
    lengths = check_lengths(lengths)
    if cap and lengths[-1] > cap:
        kept = [b for b in lengths if b <= cap]
        logger.warning("Buckets %s exceed the sentence-transformers max_seq_length %d of %s (inputs are truncated "
                       "there): dropped.", [b for b in lengths if b > cap], cap, display_name(model))
        if not kept:
            raise ValueError(f"lengths={lengths} all exceed max_seq_length={cap} of {display_name(model)}; pass "
                             f"--lengths up to {cap}.")
        lengths = kept
    return lengths


def bucket_covariance_files(out: str) -> dict[int, str]:
    """``{b: path}`` of the bucket covariances in ``out``."""
    found = {}
    for path in glob.glob(os.path.join(out, "covariance_len*.safetensors")):
        if m := _COV_FILE.search(path):
            found[int(m.group(1))] = path
    return dict(sorted(found.items()))


def _buckets_of(lengths: torch.Tensor, buckets: list[int]) -> torch.Tensor:
    return torch.tensor([bucket_for(buckets, int(t)) for t in lengths.tolist()], dtype=torch.long)


def analyze_lengths(model: Any, inputs: Any = None, out: str = "runs/lengths", *, lengths=None,
                    kind: str = "sentence", tokenizer: Any = None, heldout_every: int = 5,
                    max_inputs: int | None = None, max_heldout: int | None = None, granularity: str = "pooled",
                    centered: bool = True, batch_size: int = 16, columns=DEFAULT_PAIR_COLUMNS,
                    text_column: str = "text", split: str = "train", model_id: str | None = None,
                    progress: bool = True, section: str = "analyze_lengths") -> dict:
    """One per-query covariance per length bucket from ``model``'s scores on real inputs, and the held-out inputs.

    Each input of T tokens goes to the smallest bucket b >= T, is padded to b with the real attention mask, and its
    scores enter that bucket's per-query covariance with its rows i >= T left out and its keys >= T zero
    (`ScoreCovariance.update(..., lengths=...)`). Held out: every ``heldout_every``-th document.

    Folder layout (beside `workflow`'s): ``covariance_len{b}.safetensors``, ``heldout_inputs.safetensors``,
    ``patterns/buckets_k{k}.safetensors``, ``figures/input_lengths.png``; results in ``results.json``
    (``analyze_lengths``, ``derive_lengths``).

    Args:
        model: path / Hub id or a loaded model (a path is recorded, for `derive_lengths`' held-out measurement).
        inputs: a source of `inputs.load_inputs` (None: the demo text), or documents ``[[input, ...], ...]``.
        lengths: bucket lengths (default `default_lengths`); inputs are truncated to the longest.
        kind: ``"sentence"``, ``"paragraph"`` or ``"pairs"``.
        heldout_every: every ``heldout_every``-th document is held out (0: none).
        max_inputs, max_heldout: at most this many fit / held-out inputs (in document order).
        columns, text_column, split: as in `inputs.load_inputs`.

    A bucket fitted on fewer inputs than it has positions logs `fit_size_warning` (and is fitted); a bucket with no
    input is skipped with a warning, and inputs of its lengths run the next bucket up (``skipped`` in the result).
    """
    start = time.perf_counter()
    lengths = default_lengths(model, lengths)
    model_obj, tok = load_model_and_tokenizer(model, tokenizer)
    if tok is None:
        raise ValueError("analyze_lengths needs the model's tokenizer; pass tokenizer=<path or tokenizer>.")
    check_seq_len(model_obj, lengths[-1])
    documents = inputs if _is_documents(inputs) else load_inputs(inputs, kind, columns=columns,
                                                                  text_column=text_column, split=split)
    fit_docs, held_docs = split_heldout(documents, heldout_every) if heldout_every else (documents, [])
    fit, held = _tokenized(tok, documents, fit_docs, held_docs, kind, max_inputs, max_heldout, lengths[-1])
    fit_bucket, held_bucket = _buckets_of(fit.lengths, lengths), _buckets_of(held.lengths, lengths)
    os.makedirs(out, exist_ok=True)
    layers, heads, head_dim = model_shape(model_obj)
    source = (os.fspath(model) if isinstance(model, (str, os.PathLike))
              else getattr(model_obj.config, "_name_or_path", ""))
    identity = model_id or hub_id(model) or ""
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    rows, skipped, present = [], [], [b for b in lengths if int((fit_bucket == b).sum())]
    for b in lengths:
        index = torch.nonzero(fit_bucket == b).flatten()
        if not len(index):
            skipped.append(_skipped_bucket(b, present))
            continue
        meta = dict(model=source, model_id=identity, kind=kind, seq_len=b, lengths=lengths, num_layers=layers,
                    num_heads=heads, head_dim=head_dim, model_type=getattr(model_obj.config, "model_type", ""))
        row = _collect_bucket(model_obj, fit, index, b, granularity, centered, batch_size, pad, progress, meta,
                              os.path.join(out, f"covariance_len{b}.safetensors"))
        rows.append({**row, "heldout_inputs": int((held_bucket == b).sum())})
    _count_skipped_heldout(rows, skipped, held_bucket)
    if len(held):
        save_file({name: v.contiguous() for name, v in held.tensors().items()}, os.path.join(out, HELDOUT_INPUTS_FILE),
                  metadata={"model": source, "kind": kind, "lengths": json.dumps(lengths)})
    summary = {"model": identity or display_name(source), "kind": kind, "lengths": lengths, "buckets": rows,
               "skipped": skipped, "fit_inputs": len(fit), "heldout_inputs": len(held),
               "fit_documents": len(fit_docs), "heldout_documents": len(held_docs), "granularity": granularity,
               "centered": centered, "head_dim": head_dim, **_length_summary(fit, held, lengths, kind, out),
               "seconds": round(time.perf_counter() - start, 1)}
    update_results(out, section, summary)
    return summary


def _tokenized(tok, documents: list, fit_docs: list, held_docs: list, kind: str, max_inputs: int | None,
               max_heldout: int | None, longest: int) -> tuple[TokenizedInputs, TokenizedInputs]:
    """The fit and held-out inputs (at most ``max_inputs`` / ``max_heldout``, in document order), tokenized up to the
    longest bucket; a ValueError when nothing is left to fit on."""
    fit_inputs = flatten(fit_docs)[0][:max_inputs]
    if not fit_inputs:
        raise ValueError(f"No inputs to fit on: {len(documents)} document(s) of kind {kind!r}; pass more text or "
                         "another --inputs kind.")
    fit = tokenize_inputs(tok, fit_inputs, longest)
    held = tokenize_inputs(tok, flatten(held_docs)[0][:max_heldout], longest)
    return fit, held


def _skipped_bucket(b: int, present: list[int]) -> dict[str, Any]:
    """The entry of a bucket with no fit input in ``skipped``: the bucket its inputs run instead (the next one up
    that has fit inputs, or None), with a warning."""
    above = [c for c in present if c > b]
    logger.warning("Bucket %d has no fit input: skipped; inputs of its lengths run %s.", b,
                   f"bucket {above[0]}" if above else "no bucket (there is none longer)")
    return {"length": b, "used_instead": above[0] if above else None}


def _count_skipped_heldout(rows: list[dict], skipped: list[dict], held_bucket: torch.Tensor) -> None:
    """Held-out inputs of a skipped bucket are measured in the bucket they run: add them to its row."""
    for s in skipped:
        for r in rows:
            if r["length"] == s["used_instead"]:
                r["heldout_inputs"] += int((held_bucket == s["length"]).sum())


def _length_summary(fit: TokenizedInputs, held: TokenizedInputs, lengths: list[int], kind: str,
                    out: str) -> dict[str, Any]:
    """The inputs' lengths: a histogram (tokens -> inputs), how many reach the longest bucket, and the figure."""
    values, counts = torch.unique(torch.cat([fit.lengths, held.lengths]), return_counts=True)
    figure = plots.plot_length_histogram(fit.lengths.tolist(), held.lengths.tolist(), lengths,
                                         os.path.join(out, "figures", "input_lengths.png"),
                                         f"Input lengths ({kind}), buckets {lengths}")
    return {"length_histogram": {str(int(t)): int(c) for t, c in zip(values.tolist(), counts.tolist())},
            "at_longest_bucket": int((fit.lengths == lengths[-1]).sum() + (held.lengths == lengths[-1]).sum()),
            "figures": {"input_lengths": figure}}


def _collect_bucket(model, fit: TokenizedInputs, index: torch.Tensor, b: int, granularity: str, centered: bool,
                    batch_size: int, pad: int, progress: bool, meta: dict, path: str) -> dict[str, Any]:
    """Bucket ``b``'s covariance from the fit inputs ``index`` (padded to b, rows and keys past each input's length
    left out), saved at ``path`` with ``meta``; its row of the summary."""
    if warning := fit_size_warning(len(index), b):
        logger.warning("Bucket %d: %s", b, warning)
    cov = ScoreCovariance(b, ("per_query",), granularity, centered)
    run_inputs(model, fit, index, b, lambda layer, s, t: cov.update(layer, s, lengths=t), batch_size, pad, progress,
               desc=f"scores b={b}", full_width=False)  # each batch's (w/b)³ of the update: its w × w block
    t = fit.lengths[index].float()
    row = {"length": b, "fit_inputs": len(index), "median_length": float(t.median()), "min_length": int(t.min()),
           "max_length": int(t.max()), "fit_warning": warning, "path": path}
    cov.num_sequences = len(index)
    cov.metadata.update(**meta, num_inputs=len(index), median_length=row["median_length"])
    cov.save(path)
    return row


def _is_documents(inputs: Any) -> bool:
    return isinstance(inputs, list) and bool(inputs) and all(isinstance(d, list) for d in inputs)


def load_heldout_inputs(out: str) -> TokenizedInputs | None:
    path = os.path.join(out, HELDOUT_INPUTS_FILE)
    if not os.path.isfile(path):
        return None
    t = load_file(path)
    return TokenizedInputs(t["input_ids"], t["token_type_ids"], t["lengths"])


def _windows_reference(out: str, tag: str, k: int, centered: bool | None):
    """The fixed-window pattern of n for k (``patterns/{tag}_k{k}``, else the paper objective's ``per_query_k{k}``: the
    zero fill a one-bucket model runs today) and the n-window covariance, when present."""
    path = os.path.join(out, "patterns", f"{tag}_k{k}.safetensors")
    if not os.path.isfile(path):
        path = os.path.join(out, "patterns", f"per_query_k{k}.safetensors")
    pattern = AttentionPattern.load(path) if os.path.isfile(path) else None
    cov_path = os.path.join(out, "covariance.safetensors")
    conditional = None
    if pattern is not None and os.path.isfile(cov_path):
        cov = ScoreCovariance.load(cov_path)
        if "per_query" in cov.scopes and cov.seq_len == pattern.seq_len:
            conditional = ConditionalReconstructor.for_pattern(cov, pattern, centered)
    return pattern, conditional


def record_buckets(out: str, covs: dict[int, ScoreCovariance], sets, built: dict, fitted: dict, req, path) -> dict:
    """The pooled buckets' files and section (`derive.derive_patterns`): each k's `PatternBuckets` and, per bucket,
    its predicted error and, on the held-out inputs, its error at real positions beside the zero fill of the
    fixed-window pattern and the conditional R's.

    The zero fill of a fixed-window pattern of n is what a single-bucket model runs; the conditional R
    (`conditional`) is measured of the n-window covariance and of the bucket's own."""
    lengths, meta = list(covs), covs[max(covs)].metadata
    d_head = meta.get("head_dim")
    by_bucket: dict[int, dict[int, AttentionPattern]] = {}
    for (b, _, _), patterns in fitted.items():
        by_bucket[b] = patterns
    held = load_heldout_inputs(out) if req.evaluate else None
    held_bucket, measured = None, {}
    if held is not None and len(held):
        bucket_k = req.bucket_k or {}
        references = {k: _windows_reference(out, file_tag("per_query", req.family, req.objective), k, req.centered)
                      for k in {*(s.k for s in sets), *bucket_k.values()}}
        held_bucket, measured = _measure_buckets(meta, held, lengths, by_bucket, covs, references, req.centered,
                                                 req.batch_size or 16, req.progress)
    result: dict[str, Any] = {"lengths": lengths, "head_dim": d_head, "family": req.family,
                              "objective": req.objective, "kind": meta.get("kind"), "ks": {}}
    for s in sets:
        rows = []
        for b, cov in covs.items():
            kb = s.k_of(b, None)
            pattern = by_bucket.get(b, {}).get(kb) if kb < b else None
            row = {"length": b, "k": min(kb, b), "exact": pattern is None, "fit_inputs": cov.num_sequences,
                   "median_length": cov.metadata.get("median_length"),
                   "relative_cost": 1.0 if pattern is None or not d_head else score_cost(b, kb, d_head).relative,
                   "predicted": None if pattern is None else pattern.normalized_error}
            if measured or (held is not None and len(held) and pattern is not None):
                row["heldout_inputs"] = int((held_bucket == b).sum())
            if (b, kb) in measured:
                row.update(measured[(b, kb)])
                pattern.metadata.update(heldout_normalized_error=row["heldout"], heldout_inputs=row["heldout_inputs"])
            rows.append(row)
        built[s.name].save(path(s))
        result["ks"][str(s.k)] = {"k": s.k, "lengths_k": built[s.name].lengths_k, "path": path(s), "buckets": rows}
    result["_section"] = req.section or "derive_lengths"
    return result


def _measure_buckets(meta, held: TokenizedInputs, lengths, fitted, covs, references, centered, batch_size,
                     progress) -> tuple[torch.Tensor, dict[tuple[int, int], dict]]:
    """``(each held-out input's bucket (-1: longer than the longest), {(b, k): that bucket's held-out row}``, every
    fitted bucket measured on its held-out inputs (`_measure`)."""
    model, _ = load_model_and_tokenizer(meta["model"], load_tokenizer=False)
    runs = held.lengths <= lengths[-1]  # longer ones have no bucket here (the longest had no fit input)
    if not bool(runs.all()):
        logger.warning("%d held-out inputs are longer than the longest bucket %d: not measured.",
                       int((~runs).sum()), lengths[-1])
    held_bucket = torch.tensor([bucket_for(lengths, int(t)) if ok else -1
                                for t, ok in zip(held.lengths.tolist(), runs.tolist())], dtype=torch.long)
    measured: dict[tuple[int, int], dict] = {}
    for b, patterns in fitted.items():
        index = torch.nonzero(held_bucket == b).flatten()
        if len(index):
            measured.update(_measure(model, held, index, b, patterns, covs[b], references, centered, batch_size,
                                     progress))
    return held_bucket, measured


def _measure(model, held, index, b, patterns, cov, references, centered, batch_size, progress) -> dict:
    """Held-out errors at real positions of the inputs ``index`` of bucket b, for each k of ``patterns``: the
    bucket's pattern (``heldout``), its conditional R (``conditional_bucket``) and, when the folder has a
    fixed-window pattern of n >= b, its zero fill (``zero_fill_n``) and conditional R (``conditional_n``)."""
    methods = {}
    for k, pattern in patterns.items():
        methods[("heldout", k)] = PaddedPattern(pattern)
        methods[("conditional_bucket", k)] = ConditionalReconstructor.for_pattern(cov, pattern, centered)
        reference, conditional_n = references.get(k, (None, None))
        if reference is not None and reference.seq_len >= b:
            methods[("zero_fill_n", k)] = PaddedPattern(reference)
            if conditional_n is not None:
                methods[("conditional_n", k)] = conditional_n
    meter = RealPositionMeter(b, methods)
    run_inputs(model, held, index, b, meter.update, batch_size, progress=progress, desc=f"held-out b={b}")
    errors = meter.results()
    out = {}
    for k in patterns:
        reference = references.get(k, (None, None))[0]
        row = {"heldout_inputs": len(index), "score_matrices": meter.count,
               "reference_seq_len": None if reference is None else reference.seq_len}
        row.update({name: errors[(name, kk)] for name, kk in methods if kk == k})
        out[(b, k)] = row
    return out

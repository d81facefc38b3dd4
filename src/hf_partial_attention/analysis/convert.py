"""`convert`: a pattern file and a source model in, a partial checkpoint of the source's architecture out (P and R
in ``model.safetensors``, the code, tokenizer, card and, for a sentence-transformers source, its modules).
`workflow` re-exports it beside ``analyze`` and ``derive``."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ..pattern import AttentionPattern
from ..pattern_buckets import PatternBuckets, is_single_pattern_file
from ..pattern_layers import LayerPatterns, is_layer_patterns_file
from .collect import display_name

logger = logging.getLogger(__name__)

__all__ = ["convert"]


def convert(pattern_path: str, out_dir: str, model: Any = None, *, reconstruction: str | None = None,
            verify: bool = True, command: str | None = None) -> dict:
    """Write a partial checkpoint (weights of ``model``, P and R of the pattern) and check it reloads with
    ``AutoModel``. ``model`` defaults to the pattern's ``source_model``; its architecture picks the partial class
    (`partial_class_for`: PartialBert for BERT, PartialRoberta for RoBERTa, ...), and a model partial attention cannot
    run in (a decoder, DeBERTa-v2, MPNet, ...) is refused before anything is written (`UnsupportedModelError`).

    ``pattern_path`` is a single pattern (`AttentionPattern`, installed as it is) or length buckets
    (`PatternBuckets`, ``patterns/buckets_k<k>.safetensors`` of `derive.derive_lengths`: passed whole to
    ``from_source``); the checks, the card's pattern facts and n are those of its longest bucket. A per-layer file
    (`LayerPatterns`, ``derive --granularity layer`` or ``head``) gives each partial layer (or head) its own P and
    R (the first group's stand for the set in the checks and the card). ``reconstruction``: ``"common"`` by default,
    ``"per_layer"`` for a per-layer file (``"fixed"`` for either).

    The tokenizer is saved with ``model_max_length = n`` (pipelines with ``truncation=True`` then cut inputs to n);
    a sentence-transformers source also gets its modules, pooling and ``max_seq_length ≤ n`` (`sentence_folder`),
    so that ``SentenceTransformer(out_dir, trust_remote_code=True)`` loads the converted model.

    The model card states where P and R came from (the pattern's method, source model, windows, predicted and
    held-out errors), ``command`` (the command line that made the checkpoint, when given) and that the checkpoint
    is converted, not retrained; the same record goes into ``config.partial_conversion`` for later cards. The
    card's ``base_model`` is a Hub id (`convert_checks.base_model_id`) or left out.

    Raises ValueError for a whole-matrix pattern, a file that is not a pattern, or a pattern for more positions
    than the model has, and FileNotFoundError for a missing file. Logs a warning (also in ``result["warnings"]``)
    when k saves no work at the model's d_h and when the pattern was derived on another model."""
    from ..model_card import write_model_card
    from ..modeling_partial_encoders import partial_class_for
    from .convert_checks import base_model_id, check_convertible, source_warnings

    layers, buckets, pattern = _read_patterns(pattern_path)
    installed = layers if layers is not None else pattern if len(buckets.lengths) == 1 else buckets
    if reconstruction is None:
        reconstruction = "common" if layers is None else "per_layer"
    source = _source_model(model, pattern_path, layers, buckets, pattern)
    base_id = base_model_id(pattern, model)
    name = base_id or display_name(source)
    config = _source_config(source, name)
    warnings = check_convertible(pattern, pattern_path, config, name)
    warnings += source_warnings(pattern, pattern_path, model, config, name)
    if layers is not None and (warning := _memory_warning(layers, buckets, config)):
        logger.warning(warning)
        warnings.append(warning)
    partial = partial_class_for(config.model_type).from_source(source, installed, reconstruction=reconstruction)
    partial.config.partial_base_model = base_id  # a Hub id or nothing: a local path names no Hub repo
    partial.config.partial_conversion = _record(pattern, pattern_path, layers, buckets, name, command)
    partial.save_pretrained(out_dir, write_model_card=False)  # the card comes last, when the folder is complete
    result = _result(partial, config, out_dir, pattern_path, source, name, base_id, layers, buckets, warnings)
    if isinstance(source, (str, os.PathLike)):
        _save_tokenizer(source, out_dir, buckets.seq_len, result)
    short = os.path.basename(os.path.normpath(name))
    result["card"] = write_model_card(partial, out_dir, overwrite=True, untrained_conversion=True,
                                      model_name=f"{short} with partial attention (k = {pattern.k})")
    if verify:
        result.update(_reload_check(partial, out_dir, buckets.seq_len))
    return result


def _source_model(model: Any, pattern_path: str, layers: LayerPatterns | None, buckets: PatternBuckets,
                  pattern: AttentionPattern) -> Any:
    """``model``, else the source model the pattern file names (a ValueError when it names none)."""
    source = model if model is not None else (pattern.metadata.get("source_model")
                                              or buckets.metadata.get("source_model")
                                              or (layers.metadata.get("source_model") if layers else None))
    if not source:
        raise ValueError(f"{pattern_path!r} names no source_model; pass model=<path or Hub id of the source model>.")
    return source


def _source_config(source: Any, name: str):
    """The source's config, refused (before anything is written) for a type partial attention cannot run in and for
    a model that is partial already."""
    from ..architectures import check_supported
    from .convert_checks import source_config

    config = source_config(source)
    check_supported(config)  # one line naming the model type and what is supported; nothing is written
    if str(config.model_type).startswith("partial_"):
        raise ValueError(f"{name} is a partial model already ({config.model_type}): convert its source model, or "
                         "install the new P and R with model.set_pattern (the training scripts' --pattern).")
    return config


def _result(partial, config, out_dir: str, pattern_path: str, source: Any, name: str, base_id: str | None,
            layers: LayerPatterns | None, buckets: PatternBuckets, warnings: list[str]) -> dict[str, Any]:
    """What `convert` returns about the checkpoint written (the tokenizer, card and reload check add theirs)."""
    from ..cost import score_terms
    from .convert_checks import head_dim

    return {"checkpoint": out_dir, "pattern": pattern_path, "source_model": str(source),
            "source_model_id": name, "base_model": base_id, "k": partial.config.partial_k,
            "seq_len": buckets.seq_len, "lengths": buckets.lengths, "lengths_k": buckets.lengths_k,
            "partial_layers": list(partial.config.partial_layers), "head_dim": head_dim(partial.config),
            "score_terms": score_terms(partial.config), "layers_k": partial.config.partial_layers_k,
            "exact_layers": list(layers.metadata.get("exact_layers") or []) if layers is not None else [],
            "model_type": config.model_type, "partial_class": type(partial).__name__, "warnings": warnings}


def _memory_warning(layers: LayerPatterns, buckets: PatternBuckets, config) -> str | None:
    """R per layer or head: its size, stated before it is built (`cost.memory_warning`)."""
    from ..cost import memory_warning

    kinds = getattr(config, "num_attention_heads", None) if layers.heads else None
    partial_layers = max(len(layers.layers) - 1, 1)  # the default partial layers: all but the last
    return memory_warning(buckets.seq_len, buckets.k, partial_layers, kinds,
                          dict(zip(buckets.lengths, buckets.lengths_k)))


def _reload_check(partial, out_dir: str, seq_len: int) -> dict[str, Any]:
    """The written folder reloaded by ``AutoModel``: its class and its largest difference from ``partial`` on random
    ids of n tokens."""
    from transformers import AutoModel

    reloaded = AutoModel.from_pretrained(out_dir).eval()
    ids = torch.randint(0, partial.config.vocab_size, (1, seq_len))
    with torch.no_grad():
        diff = (reloaded(input_ids=ids).last_hidden_state - partial.eval()(input_ids=ids).last_hidden_state).abs().max()
    return {"reloaded_class": type(reloaded).__name__, "reload_max_abs_diff": float(diff)}


def _read_patterns(pattern_path: str) -> tuple[LayerPatterns | None, PatternBuckets, AttentionPattern]:
    """``(the per-layer set or None, the buckets (of the first group for a set), the longest bucket's pattern)``: the
    last stands for the file in the checks and the card (it names the source and n)."""
    layers = LayerPatterns.load(pattern_path) if is_layer_patterns_file(pattern_path) else None
    if layers is not None:
        buckets = layers.first()
    elif is_single_pattern_file(os.fspath(pattern_path)):
        single = AttentionPattern.load(pattern_path)
        if single.scope != "per_query":
            from .convert_checks import check_convertible

            check_convertible(single, pattern_path, None, "")  # raises: whole-matrix patterns are for analysis
        buckets = PatternBuckets.single(single)
    else:
        buckets = PatternBuckets.load(pattern_path)
    if not buckets.patterns:
        raise ValueError(f"{pattern_path!r} holds only exact buckets {buckets.lengths} (each b <= k = {buckets.k}): "
                         "nothing to convert; derive with a smaller --k.")
    return layers, buckets, buckets.patterns[buckets.partial_lengths[-1]]


def _record(pattern, pattern_path, layers, buckets, name, command) -> dict[str, Any]:
    """``config.partial_conversion``: where P and R came from (`model_card.conversion_record`), with each group's and
    each bucket's held-out error."""
    from ..model_card import conversion_record
    from .convert_checks import pattern_source_name

    record = conversion_record(pattern, pattern_path, pattern_source_name(pattern) or name, command)
    record["converted_model"] = name
    if layers is not None:
        record.update(granularity=layers.granularity, group_heldout_error={
            group: b.patterns[b.partial_lengths[-1]].metadata.get("heldout_normalized_error")
            for group, b in layers.groups()})
    if len(buckets.lengths) > 1:
        record.update(seq_len=buckets.seq_len, lengths=buckets.lengths, lengths_k=buckets.lengths_k,
                      exact_lengths=buckets.exact_lengths,
                      bucket_heldout_error={str(b): p.metadata.get("heldout_normalized_error")
                                            for b, p in buckets.patterns.items()})
    return record


def _save_tokenizer(source, out_dir: str, seq_len: int, result: dict) -> None:
    """The source's tokenizer with ``model_max_length <= n`` and, for a sentence-transformers source, its modules
    (``result["sentence_transformers"]``)."""
    from transformers import AutoTokenizer

    from ..sentence_folder import sentence_transformers_folder, write_sentence_transformers_files

    tokenizer = AutoTokenizer.from_pretrained(os.fspath(source))
    tokenizer.model_max_length = min(tokenizer.model_max_length, seq_len)
    tokenizer.save_pretrained(out_dir)
    st_dir = sentence_transformers_folder(source)
    if st_dir is not None:
        result["sentence_transformers"] = write_sentence_transformers_files(st_dir, out_dir, seq_len)

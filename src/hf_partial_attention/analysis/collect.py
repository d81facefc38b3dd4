"""Run a model over text windows and stream its attention scores into accumulators."""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

import torch
from tqdm.auto import tqdm

from ..cost import score_terms
from .capture import ScoreSink, capture_scores, require_calls
from .corpus import load_texts, make_windows, windows_fingerprint
from .covariance import ScoreCovariance
from .distributed import process_info, reduce_covariance

logger = logging.getLogger(__name__)

__all__ = ["collect_covariance", "load_model_and_tokenizer", "run_windows", "prepare_windows", "model_shape",
           "display_name", "hub_id"]

# "name" or "org/name" (https://huggingface.co/docs/hub/repositories: letters, digits, "-", "_", ".")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
# the folder huggingface_hub downloads a repo into: <cache>/models--<org>--<name>/snapshots/<commit>
_CACHE_SNAPSHOT = re.compile(r"models--(?P<repo>[^/\\]+)[/\\]snapshots[/\\][^/\\]+[/\\]?$")
# sentence-transformers cards show how to load the model by its id: SentenceTransformer("org/name")
_ST_SNIPPET = re.compile(r"""SentenceTransformer\(\s*["']([^"'\s]+/[^"'\s]+)["']""")


def load_model_and_tokenizer(model: Any, tokenizer: Any = None, load_tokenizer: bool = True):
    """Accept a model or a path / Hub id; return ``(model in eval mode, tokenizer or None)``.

    Without ``tokenizer``, the model's own is loaded (unless ``load_tokenizer`` is False).
    """
    from transformers import AutoModel, AutoTokenizer

    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        model = AutoModel.from_pretrained(path)
        if tokenizer is None and load_tokenizer:
            tokenizer = AutoTokenizer.from_pretrained(path)
    elif tokenizer is None and load_tokenizer:
        name = getattr(getattr(model, "config", None), "_name_or_path", "")
        if name:
            try:
                tokenizer = AutoTokenizer.from_pretrained(name)
            except (OSError, ValueError) as err:
                logger.info("No tokenizer found at %r (%s)", name, err)
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = AutoTokenizer.from_pretrained(os.fspath(tokenizer))
    return model.eval(), tokenizer


def display_name(model: Any) -> str:
    """How reports name a model: a Hub id as it is, a local folder by its name (never a path of this machine)."""
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        return os.path.basename(os.path.normpath(path)) if os.path.exists(path) else path
    return getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__


def _looks_like_hub_id(name: Any) -> bool:
    return (isinstance(name, str) and bool(_HUB_ID.fullmatch(name)) and not os.path.exists(name)
            and not name.endswith(".") and ".." not in name)


def hub_id(model: Any) -> str | None:
    """The Hub id of a model source, or None when it records none.

    ``model`` is a Hub id (returned as it is), a local folder or a loaded model (its config's ``_name_or_path``).
    A folder is named by, in this order: the Hub cache layout it sits in (``models--org--name/snapshots/…``); for a
    sentence-transformers folder, the id its own card loads (``SentenceTransformer("org/name")`` in ``README.md``),
    since its ``config.json`` names the transformer it was trained from (all-MiniLM-L6-v2's names
    ``nreimers/MiniLM-L6-H384-uncased``); else the ``_name_or_path`` its ``config.json`` records, when that is a
    Hub id and not a path. The folder's own name is never taken for an id: it names no Hub repo.
    """
    if not isinstance(model, (str, os.PathLike)):
        name = getattr(getattr(model, "config", None), "_name_or_path", "")
        return hub_id(name) if name else None
    path = os.fspath(model)
    if not os.path.exists(path):
        return path if _looks_like_hub_id(path) else None
    cached = _CACHE_SNAPSHOT.search(os.path.abspath(path) + os.sep)
    if cached:
        return cached.group("repo").replace("--", "/")
    if not os.path.isdir(path):
        return None
    readme = os.path.join(path, "README.md")
    if os.path.isfile(os.path.join(path, "modules.json")) and os.path.isfile(readme):
        with open(readme, encoding="utf-8", errors="replace") as f:
            found = _ST_SNIPPET.search(f.read())
        if found and _looks_like_hub_id(found.group(1)):
            return found.group(1)
    config_path = os.path.join(path, "config.json")
    if os.path.isfile(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                recorded = json.load(f).get("_name_or_path")
        except (OSError, ValueError, AttributeError):  # not a JSON object: no id recorded
            return None
        if _looks_like_hub_id(recorded) and not os.path.isabs(recorded):
            return recorded
    return None


def model_shape(model) -> tuple[int | None, int | None, int | None]:
    """``(num_layers, num_heads, head_dim)`` from the model's config when it names them."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config

    def first(*names):
        return next((getattr(config, a) for a in names if getattr(config, a, None) is not None), None)

    layers = first("num_hidden_layers", "n_layers", "n_layer")
    heads = first("num_attention_heads", "n_heads", "n_head")
    hidden = first("hidden_size", "dim", "n_embd")
    head_dim = first("head_dim") or (hidden // heads if hidden and heads else None)
    # the cost model's d_h: multiply-adds of one exact score (DeBERTa-v2's has a content and position terms)
    return layers, heads, None if head_dim is None else head_dim * score_terms(config)


def prepare_windows(texts: Any, tokenizer, seq_len: int, max_sequences: int | None) -> torch.Tensor:
    """``(S, n)`` int64 windows from texts (see `corpus.make_windows`), or ready windows passed as a tensor."""
    if isinstance(texts, torch.Tensor):
        if texts.dim() != 2 or texts.shape[1] != seq_len or texts.is_floating_point():
            raise ValueError(f"windows given as a tensor must be integer (S, seq_len={seq_len}), "
                             f"got {tuple(texts.shape)} {texts.dtype}.")
        return texts[:max_sequences] if max_sequences is not None else texts
    if tokenizer is None:
        raise ValueError("tokenizer is required to cut texts into windows; "
                         "pass tokenizer=AutoTokenizer.from_pretrained(...).")
    return make_windows(tokenizer, load_texts(texts), seq_len, max_sequences)


@torch.no_grad()
def run_windows(model, windows: torch.Tensor, sink: ScoreSink, batch_size: int = 8, progress: bool = True,
                desc: str = "capture", on_batch=None) -> None:
    """Forward ``windows`` ``(S, n)`` through ``model`` in batches, reporting every attention call to ``sink``.

    ``on_batch(num_windows_done)`` runs after each batch (checkpointing).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    device = next(model.parameters()).device
    done = 0
    with capture_scores(model, sink) as state:
        for start in tqdm(range(0, windows.shape[0], batch_size), desc=desc, disable=not progress,
                          unit="batch", leave=False):
            batch = windows[start:start + batch_size].to(device)  # (b, n)
            model(input_ids=batch, attention_mask=torch.ones_like(batch))
            if start == 0:
                require_calls(state, model)
            done += batch.shape[0]
            if on_batch is not None:
                on_batch(done)


def _resumed(path, windows: torch.Tensor, seq_len: int, scopes, granularity: str, max_memory_bytes):
    """The covariance an interrupted run saved at ``path``, checked to be of this call's settings and of the first
    windows of this corpus (a ValueError naming what differs)."""
    cov = ScoreCovariance.load(path, max_memory_bytes=max_memory_bytes)
    wanted = (seq_len, tuple(s for s in ("per_query", "whole") if s in scopes), granularity)
    if (cov.seq_len, cov.scopes, cov.granularity) != wanted:
        raise ValueError(f"resume_from={os.fspath(path)!r} holds seq_len={cov.seq_len}, scopes={cov.scopes}, "
                         f"granularity={cov.granularity!r}, which differ from this call's {wanted}; pass matching "
                         "arguments.")
    seen = cov.num_sequences
    if cov.metadata.get("windows_fingerprint") != windows_fingerprint(windows[:seen]):
        raise ValueError(f"resume_from={os.fspath(path)!r} was built from other windows than the first {seen} of this "
                         "corpus; use the same texts, tokenizer and seq_len, or start afresh.")
    logger.info("Resuming after %d windows", seen)
    return cov


def collect_covariance(
    model: Any,
    texts: Any = None,
    tokenizer: Any = None,
    seq_len: int = 128,
    max_sequences: int | None = None,
    scopes=("per_query",),
    granularity: str = "pooled",
    centered: bool = True,
    batch_size: int = 8,
    resume_from: str | os.PathLike | None = None,
    checkpoint_path: str | os.PathLike | None = None,
    checkpoint_every: int = 50,
    distributed: bool | str = "auto",
    max_memory_bytes: int | None = None,
    progress: bool = True,
) -> "ScoreCovariance":
    """Covariances of the pre-softmax attention scores of ``model`` over text windows.

    Args:
        model: a `PreTrainedModel` whose attention goes through transformers' AttentionInterface, or a
            path / Hub id (loaded with ``AutoModel``).
        texts: list of strings, text file path, ``datasets.Dataset``, ``None`` (the default corpus,
            `corpus.default_texts`), or ready windows as an int tensor ``(S, seq_len)``.
        tokenizer: tokenizer or its path (default: the model's).
        seq_len: n; windows are ``[CLS] + n − 2 tokens + [SEP]``.
        max_sequences: stop after this many windows (None: all).
        scopes: ``("per_query",)``, ``("whole",)`` or both. ``"whole"`` needs ``8·n⁴`` bytes per group.
        granularity: ``"pooled"`` (over layers and heads), ``"layer"`` or ``"head"``.
        centered: default read mode of the result (both modes stay available).
        batch_size: windows per forward pass.
        resume_from: a covariance saved by an earlier (interrupted) run over the same windows: its windows
            are skipped, so nothing is lost or counted twice.
        checkpoint_path: save the accumulators here every ``checkpoint_every`` batches and at the end.
        distributed: ``"auto"``: under ``accelerate launch`` each process takes every world-size-th window
            and the accumulators are summed across processes at the end.
        max_memory_bytes: memory allowed for accumulators (default 80% of available memory).

    Returns:
        A `ScoreCovariance`; ``metadata`` records the model, seq_len and the windows' fingerprint.
    """
    model, tokenizer = load_model_and_tokenizer(model, tokenizer)
    windows = prepare_windows(texts, tokenizer, seq_len, max_sequences)  # (S, n)
    rank, world = process_info(distributed)
    cov = _started(resume_from, windows, world, seq_len, scopes, granularity, centered, max_memory_bytes)
    _describe_model(cov, model, seq_len, granularity)
    _accumulate(cov, model, windows, rank, world, batch_size=batch_size, checkpoint_path=checkpoint_path,
                checkpoint_every=checkpoint_every, progress=progress, desc=f"scores n={seq_len}")
    logger.info("Collected %d score matrices from %d windows of length %d", cov.count, cov.num_sequences, seq_len)
    return cov


def _started(resume_from, windows: torch.Tensor, world: int, seq_len: int, scopes, granularity: str, centered: bool,
             max_memory_bytes) -> ScoreCovariance:
    """The covariance to add to: the one an interrupted run saved at ``resume_from`` (single process only), else a
    new one."""
    if resume_from is not None and os.path.isfile(resume_from):
        if world > 1:
            raise ValueError("resume_from is supported in a single process only; resume without accelerate launch.")
        return _resumed(resume_from, windows, seq_len, scopes, granularity, max_memory_bytes)
    return ScoreCovariance(seq_len, scopes, granularity, centered, max_memory_bytes=max_memory_bytes)


def _accumulate(cov: ScoreCovariance, model, windows: torch.Tensor, rank: int, world: int, *, batch_size: int,
                checkpoint_path, checkpoint_every: int, progress: bool, desc: str) -> None:
    """Run the windows ``cov`` has not seen yet (this process's share of them) into ``cov``, checkpointing in a
    single process, summing across processes otherwise, and save the result."""
    seen = cov.num_sequences  # windows an earlier run already took (0 for a fresh covariance)
    todo = windows[seen:][rank::world]  # (S', n): this process's share of the remaining windows

    def checkpoint(done: int) -> None:
        cov.num_sequences = seen + done
        cov.metadata["windows_fingerprint"] = windows_fingerprint(windows[:cov.num_sequences])
        if checkpoint_path is not None and (done // batch_size) % checkpoint_every == 0:
            cov.save(checkpoint_path)

    on_batch = checkpoint if world == 1 else None
    run_windows(model, todo, cov.update, batch_size=batch_size, progress=progress and rank == 0, desc=desc,
                on_batch=on_batch)
    if world > 1:
        cov.num_sequences = todo.shape[0]
        reduce_covariance(cov)
        cov.num_sequences += seen
    cov.metadata["windows_fingerprint"] = windows_fingerprint(windows[:cov.num_sequences])
    if checkpoint_path is not None and rank == 0:
        cov.save(checkpoint_path)


def _describe_model(cov: ScoreCovariance, model, seq_len: int, granularity: str) -> None:
    """Check that the model's groups fit in memory (when its shape is known) and record the model in the metadata."""
    layers, heads, head_dim = model_shape(model)
    if layers is not None:
        groups = {"pooled": 1, "layer": layers, "head": layers * (heads or 1)}[granularity]
        cov.check_memory(groups)
    cov.metadata.update(model=str(getattr(model.config, "_name_or_path", "")), seq_len=seq_len,
                        model_type=getattr(model.config, "model_type", ""), num_layers=layers, num_heads=heads,
                        head_dim=head_dim)

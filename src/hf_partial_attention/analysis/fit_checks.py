"""Checks of what `analyze` and `derive` fit on: the window length against the model, the number of windows
against the window length (docs/analysis.md#how-much-text)."""

from __future__ import annotations

from typing import Any

__all__ = ["MIN_WINDOWS_PER_POSITION", "fit_size_warning", "check_seq_len"]

# Fewer fitted windows than MIN_WINDOWS_PER_POSITION · n: warn (see `fit_size_warning`).
MIN_WINDOWS_PER_POSITION = 1
# position ids of these models start after the padding index: pad_token_id + 1 of max_position_embeddings are unused
_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert", "longformer", "data2vec-text", "xmod", "mpnet")


def fit_size_warning(num_windows: int, n: int) -> str | None:
    """A sentence for the user when per-query patterns are fitted on fewer than ``MIN_WINDOWS_PER_POSITION · n``
    windows, else None.

    The rule: at least one fitted window per position of a row. Each row's covariance Q^i is n×n; in pooled
    granularity it is estimated from windows × layers × heads score rows, but the rows of one window share its
    tokens, so the independent samples are the windows. With fewer windows than Q^i has dimensions the greedy
    picks P on estimation noise and the predicted error (in-sample) falls below the held-out one.
    """
    need = MIN_WINDOWS_PER_POSITION * n
    if num_windows >= need:
        return None
    rule = "n" if MIN_WINDOWS_PER_POSITION == 1 else f"{MIN_WINDOWS_PER_POSITION}·n"
    return (f"Fitted on {num_windows} window(s) at n={n}, fewer than {need} (rule: at least {rule} windows for a "
            "stable n×n per-query covariance): the predicted error is optimistic; expect a higher held-out error. "
            "Pass more text or a larger --max-sequences.")


def check_seq_len(model: Any, seq_len: int) -> None:
    """Refuse a window length beyond the model's positions before any text is read (the model's own error would be
    a tensor shape mismatch); a length too short for a window is `corpus.make_windows`' to refuse."""
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return
    if getattr(config, "model_type", "") in _OFFSET_POSITIONS and isinstance(config.pad_token_id, int):
        limit -= config.pad_token_id + 1
    if seq_len > limit:
        raise ValueError(f"seq_len={seq_len} exceeds the model's {limit} positions (config.max_position_embeddings"
                         f"={config.max_position_embeddings}); pass --seq-len {limit} or less.")

"""Small helpers the training scripts share: logging setup, checkpoint resolution, sequence length."""

from __future__ import annotations

import logging
import math
import sys

import datasets
import transformers

__all__ = ["setup_logging", "resolve_resume", "sequence_length", "perplexity"]


def setup_logging(training_args, logger: logging.Logger) -> None:
    """Log like transformers' examples: INFO on the main process, WARNING elsewhere (``--log_level``)."""
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        datefmt="%m/%d/%Y %H:%M:%S", handlers=[logging.StreamHandler(sys.stdout)])
    if training_args.should_log:
        transformers.utils.logging.set_verbosity_info()
    level = training_args.get_process_log_level()
    logger.setLevel(level)
    logging.getLogger("hf_partial_attention").setLevel(level)
    datasets.utils.logging.set_verbosity(level)
    transformers.utils.logging.set_verbosity(level)
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.enable_explicit_format()
    logger.warning("Process rank %s, device %s, n_gpu %s, distributed %s", training_args.process_index,
                   training_args.device, training_args.n_gpu, training_args.parallel_mode.value == "distributed")


def resolve_resume(value: str | bool | None) -> str | bool | None:
    """``--resume_from_checkpoint``: a folder, or ``true``/``last`` for the newest checkpoint in output_dir."""
    if isinstance(value, str) and value.strip().lower() in ("true", "last"):
        return True
    return value or None


def sequence_length(model, requested: int | None, default: int = 128) -> int:
    """n for the data: `requested`, else the model's ``partial_seq_len``, else ``min(default, max positions)``.

    Raises:
        ValueError: if `requested` exceeds the model's ``partial_seq_len`` or its position embeddings.
    """
    config = model.config
    limit = getattr(config, "partial_seq_len", None) or config.max_position_embeddings
    n = requested or (getattr(config, "partial_seq_len", None) or min(default, config.max_position_embeddings))
    if n > limit:
        raise ValueError(f"--max_seq_length={n} exceeds the model's limit {limit} (partial_seq_len or "
                         "max_position_embeddings); use a smaller --max_seq_length or a pattern for a longer n.")
    return n


def perplexity(loss: float) -> float:
    """``exp(loss)``, infinite on overflow."""
    try:
        return math.exp(loss)
    except OverflowError:
        return float("inf")

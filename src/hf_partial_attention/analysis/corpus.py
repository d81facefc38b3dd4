"""Text sources and the fixed-length windows the analysis runs on.

Sequences are built as in BERT pretraining: each text is tokenized without special tokens and cut into
consecutive windows of ``n − 2`` tokens from its first token, each wrapped as ``[CLS] … [SEP]`` (n tokens,
no padding); a shorter tail is dropped; texts are taken in order until ``max_sequences`` windows.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "default_texts",
    "package_readmes",
    "pydoc_paragraphs",
    "load_texts",
    "make_windows",
    "split_heldout",
    "windows_fingerprint",
]

_HEADING = re.compile(r"^[*=\-~^]{3,}\s*$")


def pydoc_paragraphs(min_words: int = 8) -> list[list[str]]:
    """Prose paragraphs of CPython's ``pydoc_data.topics``, one list per topic (topics in sorted order).

    Code samples (indented blocks, ``>>>`` sessions), headings and short fragments are dropped; the lines of
    a paragraph are joined with spaces.
    """
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        paragraphs = []
        for block in re.split(r"\n\s*\n", topics[name]):
            lines = [line for line in block.splitlines() if line.strip()]
            if not lines or lines[0].startswith((" ", "\t", ">>>")):
                continue
            lines = [line for line in lines if not _HEADING.match(line)]
            text = " ".join(line.strip() for line in lines)
            if len(text.split()) >= min_words:
                paragraphs.append(text)
        if paragraphs:
            out.append(paragraphs)
    return out


def default_texts() -> list[str]:
    """The default corpus: real English prose shipped with CPython, one text per ``pydoc_data.topics`` topic."""
    return [" ".join(paragraphs) for paragraphs in pydoc_paragraphs()]


def package_readmes(names=("tqdm", "torch", "transformers", "datasets", "huggingface_hub", "tokenizers")) -> list[str]:
    """A second real-English corpus found offline: the long descriptions (READMEs) of installed packages."""
    from importlib import metadata

    texts = []
    for name in names:
        try:
            payload = metadata.metadata(name).get_payload()
        except metadata.PackageNotFoundError:
            continue
        if payload and payload.strip():
            texts.append(" ".join(payload.split()))
    return texts


def split_heldout(texts: Sequence[Any], every: int = 5) -> tuple[list[Any], list[Any]]:
    """Deterministic document-level split: text i is held out when ``i % every == every − 1``."""
    if every < 2:
        raise ValueError(f"every must be >= 2 to keep some texts for fitting, got {every}.")
    fit = [t for i, t in enumerate(texts) if i % every != every - 1]
    held = [t for i, t in enumerate(texts) if i % every == every - 1]
    return fit, held


def load_texts(source: Any = None, text_column: str = "text", split: str = "paragraph") -> list[str]:
    """Normalise a text source to a list of strings.

    Args:
        source: ``None`` (the default corpus, `default_texts`), a list of strings, a path to a UTF-8 text
            file, or a ``datasets.Dataset`` (its ``text_column`` is read).
        text_column: column of a ``datasets.Dataset`` holding the text.
        split: for a text file: ``"paragraph"`` (default: blank-line separated blocks, so that documents can be
            held out), ``"line"`` or ``"document"`` (the whole file is one text: nothing can be held out).
    """
    if source is None:
        return default_texts()
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"Text file {path!r} does not exist; pass an existing UTF-8 text file.")
        with open(path, encoding="utf-8") as f:
            content = f.read()
        if split == "document":
            texts = [content]
        elif split == "paragraph":
            texts = [" ".join(block.split()) for block in re.split(r"\n\s*\n", content)]
        elif split == "line":
            texts = content.splitlines()
        else:
            raise ValueError(f"split must be 'document', 'paragraph' or 'line', got {split!r}.")
        return [t for t in texts if t.strip()]
    if _is_dataset(source):
        if text_column not in source.column_names:
            raise ValueError(f"text_column={text_column!r} is not a column of the dataset "
                             f"(columns: {source.column_names}); pass text_column=<name>.")
        return [t for t in source[text_column] if isinstance(t, str) and t.strip()]
    if isinstance(source, Iterable) and not isinstance(source, (bytes, torch.Tensor)):
        texts = list(source)
        bad = [type(t).__name__ for t in texts if not isinstance(t, str)]
        if bad:
            raise TypeError(f"texts must be strings, found {bad[0]}; pass a list of str, a file path or a dataset.")
        return texts
    raise TypeError(f"texts must be a list of strings, a text file path or a datasets.Dataset, "
                    f"got {type(source).__name__}.")


def _is_dataset(obj: Any) -> bool:
    return type(obj).__name__ in ("Dataset", "IterableDataset") and hasattr(obj, "column_names")


def _wrap_tokens(tokenizer) -> tuple[int | None, int | None]:
    first = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.bos_token_id
    last = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
    return first, last


def make_windows(tokenizer, texts: Sequence[str], seq_len: int, max_sequences: int | None = None) -> torch.Tensor:
    """Cut texts into ``[CLS] + (n − 2 tokens) + [SEP]`` windows: ``-> (S, n)`` int64.

    Tokenizers without CLS/SEP use BOS/EOS; with neither, windows hold n plain tokens.
    """
    if seq_len < 3:
        raise ValueError(f"seq_len must be >= 3 (room for [CLS], one token and [SEP]), got {seq_len}.")
    if max_sequences is not None and max_sequences < 1:
        raise ValueError(f"max_sequences must be >= 1 or None, got {max_sequences}.")
    first, last = _wrap_tokens(tokenizer)
    body = seq_len - (first is not None) - (last is not None)
    windows: list[list[int]] = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        for start in range(0, len(ids) - body + 1, body):
            window = ids[start:start + body]
            windows.append(([first] if first is not None else []) + window + ([last] if last is not None else []))
            if max_sequences is not None and len(windows) >= max_sequences:
                return torch.tensor(windows, dtype=torch.long)
    if not windows:
        raise ValueError(f"No text is long enough for one window of seq_len={seq_len} ({body} tokens); "
                         "use longer texts or a smaller seq_len.")
    if max_sequences is not None and len(windows) < max_sequences:
        logger.info("Corpus yields %d windows of length %d (< max_sequences=%d)", len(windows), seq_len, max_sequences)
    return torch.tensor(windows, dtype=torch.long)


def windows_fingerprint(windows: torch.Tensor) -> str:
    """SHA-1 of the windows' token ids: identifies the data a saved covariance has consumed."""
    return hashlib.sha1(windows.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()

"""The inputs a user has, at their own length: documents of sentences, paragraphs or sentence pairs, tokenized.

Real inputs are shorter than the analysis windows (docs/method.md#padding-and-short-inputs): sentences are 10–40
tokens, sentence pairs 30–75. `load_inputs` reads them as a list of *documents*, each a list of *inputs* (a str,
or a ``(str, str)`` pair); the held-out split is by document, so that no held-out input shares a paragraph with a
fitted one. `tokenize_inputs` turns them into `TokenizedInputs`: padded int tensors and each input's length.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch

logger = logging.getLogger(__name__)

__all__ = ["KINDS", "DEFAULT_PAIR_COLUMNS", "Input", "TokenizedInputs", "split_sentences", "load_inputs",
           "tokenize_inputs", "flatten"]

KINDS = ("sentence", "paragraph", "pairs")
DEFAULT_PAIR_COLUMNS = ("sentence1", "sentence2")
Input = Union[str, tuple[str, str]]

# A sentence ends at ., ! or ? (optionally followed by a closing quote or bracket) before white space and a capital
# letter, a digit or an opening quote/bracket. Abbreviations before a capital ("Dr. Smith") are split too.
_SENTENCE_END = re.compile(r"""(?:(?<=[.!?])|(?<=[.!?]["')\]]))\s+(?=["'(\[]?[A-Z0-9])""")


def split_sentences(text: str, min_words: int = 3) -> list[str]:
    """Sentences of ``text`` by the regex above (white space collapsed); a sentence of fewer than ``min_words``
    words is joined to the next one (to the previous one at the end of the text)."""
    parts = [p for p in _SENTENCE_END.split(" ".join(text.split())) if p]
    out: list[str] = []
    pending = ""
    for part in parts:
        pending = f"{pending} {part}" if pending else part
        if len(pending.split()) >= min_words:
            out.append(pending)
            pending = ""
    if pending:
        if out:
            out[-1] = f"{out[-1]} {pending}"
        else:
            out.append(pending)
    return out


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
    return kind


def _text_documents(paragraphs_by_document: list[list[str]], kind: str, min_words: int) -> list[list[str]]:
    docs = []
    for paragraphs in paragraphs_by_document:
        if kind == "paragraph":
            inputs = [" ".join(p.split()) for p in paragraphs if p.strip()]
        else:
            inputs = [s for p in paragraphs for s in split_sentences(p, min_words)]
        if inputs:
            docs.append(inputs)
    return docs


def _pair_rows_tsv(path: str, columns: tuple[str, str]) -> list[tuple[str, str]]:
    with open(path, encoding="utf-8", newline="") as f:
        rows = [r for r in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE) if any(c.strip() for c in r)]
    if not rows:
        return []
    first = [c.strip() for c in rows[0]]
    if all(c in first for c in columns):  # a header row naming the columns
        a, b = first.index(columns[0]), first.index(columns[1])
        rows = rows[1:]
    else:
        a, b = 0, 1
    short = [i for i, r in enumerate(rows) if len(r) <= max(a, b)]
    if short:
        raise ValueError(f"{path!r}: row {short[0] + 1} has {len(rows[short[0]])} tab-separated column(s), need "
                         f"{max(a, b) + 1}; write two columns (sentence 1, sentence 2) per line, or a header row "
                         f"naming columns={list(columns)}.")
    return [(r[a], r[b]) for r in rows]


def _pair_rows_jsonl(path: str, columns: tuple[str, str]) -> list[tuple[str, str]]:
    out = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            missing = [c for c in columns if not isinstance(row, dict) or c not in row]
            if missing:
                found = list(row) if isinstance(row, dict) else type(row).__name__
                raise ValueError(f"{path!r}: line {number} lacks column(s) {missing} (found {found}); pass "
                                 "columns=(first, second) (CLI --pair-columns A B) naming the two sentences.")
            out.append((str(row[columns[0]]), str(row[columns[1]])))
    return out


def _dataset_documents(dataset, kind, columns, text_column, split, min_words) -> list[list[Input]]:
    if isinstance(getattr(dataset, "column_names", None), dict):  # a DatasetDict: {split: columns}
        if split not in dataset:
            raise ValueError(f"split={split!r} is not a split of the DatasetDict (splits: {list(dataset)}); "
                             "pass split=<name>.")
        dataset = dataset[split]
    names = dataset.column_names
    wanted = list(columns) if kind == "pairs" else [text_column]
    missing = [c for c in wanted if c not in names]
    if missing:
        field = "columns" if kind == "pairs" else "text_column"
        raise ValueError(f"{field}: {missing} not a column of the dataset (columns: {names}); pass {field}=<names>.")
    if kind == "pairs":
        return [[(str(a), str(b))] for a, b in zip(dataset[columns[0]], dataset[columns[1]])]
    texts = [t for t in dataset[text_column] if isinstance(t, str) and t.strip()]
    return _text_documents([[t] for t in texts], kind, min_words)


def load_inputs(source: Any = None, kind: str = "sentence", *, columns: Sequence[str] = DEFAULT_PAIR_COLUMNS,
                text_column: str = "text", split: str = "train", min_words: int = 3) -> list[list[Input]]:
    """Documents of inputs from ``source``.

    Sources and what a document is:

    - a UTF-8 text file: paragraphs (blocks separated by blank lines) are the documents; kind ``"sentence"`` splits
      each into sentences (`split_sentences`), kind ``"paragraph"`` keeps it whole (one input per document);
    - ``None``: the shipped demo text, CPython's ``pydoc_data.topics`` prose (`corpus.pydoc_paragraphs`), one
      document per topic (its sentences or paragraphs);
    - a sentence-pair file (kind ``"pairs"``): ``.tsv`` (two columns, or a header row naming ``columns``) or
      ``.jsonl`` (one object per line with the ``columns`` keys); each row is its own document;
    - a ``datasets.Dataset`` (or a ``DatasetDict`` with ``split``): ``columns`` for pairs, ``text_column``
      otherwise; each row is its own document;
    - a list: of str (each a document, split by kind), of ``(str, str)`` pairs (each a document), or of documents.

    Args:
        kind: ``"sentence"``, ``"paragraph"`` or ``"pairs"``.
        columns: the two columns of a pair (``.jsonl`` keys, a ``.tsv`` header, dataset columns).
        text_column: the text column of a dataset (sentence and paragraph kinds).
        split: the split of a ``DatasetDict``.
        min_words: sentences shorter than this are joined to a neighbour (`split_sentences`).

    Returns:
        ``[[input, ...], ...]``: one list per document, documents without inputs left out.
    """
    kind = _check_kind(kind)
    columns = tuple(columns)
    if len(columns) != 2:
        raise ValueError(f"columns must name two columns (first and second sentence), got {list(columns)}.")
    if source is None:
        if kind == "pairs":
            raise ValueError("kind='pairs' needs a sentence-pair source (a .tsv or .jsonl file, or a dataset); the "
                             "demo text has sentences and paragraphs only.")
        from .corpus import pydoc_paragraphs

        return _text_documents(pydoc_paragraphs(), kind, min_words)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"Input file {path!r} does not exist; pass an existing UTF-8 file.")
        suffix = os.path.splitext(path)[1].lower()
        if kind == "pairs":
            if suffix not in (".tsv", ".jsonl"):
                raise ValueError(f"kind='pairs' reads a .tsv or .jsonl file, got {path!r}; write the pairs as two "
                                 "tab-separated columns (.tsv) or JSON lines (.jsonl).")
            rows = _pair_rows_tsv(path, columns) if suffix == ".tsv" else _pair_rows_jsonl(path, columns)
            return [[row] for row in rows]
        with open(path, encoding="utf-8") as f:
            blocks = [b for b in re.split(r"\n\s*\n", f.read()) if b.strip()]
        return _text_documents([[b] for b in blocks], kind, min_words)
    if hasattr(source, "column_names") or type(source).__name__ in ("DatasetDict",):
        return _dataset_documents(source, kind, columns, text_column, split, min_words)
    if isinstance(source, (list, tuple)):
        docs: list[list[Input]] = []
        for item in source:
            if isinstance(item, str):
                if kind == "pairs":
                    raise ValueError("kind='pairs' takes (str, str) pairs, got a str; pass [(a, b), ...].")
                docs += _text_documents([[item]], kind, min_words)
            elif isinstance(item, tuple) and len(item) == 2 and all(isinstance(x, str) for x in item):
                docs.append([item])
            elif isinstance(item, list):
                docs.append(list(item))
            else:
                raise TypeError(f"inputs must be str, (str, str) pairs or lists of them, got {type(item).__name__}.")
        return [d for d in docs if d]
    raise TypeError(f"source must be None, a file path, a datasets Dataset or a list, got {type(source).__name__}.")


def flatten(documents: list[list[Input]]) -> tuple[list[Input], list[int]]:
    """``(inputs, document index of each)``."""
    inputs, doc_of = [], []
    for d, doc in enumerate(documents):
        inputs += doc
        doc_of += [d] * len(doc)
    return inputs, doc_of


@dataclass
class TokenizedInputs:
    """Token ids of inputs at their own length, right-padded: ``input_ids`` and ``token_type_ids`` ``(S, L)``
    int64 (L the longest input), ``lengths`` ``(S,)`` int64 (real tokens, special tokens included)."""

    input_ids: torch.Tensor
    token_type_ids: torch.Tensor
    lengths: torch.Tensor

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def subset(self, index) -> "TokenizedInputs":
        """The inputs at ``index`` (a list or an int tensor), padding trimmed to their longest."""
        index = torch.as_tensor(index, dtype=torch.long)
        lengths = self.lengths[index]
        width = int(lengths.max()) if len(index) else 0
        return TokenizedInputs(self.input_ids[index, :width], self.token_type_ids[index, :width], lengths)

    def batch(self, index, width: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
        """Model inputs for ``index``, padded to ``width``: input_ids, token_type_ids, attention_mask ``(B, width)``."""
        sub = self.subset(index)
        b, have = sub.input_ids.shape
        ids = torch.full((b, width), pad_id, dtype=torch.long)
        types = torch.zeros(b, width, dtype=torch.long)
        ids[:, :have], types[:, :have] = sub.input_ids, sub.token_type_ids
        mask = (torch.arange(width) < sub.lengths[:, None]).long()  # (B, width)
        return {"input_ids": ids.masked_fill(mask == 0, pad_id), "token_type_ids": types * mask,
                "attention_mask": mask}

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "token_type_ids": self.token_type_ids, "lengths": self.lengths}


def tokenize_inputs(tokenizer, inputs: Sequence[Input], max_length: int) -> TokenizedInputs:
    """Tokenize ``inputs`` with special tokens, truncated to ``max_length`` (pairs: longest first), with
    token_type_ids for pairs (zeros where the tokenizer gives none)."""
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 (room for the special tokens), got {max_length}.")
    if not inputs:
        return TokenizedInputs(torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, 0, dtype=torch.long),
                               torch.zeros(0, dtype=torch.long))
    pairs = [isinstance(x, tuple) for x in inputs]
    if any(pairs) and not all(pairs):
        raise ValueError("inputs mix single texts and pairs; pass one kind.")
    first = [x[0] if isinstance(x, tuple) else x for x in inputs]
    second = [x[1] for x in inputs] if all(pairs) else None
    enc = tokenizer(first, second, truncation=True, max_length=max_length, padding=False, verbose=False)
    ids = enc["input_ids"]
    types = enc.get("token_type_ids") or [[0] * len(row) for row in ids]
    lengths = torch.tensor([len(row) for row in ids], dtype=torch.long)
    width = int(lengths.max())
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out_ids = torch.full((len(ids), width), pad, dtype=torch.long)
    out_types = torch.zeros(len(ids), width, dtype=torch.long)
    for s, (row, trow) in enumerate(zip(ids, types)):
        out_ids[s, :len(row)] = torch.tensor(row, dtype=torch.long)
        out_types[s, :len(trow)] = torch.tensor(trow, dtype=torch.long)
    return TokenizedInputs(out_ids, out_types, lengths)

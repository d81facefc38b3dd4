"""Data of the from-scratch Table 1 study (`scratch`): real English prose, split by document.

`load_scratch_data` describes the corpora (``--corpus``: CPython's HTML documentation, or ``pydoc`` for the tests'
tiny run) and the splits; the rest cuts, dedupes and tokenizes them.
"""

from __future__ import annotations

import glob
import html.parser
import math
import os
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any

__all__ = ["ScratchData", "load_scratch_data", "python_docs_documents", "DOCS_DIR", "unigram_cross_entropy",
           "train_wordpiece", "WORDPIECE", "window_passes"]

# ``tokenizer_name`` that trains a WordPiece vocabulary on the study's own training documents (`train_wordpiece`)
WORDPIECE = "wordpiece"

DOCS_DIR = "/usr/share/doc/python3.11/html"
_SKIP_PAGES = ("genindex", "modindex", "search.html", "contents.html", "copyright.html", "license.html",
               "download.html")


class _Paragraphs(html.parser.HTMLParser):
    """The text of every ``<p>`` of a page, code (``<pre>``) left out."""

    def __init__(self):
        super().__init__()
        self.depth, self.skip, self.buffer, self.paragraphs = 0, 0, [], []

    def handle_starttag(self, tag, attrs):
        self.depth += tag == "p"
        self.skip += tag in ("pre", "script", "style")

    def handle_endtag(self, tag):
        if tag == "p" and self.depth:
            self.depth -= 1
            self.paragraphs.append(" ".join("".join(self.buffer).split()))
            self.buffer = []
        elif tag in ("pre", "script", "style") and self.skip:
            self.skip -= 1

    def handle_data(self, data):
        if self.depth and not self.skip:
            self.buffer.append(data)


def python_docs_documents(folder: str = DOCS_DIR, min_words: int = 8) -> list[list[str]]:
    """The prose paragraphs of every page of CPython's HTML documentation under ``folder``, one list per page
    (sorted by path); paragraphs under ``min_words`` words are dropped. A FileNotFoundError names how to install it."""
    pages = sorted(glob.glob(os.path.join(folder, "**", "*.html"), recursive=True))
    if not pages:
        raise FileNotFoundError(f"No HTML pages under {folder!r}: install CPython's documentation (`make python-docs`, "
                                "i.e. `apt-get install python3.11-doc`) or pass --corpus pydoc / --docs_dir.")
    documents = []
    for page in pages:
        if any(skip in page for skip in _SKIP_PAGES):
            continue
        parser = _Paragraphs()
        with open(page, encoding="utf-8") as f:
            parser.feed(f.read())
        paragraphs = [p for p in parser.paragraphs if len(p.split()) >= min_words]
        if paragraphs:
            documents.append(paragraphs)
    return documents


def _dedupe(documents: list[list[str]]) -> list[list[str]]:
    """Each paragraph once (the first time it appears), empty documents dropped."""
    seen, out = set(), []
    for doc in documents:
        kept = [p for p in doc if not (p in seen or seen.add(p))]
        if kept:
            out.append(kept)
    return out


@dataclass
class ScratchData:
    tokenizer: Any
    windows: Any  # DatasetDict train / test of n-token MLM windows
    pairs: Any  # DatasetDict train / test of tokenized pairs (test sorted by length)
    labels: tuple[str, ...]
    corpus: str
    sizes: dict


def _documents(corpus: str, docs_dir: str) -> tuple[list[list[str]], str]:
    from hf_partial_attention.analysis.corpus import pydoc_paragraphs
    from hf_partial_attention.training.pair_task import stdlib_docstring_documents

    version = sys.version.split()[0]
    if corpus == "python-docs":
        return (_dedupe(python_docs_documents(docs_dir) + stdlib_docstring_documents()),
                f"CPython 3.11's HTML documentation (Debian python3.11-doc, <p> prose) + standard-library docstrings "
                f"(CPython {version})")
    if corpus == "pydoc":
        return (_dedupe(pydoc_paragraphs() + stdlib_docstring_documents()),
                f"pydoc_data.topics + standard-library docstrings (CPython {version})")
    raise ValueError(f"corpus must be 'python-docs' or 'pydoc', got {corpus!r}.")


def train_wordpiece(documents: list[list[str]], vocab_size: int, folder: str | None = None):
    """A lower-cased BERT WordPiece tokenizer (``[PAD] [UNK] [CLS] [SEP] [MASK]``) with a ``vocab_size`` vocabulary
    trained by `tokenizers` on ``documents``' paragraphs (the training split only: held-out text must not shape the
    vocabulary), as a transformers fast tokenizer; saved into ``folder`` when given."""
    from tokenizers import BertWordPieceTokenizer
    from tokenizers.models import WordPiece
    from tokenizers.processors import BertProcessing
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 100:
        raise ValueError(f"vocab_size={vocab_size} is too small for a WordPiece vocabulary; give 4000-8000.")
    trainer = BertWordPieceTokenizer(lowercase=True)
    trainer.train_from_iterator((p for doc in documents for p in doc), vocab_size=vocab_size, min_frequency=2,
                                special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False)
    # `tokenizers` numbers the vocabulary in hash order (and breaks ties between equally frequent merges so too:
    # two trainings on the same text can keep a few different tokens of thousands): number it in sorted order, so
    # one set of tokens gives one numbering. The study trains once per run directory and reuses the saved files.
    vocab = trainer._tokenizer.get_vocab()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    ordered = specials + sorted(t for t in vocab if t not in specials)
    trainer._tokenizer.model = WordPiece({t: i for i, t in enumerate(ordered)}, unk_token="[UNK]")
    trainer._tokenizer.post_processor = BertProcessing(("[SEP]", 3), ("[CLS]", 2))  # [CLS] text [SEP], as BERT's
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=trainer._tokenizer, pad_token="[PAD]", unk_token="[UNK]",
                                        cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                        model_max_length=512)
    if folder:
        tokenizer.save_pretrained(folder)
    return tokenizer


def window_passes(train, tokenizer, window: int, passes: int, seed: int, max_windows: int = 0):
    """``passes`` cuts of the training texts (a `datasets.Dataset` with a ``text`` column) into ``window``-token
    windows, concatenated; pass 0 cuts the token stream from its start, each later pass from a random token offset
    (1 to window − 3, drawn with ``seed``), so a run that reads the windows more than once sees other window
    boundaries each time instead of the same windows again. ``max_windows``: the first so many of each pass (0:
    all)."""
    import random

    from datasets import DatasetDict, concatenate_datasets

    from hf_partial_attention.training import group_into_windows

    if passes < 1:
        raise ValueError(f"window_passes must be >= 1, got {passes}.")
    rng = random.Random(seed)
    offsets = [0] + [rng.randrange(1, window - 2) for _ in range(passes - 1)]
    cuts = [group_into_windows(DatasetDict(train=train), tokenizer, window, offset=offset)["train"]
            for offset in offsets]
    return concatenate_datasets([c.select(range(min(max_windows, len(c)))) if max_windows else c for c in cuts])


def load_scratch_data(a) -> ScratchData:
    """Windows and pairs of the study's corpus (`ScratchArguments`: corpus, docs_dir, test_every, max_seq_length,
    max_train_windows, test_windows, test_pairs, seed).

    Corpora (``--corpus``):

    - ``python-docs`` (the default): the prose paragraphs (``<p>``, code blocks left out) of CPython's own HTML
      documentation as Debian's ``python3.11-doc`` installs it (``/usr/share/doc/python3.11/html``: tutorial, library
      and language reference, how-tos, FAQs, what's new; ``make python-docs`` installs it), beside the standard
      library's docstrings; about 1.5 M words after exact duplicates are dropped.
    - ``pydoc``: ``pydoc_data.topics`` and the standard library's docstrings (what the other studies use; small, for
      the tiny run of the tests).

    Every ``test_every``-th document is held out (the test split: MLM losses, the pair task's test pairs); with
    ``validation_every``, every so many of the others too (the validation split: MLM losses that choose between
    arms); the rest train (MLM windows, the covariance for P and R, the pair task's training pairs). Splits:
    ``windows`` train / test (/ validation) (n-token MLM windows), ``pairs`` train / test (sentence order at the
    pairs' own lengths)."""
    from datasets import Dataset, DatasetDict
    from transformers import AutoTokenizer

    from hf_partial_attention.analysis.defaults import resolve_model
    from hf_partial_attention.training import group_into_windows, tokenize_pairs
    from hf_partial_attention.training.pair_task import PAIR_LABELS, sentence_order_examples

    documents, corpus = _documents(a.corpus, a.docs_dir)
    if a.test_every < 2:
        raise ValueError(f"test_every must be >= 2 (every test_every-th document is held out), got {a.test_every}.")
    test_docs = documents[::a.test_every]
    train_docs = [d for i, d in enumerate(documents) if i % a.test_every]
    validation_docs = []
    if a.validation_every:  # every validation_every-th training document chooses between arms, never trains
        if a.validation_every < 2:
            raise ValueError(f"validation_every must be 0 (none) or >= 2, got {a.validation_every}.")
        validation_docs = train_docs[::a.validation_every]
        train_docs = [d for i, d in enumerate(train_docs) if i % a.validation_every]
    if a.tokenizer_name == WORDPIECE:  # trained once per run directory, on the training documents only
        folder = os.path.join(a.run_dir, "tokenizer")
        tokenizer = (AutoTokenizer.from_pretrained(folder) if os.path.isdir(folder)
                     else train_wordpiece(train_docs, a.vocab_size, folder))
    else:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(a.tokenizer_name)[0])
    raw = DatasetDict(train=Dataset.from_dict({"text": [" ".join(d) for d in train_docs]}),
                      test=Dataset.from_dict({"text": [" ".join(d) for d in test_docs]}))
    windows = group_into_windows(raw, tokenizer, a.max_seq_length)
    if a.max_train_windows and len(windows["train"]) > a.max_train_windows:
        windows["train"] = windows["train"].select(range(a.max_train_windows))
    if a.window_passes > 1:  # max_train_windows of each pass
        windows["train"] = window_passes(raw["train"], tokenizer, a.max_seq_length, a.window_passes, a.seed,
                                         a.max_train_windows)
    windows["test"] = windows["test"].shuffle(seed=a.seed).select(range(min(a.test_windows, len(windows["test"]))))
    if validation_docs:
        held = group_into_windows(DatasetDict(validation=Dataset.from_dict(
            {"text": [" ".join(d) for d in validation_docs]})), tokenizer, a.max_seq_length)["validation"]
        windows["validation"] = held.shuffle(seed=a.seed).select(range(min(a.test_windows, len(held))))
    for split in windows:
        if not len(windows[split]):
            raise ValueError(f"The {split} split has no window of max_seq_length={a.max_seq_length} tokens; give "
                             "more text or a smaller --max_seq_length.")
    pairs_raw = DatasetDict(train=Dataset.from_list(sentence_order_examples(train_docs, seed=a.seed,
                                                                            all_variants=True)),
                            test=Dataset.from_list(sentence_order_examples(test_docs, seed=a.seed + 1)))
    pairs_raw["test"] = pairs_raw["test"].shuffle(seed=a.seed).select(range(min(a.test_pairs,
                                                                                  len(pairs_raw["test"]))))
    pairs = tokenize_pairs(pairs_raw, tokenizer, a.max_seq_length, pad=False)
    lengths = [len(x) for x in pairs["test"]["input_ids"]]
    pairs["test"] = pairs["test"].add_column("length", lengths).sort("length").remove_columns("length")
    words = sum(len(p.split()) for d in documents for p in d)
    sizes = {"documents": {"train": len(train_docs), "test": len(test_docs)}, "words": words,
             "windows": {k: len(v) for k, v in windows.items()},
             "train_tokens": len(windows["train"]) * a.max_seq_length,
             "pairs": {k: len(v) for k, v in pairs.items()},
             "unigram_nats": unigram_cross_entropy(windows["train"], windows["test"], tokenizer)}
    return ScratchData(tokenizer, windows, pairs, PAIR_LABELS, corpus, sizes)


def unigram_cross_entropy(train_windows, test_windows, tokenizer) -> float:
    """Nats per token of the test windows' ordinary tokens under the training windows' unigram distribution
    (add-½ smoothing over the vocabulary): the MLM loss of a model that ignores context, the floor the exact model
    must clearly beat."""
    special = set(tokenizer.all_special_ids)
    counts = Counter(t for row in train_windows["input_ids"] for t in row if t not in special)
    total, vocab = sum(counts.values()), len(tokenizer)
    test = [t for row in test_windows["input_ids"] for t in row if t not in special]
    return -sum(math.log((counts.get(t, 0) + 0.5) / (total + 0.5 * vocab)) for t in test) / len(test)

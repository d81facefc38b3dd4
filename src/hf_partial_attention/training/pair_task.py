"""A real-text sentence-pair classification task that needs no download: sentence order (3 classes).

MNLI cannot be downloaded on an offline machine, so the CPU Table-1 study fine-tunes on a task built from
English prose that ships with Python: the prose paragraphs of ``pydoc_data.topics`` (the language reference)
and of the standard library's docstrings. `sentence_order_examples` describes the labels; like MNLI it has three
labels and sentence pairs as input. Documents (topics, source files) are split into train and held-out, so no
evaluation sentence is seen in pretraining or fine-tuning.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import logging
import os
import random
import re
import sys
import sysconfig
import tempfile

__all__ = ["PAIR_LABELS", "NEXT_SENTENCE_LABELS", "stdlib_docstring_documents", "split_sentences",
           "sentence_order_examples", "next_sentence_examples"]

PAIR_LABELS = ("next", "previous", "unrelated")
NEXT_SENTENCE_LABELS = ("next", "unrelated")  # BERT's next-sentence prediction
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'])")
_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "ensurepip", "turtledemo",
              "__pycache__", "tkinter"}


logger = logging.getLogger(__name__)

# Where the parsed docstrings are kept between processes (a study's jobs, the test workers): parsing the library takes
# about 5 s a process. Default: $XDG_CACHE_HOME (or ~/.cache)/hf_partial_attention.
CACHE_ENV = "HF_PARTIAL_ATTENTION_CACHE"
_CACHE_FORMAT = 1  # bump when what `_parse_documents` keeps changes


def stdlib_docstring_documents(min_words: int = 8) -> list[list[str]]:
    """Prose paragraphs of the docstrings of Python's standard library, one list per source file (sorted).

    Paragraphs with indented lines or ``>>>`` sessions (code), and fragments under `min_words` words, are dropped.
    The text depends on the Python version (the study records it). Parsing the library takes seconds: it is read
    once per process (a study reads it for pretraining and again for its pair task) and kept in a cache file
    (``$HF_PARTIAL_ATTENTION_CACHE``, default ``~/.cache/hf_partial_attention``) named by a fingerprint of the
    Python version and of every source file's path, size and modification time, so that another process reads it
    instead; each call returns new lists.
    """
    return [list(document) for document in _stdlib_documents(sysconfig.get_paths()["stdlib"], min_words)]


def _source_files(root: str) -> list[str]:
    """The library's ``.py`` files the documents come from, in a fixed order (tests, demos and GUIs left out)."""
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("test"))
        paths += [os.path.join(dirpath, name) for name in sorted(filenames)
                  if name.endswith(".py") and not name.startswith("test")]
    return paths


@functools.lru_cache(maxsize=4)
def _stdlib_documents(root: str, min_words: int) -> tuple[tuple[str, ...], ...]:
    paths = _source_files(root)
    stats = [(os.path.relpath(path, root), st.st_size, st.st_mtime_ns) for path in paths for st in [os.stat(path)]]
    key = json.dumps([_CACHE_FORMAT, sys.version, os.path.abspath(root), min_words, stats])
    cache_dir = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "hf_partial_attention")
    cache = os.path.join(cache_dir, f"stdlib_docstrings_{hashlib.sha256(key.encode()).hexdigest()[:32]}.json")
    try:
        with open(cache, encoding="utf-8") as handle:
            return tuple(tuple(document) for document in json.load(handle))
    except (OSError, ValueError):
        pass  # not there yet (or unreadable): parse
    documents = _parse_documents(paths, min_words)
    try:  # written whole, then renamed: a process reading at the same time sees the old file or the new one
        os.makedirs(cache_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=cache_dir, suffix=".tmp", delete=False) as handle:
            json.dump(documents, handle)
        os.replace(handle.name, cache)
    except OSError as error:
        logger.debug("not caching the standard library's docstrings in %s: %s", cache_dir, error)
    return documents


def _parse_documents(paths: list[str], min_words: int) -> tuple[tuple[str, ...], ...]:
    documents = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as handle:
                tree = ast.parse(handle.read())
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        paragraphs = []
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for block in re.split(r"\n\s*\n", ast.get_docstring(node) or ""):
                lines = [line for line in block.splitlines() if line.strip()]
                if not lines or any(line.startswith((" ", "\t", ">>>")) for line in lines):
                    continue
                text = " ".join(line.strip() for line in lines)
                if len(text.split()) >= min_words and text[0].isupper():
                    paragraphs.append(text)
        if paragraphs:
            documents.append(tuple(paragraphs))
    return tuple(documents)


def split_sentences(paragraph: str, min_words: int = 3) -> list[str]:
    """Sentences of a paragraph (split after ``.!?`` before a capital); fragments under `min_words` dropped."""
    return [s for s in _SENTENCE_END.split(paragraph) if len(s.split()) >= min_words]


def next_sentence_examples(documents: list[list[str]], seed: int = 0, all_variants: bool = False) -> list[dict]:
    """Next-sentence prediction (2 classes, as in BERT's pretraining): ``next`` (A, B) with B following A in its
    paragraph, ``unrelated`` (A, C) with C a sentence of another document. Same draws as
    `sentence_order_examples`, without the ``previous`` class."""
    return sentence_order_examples(documents, seed, all_variants, classes=(0, 2))


def sentence_order_examples(documents: list[list[str]], seed: int = 0, all_variants: bool = False,
                            classes: tuple[int, ...] = (0, 1, 2)) -> list[dict]:
    """Examples ``{"premise", "hypothesis", "label"}`` from every consecutive sentence pair of every paragraph.

    From two consecutive sentences (A, B) of one paragraph:

    - label 0 ``next``: (A, B), B follows A;
    - label 1 ``previous``: (B, A), the order swapped;
    - label 2 ``unrelated``: (A, C), C a sentence of another document of the same split.

    Telling ``next`` from ``previous`` needs word order and discourse cues, ``unrelated`` mostly topic cues.

    Args:
        documents: paragraphs grouped by document (``unrelated`` sentences come from other documents).
        seed: the draws of labels and unrelated sentences.
        all_variants: emit all three labels per pair (training: more signal from little text) instead of
            one label drawn per pair (evaluation: independent examples, balanced in expectation).
        classes: the labels of `PAIR_LABELS` to emit; the emitted labels are renumbered 0, 1, ... in this order.
    """
    if len(documents) < 2:
        raise ValueError(f"Need at least 2 documents for 'unrelated' pairs, got {len(documents)}.")
    rng = random.Random(seed)
    sentences = [[s for p in doc for s in split_sentences(p)] for doc in documents]
    examples = []
    for d, doc in enumerate(documents):
        for paragraph in doc:
            sents = split_sentences(paragraph)
            for a, b in zip(sents, sents[1:]):
                other = rng.choice([i for i in range(len(sentences)) if i != d and sentences[i]])
                c = rng.choice(sentences[other])
                every = [(a, b, 0), (b, a, 1), (a, c, 2)]
                variants = [(p, h, classes.index(label)) for p, h, label in every if label in classes]
                for premise, hypothesis, label in (variants if all_variants else [rng.choice(variants)]):
                    examples.append({"premise": premise, "hypothesis": hypothesis, "label": label})
    return examples

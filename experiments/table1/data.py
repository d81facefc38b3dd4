"""The Table-1 study's data: the start model, its tokenizer, MLM windows, sentence pairs and the bucket-fit inputs.

Default (offline): the English prose that ships with CPython (``pydoc_data.topics`` and the standard library's
docstrings), split by document so that no evaluation sentence is seen in training. `load_study_data` describes the
splits and why they are drawn so.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["StudyData", "load_study_data", "split_documents", "bucket_fit_documents", "TASK_DESCRIPTION"]

TASK_DESCRIPTION = {
    "next_sentence": "next-sentence prediction (next / unrelated) on CPython's English prose",
    "sentence_order": "sentence order (next / previous / unrelated) on CPython's English prose",
    "mnli": "MNLI",
}


@dataclass
class StudyData:
    model_path: str  # what from_pretrained loads
    model_id: str  # how reports name it (a Hub id, never a local path)
    tokenizer: Any
    windows: Any  # DatasetDict train / selection / validation of n-token MLM windows
    pairs: Any  # DatasetDict train / validation of tokenized pairs (validation sorted by length)
    mlm_pairs: Any  # Dataset of held-out pairs' input_ids, token_type_ids, attention_mask (MLM at their lengths)
    fit_documents: list  # training documents as [sentence, ..., paragraph, ...] (the bucket fit)
    labels: tuple[str, ...]
    corpus: str
    sizes: dict
    pooler: dict  # the start model's pooler weights (fine-tuning heads start from them)
    recovery_inputs: Any = None  # phase 2's data: training windows and training pairs at their own lengths


def split_documents(documents: list, train_every: int) -> tuple[list, list]:
    """(train, held-out): document i trains when ``i % train_every == 0``."""
    if train_every < 2:
        raise ValueError(f"train_every must be >= 2 (some documents held out), got {train_every}.")
    return ([d for i, d in enumerate(documents) if i % train_every == 0],
            [d for i, d in enumerate(documents) if i % train_every != 0])


def bucket_fit_documents(documents: list) -> list[list[str]]:
    """Each document (a list of paragraphs, or of a paragraph's pieces) as its sentences followed by its paragraphs
    of more than 12 words: real inputs of both kinds, as `experiments.lengths.fit_documents` builds them."""
    from hf_partial_attention.analysis.inputs import split_sentences

    out = []
    for doc in documents:
        paragraphs = [" ".join(p.split()) if isinstance(p, str) else " ".join(p) for p in doc]
        sentences = [s for p in paragraphs for s in split_sentences(p)]
        out.append(sentences + [p for p in paragraphs if len(p.split()) > 12])
    return [d for d in out if d]


def _spread(dataset, count: int):
    """At most ``count`` rows of ``dataset`` taken evenly over it (it is sorted by length: every length kept)."""
    if not count or count >= len(dataset):
        return dataset
    step = len(dataset) / count
    return dataset.select([int(i * step) for i in range(count)])


def load_study_data(a) -> StudyData:
    """The study's data (`StudyData`) for the arguments ``a``.

    Every `train_every`-th document is for training (MLM, P and R, fine-tuning), the others are held out (the test
    split: MLM losses and accuracies), so no evaluation sentence is seen in training. Holding out the larger part
    buys a held-out pair set big enough for a standard error near one point. Of the training documents, every
    `selection_every`-th is the *selection* split: the validation data of the R learning-rate choice, used for
    nothing else (no training, no fit), so that choice reads neither the test split nor the data it trained on.

    Splits: ``windows`` train / selection / validation (n-token MLM windows, the last two at most
    ``mlm_eval_windows``; validation = test), ``pairs`` train / validation (tokenized at their own lengths,
    validation sorted by length), ``mlm_pairs`` (held-out pairs spread over their lengths, without labels: the MLM
    losses at the pairs' lengths) and ``fit_documents`` (the training documents' sentences and paragraphs, each at
    its own length: the inputs of the length-bucket fit)."""
    from transformers import AutoTokenizer

    from hf_partial_attention.analysis.defaults import resolve_model
    from hf_partial_attention.training import tokenize_pairs

    path, hub_id = resolve_model(a.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    raw, fit_documents, corpus, prose = _mlm_text(a)
    windows = _mlm_windows(a, raw, tokenizer)
    pairs_raw, labels = _pair_examples(a, prose)
    if a.max_finetune_eval:
        pairs_raw["validation"] = pairs_raw["validation"].select(range(min(a.max_finetune_eval,
                                                                           len(pairs_raw["validation"]))))
    pairs = tokenize_pairs(pairs_raw, tokenizer, a.max_seq_length, pad=False)
    lengths = [len(x) for x in pairs["validation"]["input_ids"]]
    pairs["validation"] = pairs["validation"].add_column("length", lengths).sort("length").remove_columns("length")
    mlm_pairs = _spread(pairs["validation"], a.mlm_eval_pairs).remove_columns("label")
    recovery_inputs = _recovery_inputs(windows["train"], pairs["train"], tokenizer)
    sizes = {"mlm_windows": {k: len(v) for k, v in windows.items()}, "pairs": {k: len(v) for k, v in pairs.items()},
             "mlm_pairs": len(mlm_pairs), "recovery_inputs": len(recovery_inputs),
             "bucket_fit_documents": len(fit_documents),
             "bucket_fit_inputs_available": sum(len(d) for d in fit_documents)}
    pooler = _start_pooler(path)
    return StudyData(path, hub_id or a.model_name_or_path, tokenizer, windows, pairs, mlm_pairs, fit_documents,
                     labels, corpus, sizes, pooler, recovery_inputs)


def _mlm_text(a):
    """The MLM text as (train / selection / validation documents, bucket-fit documents, corpus name, prose): the
    given dataset or files, else the default corpus, whose (train, selection, held-out) documents are ``prose``
    (None for a given dataset)."""
    from datasets import Dataset, DatasetDict

    from hf_partial_attention.analysis.corpus import pydoc_paragraphs
    from hf_partial_attention.training import MlmDataArguments, load_text_datasets
    from hf_partial_attention.training.pair_task import stdlib_docstring_documents

    prose = None  # (train, selection, held-out) documents of the default corpus
    if a.pretrain_dataset_name or a.pretrain_train_file:
        raw = load_text_datasets(MlmDataArguments(dataset_name=a.pretrain_dataset_name,
                                                  dataset_config_name=a.pretrain_dataset_config_name,
                                                  train_file=a.pretrain_train_file))
        rows = raw["train"]  # each row a document; every selection_every-th the selection split
        raw = DatasetDict(train=rows.select([i for i in range(len(rows)) if i % a.selection_every]),
                          selection=rows.select(range(0, len(rows), a.selection_every)),
                          validation=raw["validation"])
        fit_documents = bucket_fit_documents([[t] for t in raw["train"]["text"] if isinstance(t, str) and t.strip()])
        corpus = a.pretrain_dataset_name or "local text files"
    else:
        train_docs, held = split_documents(pydoc_paragraphs() + stdlib_docstring_documents(), a.train_every)
        selection, train_docs = split_documents(train_docs, a.selection_every)
        prose = (train_docs, selection, held)
        raw = DatasetDict({split: Dataset.from_dict({"text": [" ".join(d) for d in docs]})
                           for split, docs in zip(("train", "selection", "validation"), prose)})
        fit_documents = bucket_fit_documents(train_docs)
        corpus = f"pydoc_data.topics + standard-library docstrings (CPython {sys.version.split()[0]})"
    return raw, fit_documents, corpus, prose


def _mlm_windows(a, raw, tokenizer):
    """The MLM text in windows of n tokens; the selection and validation splits cut to ``mlm_eval_windows``."""
    from hf_partial_attention.training import group_into_windows

    windows = group_into_windows(raw, tokenizer, a.max_seq_length)
    for split in ("selection", "validation"):  # the first mlm_eval_windows of each (the selection has fewer)
        windows[split] = windows[split].select(range(min(a.mlm_eval_windows, len(windows[split]))))
    for split in ("train", "selection", "validation"):
        if not len(windows[split]):
            raise ValueError(f"The {split} split has no window of max_seq_length={a.max_seq_length} tokens; give "
                             "more text, a smaller --max_seq_length or a larger --selection_every.")
    return windows


def _pair_examples(a, prose):
    """The fine-tuning task's (train, validation) examples, untokenized, and its labels: MNLI, or next-sentence or
    sentence-order pairs from the default corpus's training and held-out documents (``prose``, or split here)."""
    from datasets import Dataset, DatasetDict

    from hf_partial_attention.analysis.corpus import pydoc_paragraphs
    from hf_partial_attention.training import MnliDataArguments, load_mnli
    from hf_partial_attention.training.pair_task import (
        NEXT_SENTENCE_LABELS, PAIR_LABELS, next_sentence_examples, sentence_order_examples, stdlib_docstring_documents,
    )

    if a.task == "mnli":
        pairs_raw = load_mnli(MnliDataArguments(dataset_name=a.finetune_dataset_name,
                                                dataset_config_name=a.finetune_dataset_config_name,
                                                train_file=a.finetune_train_file,
                                                validation_file=a.finetune_validation_file))
        pairs_raw = DatasetDict(train=pairs_raw["train"], validation=pairs_raw["validation_matched"])
        labels = ("entailment", "neutral", "contradiction")
    else:
        if prose is None:
            train_docs, held = split_documents(pydoc_paragraphs() + stdlib_docstring_documents(), a.train_every)
            prose = (split_documents(train_docs, a.selection_every)[1], None, held)
        make, labels = ((next_sentence_examples, NEXT_SENTENCE_LABELS) if a.task == "next_sentence" else
                        (sentence_order_examples, PAIR_LABELS))
        pairs_raw = DatasetDict(train=Dataset.from_list(make(prose[0], seed=a.seed, all_variants=True)),
                                validation=Dataset.from_list(make(prose[2], seed=a.seed + 1)))
    return pairs_raw, labels


def _recovery_inputs(train_windows, train_pairs, tokenizer):
    """Phase 2's data: the training windows (n tokens) and the training pairs at their own lengths (the inputs
    fine-tuning will see, so every length bucket's R trains), as MLM examples (input ids, attention mask, special
    tokens mask; the pairs' segment ids are left out, as the windows have none)."""
    from datasets import concatenate_datasets

    special = {tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id}
    pairs = train_pairs.map(lambda row: {"special_tokens_mask": [int(t in special) for t in row["input_ids"]]},
                            remove_columns=[c for c in train_pairs.column_names if c not in ("input_ids",
                                                                                             "attention_mask")])
    windows = train_windows.select_columns(["input_ids", "attention_mask", "special_tokens_mask"])
    return concatenate_datasets([windows, pairs.cast(windows.features)])


def _start_pooler(path: str) -> dict:
    """The pooler of the start model (a freshly initialised one, logged, if its checkpoint has none)."""
    import logging

    from transformers import BertModel

    model, info = BertModel.from_pretrained(path, output_loading_info=True)
    if any(key.startswith("pooler.") for key in info["missing_keys"]):
        logging.getLogger(__name__).warning("%s has no pooler weights: fine-tuning starts from a new one.", path)
    return {k: v.clone() for k, v in model.pooler.state_dict().items()}

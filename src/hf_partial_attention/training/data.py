"""Datasets for MLM pretraining and MNLI-style fine-tuning, sized for partial attention's fixed n.

- `load_text_datasets` / `group_into_windows`: any text dataset (Hub or local files) becomes windows of
  exactly n tokens, ``[CLS] t_1 … t_{n−2} [SEP]`` (the paper's layout: positions 0 and n−1 are [CLS], [SEP]).
- `examples_at_own_length`: the same texts as one example per line or per sentence, each at its own length
  (``[CLS] … [SEP]``, at most n tokens): the lengths real inputs have, for length-bucketed partial attention.
- `MlmCollator`: pads each batch to its longest example and applies BERT's 80/10/10 masking, drawn per example
  from a seed, the example's tokens and the epoch, never from the global RNG; so a run resumed from a checkpoint
  sees the very masks of the uninterrupted run, whatever the batch or its padding.
- `load_mnli` / `tokenize_pairs`: MNLI from the Hub (``nyu-mll/glue``, ``mnli``) or local JSON lines
  (premise, hypothesis, label), padded to n or left at their own length for a padding collator.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from dataclasses import dataclass
from typing import Any

import torch

from .pair_task import split_sentences

logger = logging.getLogger(__name__)

__all__ = [
    "MNLI_LABELS",
    "load_text_datasets",
    "group_into_windows",
    "MLM_INPUTS",
    "examples_at_own_length",
    "MlmCollator",
    "load_mnli",
    "tokenize_pairs",
]

MNLI_LABELS = ("entailment", "neutral", "contradiction")  # GLUE's label ids 0, 1, 2
MLM_INPUTS = ("windows", "sentences", "lines")  # MlmDataArguments.mlm_inputs
_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv"}


def _builder(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in _BUILDERS:
        raise ValueError(f"Unsupported data file extension {ext!r} ({path}); use one of {sorted(_BUILDERS)}.")
    return _BUILDERS[ext]


def _load_files(files: dict[str, str], cache_dir: str | None):
    from datasets import load_dataset

    builders = {_builder(path) for path in files.values()}
    if len(builders) != 1:
        raise ValueError(f"All data files must share one format, got {files}.")
    return load_dataset(builders.pop(), data_files=files, cache_dir=cache_dir)


def load_text_datasets(data_args, cache_dir: str | None = None, token: str | None = None):
    """Train and validation text splits (`MlmDataArguments`), as ``run_mlm.py`` builds them.

    A Hub dataset (``dataset_name``) wins over local files. Without a validation split, the first
    ``validation_split_percentage`` percent of train becomes validation.
    """
    from datasets import DatasetDict, load_dataset

    if data_args.dataset_name is not None:
        raw = load_dataset(data_args.dataset_name, data_args.dataset_config_name, cache_dir=cache_dir, token=token)
    else:
        files = {"train": data_args.train_file}
        if data_args.validation_file is not None:
            files["validation"] = data_args.validation_file
        raw = _load_files(files, cache_dir)
    if "validation" not in raw:
        pct = data_args.validation_split_percentage
        if pct == 0:
            return DatasetDict(train=raw["train"])
        n_val = max(1, len(raw["train"]) * pct // 100)
        raw = DatasetDict(validation=raw["train"].select(range(n_val)),
                          train=raw["train"].select(range(n_val, len(raw["train"]))))
    return DatasetDict(train=raw["train"], validation=raw["validation"])


def _text_setup(raw, tokenizer, length: int, text_column: str | None, field: str):
    """What both tokenizers need: the first split, its text column, [CLS] / [SEP] ids, whether examples are wrapped
    in them, and the tokens left between them (a ValueError naming ``field`` when none are)."""
    first = next(iter(raw.values()))
    column = text_column or ("text" if "text" in first.column_names else first.column_names[0])
    if column not in first.column_names:
        raise ValueError(f"text_column_name={column!r} not in the dataset's columns {first.column_names}.")
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    wrap = cls is not None and sep is not None
    body = length - 2 if wrap else length
    if body < 1:
        raise ValueError(f"{field}={length} leaves no room for tokens between [CLS] and [SEP]; use >= 3.")
    return first, column, cls, sep, wrap, body


def _map_splits(raw, function, **kwargs):
    """``raw.map(function, **kwargs)`` split by split, where a split held in memory (no cache files) gets a random
    fingerprint rather than one hashed from ``function``: hashing pickles everything the function holds (a tokenizer:
    about 0.5 s a call), and a fingerprint only names cache files, which such a split neither reads nor writes (a
    random one is what `datasets` uses when caching is off). Splits read from files keep the hashed fingerprint, so
    their cached results are found again."""
    from datasets import DatasetDict

    return DatasetDict({name: split.map(function, new_fingerprint=None if split.cache_files else secrets.token_hex(16),
                                        **kwargs) for name, split in raw.items()})


def group_into_windows(raw, tokenizer, window: int, text_column: str | None = None, num_proc: int | None = None,
                       load_from_cache_file: bool = True, offset: int = 0):
    """Tokenize every split and cut the token stream into windows of exactly `window` tokens.

    Each window is ``[CLS] + window−2 tokens + [SEP]`` when the tokenizer has both special tokens, else
    `window` plain tokens. The tail of each map batch (1000 texts) shorter than a window is dropped; ``offset``:
    tokens of each batch's stream left out before the first window (another cut of the same text).
    """
    first, column, cls, sep, wrap, body = _text_setup(raw, tokenizer, window, text_column, "window")

    def tokenize_and_cut(batch: dict[str, list]) -> dict[str, list]:
        texts = [t for t in batch[column] if isinstance(t, str) and t.strip()]
        ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False,
                        return_token_type_ids=False, verbose=False)["input_ids"]
        stream = [tok for seq in ids for tok in seq][offset:]
        chunks = [stream[i: i + body] for i in range(0, len(stream) - body + 1, body)]
        input_ids = [[cls, *c, sep] if wrap else c for c in chunks]
        special = [[1, *([0] * body), 1] if wrap else [0] * body for _ in chunks]
        return {"input_ids": input_ids, "special_tokens_mask": special,
                "attention_mask": [[1] * window for _ in chunks]}

    return _map_splits(raw, tokenize_and_cut, batched=True, batch_size=1000, num_proc=num_proc,
                   remove_columns=first.column_names, load_from_cache_file=load_from_cache_file,
                   desc=f"Tokenizing into {window}-token windows")


def examples_at_own_length(raw, tokenizer, max_length: int, unit: str = "lines", text_column: str | None = None,
                           num_proc: int | None = None, load_from_cache_file: bool = True):
    """Tokenize every split into one example per text unit, each at its own length (no packing into windows).

    Units (``unit``): ``"lines"``, each row of the text column as it is (a line of a ``.txt`` file, a row of a
    JSON/CSV file or Hub dataset, e.g. a wikitext paragraph); ``"sentences"``, each row split into sentences
    (after ``.!?`` before a capital, `pair_task.split_sentences`). Each example is ``[CLS] t_1 … t_m [SEP]`` (plain
    tokens without those special tokens), its tokens beyond `max_length` dropped (partial attention's n: the
    longest input the pattern covers); rows and sentences without a token are dropped. A batch of such examples is
    padded to its longest member by `MlmCollator`; group them by length with
    ``--train_sampling_strategy group_by_length`` (or ``--group_by_length``) to waste little on padding.

    Returns:
        The splits with columns ``input_ids``, ``special_tokens_mask`` and ``attention_mask`` (all ones), lists of
        2 to `max_length` ids.
    """
    if unit not in MLM_INPUTS[1:]:
        raise ValueError(f"unit={unit!r} is not one of {MLM_INPUTS[1:]}; whole windows come from group_into_windows.")
    first, column, cls, sep, wrap, body = _text_setup(raw, tokenizer, max_length, text_column, "max_length")

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        texts = [t.strip() for t in batch[column] if isinstance(t, str) and t.strip()]
        if unit == "sentences":
            texts = [s for t in texts for s in split_sentences(t, min_words=1)]
        ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False,
                        return_token_type_ids=False, verbose=False)["input_ids"] if texts else []
        ids = [seq[:body] for seq in ids if seq]
        input_ids = [[cls, *seq, sep] if wrap else seq for seq in ids]
        special = [[1, *([0] * len(seq)), 1] if wrap else [0] * len(seq) for seq in ids]
        return {"input_ids": input_ids, "special_tokens_mask": special,
                "attention_mask": [[1] * len(seq) for seq in input_ids]}

    return _map_splits(raw, tokenize, batched=True, batch_size=1000, num_proc=num_proc,
                   remove_columns=first.column_names, load_from_cache_file=load_from_cache_file,
                   desc=f"Tokenizing {unit} at their own length (at most {max_length} tokens)")


@dataclass
class MlmCollator:
    """Pads a batch to its longest example and masks tokens for MLM, reproducibly (no global RNG).

    Padding (to the longest example, or up to a multiple of `pad_to_multiple_of`) has attention mask 0 and label
    -100: it is never masked, predicted or counted. Each example's mask is drawn from a generator seeded by
    ``(seed, epoch, its token ids)``, over its own (unpadded) tokens: the masks change every epoch (dynamic masking,
    as in RoBERTa) but are a pure function of the example, so resuming from a checkpoint, any batch size or batch
    composition (whatever padding it brings) or any number of processes sees the same masks for the same example
    and epoch.
    `PartialAttentionTrainer` sets `epoch` at the start of each epoch and `None` during evaluation (one fixed
    mask per window, so evaluation losses are comparable across checkpoints and models).

    Args:
        tokenizer: provides ``pad``, ``mask_token_id``, ``pad_token_id`` and the vocabulary size.
        mlm_probability: fraction of non-special tokens to predict.
        mask_replace_prob / random_replace_prob: of those, the fraction replaced by [MASK] / a random token
            (BERT: 0.8 / 0.1; the rest stay unchanged).
        seed: base seed of the masks.
        pad_to_multiple_of: pad each batch's length up to a multiple of this (e.g. 8 for tensor cores); None: to
            the longest example exactly.
    """

    tokenizer: Any
    mlm_probability: float = 0.15
    mask_replace_prob: float = 0.8
    random_replace_prob: float = 0.1
    seed: int = 0
    epoch: int | None = 0
    pad_to_multiple_of: int | None = None

    def __post_init__(self):
        if self.tokenizer.mask_token_id is None:
            raise ValueError("The tokenizer has no mask token; MLM needs one (tokenizer.mask_token).")
        if not 0.0 < self.mlm_probability < 1.0:
            raise ValueError(f"mlm_probability must be in (0, 1), got {self.mlm_probability}.")
        if self.mask_replace_prob + self.random_replace_prob > 1.0:
            raise ValueError("mask_replace_prob + random_replace_prob must not exceed 1, got "
                             f"{self.mask_replace_prob} + {self.random_replace_prob}.")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be a positive integer or None, got {self.pad_to_multiple_of}.")

    def _generator(self, ids: torch.Tensor) -> torch.Generator:
        tag = f"{self.seed}/{self.epoch}/".encode() + ids.numpy().astype("int64").tobytes()
        gen = torch.Generator()
        gen.manual_seed(int.from_bytes(hashlib.blake2b(tag, digest_size=8).digest(), "little") >> 1)
        return gen

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        # Pads to the longest example (T), or up to a multiple of pad_to_multiple_of; attention_mask 0 there.
        batch = self.tokenizer.pad(examples, return_tensors="pt", pad_to_multiple_of=self.pad_to_multiple_of)
        input_ids = batch["input_ids"].clone()  # (B, T)
        special = batch.pop("special_tokens_mask", None)
        if special is None:
            special = torch.tensor([self.tokenizer.get_special_tokens_mask(row, already_has_special_tokens=True)
                                    for row in input_ids.tolist()])
        maskable = (special == 0) & (batch["attention_mask"] == 1)  # (B, T)
        labels = torch.full_like(input_ids, -100)
        vocab = len(self.tokenizer)
        for b in range(input_ids.shape[0]):
            # Seed and draw over the example's own tokens: padding, which depends on the batch, changes nothing.
            own = batch["attention_mask"][b] == 1  # (T,)
            ids, t = input_ids[b, own], int(own.sum())  # (t,)
            gen = self._generator(ids)
            chosen = (torch.rand(t, generator=gen) < self.mlm_probability) & maskable[b, own]
            action = torch.rand(t, generator=gen)  # < mask_p: [MASK]; < mask_p + rand_p: random token
            random_ids = torch.randint(vocab, (t,), generator=gen)
            labels[b, own] = torch.where(chosen, ids, -100)
            to_mask = chosen & (action < self.mask_replace_prob)
            to_random = chosen & ~to_mask & (action < self.mask_replace_prob + self.random_replace_prob)
            ids = torch.where(to_mask, self.tokenizer.mask_token_id, ids)
            input_ids[b, own] = torch.where(to_random, random_ids, ids)
        batch["input_ids"], batch["labels"] = input_ids, labels
        return dict(batch)


def _label_to_id(label):
    if isinstance(label, str):
        if label not in MNLI_LABELS:
            raise ValueError(f"Unknown MNLI label {label!r}; use one of {MNLI_LABELS} or their ids 0, 1, 2.")
        return MNLI_LABELS.index(label)
    return int(label)


def load_mnli(data_args, cache_dir: str | None = None, token: str | None = None):
    """MNLI splits ``train``, ``validation_matched`` and (if available) ``validation_mismatched``.

    Local files (`train_file`, `validation_file` = matched, `validation_mismatched_file`) are JSON lines with
    ``premise``, ``hypothesis`` and ``label`` (an id 0-2 or a name from `MNLI_LABELS`); they win over the Hub.
    Rows with label -1 (GLUE's unlabelled test rows) are dropped.
    """
    from datasets import DatasetDict, load_dataset

    if data_args.train_file is not None:
        files = {"train": data_args.train_file, "validation_matched": data_args.validation_file,
                 "validation_mismatched": data_args.validation_mismatched_file}
        # One load per file: label columns may differ in type (ids in one file, names in another).
        raw = DatasetDict({split: _load_files({"train": path}, cache_dir)["train"]
                           for split, path in files.items() if path})
    else:
        raw = load_dataset(data_args.dataset_name, data_args.dataset_config_name, cache_dir=cache_dir, token=token)
    keep = [s for s in ("train", "validation_matched", "validation_mismatched") if s in raw]
    out = DatasetDict({s: raw[s] for s in keep})
    for split, ds in out.items():
        missing = {"premise", "hypothesis", "label"} - set(ds.column_names)
        if missing:
            raise ValueError(f"MNLI split {split!r} lacks columns {sorted(missing)}; it has {ds.column_names}.")
    out = out.map(lambda row: {"label": _label_to_id(row["label"])})
    return out.filter(lambda row: row["label"] >= 0)


def tokenize_pairs(raw, tokenizer, max_length: int, first: str = "premise", second: str = "hypothesis",
                   num_proc: int | None = None, load_from_cache_file: bool = True, pad: bool = True):
    """Tokenize sentence pairs, truncated to `max_length` (partial attention's n) and, with `pad`, padded to it.

    ``pad=False`` leaves each pair at its own length for a padding collator (``DataCollatorWithPadding``):
    partial attention runs inputs shorter than n (keys beyond the input score zero), at less cost.
    """

    def encode(batch: dict[str, list]) -> dict[str, list]:
        return tokenizer(batch[first], batch[second], truncation=True, max_length=max_length,
                         padding="max_length" if pad else False)

    columns = next(iter(raw.values())).column_names
    return _map_splits(raw, encode, batched=True, num_proc=num_proc, load_from_cache_file=load_from_cache_file,
                   remove_columns=[c for c in columns if c != "label"], desc="Tokenizing pairs")

"""Data for training: n-token windows, reproducible MLM masks, MNLI files, the offline accuracy metric."""

import json
import os

import numpy as np
import pytest
import torch
from datasets import Dataset, DatasetDict
from transformers import DataCollatorWithPadding, EvalPrediction

from hf_partial_attention.training import (
    MlmCollator,
    MlmDataArguments,
    MnliDataArguments,
    PartialAttentionTrainingArguments,
    classification_metrics,
    examples_at_own_length,
    group_into_windows,
    load_metric,
    load_mnli,
    tokenize_pairs,
)
from hf_partial_attention.training.metrics import LOCAL_METRICS
from hf_partial_attention.training.pair_task import sentence_order_examples, split_sentences

DATA = os.path.join(os.path.dirname(__file__), "data")


def test_windows_are_n_tokens_between_cls_and_sep(tokenizer, windows):
    ids = torch.tensor(windows["input_ids"])  # (S, 32)
    assert ids.shape[1] == 32 and ids.shape[0] > 50
    assert (ids[:, 0] == tokenizer.cls_token_id).all() and (ids[:, -1] == tokenizer.sep_token_id).all()
    assert not (ids[:, 1:-1] == tokenizer.sep_token_id).any()
    assert torch.tensor(windows["special_tokens_mask"]).sum(1).eq(2).all()


@pytest.fixture(scope="module")
def sentences(tokenizer):
    with open(os.path.join(DATA, "tiny_corpus.txt")) as f:
        texts = [t for t in f.read().split("\n\n") if t.strip()]
    raw = DatasetDict(train=Dataset.from_dict({"text": ["", "   ", *texts]}))  # empty rows are dropped
    return examples_at_own_length(raw, tokenizer, 32, "sentences")["train"]


def test_examples_at_own_length(tokenizer, sentences):
    """One example per sentence (or line), [CLS] ... [SEP] at its own length, truncated to n; rows that are blank
    or have no token (a zero-width space) are dropped."""
    lengths = [len(ids) for ids in sentences["input_ids"]]
    assert len(sentences) > 50 and min(lengths) < 16 and max(lengths) == 32 and len(set(lengths)) > 10
    for ids, special, attention in zip(sentences["input_ids"], sentences["special_tokens_mask"],
                                       sentences["attention_mask"]):
        assert ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id and len(ids) >= 3
        assert tokenizer.sep_token_id not in ids[1:-1] and tokenizer.pad_token_id not in ids
        assert special == [1, *([0] * (len(ids) - 2)), 1] and attention == [1] * len(ids)
    first = "An assignment statement evaluates the expression list (remember that this can be a single expression"
    assert tokenizer.decode(sentences[0]["input_ids"][1:-1]).startswith(first.lower()[:40])
    raw = DatasetDict(train=Dataset.from_dict({"text": ["One line. Two sentences.", "", "Short", " ", "\u200b"]}))
    lines = examples_at_own_length(raw, tokenizer, 32, "lines")["train"]
    assert [tokenizer.decode(ids) for ids in lines["input_ids"]] == ["[CLS] one line. two sentences. [SEP]",
                                                                     "[CLS] short [SEP]"]
    two = examples_at_own_length(raw, tokenizer, 32, "sentences")["train"]
    assert [tokenizer.decode(ids) for ids in two["input_ids"]] == [
        "[CLS] one line. [SEP]", "[CLS] two sentences. [SEP]", "[CLS] short [SEP]"]
    assert [len(ids) for ids in examples_at_own_length(raw, tokenizer, 4, "lines")["train"]["input_ids"]] == [4, 3]
    with pytest.raises(ValueError, match="unit='windows'"):
        examples_at_own_length(raw, tokenizer, 32, "windows")


def test_mlm_inputs_argument():
    assert MlmDataArguments(train_file="corpus.txt").mlm_inputs == "windows"  # the default: unchanged behaviour
    assert MlmDataArguments(train_file="corpus.txt", mlm_inputs="sentences").mlm_inputs == "sentences"
    with pytest.raises(ValueError, match="mlm_inputs"):
        MlmDataArguments(train_file="corpus.txt", mlm_inputs="paragraph")
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        MlmDataArguments(train_file="corpus.txt", pad_to_multiple_of=0)


def test_group_by_length_argument(tmp_path):
    """transformers 5 has no group_by_length flag, only train_sampling_strategy: ours sets the strategy."""
    args = PartialAttentionTrainingArguments(str(tmp_path), group_by_length=True, use_cpu=True, report_to="none")
    assert args.train_sampling_strategy == "group_by_length" and args.length_column_name == "length"
    plain = PartialAttentionTrainingArguments(str(tmp_path), use_cpu=True, report_to="none")
    assert plain.train_sampling_strategy == "random"
    with pytest.raises(ValueError, match="train_sampling_strategy"):
        PartialAttentionTrainingArguments(str(tmp_path), group_by_length=True, train_sampling_strategy="sequential",
                                          use_cpu=True, report_to="none")


def test_mlm_collator_pads_to_the_longest_example(tokenizer, sentences):
    """Variable lengths: a batch is padded to its longest example (or a multiple of pad_to_multiple_of), never to
    n; padding has attention 0, label -100 and the pad token, and is never masked."""
    examples = [e for e in sentences if len(e["input_ids"]) < 24][:8]
    lengths = [len(e["input_ids"]) for e in examples]
    assert len(set(lengths)) > 3 and max(lengths) < 24  # n is 32: padding to n (or 32) would show
    for multiple, width in ((None, max(lengths)), (8, -(-max(lengths) // 8) * 8)):
        batch = MlmCollator(tokenizer, mlm_probability=0.5, pad_to_multiple_of=multiple)(examples)
        assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (8, width)
        for b, t in enumerate(lengths):
            assert batch["attention_mask"][b, :t].all() and not batch["attention_mask"][b, t:].any()
            assert (batch["labels"][b, t:] == -100).all()
            assert (batch["input_ids"][b, t:] == tokenizer.pad_token_id).all()
            assert (batch["labels"][b, 1:t - 1] != -100).any()
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        MlmCollator(tokenizer, pad_to_multiple_of=0)


def test_mlm_masks_of_variable_length_examples_do_not_depend_on_the_batch(tokenizer, sentences):
    """Each example's masked positions, labels and inputs are the same alone and in any batch (beside longer ones,
    in another order, padded to a multiple of 8), in training epochs and in evaluation (epoch None)."""
    order = sorted(range(12), key=lambda i: len(sentences[i]["input_ids"]))
    short, longer = order[0], order[-1]
    assert len(sentences[short]["input_ids"]) < len(sentences[longer]["input_ids"])
    examples = [sentences[i] for i in range(12)]
    for epoch in (0, 3, None):
        collator = MlmCollator(tokenizer, seed=5, mlm_probability=0.4, epoch=epoch)
        padded = MlmCollator(tokenizer, seed=5, mlm_probability=0.4, epoch=epoch, pad_to_multiple_of=8)
        together = collator(examples)
        reversed_batch = padded(list(reversed(examples)))
        pair = collator([sentences[short], sentences[longer]])
        for i in range(12):
            alone = collator([sentences[i]])
            t = alone["labels"].shape[1]
            for batch, row in ((together, i), (reversed_batch, 11 - i)):
                assert torch.equal(batch["labels"][row, :t], alone["labels"][0]), (epoch, i)
                assert torch.equal(batch["input_ids"][row, :t], alone["input_ids"][0]), (epoch, i)
        t = len(sentences[short]["input_ids"])
        assert pair["labels"].shape[1] > t and (pair["labels"][0, t:] == -100).all()
        assert torch.equal(pair["labels"][0, :t], collator([sentences[short]])["labels"][0])


def test_group_into_windows_rejects_bad_column(tokenizer):
    raw = DatasetDict(train=Dataset.from_dict({"body": ["some text here"]}))
    with pytest.raises(ValueError, match="text_column_name"):
        group_into_windows(raw, tokenizer, 16, text_column="text")


def test_mlm_masks_are_reproducible_and_leave_global_rng_alone(tokenizer, windows):
    examples = [windows[i] for i in range(16)]
    collator = MlmCollator(tokenizer, seed=7)
    state = torch.get_rng_state()
    first, second = collator(examples), collator(list(reversed(examples)))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(first["labels"], second["labels"].flip(0))  # per example, not per batch position
    collator.epoch = 1
    assert not torch.equal(collator(examples)["labels"], first["labels"])  # dynamic masking across epochs
    assert not torch.equal(MlmCollator(tokenizer, seed=8)(examples)["labels"], first["labels"])


def test_mlm_masks_do_not_depend_on_padding(tokenizer, windows):
    """An example's mask is the same alone and padded beside a longer one (batch size must not change it)."""
    short = {k: v[:20] for k, v in windows[0].items()}  # 20 of the 32 tokens: padded to 32 in a batch
    collator = MlmCollator(tokenizer, seed=3, mlm_probability=0.5)
    collator.epoch = None
    alone = collator([short])
    padded = collator([short, windows[1]])
    assert padded["labels"].shape == (2, 32) and (padded["labels"][0, 20:] == -100).all()
    assert torch.equal(padded["labels"][0, :20], alone["labels"][0])
    assert torch.equal(padded["input_ids"][0, :20], alone["input_ids"][0])
    assert torch.equal(padded["labels"][1], collator([windows[1]])["labels"][0])

def test_mlm_masking_follows_bert(tokenizer, windows):
    batch = MlmCollator(tokenizer)([windows[i] for i in range(len(windows))])
    original = torch.tensor(windows["input_ids"])
    chosen = batch["labels"] != -100
    assert not chosen[:, 0].any() and not chosen[:, -1].any()  # [CLS], [SEP] never predicted
    assert 0.12 < chosen.float().mean() * 32 / 30 < 0.18
    assert torch.equal(batch["labels"][chosen], original[chosen])
    masked = batch["input_ids"][chosen] == tokenizer.mask_token_id
    assert 0.7 < masked.float().mean() < 0.9
    assert torch.equal(batch["input_ids"][~chosen], original[~chosen])
    assert "special_tokens_mask" not in batch


def test_load_mnli_local_files(tmp_path):
    args = MnliDataArguments(train_file=os.path.join(DATA, "mnli_train.jsonl"),
                             validation_file=os.path.join(DATA, "mnli_validation_matched.jsonl"),
                             validation_mismatched_file=os.path.join(DATA, "mnli_validation_mismatched.jsonl"))
    data = load_mnli(args, cache_dir=str(tmp_path))
    assert set(data) == {"train", "validation_matched", "validation_mismatched"}
    assert set(data["validation_mismatched"]["label"]) == {0, 1, 2}  # names mapped to GLUE ids
    assert len(data["train"]) == 66


def test_load_mnli_rejects_unknown_labels(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"premise": "a b", "hypothesis": "c d", "label": "maybe"}) + "\n")
    with pytest.raises(ValueError, match="Unknown MNLI label"):
        load_mnli(MnliDataArguments(train_file=str(path)), cache_dir=str(tmp_path))


def test_tokenize_pairs_pads_to_n(tokenizer, tmp_path):
    data = load_mnli(MnliDataArguments(train_file=os.path.join(DATA, "mnli_train.jsonl")), cache_dir=str(tmp_path))
    encoded = tokenize_pairs(data, tokenizer, 24)
    lengths = {len(row) for row in encoded["train"]["input_ids"]}
    assert lengths == {24} and "label" in encoded["train"].column_names


def test_tokenize_pairs_at_own_length_are_padded_per_batch(tokenizer, tmp_path):
    """pad=False: each pair keeps its own length (at most n); DataCollatorWithPadding pads a batch to its longest
    pair, with attention 0 there; pad_to_max_length (the fine-tuning flag) is off by default."""
    data = load_mnli(MnliDataArguments(train_file=os.path.join(DATA, "mnli_train.jsonl")), cache_dir=str(tmp_path))
    own = tokenize_pairs(data, tokenizer, 24, pad=False)["train"]
    full = tokenize_pairs(data, tokenizer, 24)["train"]
    lengths = [len(ids) for ids in own["input_ids"]]
    assert max(lengths) <= 24 and min(lengths) < 20 and len(set(lengths)) > 3
    for mine, padded, t in zip(own["input_ids"], full["input_ids"], lengths):
        assert padded[:t] == mine and set(padded[t:]) <= {tokenizer.pad_token_id}
    rows = [own[i] for i in range(6)]
    batch = DataCollatorWithPadding(tokenizer)(rows)
    assert batch["input_ids"].shape == (6, max(lengths[:6])) and max(lengths[:6]) < 24
    assert batch["attention_mask"].sum(1).tolist() == lengths[:6]
    assert torch.equal(batch["labels"], torch.tensor(own["label"][:6]))
    assert MnliDataArguments().pad_to_max_length is False


def test_offline_accuracy_metric_matches_definition():
    metric = load_metric("accuracy")  # HF_HUB_OFFLINE: the bundled module
    assert metric.compute(predictions=[0, 1, 2, 2], references=[0, 1, 1, 2])["accuracy"] == 0.75
    local = load_metric("accuracy", prefer_local=True)
    assert local.compute(predictions=[1, 1], references=[1, 0], normalize=False)["accuracy"] == 1.0
    compute = classification_metrics(local)
    logits = np.array([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 1.0]])
    result = compute(EvalPrediction(predictions=logits, label_ids=np.array([0, 1, 0])))
    assert result["accuracy"] == pytest.approx(2 / 3)
    assert os.path.isfile(os.path.join(LOCAL_METRICS["accuracy"], "accuracy.py"))


def test_sentence_order_task():
    docs = [["First sentence here. Second one follows it. A third sentence ends."],
            ["Another document talks. About other things entirely."]]
    assert split_sentences(docs[0][0]) == ["First sentence here.", "Second one follows it.", "A third sentence ends."]
    all_variants = sentence_order_examples(docs, seed=0, all_variants=True)
    assert len(all_variants) == 3 * 3 and sorted({e["label"] for e in all_variants}) == [0, 1, 2]
    swapped = [e for e in all_variants if e["label"] == 1][0]
    assert (swapped["premise"], swapped["hypothesis"]) == ("Second one follows it.", "First sentence here.")
    unrelated = [e for e in all_variants if e["label"] == 2 and e["premise"] == "First sentence here."][0]
    assert unrelated["hypothesis"] in ("Another document talks.", "About other things entirely.")
    assert len(sentence_order_examples(docs, seed=0)) == 3


def test_next_sentence_task():
    from hf_partial_attention.training.pair_task import next_sentence_examples

    docs = [["First sentence here. Second one follows it. A third sentence ends."],
            ["Another document talks. About other things entirely."]]
    examples = next_sentence_examples(docs, seed=0, all_variants=True)
    assert len(examples) == 3 * 2 and sorted({e["label"] for e in examples}) == [0, 1]
    following = [(e["premise"], e["hypothesis"]) for e in examples if e["label"] == 0]
    assert following == [("First sentence here.", "Second one follows it."),
                         ("Second one follows it.", "A third sentence ends."),
                         ("Another document talks.", "About other things entirely.")]
    unrelated = [e for e in examples if e["label"] == 1 and e["premise"] == "First sentence here."][0]
    assert unrelated["hypothesis"] in ("Another document talks.", "About other things entirely.")


def test_stdlib_docstrings_are_read_once_and_each_call_gets_its_own_lists(monkeypatch):
    """The standard library's docstrings (the scratch study's text and the pair task's documents) are parsed once per
    process; a caller that edits what it got does not change what the next one gets."""
    import ast

    from hf_partial_attention.training import pair_task

    pair_task._stdlib_documents.cache_clear()
    first = pair_task.stdlib_docstring_documents()
    assert len(first) > 100 and all(isinstance(d, list) and d for d in first)
    assert any("docstring" in p or "module" in p for d in first for p in d)  # real prose of the library
    parsed = []
    real_parse = ast.parse
    monkeypatch.setattr(ast, "parse", lambda *a, **k: parsed.append(1) or real_parse(*a, **k))
    snapshot = [list(d) for d in first]
    first[0].append("edited")
    first.pop()
    again = pair_task.stdlib_docstring_documents()
    assert again == snapshot and not parsed


def test_stdlib_docstrings_are_cached_for_other_processes_and_reparsed_when_a_file_changes(tmp_path, monkeypatch):
    """A second process (the per-process cache cleared) reads the documents from the cache file instead of parsing
    the library; a source file that changes (or a new one) makes a new fingerprint, so its text is parsed again,
    never a stale cache read. Tested on a small library of its own."""
    import ast

    from hf_partial_attention.training import pair_task

    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    (root / "alpha.py").write_text('"""The first module has a docstring of eight words or more."""\n')
    (root / "pkg" / "beta.py").write_text('def f():\n    """A function whose docstring is long enough to keep."""\n')
    (root / "test_gamma.py").write_text('"""Tests are left out of the documents, whatever they say."""\n')
    monkeypatch.setenv(pair_task.CACHE_ENV, str(tmp_path / "cache"))
    parsed = []
    real_parse = ast.parse
    monkeypatch.setattr(ast, "parse", lambda *a, **k: parsed.append(1) or real_parse(*a, **k))
    pair_task._stdlib_documents.cache_clear()
    first = pair_task._stdlib_documents(str(root), 8)
    assert first == (("The first module has a docstring of eight words or more.",),
                     ("A function whose docstring is long enough to keep.",))
    assert len(parsed) == 2 and len(os.listdir(tmp_path / "cache")) == 1
    pair_task._stdlib_documents.cache_clear()  # as in a new process
    parsed.clear()
    assert pair_task._stdlib_documents(str(root), 8) == first and not parsed
    (root / "alpha.py").write_text('"""The first module now says something else, in eight words."""\n')
    pair_task._stdlib_documents.cache_clear()
    changed = pair_task._stdlib_documents(str(root), 8)
    assert changed[0] == ("The first module now says something else, in eight words.",) and len(parsed) == 2
    pair_task._stdlib_documents.cache_clear()
    assert pair_task._stdlib_documents(str(root), 20) == ()  # min_words is part of the fingerprint
    pair_task._stdlib_documents.cache_clear()


def test_splits_in_memory_are_not_hashed_and_splits_from_files_keep_their_cache(tokenizer, tmp_path, monkeypatch):
    """Tokenizing a split held in memory hashes nothing (hashing pickles the tokenizer the function holds, and such a
    split has no cache file a fingerprint would name); a split read from files gets the hashed fingerprint, so a second
    tokenization finds the first one's cache file. Both give the same windows."""
    import datasets.arrow_dataset
    from datasets import load_from_disk

    hashed = []  # the hashes `Dataset.map` makes of its function and arguments
    real = datasets.arrow_dataset.update_fingerprint
    monkeypatch.setattr(datasets.arrow_dataset, "update_fingerprint", lambda *a: hashed.append(1) or real(*a))
    texts = ["Partial attention computes k scores of each query exactly.",
             "The other scores are reconstructed by a linear map R from the covariance of the scores."] * 8
    raw = DatasetDict(train=Dataset.from_dict({"text": texts}), test=Dataset.from_dict({"text": texts[:6]}))
    in_memory = group_into_windows(raw, tokenizer, 16)
    assert not hashed and in_memory["train"]["input_ids"]
    raw.save_to_disk(str(tmp_path / "raw"))
    from_files = load_from_disk(str(tmp_path / "raw"))
    first = group_into_windows(from_files, tokenizer, 16)
    assert len(hashed) == 2  # one per split
    second = group_into_windows(from_files, tokenizer, 16)
    for split in ("train", "test"):
        assert first[split]._fingerprint == second[split]._fingerprint
        assert first[split].cache_files and second[split].cache_files == first[split].cache_files  # read, not redone
        assert first[split]["input_ids"] == in_memory[split]["input_ids"]

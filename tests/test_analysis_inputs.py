"""Real inputs: sentence splitting, documents of text files, pair files, datasets and the demo text; tokenizing."""

import json
import os

import pytest

from hf_partial_attention.analysis.inputs import flatten, load_inputs, split_sentences, tokenize_inputs

DATA = os.path.join(os.path.dirname(__file__), "data")


@pytest.fixture(scope="module")
def tokenizer(minilm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path)


def test_split_sentences_ends_quotes_and_short_joins():
    text = 'The cat sat down.  It purred "very loudly." Then it slept! Ok. Was it happy? Yes.'
    # "Ok." (one word) joins the next sentence; "Yes." at the end joins the previous one
    assert split_sentences(text) == ["The cat sat down.", 'It purred "very loudly."', "Then it slept!",
                                     "Ok. Was it happy? Yes."]
    assert split_sentences("version 3.11 is out. e.g. this stays") == ["version 3.11 is out. e.g. this stays"]
    assert split_sentences("Hi.") == ["Hi."]  # a single short sentence is kept


def test_text_file_paragraphs_are_documents(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("First one here. Second one here.\nStill second.\n\n\nOther paragraph is here.\n")
    # "Still second." is shorter than 3 words and ends its paragraph: joined to the sentence before
    assert load_inputs(str(path), "sentence") == [["First one here.", "Second one here. Still second."],
                                                   ["Other paragraph is here."]]
    assert load_inputs(str(path), "paragraph") == [["First one here. Second one here. Still second."],
                                                    ["Other paragraph is here."]]
    assert load_inputs(str(path), "sentence", min_words=4) == [["First one here. Second one here. Still second."],
                                                                ["Other paragraph is here."]]


def test_pairs_from_tsv_with_and_without_header_and_jsonl(tmp_path):
    plain = tmp_path / "p.tsv"
    plain.write_text("a b c\td e f\ng h\ti j\n")
    assert load_inputs(str(plain), "pairs") == [[("a b c", "d e f")], [("g h", "i j")]]
    headed = tmp_path / "h.tsv"
    headed.write_text("id\tsentence2\tsentence1\n1\tsecond\tfirst\n")
    assert load_inputs(str(headed), "pairs") == [[("first", "second")]]
    mnli = load_inputs(os.path.join(DATA, "mnli_train.jsonl"), "pairs", columns=("premise", "hypothesis"))
    first = json.loads(open(os.path.join(DATA, "mnli_train.jsonl")).readline())
    assert mnli[0] == [(first["premise"], first["hypothesis"])] and all(len(d) == 1 for d in mnli)
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['sentence1', 'sentence2'\].*--pair-columns"):
        load_inputs(os.path.join(DATA, "mnli_train.jsonl"), "pairs")
    with pytest.raises(ValueError, match="reads a .tsv or .jsonl file"):
        load_inputs(os.path.join(DATA, "tiny_corpus.txt"), "pairs")


def test_datasets_and_dataset_dicts():
    from datasets import Dataset, DatasetDict

    ds = Dataset.from_dict({"q": ["one two three", "four five six"], "a": ["x y", "z w"],
                            "text": ["Alpha beta gamma. Delta epsilon zeta.", ""]})
    assert load_inputs(ds, "pairs", columns=("q", "a")) == [[("one two three", "x y")], [("four five six", "z w")]]
    assert load_inputs(DatasetDict(validation=ds), "sentence", split="validation") == [
        ["Alpha beta gamma.", "Delta epsilon zeta."]]
    with pytest.raises(ValueError, match="split='train' is not a split"):
        load_inputs(DatasetDict(validation=ds), "sentence")
    with pytest.raises(ValueError, match="columns"):
        load_inputs(ds, "pairs")


def test_demo_text_in_sentences_and_paragraphs():
    from hf_partial_attention.analysis.corpus import pydoc_paragraphs

    topics = pydoc_paragraphs()
    sentences, paragraphs = load_inputs(None, "sentence"), load_inputs(None, "paragraph")
    assert len(sentences) == len(paragraphs) == len(topics)  # one document per topic
    assert paragraphs[0] == [" ".join(p.split()) for p in topics[0]]
    flat, doc_of = flatten(sentences)
    assert len(flat) > 3 * sum(len(t) for t in topics) / 2 and doc_of[-1] == len(topics) - 1
    assert all(len(s.split()) >= 3 for s in flat)
    with pytest.raises(ValueError, match="kind='pairs' needs a sentence-pair source"):
        load_inputs(None, "pairs")


def test_tokenize_at_own_length_with_pair_token_types(tokenizer):
    pairs = [("A short premise.", "A hypothesis."), ("word " * 40, "other " * 40)]
    tok = tokenize_inputs(tokenizer, pairs, max_length=32)
    assert tok.lengths.tolist() == [len(tokenizer(*pairs[0])["input_ids"]), 32]
    assert tok.input_ids.shape == (2, 32)
    first = tokenizer(*pairs[0])
    t = int(tok.lengths[0])
    assert tok.input_ids[0, :t].tolist() == first["input_ids"] and tok.token_type_ids[0, :t].tolist() == \
        first["token_type_ids"]
    assert (tok.input_ids[0, t:] == tokenizer.pad_token_id).all() and tok.token_type_ids[1].max() == 1
    batch = tok.batch([0], 16)
    assert batch["input_ids"].shape == (1, 16) and batch["attention_mask"].sum() == t
    singles = tokenize_inputs(tokenizer, ["one two three"], max_length=32)
    assert singles.token_type_ids.sum() == 0 and singles.lengths.tolist() == [5]

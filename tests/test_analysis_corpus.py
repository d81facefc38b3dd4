"""Texts and windows: the BERT-pretraining windowing rule, the default corpus, text sources."""

import pytest

from hf_partial_attention.analysis.corpus import (
    default_texts,
    load_texts,
    make_windows,
    package_readmes,
    pydoc_paragraphs,
    split_heldout,
    windows_fingerprint,
)


class WordTokenizer:
    """One token per word (id = word length + 10), [CLS] = 1, [SEP] = 2."""

    cls_token_id, sep_token_id, bos_token_id, eos_token_id = 1, 2, None, None

    def __call__(self, text, add_special_tokens=True, verbose=True):
        assert add_special_tokens is False
        return {"input_ids": [len(w) + 10 for w in text.split()]}


def test_windows_follow_bert_pretraining():
    texts = ["a bb ccc dddd eeeee f gg hhh", "x yy", "one two three four five six"]
    w = make_windows(WordTokenizer(), texts, seq_len=5)  # 3 tokens per window
    assert w.tolist() == [[1, 11, 12, 13, 2], [1, 14, 15, 11, 2], [1, 13, 13, 15, 2], [1, 14, 14, 13, 2]]
    # the tail 'gg hhh' of the first text and the short second text are dropped; max_sequences stops early
    assert make_windows(WordTokenizer(), texts, seq_len=5, max_sequences=3).shape == (3, 5)
    with pytest.raises(ValueError, match="No text is long enough"):
        make_windows(WordTokenizer(), ["a b"], seq_len=8)
    with pytest.raises(ValueError, match="seq_len must be >= 3"):
        make_windows(WordTokenizer(), texts, seq_len=2)


def test_windows_with_a_real_tokenizer(minilm_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_path)
    text = default_texts()[0]
    w = make_windows(tok, [text], seq_len=32, max_sequences=2)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert w[0].tolist() == [tok.cls_token_id, *ids[:30], tok.sep_token_id]
    assert w[1, 1:-1].tolist() == ids[30:60]
    assert windows_fingerprint(w) == windows_fingerprint(w.clone()) != windows_fingerprint(w[:1])


def test_default_corpus_is_english_prose():
    topics = pydoc_paragraphs()
    texts = default_texts()
    assert len(texts) == len(topics) > 50
    assert sum(len(t) for t in texts) > 200_000
    assert not any(p.startswith(">>>") for topic in topics for p in topic)
    fit, held = split_heldout(texts)
    assert len(held) == len(texts) // 5 and len(fit) + len(held) == len(texts)
    assert package_readmes() and all(isinstance(t, str) for t in package_readmes())


def test_load_texts_sources(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("first para\nline two\n\nsecond para\n", encoding="utf-8")
    assert load_texts(path) == ["first para line two", "second para"]  # paragraphs: documents to hold out
    assert load_texts(path, split="document") == ["first para\nline two\n\nsecond para\n"]
    assert load_texts(path, split="line") == ["first para", "line two", "second para"]
    assert load_texts(["a", "b"]) == ["a", "b"]
    import datasets  # the analysis/train/demo extras: missing, this test fails (no silent skip)
    ds = datasets.Dataset.from_dict({"text": ["x y", "", "z"], "label": [0, 1, 2]})
    assert load_texts(ds) == ["x y", "z"]
    with pytest.raises(ValueError, match="text_column='body'"):
        load_texts(ds, text_column="body")
    with pytest.raises(FileNotFoundError):
        load_texts(tmp_path / "missing.txt")
    with pytest.raises(TypeError, match="must be strings"):
        load_texts([1, 2])
    with pytest.raises(ValueError, match="split"):
        load_texts(path, split="sentence")

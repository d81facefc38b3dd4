"""PartialBertConfig: defaults, validation, serialisation."""

import pytest

from hf_partial_attention import PartialBertConfig

TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37)


def test_defaults_keep_last_layer_exact():
    cfg = PartialBertConfig(**TINY)
    assert cfg.model_type == "partial_bert"
    assert cfg.partial_layers == [0, 1]
    assert (cfg.partial_seq_len, cfg.partial_k, cfg.reconstruction) == (128, 32, "common")
    assert PartialBertConfig(**{**TINY, "num_hidden_layers": 1}).partial_layers == []


def test_partial_layers_are_sorted_and_deduplicated():
    assert PartialBertConfig(**TINY, partial_layers=[2, 0, 2]).partial_layers == [0, 2]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("partial_k", 0, "partial_k"),
        ("partial_k", 129, "partial_k"),
        ("partial_seq_len", 0, "partial_seq_len"),
        ("partial_seq_len", 1024, "max_position_embeddings"),
        ("reconstruction", "learned", "reconstruction"),
        ("partial_layers", [0, 3], "partial_layers"),
        ("partial_layers", [-1], "partial_layers"),
        ("partial_implementation", "cuda", "partial_implementation"),
        ("partial_default_correlation", 1.0, "partial_default_correlation"),
        ("is_decoder", True, "is_decoder"),
    ],
)
def test_invalid_fields_raise_value_error_naming_them(field, value, message):
    with pytest.raises(ValueError, match=message):
        PartialBertConfig(**{**TINY, field: value})


def test_save_and_load_keeps_partial_fields(tmp_path):
    cfg = PartialBertConfig(**TINY, partial_seq_len=16, partial_k=4, reconstruction="per_layer",
                            partial_layers=[1], partial_use_bias=True)
    cfg.save_pretrained(tmp_path)
    back = PartialBertConfig.from_pretrained(tmp_path)
    for field in ("partial_seq_len", "partial_k", "reconstruction", "partial_layers", "partial_use_bias"):
        assert getattr(back, field) == getattr(cfg, field)

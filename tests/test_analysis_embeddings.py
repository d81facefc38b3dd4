"""Sentence-embedding comparison helpers."""

import pytest
import torch
from transformers import BertModel

from hf_partial_attention.analysis.embeddings import (
    embedding_cosines,
    mean_pooled_embeddings,
    summarize_cosines,
    window_batches,
)


def test_mean_pooling_ignores_padding(tiny_bert_config):
    torch.manual_seed(0)
    model = BertModel(tiny_bert_config).eval()
    ids = torch.randint(5, 99, (1, 6))
    padded = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], 1)
    a = mean_pooled_embeddings(model, [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}])
    mask = torch.tensor([[1] * 6 + [0] * 3])
    b = mean_pooled_embeddings(model, [{"input_ids": padded, "attention_mask": mask}])
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert len(window_batches(torch.zeros(5, 4, dtype=torch.long), 2)) == 3


def test_cosines_and_summary():
    x = torch.randn(10, 4)
    c = embedding_cosines(x, 2 * x)
    torch.testing.assert_close(c, torch.ones(10, dtype=torch.float64))
    s = summarize_cosines(torch.tensor([0.5, 1.0, 0.9]))
    assert s["min"] == 0.5 and s["count"] == 3 and s["mean"] == pytest.approx(0.8)

"""collect_covariance: agreement with captured scores, resume without loss or double counting."""

import numpy as np
import pytest
import torch
from transformers import BertModel

from hf_partial_attention.analysis import collect_covariance
from hf_partial_attention.analysis.capture import capture_scores
from hf_partial_attention.analysis.collect import model_shape


@pytest.fixture
def model(tiny_bert_config):
    torch.manual_seed(0)
    return BertModel(tiny_bert_config).eval()


def _windows(count, n=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(5, 99, (count, n), generator=gen)


@pytest.mark.parametrize("name", ["bert", "distilbert", "llama-causal-gqa"])
def test_matches_numpy_on_stored_scores(name):
    from test_analysis_capture import MODELS

    cls, make = MODELS[name]
    torch.manual_seed(0)
    model = cls(make()).eval()
    windows = _windows(10)
    cov = collect_covariance(model, windows, seq_len=12, scopes=("per_query", "whole"), granularity="layer",
                             batch_size=3, progress=False)
    stored = []
    with torch.no_grad(), capture_scores(model, lambda layer, s: stored.append(s.double())):
        model(input_ids=windows)
    x = torch.cat([s.reshape(-1, 12, 12) for s in stored]).numpy()  # (S, n, n)
    flat = x.reshape(x.shape[0], -1) - x.reshape(x.shape[0], -1).mean(0)
    np.testing.assert_allclose(cov.whole().numpy(), flat.T @ flat / x.shape[0], rtol=1e-9, atol=1e-9)
    for i in (0, 5, 11):
        rows = x[:, i] - x[:, i].mean(0)
        np.testing.assert_allclose(cov.per_query().numpy()[i], rows.T @ rows / x.shape[0], rtol=1e-9, atol=1e-9)
    assert cov.count == 10 * 2 * 4 and cov.num_sequences == 10 and cov.layers == [0, 1]
    assert cov.metadata["head_dim"] == 8 and cov.metadata["num_layers"] == 2


def test_real_minilm_on_real_text(minilm_path):
    from hf_partial_attention.analysis import select_pattern
    from hf_partial_attention.analysis.corpus import default_texts

    cov = collect_covariance(minilm_path, default_texts()[:3], seq_len=32, max_sequences=4, progress=False)
    assert cov.count == 4 * 6 * 12 and cov.metadata["head_dim"] == 32
    pattern = select_pattern(cov, 8)
    assert 0 < pattern.normalized_error < 1


def test_resume_loses_and_repeats_nothing(model, tmp_path):
    windows = _windows(9)
    path = tmp_path / "cov.safetensors"
    full = collect_covariance(model, windows, seq_len=12, batch_size=2, progress=False)
    # an "interrupted" run that saw the first 4 windows, then a resumed one over all 9
    collect_covariance(model, windows[:4], seq_len=12, batch_size=2, checkpoint_path=path, progress=False)
    resumed = collect_covariance(model, windows, seq_len=12, batch_size=2, resume_from=path, checkpoint_path=path,
                                 progress=False)
    assert resumed.num_sequences == 9 and resumed.count == full.count
    torch.testing.assert_close(resumed.per_query(), full.per_query(), rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="other windows"):
        collect_covariance(model, _windows(9, seed=1), seq_len=12, resume_from=path, progress=False)


def test_checkpoint_every_batch_is_resumable(model, tmp_path):
    path = tmp_path / "cov.safetensors"
    collect_covariance(model, _windows(5), seq_len=12, batch_size=2, checkpoint_path=path, checkpoint_every=1,
                       progress=False)
    from hf_partial_attention.analysis import ScoreCovariance

    assert ScoreCovariance.load(path).num_sequences == 5


def test_texts_need_a_tokenizer(model):
    with pytest.raises(ValueError, match="tokenizer is required"):
        collect_covariance(model, ["some text"], seq_len=12, progress=False)
    with pytest.raises(ValueError, match="seq_len=16"):
        collect_covariance(model, _windows(2), seq_len=16, progress=False)


def test_model_path_and_text(tiny_bert_dir):
    texts = ["The quick brown fox jumps over the lazy dog. " * 20]
    cov = collect_covariance(tiny_bert_dir, texts, seq_len=16, max_sequences=5, progress=False)
    assert cov.num_sequences == 5 and cov.metadata["model"] == tiny_bert_dir
    assert model_shape(BertModel.from_pretrained(tiny_bert_dir)) == (2, 4, 8)

"""ScoreCovariance: brute-force agreement, exact merge and save/load, memory refusal, errors."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_partial_attention.analysis.covariance import ScoreCovariance, estimate_bytes

N = 5


def _scores(seed, b=3, h=2, n=N):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, n, n, generator=gen) * 2 + torch.arange(n * n).reshape(n, n) / 10


def _numpy_cov(samples, centered):
    x = samples.reshape(samples.shape[0], -1)  # (S, l)
    if centered:
        x = x - x.mean(0)
    return x.T @ x / x.shape[0]


def _filled(granularity="pooled", scopes=("per_query", "whole"), seeds=(0, 1, 2)):
    cov = ScoreCovariance(N, scopes, granularity)
    stored = {0: [], 1: []}
    for i, seed in enumerate(seeds):
        layer = i % 2
        s = _scores(seed)
        cov.update(layer, s)
        stored[layer].append(s)
    return cov, {k: torch.cat(v) for k, v in stored.items()}


@pytest.mark.parametrize("centered", [True, False])
def test_matches_numpy_brute_force(centered):
    cov, stored = _filled("head")
    allmats = torch.cat([v.reshape(-1, N, N) for v in stored.values()]).double().numpy()  # (S, n, n)
    whole = cov.whole(centered=centered).numpy()
    np.testing.assert_allclose(whole, _numpy_cov(allmats, centered), rtol=1e-10, atol=1e-10)
    per_query = cov.per_query(centered=centered).numpy()
    for i in range(N):
        np.testing.assert_allclose(per_query[i], _numpy_cov(allmats[:, i, :], centered), rtol=1e-10, atol=1e-10)
        # each per-query covariance is a diagonal block of the whole one (row-major vec)
        np.testing.assert_allclose(per_query[i], whole[i * N:(i + 1) * N, i * N:(i + 1) * N], rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(cov.mean_per_query().numpy(), allmats.mean(0), rtol=1e-12)
    assert cov.count == allmats.shape[0]
    assert cov.total_variance(centered=centered) == pytest.approx(np.trace(_numpy_cov(allmats, centered)), rel=1e-10)
    # finer groups: layer 1, head 0
    l1h0 = stored[1][:, 0].double().numpy()
    np.testing.assert_allclose(cov.whole(layer=1, head=0, centered=centered).numpy(), _numpy_cov(l1h0, centered),
                               rtol=1e-10, atol=1e-10)
    l0 = stored[0].reshape(-1, N, N).double().numpy()
    np.testing.assert_allclose(cov.per_query(layer=0, centered=centered).numpy()[2], _numpy_cov(l0[:, 2], centered),
                               rtol=1e-10, atol=1e-10)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=2, max_size=6), st.integers(1, 5),
       st.sampled_from(["pooled", "layer", "head"]))
def test_merge_equals_single_pass(seeds, cut, granularity):
    cut = min(cut, len(seeds) - 1)
    one = ScoreCovariance(N, ("per_query", "whole"), granularity)
    a = ScoreCovariance(N, ("per_query", "whole"), granularity)
    b = ScoreCovariance(N, ("per_query", "whole"), granularity)
    for i, seed in enumerate(seeds):
        one.update(i % 2, _scores(seed))
        (a if i < cut else b).update(i % 2, _scores(seed))
    a.num_sequences, b.num_sequences = 2, 3
    merged = a.merge(b)
    assert merged.count == one.count and merged.num_sequences == 5
    assert merged.group_keys() == one.group_keys()
    for name, tensor in one.tensors().items():
        torch.testing.assert_close(merged.tensors()[name], tensor, rtol=1e-13, atol=1e-12)


def test_merge_into_empty_is_bit_exact():
    cov, _ = _filled()
    empty = ScoreCovariance(N, ("per_query", "whole"))
    empty.merge(cov)
    for name, tensor in cov.tensors().items():
        assert torch.equal(empty.tensors()[name], tensor)


def test_merge_refuses_incompatible():
    with pytest.raises(ValueError, match="seq_len differs"):
        ScoreCovariance(4).merge(ScoreCovariance(5))
    with pytest.raises(TypeError):
        ScoreCovariance(4).merge("x")


@pytest.mark.parametrize("granularity", ["pooled", "layer", "head"])
def test_save_load_exact(tmp_path, granularity):
    cov, _ = _filled(granularity)
    cov.num_sequences = 7
    cov.metadata["model"] = "tiny"
    cov.save(tmp_path / "c.safetensors")
    back = ScoreCovariance.load(tmp_path / "c.safetensors")
    assert (back.seq_len, back.scopes, back.granularity, back.count, back.num_sequences) == \
        (cov.seq_len, cov.scopes, cov.granularity, cov.count, 7)
    assert back.metadata["model"] == "tiny"
    assert back.counts() == cov.counts()
    for name, tensor in cov.tensors().items():
        assert torch.equal(back.tensors()[name], tensor)


def test_load_rejects_other_files(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="not a ScoreCovariance"):
        ScoreCovariance.load(tmp_path / "other.safetensors")
    with pytest.raises(FileNotFoundError):
        ScoreCovariance.load(tmp_path / "missing.safetensors")


def test_memory_refusal_names_the_estimate():
    cov = ScoreCovariance(128, ("per_query", "whole"), "layer", max_memory_bytes=4 * 2 ** 30)
    assert estimate_bytes(128, ("whole",)) == 128 ** 4 * 8 + 128 ** 2 * 8
    with pytest.raises(ValueError, match=r"need 12\.09 GiB.*drop 'whole'"):
        cov.check_memory(6)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="scopes"):
        ScoreCovariance(4, ("rows",))
    with pytest.raises(ValueError, match="granularity"):
        ScoreCovariance(4, granularity="neuron")
    cov = ScoreCovariance(4)
    with pytest.raises(ValueError, match="empty"):
        cov.per_query()
    with pytest.raises(ValueError, match=r"\(B, H, 4, 4\)"):
        cov.update(0, torch.zeros(1, 1, 3, 3))
    cov.update(0, torch.randn(2, 1, 4, 4))
    with pytest.raises(ValueError, match="granularity='pooled'"):
        cov.per_query(layer=0)
    with pytest.raises(ValueError, match="'whole' was not collected"):
        cov.whole()

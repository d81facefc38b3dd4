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


# ---------------------------------------------------------------- inputs shorter than n: per-row counts


def _short_batch(seed, b=4, h=2, n=N):
    """Scores (B, H, n, n) with garbage at the padded positions, and lengths in [1, n]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, n, n, generator=gen) * 3 + 1, torch.randint(1, n + 1, (b,), generator=gen)


def _brute_force_rows(batches, centered):
    """Per-query covariance of row i over only the score rows of sequences that reach i, keys >= t zero."""
    rows = {i: [] for i in range(N)}
    for scores, lengths in batches:
        for s, t in enumerate(lengths.tolist()):
            for h in range(scores.shape[1]):
                for i in range(t):
                    row = scores[s, h, i].double().clone()
                    row[t:] = 0
                    rows[i].append(row.numpy())
    out = np.zeros((N, N, N))
    for i, samples in rows.items():
        if samples:
            out[i] = _numpy_cov(np.stack(samples), centered)
    return out, {i: len(v) for i, v in rows.items()}


@pytest.mark.parametrize("centered", [True, False])
def test_row_counts_match_brute_force_over_sequences_reaching_each_row(centered):
    batches = [_short_batch(seed) for seed in range(3)]
    batches[0][1][:] = torch.tensor([1, 2, 2, 3])  # rows 3 and 4 reached by later batches only
    cov = ScoreCovariance(N, ("per_query",))
    for layer, (scores, lengths) in enumerate(batches):
        cov.update(layer % 2, scores, lengths=lengths)
    expected, counts = _brute_force_rows(batches, centered)
    np.testing.assert_allclose(cov.per_query(centered=centered).numpy(), expected, rtol=1e-10, atol=1e-10)
    assert cov.row_counts_of().tolist() == [counts[i] for i in range(N)]
    assert cov.total_variance(centered=centered) == pytest.approx(np.trace(expected, axis1=1, axis2=2).sum(), rel=1e-10)


def test_padding_garbage_does_not_change_a_sequence_contribution():
    scores, lengths = _short_batch(7)
    other = scores.clone()
    for s, t in enumerate(lengths.tolist()):  # other garbage in every padded row and key
        other[s, :, t:, :] = torch.randn_like(other[s, :, t:, :]) * 100
        other[s, :, :, t:] = -5.0
    a, b = ScoreCovariance(N), ScoreCovariance(N)
    a.update(0, scores, lengths=lengths)
    b.update(0, other, lengths=lengths)
    for name, tensor in a.tensors().items():
        assert torch.equal(b.tensors()[name], tensor), name


@pytest.mark.parametrize("granularity", ["pooled", "head"])
def test_scores_cut_at_the_longest_sequence_add_what_zero_padded_scores_add(granularity):
    """`run_inputs` hands the bucket's covariance each batch's scores at its longest input (w < n): the moments must
    be those of the scores zero-padded to n, and scores shorter than a sequence refused."""
    for seed in range(6):
        scores, lengths = _short_batch(seed, n=N)
        lengths = lengths.clamp_max(N - 2)  # every sequence short of n: the cut is real
        w = int(lengths.max())
        full, cut = ScoreCovariance(N, granularity=granularity), ScoreCovariance(N, granularity=granularity)
        full.update(0, scores, lengths=lengths)
        cut.update(0, scores[..., :w, :w], lengths=lengths)
        for name, tensor in full.tensors().items():
            torch.testing.assert_close(cut.tensors()[name], tensor, rtol=1e-12, atol=1e-12, msg=name)
    with pytest.raises(ValueError, match="cannot hold sequences of up to"):
        cut.update(0, scores[..., :w - 1, :w - 1], lengths=lengths)
    with pytest.raises(ValueError, match=r"\(B, H, w, w\), w < seq_len, with lengths"):
        cut.update(0, scores[..., :w, :w])


def test_unreached_rows_read_as_zero_and_selection_fits_them():
    from hf_partial_attention.analysis.selection import select_pattern

    scores, _ = _short_batch(1, b=6)
    cov = ScoreCovariance(N)
    cov.update(0, scores, lengths=torch.tensor([1, 2, 3, 3, 2, 3]))  # rows 3 and 4: no sequence
    c = cov.per_query()
    assert torch.isfinite(c).all() and torch.isfinite(cov.mean_per_query()).all()
    assert torch.equal(c[3:], torch.zeros_like(c[3:])) and cov.row_counts_of()[3:].tolist() == [0, 0]
    pattern = select_pattern(cov, 2)  # the greedy and the ridge Cholesky on all-zero rows: no NaN, no crash
    assert torch.isfinite(pattern.reconstruction).all() and torch.isfinite(pattern.bias).all()
    assert pattern.indices[3:].tolist() == [[0, 1], [0, 1]]  # ties: lowest keys
    assert torch.equal(pattern.reconstruction[3:], torch.zeros_like(pattern.reconstruction[3:]))
    assert 0 <= pattern.normalized_error < 1


def test_row_counts_merge_save_load_exact(tmp_path):
    old = ScoreCovariance(N, ("per_query",), "layer")
    old.update(0, _scores(0))  # full windows: no lengths
    new = ScoreCovariance(N, ("per_query",), "layer")
    for seed in (1, 2):
        scores, lengths = _short_batch(seed)
        new.update(seed - 1, scores, lengths=lengths)
    one = ScoreCovariance(N, ("per_query",), "layer")
    one.update(0, _scores(0), lengths=torch.full((3,), N))  # full length: the same as no lengths
    for seed in (1, 2):
        one.update(seed - 1, *_short_batch(seed))
    merged = old.merge(new)  # the full-window group gets count per row
    for name, tensor in one.tensors().items():
        torch.testing.assert_close(merged.tensors()[name], tensor, rtol=1e-13, atol=1e-12)
    merged.save(tmp_path / "rows.safetensors")
    back = ScoreCovariance.load(tmp_path / "rows.safetensors")
    assert back.row_counts and back.counts() == merged.counts()
    for name, tensor in merged.tensors().items():
        assert torch.equal(back.tensors()[name], tensor), name
    assert torch.equal(back.per_query(layer=1), merged.per_query(layer=1))


def test_files_without_row_counts_read_bit_identically(tmp_path):
    cov, _ = _filled(scopes=("per_query",))
    cov.save(tmp_path / "v1.safetensors")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "v1.safetensors"), "pt") as f:
        import json

        assert json.loads(f.metadata()["hf_partial_attention_covariance"])["format_version"] == "1"
        assert not any(name.endswith(".rows") for name in f.keys())
    back = ScoreCovariance.load(tmp_path / "v1.safetensors")
    assert not back.row_counts
    count, total_sum, moment = back._total(None, None, "per_query")
    mean = total_sum / count
    assert torch.equal(back.per_query(), moment / count - mean.unsqueeze(-1) * mean.unsqueeze(-2))
    assert torch.equal(back.per_query(), cov.per_query()) and torch.equal(back.mean_per_query(), total_sum / count)


def test_lengths_errors_name_the_field():
    with pytest.raises(ValueError, match="scopes=\\('per_query',\\)"):
        ScoreCovariance(N, ("per_query", "whole")).update(0, torch.zeros(2, 1, N, N), lengths=torch.tensor([2, 3]))
    cov = ScoreCovariance(N)
    with pytest.raises(ValueError, match=r"lengths must be an int tensor of shape \(2,\)"):
        cov.update(0, torch.zeros(2, 1, N, N), lengths=torch.tensor([2]))
    with pytest.raises(ValueError, match=r"lengths must be in \[1, seq_len=5\]"):
        cov.update(0, torch.zeros(2, 1, N, N), lengths=torch.tensor([0, 6]))

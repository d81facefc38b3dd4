"""Reconstruction math: complements, optimal R and its error, the default prior."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_partial_attention.reconstruction import (
    complement_indices,
    nearest_keys,
    inverse_permutation,
    local_prior,
    solve_reconstruction,
)


def random_cov(l, rank=None, seed=0, batch=()):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(*batch, l, rank or l, generator=g, dtype=torch.float64)
    return a @ a.transpose(-1, -2) + 1e-3 * torch.eye(l, dtype=torch.float64)


@settings(max_examples=50, deadline=None)
@given(st.integers(2, 20).flatmap(
    lambda l: st.tuples(st.just(l), st.sets(st.integers(0, l - 1), min_size=1, max_size=l))))
def test_complement_and_inverse_permutation(case):
    l, chosen = case
    idx = torch.tensor(sorted(chosen)).unsqueeze(0)
    comp = complement_indices(idx, l)
    assert sorted(idx[0].tolist() + comp[0].tolist()) == list(range(l))
    assert comp[0].tolist() == sorted(comp[0].tolist())
    inv = inverse_permutation(idx, l)
    values = torch.arange(l).float()[None]  # scores equal to their key position
    both = torch.cat([values.gather(-1, idx), values.gather(-1, comp)], -1)
    assert torch.equal(both.gather(-1, inv), values)


def test_solve_matches_explicit_formula():
    cov = random_cov(9, seed=1)
    idx = torch.tensor([1, 4, 7])
    r, bias, err = solve_reconstruction(cov, idx, ridge=0.0)
    c = cov.numpy()
    p, q = idx.numpy(), complement_indices(idx, 9).numpy()
    r_ref = c[np.ix_(q, p)] @ np.linalg.inv(c[np.ix_(p, p)])
    err_ref = np.trace(c[np.ix_(q, q)] - r_ref @ c[np.ix_(p, q)])
    assert bias is None
    np.testing.assert_allclose(r.numpy(), r_ref, rtol=1e-8, atol=1e-10)
    assert float(err) == pytest.approx(err_ref, rel=1e-8)


def test_error_is_the_mean_squared_error_of_samples():
    # Gaussian vectors with known mean and covariance: the empirical MSE of mu_q + R (a_p - mu_p) matches eps.
    cov = random_cov(8, seed=2)
    mean = torch.linspace(-1, 1, 8, dtype=torch.float64)
    idx = torch.tensor([0, 3, 5])
    r, bias, err = solve_reconstruction(cov, idx, mean=mean, ridge=0.0)
    g = torch.Generator().manual_seed(0)
    chol = torch.linalg.cholesky(cov)
    x = mean + torch.randn(200_000, 8, generator=g, dtype=torch.float64) @ chol.T
    comp = complement_indices(idx, 8)
    pred = x[:, idx] @ r.T + bias
    mse = ((pred - x[:, comp]) ** 2).sum(-1).mean()
    assert float(mse) == pytest.approx(float(err), rel=0.02)


def test_batched_solve_equals_loop():
    cov = random_cov(7, batch=(4,), seed=3)
    idx = torch.tensor([[0, 1], [2, 6], [3, 4], [1, 5]])
    r, _, err = solve_reconstruction(cov, idx)
    for i in range(4):
        r_i, _, e_i = solve_reconstruction(cov[i], idx[i])
        torch.testing.assert_close(r[i], r_i)
        torch.testing.assert_close(err[i], e_i)


def test_local_prior_is_markov():
    idx, r = local_prior(10, 3, correlation=0.5)
    assert idx[0].tolist() == [0, 1, 2] and idx[5].tolist() == [4, 5, 6] and idx[9].tolist() == [7, 8, 9]
    # AR(1): a key outside the window is predicted from the nearest window edge alone, with rho**distance.
    comp = complement_indices(idx, 10)
    row = 5
    for m, j in enumerate(comp[row].tolist()):
        edge = 4 if j < 4 else 6
        expect = torch.zeros(3)
        expect[idx[row].tolist().index(edge)] = 0.5 ** abs(j - edge)
        torch.testing.assert_close(r[row, m], expect, atol=1e-5, rtol=0)


def test_local_prior_equals_the_full_solve():
    """The block formula of local_prior gives the R of solve_reconstruction on the n×n AR(1) covariances."""
    n, k, rho = 12, 4, 0.8
    idx, r = local_prior(n, k, correlation=rho)
    pos = torch.arange(n, dtype=torch.float64)
    prior = rho ** (pos[:, None] - pos[None, :]).abs()
    expect, _, _ = solve_reconstruction(prior.expand(n, n, n), idx)
    torch.testing.assert_close(r, expect.to(torch.float32), rtol=0, atol=0)
    assert torch.equal(idx, nearest_keys(n, k))


def test_nearest_keys_band():
    assert nearest_keys(6, 3).tolist() == [[0, 1, 2], [0, 1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 5], [3, 4, 5]]
    # even k: a query's two neighbours tie, the lower position wins
    assert nearest_keys(5, 2).tolist() == [[0, 1], [0, 1], [1, 2], [2, 3], [3, 4]]

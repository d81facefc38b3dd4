"""Tests for research.expressivity (seed 002 analysis)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from research.expressivity import (
    build_B,
    condition_report,
    construct_attention,
    default_d_grid,
    draw_seed,
    find_d_min,
    fit_log,
    sample_sparse_target,
    sample_stiefel,
    satisfies,
)


# These small problems run fastest on one thread (conftest.one_torch_thread restores the setting afterwards).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@settings(max_examples=25, deadline=None)
@given(L=st.integers(2, 40), k=st.integers(1, 5), gamma=st.sampled_from([1.0, 2.0, 3.5]),
       seed=st.integers(0, 10_000), order=st.sampled_from(["per_pass", "per_row"]))
def test_sampler_bounds_and_values(L, k, gamma, seed, order):
    A = sample_sparse_target(L, k, gamma, seed, column_order=order)
    nz = A > 0
    assert A.shape == (L, L)
    assert nz.sum(axis=1).max() <= k and nz.sum(axis=0).max() <= k
    assert nz.sum(axis=1).min() >= 1  # every row gets a nonzero
    assert set(np.unique(A)) <= {0.0, 1.0, gamma}


def test_sampler_reproducible():
    a = sample_sparse_target(64, 3, 2.0, seed=5)
    assert np.array_equal(a, sample_sparse_target(64, 3, 2.0, seed=5))
    assert not np.array_equal(a, sample_sparse_target(64, 3, 2.0, seed=6))


@settings(max_examples=15, deadline=None)
@given(L=st.integers(1, 60), frac=st.floats(0.01, 1.0), seed=st.integers(0, 1000))
def test_stiefel_orthonormal(L, frac, seed):
    d = max(1, int(frac * L))
    Y = sample_stiefel(L, d, seed)
    assert Y.shape == (L, d)
    np.testing.assert_allclose(Y.T @ Y, np.eye(d), atol=1e-10)


def test_construction_shapes_and_selectors():
    A = sample_sparse_target(32, 2, 2.0, 0)
    con = construct_attention(A, 8, seed=1, eps1=1.0, eps2=0.1)
    assert con.X.shape == (32, 16) and con.W_Q.shape == (16, 8) and con.M.shape == (32, 32)
    np.testing.assert_allclose(con.X @ con.W_Q, con.X1)
    np.testing.assert_allclose(con.X @ con.W_K, con.X2)
    np.testing.assert_allclose(con.M.sum(axis=1), 1.0)
    # the selector weights do not depend on A
    other = construct_attention(sample_sparse_target(32, 1, 1.0, 9), 8, seed=1)
    assert np.array_equal(con.W_Q, other.W_Q) and np.array_equal(con.W_K, other.W_K)


def test_construction_unbiased_in_expectation():
    A = sample_sparse_target(24, 2, 2.0, 0)
    B = build_B(A, 3.0)
    mean = np.mean([construct_attention(A, 6, seed=s, offset=3.0).logits for s in range(400)], 0)
    assert np.abs(mean - B).max() < 0.6  # E[X1 X2^T] = B; Monte-Carlo tolerance


@pytest.mark.parametrize("k,gamma,eps1,eps2", [(1, 1.0, 1.0, 0.1), (2, 2.0, 0.5, 0.5)])
def test_conditions_hold_at_full_d_and_fail_at_tiny_d(k, gamma, eps1, eps2):
    L = 96
    A = sample_sparse_target(L, k, gamma, 3)
    assert satisfies(A, construct_attention(A, L, seed=0, eps1=eps1, eps2=eps2).M, eps1, eps2)
    assert not any(satisfies(A, construct_attention(A, 2, seed=s, eps1=eps1, eps2=eps2).M, eps1, eps2)
                   for s in range(5))


def test_satisfies_on_hand_made_matrices():
    A = np.array([[1.0, 2.0, 0.0], [0.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    M_good = np.array([[1.0, 2.0, 0.01], [0.0, 1.0, 0.0], [1.0, 0.001, 1.0]])
    M_good /= M_good.sum(1, keepdims=True)
    assert satisfies(A, M_good, eps1=0.1, eps2=0.1)
    assert not satisfies(A, M_good, eps1=0.1, eps2=0.001)  # 0.01/1 > 0.001 in row 0
    M_bad = np.array([[1.0, 3.0, 0.0], [0.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    assert not satisfies(A, M_bad, eps1=0.2, eps2=0.1)  # ratio 3 vs 2
    assert satisfies(A, M_bad, eps1=0.6, eps2=0.1)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), eps1=st.floats(0.05, 3.0), noise=st.floats(0.0, 1.0))
def test_multiplicative_form_equals_log_form(seed, eps1, noise):
    """Over ordered pairs the two-sided multiplicative variant is the log form (symmetry)."""
    rng = np.random.default_rng(seed)
    A = sample_sparse_target(12, 3, 2.0, seed)
    log_M = np.log(np.where(A > 0, A, 1e-3)) + noise * rng.standard_normal(A.shape)
    r_log = condition_report(A, log_M, eps1, 0.5, ratio_form="log")
    r_mul = condition_report(A, log_M, eps1, 0.5, ratio_form="multiplicative")
    assert r_log.ok_ratio == r_mul.ok_ratio


def test_d_min_reproducible_and_looser_is_not_larger():
    grid = default_d_grid(128, 8)
    kw = {"L": 128, "k": 2, "gamma": 2.0, "d_grid": grid, "redraws": 3, "seed": 4, "offset": 3.0}
    tight = find_d_min(eps1=0.5, eps2=0.1, **kw)
    again = find_d_min(eps1=0.5, eps2=0.1, **kw)
    loose = find_d_min(eps1=2.0, eps2=0.3, **kw)
    assert tight.d_min == again.d_min and tight.trials == again.trials
    assert tight.d_min is not None and loose.d_min is not None
    assert loose.d_min <= tight.d_min  # common random numbers at a fixed offset


def test_d_min_scan_all_and_grid_end():
    res = find_d_min(96, 1, 1.0, 1.0, 0.1, default_d_grid(96, 8), 3, 0, scan_all=True)
    assert res.d_min is not None and res.d_stable is not None and res.d_stable >= res.d_min
    assert res.trials[-1] == (96, True, 1)  # d = L: the projection is exact, first draw succeeds
    ok = {d: s for d, s, _ in res.trials}
    assert all(ok[d] for d in ok if d >= res.d_stable)
    assert not any(ok[d] for d in ok if d < res.d_min)
    # the recorded successful draw is reproduced by construct_attention
    A = sample_sparse_target(96, 1, 1.0, 0)
    t = next(n - 1 for d, s, n in res.trials if d == res.d_min)
    con = construct_attention(A, res.d_min, draw_seed(0, 96, res.d_min, t), eps1=1.0, eps2=0.1)
    assert satisfies(A, con.M, 1.0, 0.1)


def test_fit_log_recovers_coefficients():
    Ls = [128, 256, 512, 1024]
    a, b, rmse = fit_log(Ls, [7 * math.log(L) + 3 for L in Ls])
    assert a == pytest.approx(7) and b == pytest.approx(3) and rmse < 1e-9


@pytest.mark.parametrize("call,field", [
    (lambda: sample_sparse_target(0, 2, 2.0, 0), "L="),
    (lambda: sample_sparse_target(8, 2, 0.5, 0), "gamma="),
    (lambda: sample_sparse_target(8, 2, 2.0, 0, column_order="zigzag"), "column_order="),
    (lambda: construct_attention(np.eye(4), 5, 0), "d="),
    (lambda: construct_attention(-np.eye(4), 2, 0), "A="),
    (lambda: satisfies(np.eye(3), np.eye(3), eps1=0.1, eps2=1.5), "eps2="),
    (lambda: find_d_min(16, 1, 1.0, 1.0, 0.1, [8, 4], 1, 0), "d_grid="),
    (lambda: find_d_min(16, 1, 1.0, 1.0, 0.1, [8], 0, 0), "redraws="),
    (lambda: find_d_min(16, 1, 1.0, 1.0, 0.1, [8], 1, 0, margin="big"), "margin="),
])
def test_bad_arguments_raise_value_error(call, field):
    with pytest.raises(ValueError, match=field):
        call()


def test_verdict_separates_log_and_linear_growth():
    from research.exp_expressivity import verdict

    Ls = [128, 256, 512, 1024, 2048]
    assert verdict(Ls, [round(12 * math.log(L)) for L in Ls])["log_like"]
    assert not verdict(Ls, [L // 3 for L in Ls])["log_like"]

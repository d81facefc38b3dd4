"""Eigen analysis: randomized top-k, projection curves, per-layer projections, per-query spectra, images."""

import pytest
import torch

from hf_partial_attention.analysis import ScoreCovariance, spectra


def _decaying(l, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(l, l, generator=gen, dtype=torch.float64)).Q
    return q @ torch.diag(0.7 ** torch.arange(l, dtype=torch.float64)) @ q.T


def test_top_eigh_randomized_matches_dense():
    c = _decaying(300)
    vals, vecs = spectra.top_eigh(c, 10, dense_limit=100)
    exact, exact_vecs = spectra.eigh_desc(c)
    torch.testing.assert_close(vals, exact[:10], rtol=1e-8, atol=1e-12)
    overlap = (vecs.T @ exact_vecs[:, :10]).abs().diagonal()
    assert bool((overlap > 1 - 1e-6).all())


def test_projection_on_own_eigenvectors_is_cumulative_energy():
    c = _decaying(20)
    vals, vecs = spectra.eigh_desc(c)
    torch.testing.assert_close(spectra.projection_energy(vecs, c), spectra.cumulative_energy(vals, float(c.trace())))
    assert spectra.cumulative_energy(vals)[-1] == pytest.approx(1.0)


def test_subspace_overlap_of_rotated_covariances_matches_hand_computation():
    # In the basis e_0..e_5, A = diag(6, 5, 4, 3, 2, 1): its top-j eigenspace is span(e_0..e_{j-1}).
    # B has eigenvalues mu = (8, 4, 2, 1, 0.5, 0.25), with its eigenvectors rotated by 30 degrees in the planes
    # (e_0, e_3), (e_1, e_4), (e_2, e_5): B's top eigenvector is cos·e_0 + sin·e_3, its 4th -sin·e_0 + cos·e_3, ...
    # So B_ii = mu_i cos² + mu_{i+3} sin² and B_{i+3,i+3} = mu_i sin² + mu_{i+3} cos² (cos² = 3/4, sin² = 1/4):
    #   diag(B) = (6.25, 3.125, 1.5625, 2.75, 1.375, 0.6875), Tr B = 15.75,
    # and the energy of B on A's top-j eigenspace is the sum of the first j diagonal entries of B.
    theta = torch.tensor(torch.pi / 6, dtype=torch.float64)
    c, s = torch.cos(theta), torch.sin(theta)
    rot = torch.eye(6, dtype=torch.float64)
    for i in range(3):
        rot[i, i], rot[i, i + 3], rot[i + 3, i], rot[i + 3, i + 3] = c, -s, s, c
    mu = torch.tensor([8.0, 4.0, 2.0, 1.0, 0.5, 0.25], dtype=torch.float64)
    a = torch.diag(torch.tensor([6.0, 5.0, 4.0, 3.0, 2.0, 1.0], dtype=torch.float64))
    b = rot @ torch.diag(mu) @ rot.T
    # the same random orthogonal change of basis for both: the overlaps do not change, but A is no longer diagonal
    q = torch.linalg.qr(torch.randn(6, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)).Q
    out = spectra.subspace_overlap(q @ a @ q.T, q @ b @ q.T, 4)
    want = {"b_on_a": [6.25 / 15.75, 9.375 / 15.75, 10.9375 / 15.75, 13.6875 / 15.75],
            "b_own": [8 / 15.75, 12 / 15.75, 14 / 15.75, 15 / 15.75],
            "a_own": [6 / 21, 11 / 21, 15 / 21, 18 / 21]}
    for key, values in want.items():
        torch.testing.assert_close(out[key], torch.tensor(values, dtype=torch.float64), rtol=1e-10, atol=1e-12,
                                   msg=key)
    # the rotation costs B energy on A's subspace: strictly below B's own spectrum until k = 6
    assert float(out["b_on_a"][0]) < float(out["b_own"][0])
    with pytest.raises(ValueError, match="same shape"):
        spectra.subspace_overlap(a, _decaying(9), 3)


def _layered(n=4):
    cov = ScoreCovariance(n, ("per_query", "whole"), "layer")
    gen = torch.Generator().manual_seed(0)
    for layer in range(3):
        cov.update(layer, torch.randn(20, 2, n, n, generator=gen) * (layer + 1))
    return cov


def test_layer_projections_are_bounded_by_own_spectrum():
    cov = _layered()
    g_curve, layers = spectra.layer_projections(cov, 16)
    assert [lp.layer for lp in layers] == [0, 1, 2] and g_curve.shape == (16,)
    for lp in layers:
        assert bool((lp.on_global <= lp.own + 1e-9).all())  # no k-dim subspace beats the top-k eigenvectors
        assert float(lp.on_global[-1]) == pytest.approx(1.0) and float(lp.own[-1]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="granularity='layer'"):
        pooled = ScoreCovariance(4, ("whole",))
        pooled.update(0, torch.randn(2, 1, 4, 4))
        spectra.layer_projections(pooled, 4)


def test_per_query_spectra_and_images():
    cov = _layered(5)
    vals, vecs = spectra.per_query_spectra(cov.per_query())
    assert vals.shape == (5, 5) and vecs.shape == (5, 5, 5)
    assert bool((vals[:, :-1] >= vals[:, 1:] - 1e-12).all())
    share = spectra.top_eigenvalue_share(vals)
    assert bool(((share > 0) & (share <= 1)).all())
    pooled = spectra.pooled_per_query_energy(vals, cov.total_variance())
    assert pooled.shape == (25,) and float(pooled[-1]) == pytest.approx(1.0)
    stacked = spectra.per_query_top_eigenvectors(vecs, 3)
    assert stacked.shape == (3, 5, 5)
    torch.testing.assert_close(stacked[0, 2].abs(), vecs[2, :, 0].abs())  # row i of image r: eigenvector r of Q^i
    g_vals, g_vecs = spectra.top_eigh(cov.whole(), 4)
    images = spectra.eigenvector_images(g_vecs, 5, 4)
    assert images.shape == (4, 5, 5)
    torch.testing.assert_close(images[1].reshape(-1).abs(), g_vecs[:, 1].abs())  # row-major reshape

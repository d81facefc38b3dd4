"""Pattern selection: greedy P (plain and constrained families) and optimal R, against brute force, the Schur
error, held-out error on a Gaussian model."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_partial_attention import AttentionPattern
from hf_partial_attention.analysis import ErrorMeter, LinearReconstructor, ScoreCovariance
from hf_partial_attention.analysis.plots import pattern_mask
from hf_partial_attention.analysis.selection import (
    FAMILIES,
    OBJECTIVES,
    error_curve,
    family_constraint,
    fit_pattern,
    greedy_order,
    greedy_select,
    objective_metric,
    select_pattern,
    select_patterns,
)
from hf_partial_attention.attention_common import block_rows
from hf_partial_attention.reconstruction import solve_reconstruction


def _spd(l, seed, batch=()):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(*batch, l, l + 2, generator=gen, dtype=torch.float64)
    return a @ a.transpose(-1, -2) / l + 0.05 * torch.eye(l, dtype=torch.float64)


def _schur_numpy(c, p):
    c = c.numpy()
    q = [j for j in range(c.shape[0]) if j not in p]
    return np.trace(c[np.ix_(q, q)] - c[np.ix_(q, p)] @ np.linalg.inv(c[np.ix_(p, p)]) @ c[np.ix_(p, q)])


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 4))
def test_greedy_error_is_the_schur_error_and_greedy_steps_are_best(seed, k):
    c = _spd(6, seed)
    idx, err = greedy_select(c, k)
    p = idx.tolist()
    assert float(err) == pytest.approx(_schur_numpy(c, p), rel=1e-8, abs=1e-10)
    # brute force: the best single entry, and each greedy step the best addition to the previous set
    best1 = min(range(6), key=lambda j: _schur_numpy(c, [j]))
    assert best1 in greedy_select(c, 1)[0].tolist()
    prev = greedy_select(c, k - 1)[0].tolist() if k > 1 else []
    added = [j for j in p if j not in prev]
    assert len(added) == 1
    step_errors = {j: _schur_numpy(c, sorted(prev + [j])) for j in range(6) if j not in prev}
    assert step_errors[added[0]] == pytest.approx(min(step_errors.values()), rel=1e-9)
    # and never better than the exhaustive optimum
    optimum = min(_schur_numpy(c, list(s)) for s in itertools.combinations(range(6), k))
    assert float(err) >= optimum - 1e-10


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 5))
def test_greedy_error_is_above_the_eigen_reference(seed, k):
    c = _spd(6, seed, batch=(6,))  # per-query: 6 rows of 6×6
    curve = error_curve(c, [k], "per_query")
    assert curve["greedy"][0] >= curve["eigen"][0] - 1e-12


def _cov_from_samples(samples):
    n = samples.shape[-1]
    cov = ScoreCovariance(n, ("per_query", "whole"))
    cov.update(0, samples.unsqueeze(1))
    return cov


@pytest.mark.parametrize("centered", [True, False])
@pytest.mark.parametrize("scope", ["per_query", "whole"])
def test_predicted_error_equals_in_sample_mse(centered, scope):
    gen = torch.Generator().manual_seed(0)
    samples = torch.randn(400, 6, 6, generator=gen, dtype=torch.float64) @ _spd(6, 1) + 3.0
    cov = _cov_from_samples(samples)
    k = 2 if scope == "per_query" else 10
    pattern = select_pattern(cov, k, scope, centered=centered, ridge=0.0)
    assert (pattern.bias is not None) == centered
    recon = LinearReconstructor(pattern)(samples)
    mse = float((recon - samples).pow(2).sum()) / samples.shape[0]
    total = cov.total_variance(centered=centered)
    assert pattern.normalized_error == pytest.approx(mse / total, rel=1e-7)
    assert pattern.metadata["greedy_normalized_error"] == pytest.approx(pattern.normalized_error, rel=1e-6)
    # exact scores are kept as they are
    mask = pattern_mask(pattern)
    assert torch.allclose(recon[:, mask], samples[:, mask])


def test_heldout_mse_on_a_gaussian_model_matches_prediction():
    """R from the known covariance; held-out samples of N(μ, C): measured error ≈ predicted, within sampling error."""
    n, k, draws = 8, 3, 4000
    per_query = _spd(n, 7, batch=(n,))  # Q^i, known
    mean = torch.linspace(-1, 1, n * n, dtype=torch.float64).reshape(n, n)
    pattern = select_pattern(per_query, k, "per_query", mean=mean, centered=True)
    gen = torch.Generator().manual_seed(3)
    chol = torch.linalg.cholesky(per_query)  # (n, n, n)
    z = torch.randn(draws, n, n, 1, generator=gen, dtype=torch.float64)
    samples = (chol @ z).squeeze(-1) + mean  # (draws, n, n): row i ~ N(μ_i, Q^i)
    per_sample = (LinearReconstructor(pattern)(samples) - samples).pow(2).sum((-1, -2))  # (draws,)
    predicted = pattern.normalized_error * pattern.metadata["total_variance"]  # Σ_i ε_i, absolute
    standard_error = float(per_sample.std() / draws ** 0.5)
    assert abs(float(per_sample.mean()) - predicted) < 4 * standard_error
    assert standard_error < 0.05 * predicted  # the check has teeth
    meter = ErrorMeter({"greedy": LinearReconstructor(pattern)}, dtype=torch.float64)
    for chunk in samples.split(500):
        meter.update(chunk)
    result = meter.results()["greedy"]
    assert result["mse"] == pytest.approx(float(per_sample.mean()), rel=1e-12)
    assert result["normalized_error"] == pytest.approx(result["mse"] / meter.total_variance, rel=1e-12)
    assert meter.total_variance == pytest.approx(float(torch.diagonal(per_query, dim1=-2, dim2=-1).sum()), rel=0.05)


def test_pattern_round_trip_and_metadata(tmp_path):
    c = _spd(8, 0, batch=(8,))
    pattern = select_pattern(c, 3, "per_query", mean=torch.zeros(8, 8))
    assert isinstance(pattern, AttentionPattern) and pattern.k == 3 and pattern.seq_len == 8
    assert 0 < pattern.normalized_error < 1
    pattern.save(tmp_path / "p.safetensors")
    back = AttentionPattern.load(tmp_path / "p.safetensors")
    assert back.normalized_error == pattern.normalized_error and back.metadata["method"] == "greedy"
    assert pattern_mask(pattern).sum() == 8 * 3


def test_fit_pattern_for_given_indices_and_whole_mask():
    c = _spd(9, 0)  # whole matrix for n = 3
    pattern = fit_pattern(c, torch.tensor([4, 0, 8]), "whole", mean=torch.zeros(9))
    assert pattern.indices.tolist() == [0, 4, 8]
    assert pattern_mask(pattern).tolist() == torch.eye(3, dtype=torch.bool).tolist()


def test_error_curve_is_monotone():
    c = _spd(16, 2)
    curve = error_curve(c, [1, 2, 4, 8, 16], "whole", d_head=4)
    assert curve["greedy"] == sorted(curve["greedy"], reverse=True)
    assert curve["greedy"][-1] == pytest.approx(0, abs=1e-9)
    assert curve["k_bar"] == [1, 2, 4, 8, 16] and len(curve["relative_cost"]) == 5


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="k must be in"):
        select_pattern(_spd(4, 0, batch=(4,)), 5, "per_query")
    with pytest.raises(ValueError, match="scope"):
        select_pattern(_spd(4, 0), 2, "rows")
    with pytest.raises(ValueError, match="needs the mean"):
        select_pattern(_spd(4, 0, batch=(4,)), 2, "per_query", centered=True, bias=True)
    with pytest.raises(ValueError, match="family"):
        select_pattern(_spd(4, 0, batch=(4,)), 2, "whole", family="columns")


# ---------------------------------------------------------------- the greedy itself (moved from reconstruction)
def test_greedy_error_equals_schur_error_and_brute_force_on_tiny_l():
    cov = _spd(6, seed=4)
    for k in (1, 2, 3):
        idx, err = greedy_select(cov, k)
        _, _, schur = solve_reconstruction(cov, idx, ridge=0.0)
        assert float(err) == pytest.approx(float(schur), rel=1e-8)
        best = min(float(solve_reconstruction(cov, torch.tensor(s), ridge=0.0)[2])
                   for s in itertools.combinations(range(6), k))
        assert float(err) >= best - 1e-9
        if k == 1:  # one greedy step is the exhaustive optimum
            assert float(err) == pytest.approx(best, rel=1e-9)


def test_greedy_is_deterministic_and_breaks_ties_low():
    idx, err = greedy_select(torch.eye(5, dtype=torch.float64), 2)
    assert idx.tolist() == [0, 1]
    assert float(err) == pytest.approx(3.0)


def test_greedy_handles_rank_deficiency():
    g = torch.Generator().manual_seed(5)
    a = torch.randn(8, 2, generator=g, dtype=torch.float64)
    cov = a @ a.T  # rank 2
    idx, err = greedy_select(cov, 4)
    assert len(set(idx.tolist())) == 4
    assert float(err) < 1e-8 * float(torch.trace(cov))


def test_greedy_rejects_bad_k():
    with pytest.raises(ValueError, match="k must be in"):
        greedy_select(torch.eye(3, dtype=torch.float64), 4)


def test_batched_greedy_solves_each_problem_alone():
    cov = _spd(6, 3, batch=(2, 3))
    idx, err = greedy_select(cov, 2)
    assert idx.shape == (2, 3, 2) and err.shape == (2, 3)
    for a in range(2):
        for b in range(3):
            i1, e1 = greedy_select(cov[a, b], 2)
            assert torch.equal(idx[a, b], i1) and float(err[a, b]) == pytest.approx(float(e1), rel=1e-12)


# ---------------------------------------------------------------- constrained families
def per_query_cov(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, 3 * n, generator=g, dtype=torch.float64)
    pos = torch.arange(n, dtype=torch.float64)
    scale = torch.exp(-0.3 * (pos[:, None] - pos[None, :]).abs())  # nearby keys vary more, as in real scores
    a = a * scale[:, :, None]
    return a @ a.transpose(-1, -2) / a.shape[-1] + 1e-4 * torch.eye(n, dtype=torch.float64)


def _total_error(cov, idx):
    return float(solve_reconstruction(cov, idx, ridge=0.0)[2].sum())


def test_columns_greedy_takes_the_best_shared_key_at_each_step():
    """Brute force: each step of the shared-columns greedy adds the key that minimises the summed error."""
    cov = per_query_cov(8)
    n = cov.shape[0]
    groups, candidates = family_constraint(n, "columns")
    prev: list[int] = []
    for k in (1, 2, 3):
        idx, residual = greedy_select(cov, k, groups, candidates)
        assert bool((idx == idx[:1]).all())  # one key set for every query
        chosen = idx[0].tolist()
        added = [j for j in chosen if j not in prev]
        assert len(added) == 1
        errors = {j: _total_error(cov, torch.tensor(sorted(prev + [j])).expand(n, k))
                  for j in range(n) if j not in prev}
        assert errors[added[0]] == pytest.approx(min(errors.values()), rel=1e-9)
        assert float(residual.sum()) == pytest.approx(errors[added[0]], rel=1e-8)
        prev = chosen


def test_bands_greedy_takes_the_best_shared_offset():
    cov = per_query_cov(8)
    n = cov.shape[0]
    idx = select_pattern(cov, 1, family="bands", mean=torch.zeros(n, n), bias=False).indices  # (n, 1)
    errors = {o: _total_error(cov, ((torch.arange(n) + o) % n).unsqueeze(-1)) for o in range(n)}
    best = min(errors, key=errors.get)
    assert idx[:, 0].tolist() == ((torch.arange(n) + best) % n).tolist()


@pytest.mark.parametrize("family, rows", [("columns", 12), ("blocks", 4), ("windows", 4)])
def test_structured_families_have_the_kernel_structure(family, rows):
    pattern = select_pattern(per_query_cov(), 4, family=family, block_rows=4 if family == "blocks" else None)
    assert block_rows(pattern.indices) == rows and pattern.metadata["family"] == family


def test_bands_share_offsets():
    idx = select_pattern(per_query_cov(), 3, family="bands").indices
    n = idx.shape[0]
    offsets = {tuple(sorted(((idx[i] - i) % n).tolist())) for i in range(n)}
    assert len(offsets) == 1


def test_constraints_cost_error():
    cov = per_query_cov()
    errors = {f: select_pattern(cov, 4, family=f).normalized_error for f in FAMILIES}
    # a constraint can only cost error: the unconstrained greedy is at least as good as each family here
    assert errors["per_query"] <= min(errors.values()) + 1e-12
    assert errors["columns"] > errors["per_query"] * 1.05  # and on this covariance it does cost


def test_family_errors():
    cov = per_query_cov()
    with pytest.raises(ValueError, match="family"):
        select_pattern(cov, 4, family="diagonal")
    with pytest.raises(ValueError, match="block_rows"):
        select_pattern(cov, 4, family="blocks", block_rows=5)
    with pytest.raises(ValueError, match="k to divide n"):
        select_pattern(cov, 5, family="windows")
    with pytest.raises(ValueError, match="3 dims"):
        select_pattern(cov[0], 4, family="columns")


# ---------------------------------------------------------------- objectives that track the output
def _objective_error(c, m, idx):
    """Tr(M E[eeᵀ]) of the optimal R for P = idx (full coordinates, e_P = 0), by explicit block algebra."""
    l = c.shape[-1]
    p = idx.tolist()
    q = [j for j in range(l) if j not in p]
    r = c[q][:, p] @ torch.linalg.inv(c[p][:, p])
    err = torch.zeros(l, l, dtype=torch.float64)
    block = c[q][:, q] - r @ c[p][:, q] - c[q][:, p] @ r.T + r @ c[p][:, p] @ r.T
    err[torch.tensor(q)[:, None], torch.tensor(q)[None, :]] = block
    return float((m * err).sum())


@pytest.mark.parametrize("objective", ["shift", "fisher"])
def test_objective_greedy_steps_are_best_by_brute_force(objective):
    n = 6
    c = _spd(n, 11, batch=(n,))
    mean = torch.randn(n, n, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    metric = objective_metric(objective, n, mean)
    prev = None
    for k in (1, 2, 3):
        pattern = select_pattern(c, k, mean=mean, bias=False, ridge=0.0, objective=objective)
        for i in range(n):
            chosen = pattern.indices[i].tolist()
            base = [] if prev is None else prev[i].tolist()
            added = [j for j in chosen if j not in base]
            assert len(added) == 1
            errors = {j: _objective_error(c[i], metric[i], torch.tensor(sorted(base + [j])))
                      for j in range(n) if j not in base}
            assert errors[added[0]] == pytest.approx(min(errors.values()), rel=1e-9)
        prev = pattern.indices
    total = sum(_objective_error(c[i], metric[i], prev[i]) for i in range(n))
    assert pattern.metadata["objective_normalized_error"] == pytest.approx(total / float((metric * c).sum()), rel=1e-8)


def test_objectives_pick_different_keys_and_shift_ignores_constants():
    n = 6
    mean = torch.randn(n, n, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    shift = objective_metric("shift", n)
    torch.testing.assert_close(shift[0] @ torch.ones(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64))
    fisher = objective_metric("fisher", n, mean)
    p = torch.softmax(mean[3], -1)
    torch.testing.assert_close(fisher[3], torch.diag(p) - torch.outer(p, p))
    torch.testing.assert_close(fisher[3] @ torch.ones(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64))
    c = per_query_cov(8)
    mean8 = 3 * torch.randn(8, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    picks = {o: select_pattern(c, 2, mean=mean8, bias=False, objective=o).indices for o in OBJECTIVES}
    assert not torch.equal(picks["paper"], picks["fisher"])  # probability weighting moves P


@pytest.mark.parametrize("objective", ["shift", "fisher"])
def test_the_optimal_r_does_not_depend_on_the_objective(objective):
    """R = C_P̄P C_PP⁻¹ minimises Tr(M E[eeᵀ]) for any PSD M: random perturbations of it only increase the error."""
    n = 6
    c = _spd(n, 5)
    metric = objective_metric(objective, n, torch.randn(n, n, generator=torch.Generator().manual_seed(1),
                                                           dtype=torch.float64))[2]
    p, q = [0, 3], [1, 2, 4, 5]
    r = c[q][:, p] @ torch.linalg.inv(c[p][:, p])

    def value(rr):
        block = c[q][:, q] - rr @ c[p][:, q] - c[q][:, p] @ rr.T + rr @ c[p][:, p] @ rr.T
        return float((metric[q][:, q] * block).sum())

    g = torch.Generator().manual_seed(3)
    best = value(r)
    assert all(value(r + 0.05 * torch.randn(4, 2, generator=g, dtype=torch.float64)) >= best - 1e-12 for _ in range(50))
    pattern = select_pattern(c.expand(n, n, n), 2, mean=torch.zeros(n, n), bias=False, ridge=0.0, objective=objective)
    row = pattern.indices[2].tolist()
    rq = [j for j in range(n) if j not in row]
    torch.testing.assert_close(pattern.reconstruction[2].double(),
                               (c[rq][:, row] @ torch.linalg.inv(c[row][:, row])), atol=1e-6, rtol=0)


def _explicit_greedy(cov, k, groups, candidates, metric=None, rel_tol=1e-10):
    """The greedy as specified (docs/method.md): S updated explicitly at every step; the reference."""
    s = cov.clone()
    r, l, _ = s.shape
    rows = torch.arange(r)
    chosen = torch.zeros(r, l, dtype=torch.bool)
    picks = []
    tol = rel_tol * torch.diagonal(s, dim1=-2, dim2=-1).amax(-1, keepdim=True)
    for _ in range(k):
        diag = torch.diagonal(s, dim1=-2, dim2=-1)
        energy = (s * s).sum(-2) if metric is None else (s * (metric @ s)).sum(-2)
        gain = torch.where(diag > tol, energy / diag, torch.zeros_like(diag)).gather(-1, candidates)
        pooled = torch.zeros(int(groups.max()) + 1, candidates.shape[1], dtype=s.dtype).index_add_(0, groups, gain)
        used = torch.zeros_like(pooled).index_add_(0, groups, chosen.gather(-1, candidates).to(s.dtype)) > 0
        j = candidates[rows, torch.where(used, -1.0, pooled).argmax(-1)[groups]]
        picks.append(j)
        chosen[rows, j] = True
        col = s[rows, :, j].unsqueeze(-1)
        pivot = s[rows, j, j].view(r, 1, 1)
        s = s - torch.where(pivot > tol.unsqueeze(-1), col @ col.transpose(-1, -2) / pivot, torch.zeros_like(s))
    residual = (torch.diagonal(s, dim1=-2, dim2=-1).clamp_min(0).sum(-1) if metric is None
                else (metric * s).sum((-1, -2)))
    return torch.sort(torch.stack(picks, -1), -1).values, residual


@pytest.mark.parametrize("family", ["per_query", "columns", "blocks", "bands"])
@pytest.mark.parametrize("objective", ["paper", "fisher"])
def test_incremental_greedy_equals_the_explicit_update(family, objective):
    n = 12
    cov = per_query_cov(n, seed=3)
    mean = torch.randn(n, n, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    metric = objective_metric(objective, n, mean)
    groups, candidates = family_constraint(n, family, block_rows=4)
    for k in (1, 3, 6):
        idx, residual = greedy_select(cov, k, groups, candidates, metric=metric)
        ref_idx, ref_residual = _explicit_greedy(cov, k, groups, candidates, metric)
        assert torch.equal(idx, ref_idx)
        torch.testing.assert_close(residual, ref_residual, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------- shared_blocks: P and R shared by blocks of rows
def _shared_error(cov, idx, recon):
    """Σ_i E‖a_P̄ − R_i a_P‖² from the per-row covariances, written out (no solver)."""
    from hf_partial_attention.reconstruction import complement_indices

    total = 0.0
    for i in range(cov.shape[0]):
        p, c = idx[i], complement_indices(idx[i], cov.shape[0])
        ci, r = cov[i], recon[i]
        total += float(torch.trace(ci[c][:, c]) - 2 * torch.trace(r @ ci[p][:, c]) + torch.trace(r @ ci[p][:, p] @ r.T))
    return total


def test_shared_blocks_share_p_and_r_and_r_is_optimal_for_the_block():
    from hf_partial_attention.attention_common import shared_rows

    cov = per_query_cov(12, seed=4)
    pattern = select_pattern(cov, 3, family="shared_blocks", block_rows=4)
    assert shared_rows(pattern.indices, pattern.reconstruction) == 4
    recon = pattern.reconstruction.to(torch.float64)
    best = _shared_error(cov, pattern.indices, recon)
    total = float(torch.diagonal(cov, dim1=-2, dim2=-1).sum())
    assert pattern.normalized_error == pytest.approx(best / total, rel=1e-4)
    g = torch.Generator().manual_seed(1)
    for block in range(3):  # moving one block's shared R in any direction costs error
        delta = torch.zeros_like(recon)
        delta[4 * block: 4 * block + 4] = 1e-2 * torch.randn(recon.shape[1:], generator=g, dtype=torch.float64)
        assert _shared_error(cov, pattern.indices, recon + delta) > best
    # one R per block can only cost error against one R per row with the same P
    assert best >= _total_error(cov, pattern.indices) - 1e-9


def test_shared_blocks_of_one_row_are_the_per_query_greedy():
    cov = per_query_cov(8, seed=2)
    one = select_pattern(cov, 3, family="shared_blocks", block_rows=1)
    ref = select_pattern(cov, 3, family="per_query")
    assert torch.equal(one.indices, ref.indices)
    torch.testing.assert_close(one.reconstruction, ref.reconstruction)


def test_shared_blocks_keep_each_rows_bias():
    cov = per_query_cov(8, seed=3)
    mean = torch.randn(8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    pattern = select_pattern(cov, 2, family="shared_blocks", block_rows=4, centered=True, mean=mean, bias=True)
    from hf_partial_attention.reconstruction import complement_indices

    comp = complement_indices(pattern.indices, 8)
    r = pattern.reconstruction.to(torch.float64)
    want = mean.gather(-1, comp) - (r @ mean.gather(-1, pattern.indices).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(pattern.bias.to(torch.float64), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="objective='paper'"):
        select_pattern(cov, 2, family="shared_blocks", objective="shift")


@pytest.mark.parametrize("family,objective", [("per_query", "paper"), ("blocks", "fisher"), ("bands", "shift")])
def test_patterns_from_an_earlier_greedy_order_equal_a_fresh_selection(family, objective):
    """`derive --saving` runs the greedy once per group and builds its files from that run (`greedy_order`, then
    `select_patterns(order=...)`): each k of the run gives the pattern a fresh selection gives, bit for bit; a k
    beyond the run falls back to running the greedy."""
    g = torch.Generator().manual_seed(7)
    scores = torch.randn(64, 1, 8, 8, generator=g) @ torch.randn(8, 8, generator=g)  # (B, H, n, n), correlated keys
    cov = ScoreCovariance(8, ("per_query",), granularity="layer")
    cov.update(0, scores)
    kwargs = dict(family=family, objective=objective, layer=0)
    order = greedy_order(cov, 5, **kwargs)
    assert order[0].shape == order[1].shape == (8, 5)
    for ks in ([2, 5], [3], [3, 6]):
        fresh = select_patterns(cov, ks, **kwargs)
        reused = select_patterns(cov, ks, order=order, **kwargs)
        for k in ks:
            assert torch.equal(reused[k].indices, fresh[k].indices) and reused[k].indices.shape == (8, k)
            assert torch.equal(reused[k].reconstruction, fresh[k].reconstruction)
            assert reused[k].metadata == fresh[k].metadata

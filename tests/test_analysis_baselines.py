"""Equal-cost baselines: index sets, cost equalities, Nyström exactness, method table."""

import torch

from hf_partial_attention.analysis import ScoreCovariance
from hf_partial_attention.analysis.baselines import (
    build_methods,
    equal_cost_band,
    equal_cost_landmarks,
    landmark_indices,
    random_indices,
)
from hf_partial_attention.analysis.evaluation import NystromCUR
from hf_partial_attention.cost import nystrom_cost, score_cost


def test_index_sets():
    r = random_indices(10, 4, seed=1)
    assert torch.equal(r, random_indices(10, 4, seed=1)) and r.shape == (10, 4)
    assert bool((r[:, 1:] > r[:, :-1]).all())
    lm = landmark_indices(9, 3)
    assert lm[0].tolist() == [0, 4, 8] and torch.equal(lm[0], lm[5])


def test_equal_costs():
    n, d = 128, 32
    assert equal_cost_band(n, 32, d) == 128  # at d_h = 32, k = 32 reconstruction costs as much as dense
    assert equal_cost_band(n, 16, d) == 72
    m = equal_cost_landmarks(n, 16, d)
    assert nystrom_cost(n, m, d) <= score_cost(n, 16, d).total < nystrom_cost(n, m + 1, d)


def test_nystrom_is_exact_for_low_rank_scores():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, 12, 3, generator=gen, dtype=torch.float64)
    k = torch.randn(4, 12, 3, generator=gen, dtype=torch.float64)
    scores = q @ k.transpose(-1, -2)  # rank 3
    recon = NystromCUR(torch.tensor([0, 4, 8, 11]))(scores)
    torch.testing.assert_close(recon, scores, rtol=1e-8, atol=1e-8)


def test_build_methods_same_cost_for_p_choices():
    cov = ScoreCovariance(8, ("per_query",))
    gen = torch.Generator().manual_seed(0)
    cov.update(0, torch.randn(50, 2, 8, 8, generator=gen))
    methods = build_methods(cov, 3, d_head=4)
    assert set(methods) == {"greedy P + R", "band P + R", "random P + R", "landmark columns + R", "band only",
                            "Nyström CUR"}
    costs = {methods[name]["relative_cost"] for name in ("greedy P + R", "band P + R", "random P + R",
                                                         "landmark columns + R")}
    assert len(costs) == 1
    assert methods["band only"]["relative_cost"] <= costs.pop() + 1e-12
    # greedy is the best P under its own objective
    assert methods["greedy P + R"]["predicted"] <= min(methods[n]["predicted"] for n in ("band P + R", "random P + R",
                                                                                           "landmark columns + R"))
    assert methods["Nyström CUR"]["predicted"] is None

"""`derive`'s P does not depend on roundoff (issue 52): candidates whose gains are equal within the greedy's stated
tie tolerance go to the lower position, and R of a rank-deficient covariance is the minimum-norm solution, so a
covariance perturbed at float64 roundoff (relative 1e-12) gives the same P and the same R within 1e-6."""

import pytest
import torch

from hf_partial_attention.analysis.greedy import TIE_RTOL, greedy_select
from hf_partial_attention.analysis.selection import select_patterns


def _per_query(windows: int, n: int, seed: int) -> torch.Tensor:
    """``(n, n, n)``: n per-query centred covariances, each from ``windows`` random score rows (rank windows − 1)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, windows, n, generator=g, dtype=torch.float64)  # (rows, windows, keys)
    a = a + torch.linspace(0, 3, n, dtype=torch.float64)  # keys of unequal variance: no structural ties at start
    a = a - a.mean(1, keepdim=True)
    return a.transpose(1, 2) @ a / windows  # (n, n, n)


def _perturbed(c: torch.Tensor, draw: int) -> torch.Tensor:
    """``c`` plus symmetric noise of relative size 1e-12 of its largest entry."""
    g = torch.Generator().manual_seed(1000 + draw)
    noise = torch.randn(c.shape, generator=g, dtype=torch.float64)
    noise = (noise + noise.transpose(-1, -2)) / 2
    return c + 1e-12 * c.abs().amax((-1, -2), keepdim=True) * noise


@pytest.mark.parametrize("windows, k", [(6, 8), (40, 8)], ids=["rank_deficient", "full_rank"])
def test_p_and_r_do_not_depend_on_roundoff_of_the_covariance(windows, k):
    n = 12
    c = _per_query(windows, n, seed=3)
    want = select_patterns(c, [k])[k]
    for draw in range(10):
        got = select_patterns(_perturbed(c, draw), [k])[k]
        assert torch.equal(got.indices, want.indices), f"draw {draw}: P moved"
        torch.testing.assert_close(got.reconstruction, want.reconstruction, rtol=1e-6,
                                   atol=1e-6 * float(want.reconstruction.abs().max()), msg=f"draw {draw}: R moved")


def test_gains_equal_within_the_tolerance_go_to_the_lower_position():
    # rank one: every column's gain is ||v||^2 (a tie in exact arithmetic); the first pick is position 0 whatever
    # roundoff the entries carry
    v = torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=torch.float64)
    for draw in range(10):
        c = _perturbed(torch.outer(v, v), draw)
        picks, _ = greedy_select(c, 1, order=True)
        assert picks.tolist() == [0]
    # a real difference just above the tolerance still wins
    c = torch.diag(torch.tensor([1.0, 1.0 + 10 * TIE_RTOL, 1.0], dtype=torch.float64))
    assert greedy_select(c, 1, order=True)[0].tolist() == [1]
    c = torch.diag(torch.tensor([1.0, 1.0 + TIE_RTOL / 10, 1.0], dtype=torch.float64))
    assert greedy_select(c, 1, order=True)[0].tolist() == [0]

"""Constrained greedy pattern families."""

import pytest
import torch

from hf_partial_attention.partial_attention import block_rows
from hf_partial_attention.pattern_families import FAMILIES, family_indices, family_pattern
from hf_partial_attention.reconstruction import greedy_select


def per_query_cov(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, 3 * n, generator=g, dtype=torch.float64)
    pos = torch.arange(n, dtype=torch.float64)
    scale = torch.exp(-0.3 * (pos[:, None] - pos[None, :]).abs())  # nearby keys vary more, as in real scores
    a = a * scale[:, :, None]
    return a @ a.transpose(-1, -2) / a.shape[-1] + 1e-4 * torch.eye(n, dtype=torch.float64)


def test_per_query_family_equals_the_plain_greedy():
    cov = per_query_cov()
    assert torch.equal(family_indices(cov, 4, "per_query"), greedy_select(cov, 4)[0])


@pytest.mark.parametrize("family, rows", [("columns", 12), ("blocks", 4), ("windows", 4)])
def test_structured_families_have_the_kernel_structure(family, rows):
    idx = family_indices(per_query_cov(), 4, family, block_rows=4 if family == "blocks" else None)
    assert block_rows(idx) == rows


def test_bands_share_offsets():
    idx = family_indices(per_query_cov(), 3, "bands")
    n = idx.shape[0]
    offsets = {tuple(sorted(((idx[i] - i) % n).tolist())) for i in range(n)}
    assert len(offsets) == 1


def test_constraints_cost_error_and_patterns_validate():
    cov = per_query_cov()
    errors = {f: family_pattern(cov, 4, f).normalized_error for f in FAMILIES}
    assert errors["per_query"] <= min(errors.values()) + 1e-12
    assert all(0 <= e <= 1 for e in errors.values())


def test_family_errors():
    cov = per_query_cov()
    with pytest.raises(ValueError, match="family"):
        family_indices(cov, 4, "diagonal")
    with pytest.raises(ValueError, match="block_rows"):
        family_indices(cov, 4, "blocks", block_rows=5)
    with pytest.raises(ValueError, match="k to divide n"):
        family_indices(cov, 5, "windows")
    with pytest.raises(ValueError, match=r"\(n, n, n\)"):
        family_indices(cov[0], 4, "columns")

"""Held-out error meter and reconstructors."""

import pytest
import torch

from hf_partial_attention import AttentionPattern
from hf_partial_attention.analysis.evaluation import ErrorMeter, LinearReconstructor, MeanFill


def test_linear_reconstructor_matches_a_hand_computation():
    n, k = 4, 2
    indices = torch.tensor([[0, 1], [1, 2], [2, 3], [0, 3]])
    recon = torch.randn(n, n - k, k)
    bias = torch.randn(n, n - k)
    pattern = AttentionPattern(indices, recon, bias)
    scores = torch.randn(3, n, n, dtype=torch.float64)
    out = LinearReconstructor(pattern)(scores)
    comp = pattern.complement
    for i in range(n):
        torch.testing.assert_close(out[:, i, indices[i]], scores[:, i, indices[i]])
        want = scores[:, i, indices[i]] @ recon[i].double().T + bias[i].double()
        torch.testing.assert_close(out[:, i, comp[i]], want)


def test_meter_shift_error_ignores_row_constants():
    n = 5
    mean = torch.zeros(n, n)
    keep_nothing_useful = MeanFill(torch.zeros(n, 1, dtype=torch.long), mean)
    base = torch.randn(200, n, n, dtype=torch.float64)
    meter = ErrorMeter({"fill": keep_nothing_useful}, dtype=torch.float64)
    meter.update(base)
    r = meter.results()["fill"]
    assert r["normalized_error"] > 0 and r["normalized_error_shift"] > 0
    # adding a per-row constant changes the plain error, not the error modulo shifts... of an exact method
    exact = MeanFill(torch.arange(n).expand(n, n).clone(), mean)
    meter2 = ErrorMeter({"exact": exact})
    meter2.update(base + torch.randn(200, n, 1, dtype=torch.float64))
    assert meter2.results()["exact"]["mse"] == pytest.approx(0, abs=1e-9)


def test_meter_needs_data():
    with pytest.raises(ValueError, match="saw no scores"):
        ErrorMeter({}).results()


def test_meter_pools_heads():
    meter = ErrorMeter({"fill": MeanFill(torch.zeros(3, 1, dtype=torch.long), torch.zeros(3, 3))})
    meter.sink(0, torch.randn(2, 4, 3, 3))
    assert meter.count == 8

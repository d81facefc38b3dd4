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


class _AddError:
    """A reconstructor whose output is the input plus a given error, (S, n, n) or (S, n, 1), consumed in order
    across batches."""

    def __init__(self, error):
        self.error = error
        self.seen = 0

    def __call__(self, scores):
        part = self.error[self.seen:self.seen + scores.shape[0]]
        self.seen += scores.shape[0]
        return scores + part.to(scores.dtype)


def _variances(scores):
    """Hand computation: total variance and the variance left after removing each row's mean, both the sum over
    entries of the population variance across the S matrices."""
    centred = scores - scores.mean(-1, keepdim=True)
    return float(scores.var(0, unbiased=False).sum()), float(centred.var(0, unbiased=False).sum())


@pytest.mark.parametrize("dtype,rel", [(torch.float64, 1e-9), (torch.float32, 1e-4)])
def test_meter_shift_error_matches_hand_computation(dtype, rel):
    s, n = 200, 5
    gen = torch.Generator().manual_seed(0)
    # scores with a mean and unequal row offsets, so that total and shift-invariant variance differ
    base = 2.0 + torch.randn(s, n, n, generator=gen, dtype=torch.float64) + torch.randn(s, n, 1, generator=gen,
                                                                                      dtype=torch.float64)
    shift = torch.randn(s, n, 1, generator=gen, dtype=torch.float64)  # a per-row constant error
    noise = 0.3 * torch.randn(s, n, n, generator=gen, dtype=torch.float64)  # an error that is not a row constant
    meter = ErrorMeter({"shift": _AddError(shift), "noise": _AddError(noise), "both": _AddError(noise + shift)},
                       dtype=dtype)
    meter.update(base[:120])  # two batches: the sums must pool
    meter.update(base[120:])
    r = meter.results()
    tv, sv = _variances(base)
    assert sv < 0.9 * tv  # the two normalisers are really different here
    assert meter.total_variance == pytest.approx(tv, rel=1e-9)
    assert meter.shift_invariant_variance == pytest.approx(sv, rel=1e-9)
    # a per-row constant c_i: squared error n·c_i² per row, and exactly zero modulo shifts
    shift_sse = float(n * shift.pow(2).sum()) / s
    assert r["shift"]["mse"] == pytest.approx(shift_sse, rel=rel)
    assert r["shift"]["normalized_error"] == pytest.approx(shift_sse / tv, rel=rel)
    assert r["shift"]["normalized_error"] > 0.1
    assert r["shift"]["normalized_error_shift"] == pytest.approx(0.0, abs=1e-6)
    # a general error e: ‖e‖² / S over the total variance; modulo shifts ‖e − row mean(e)‖² / S over sv
    noise_sse = float(noise.pow(2).sum()) / s
    noise_shift_sse = float((noise - noise.mean(-1, keepdim=True)).pow(2).sum()) / s
    assert noise_shift_sse < 0.9 * noise_sse
    assert r["noise"]["normalized_error"] == pytest.approx(noise_sse / tv, rel=rel)
    assert r["noise"]["normalized_error_shift"] == pytest.approx(noise_shift_sse / sv, rel=rel)
    # adding the row constant to that error changes the plain error only
    assert r["both"]["normalized_error"] == pytest.approx(float((noise + shift).pow(2).sum()) / s / tv, rel=rel)
    assert r["both"]["normalized_error_shift"] == pytest.approx(noise_shift_sse / sv, rel=rel)


def test_exact_method_has_zero_error_and_mean_fill_known_error():
    n = 5
    base = torch.randn(200, n, n, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    exact = MeanFill(torch.arange(n).expand(n, n).clone(), torch.zeros(n, n))  # every key kept
    fill = MeanFill(torch.zeros(n, 1, dtype=torch.long), base.mean(0))  # key 0 kept, the held-out mean elsewhere
    meter = ErrorMeter({"exact": exact, "fill": fill}, dtype=torch.float64)
    meter.update(base)
    r = meter.results()
    assert r["exact"]["mse"] == pytest.approx(0, abs=1e-12)
    assert r["exact"]["normalized_error_shift"] == pytest.approx(0, abs=1e-12)
    # filling with the held-out mean leaves exactly the (population) variance of the filled entries
    tv, _ = _variances(base)
    want = float(base[:, :, 1:].var(0, unbiased=False).sum()) / tv
    assert r["fill"]["normalized_error"] == pytest.approx(want, rel=1e-9)


def test_meter_needs_data():
    with pytest.raises(ValueError, match="saw no scores"):
        ErrorMeter({}).results()


def test_meter_pools_heads():
    meter = ErrorMeter({"fill": MeanFill(torch.zeros(3, 1, dtype=torch.long), torch.zeros(3, 3))})
    meter.sink(0, torch.randn(2, 4, 3, 3))
    assert meter.count == 8

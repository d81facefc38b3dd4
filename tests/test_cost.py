"""The cost model (docs/method.md#cost-model): multiply-adds counted by hand."""

import pytest

from hf_partial_attention.cost import dense_cost, forward_ratio, nystrom_cost, score_cost


def test_per_query_cost_by_hand():
    c = score_cost(128, 32, 64)
    assert (c.exact, c.reconstruction, c.dense) == (128 * 32 * 64, 128 * 96 * 32, 128 * 128 * 64)
    assert c.saving == pytest.approx(0.375)  # 1 − (32·64 + 96·32) / (128·64) = 1 − 5120/8192
    assert score_cost(128, 24, 64).saving == pytest.approx(0.5078125)  # 1 − (1536 + 2496) / 8192
    assert score_cost(128, 16, 32).saving == pytest.approx(0.4375)  # MiniLM: 1 − (512 + 1792) / 4096
    assert score_cost(128, 32, 32).saving == 0.0  # k = d_h saves nothing
    assert score_cost(128, 48, 32).saving < 0  # k > d_h costs more than dense
    row = c.per_query(128)
    assert (row.exact, row.reconstruction, row.dense) == (32 * 64, 96 * 32, 128 * 64)


def test_whole_and_nystrom_cost_by_hand():
    assert score_cost(16, 10, 8, "whole").total == 10 * 8 + (256 - 10) * 10
    assert dense_cost(16, 8) == 2048
    assert nystrom_cost(16, 4, 8) == (2 * 16 * 4 - 16) * 8 + 64 + 12 * 16 + 144 * 4


def test_cost_errors():
    with pytest.raises(ValueError, match="1 <= k <= 16"):
        score_cost(16, 32, 64)
    with pytest.raises(ValueError, match="scope"):
        score_cost(16, 4, 8, "rows")


def test_forward_ratio_by_hand():
    # n = 128, d = 64, k = 16: (16·64 + 112·16 + 128·64) / (2·128·64) = (1024 + 1792 + 8192) / 16384
    assert forward_ratio(128, 16, 64) == pytest.approx(11008 / 16384)
    # the fused kernel multiplies all n·k entries of [I | R]: (1024 + 2048 + 8192) / 16384
    assert forward_ratio(128, 16, 64, dense_reconstruction=True) == pytest.approx(11264 / 16384)
    # exact scores from the whole QKᵀ (n·d = 8192 instead of 1024) and [I | R]: (8192 + 2048 + 8192) / 16384
    assert forward_ratio(128, 16, 64, dense_reconstruction=True, dense_exact=True) == pytest.approx(18432 / 16384)
    # n = 128, d = 64, k = 32, QKᵀ and R alone: (8192 + 96·32 + 8192) / 16384
    assert forward_ratio(128, 32, 64, dense_exact=True) == pytest.approx(19456 / 16384)

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


def test_bucket_savings_by_hand():
    from hf_partial_attention.cost import bucket_savings

    # k = 6, d_h = 8, per query: 1 − (k·d_h + (b − k)·k) / (b·d_h); b <= k runs exactly
    got = bucket_savings([4, 6, 8, 16, 32], 6, 8)
    assert list(got) == [4, 6, 8, 16, 32]
    assert got[4] == 0.0 and got[6] == 0.0  # exact buckets (b < k, b = k)
    assert got[8] == pytest.approx(1 - (48 + 2 * 6) / 64)  # 0.0625
    assert got[16] == pytest.approx(1 - (48 + 10 * 6) / 128)  # 0.15625
    assert got[32] == pytest.approx(1 - (48 + 26 * 6) / 256)  # 0.203125
    assert bucket_savings([128], 16, 32) == {128: pytest.approx(0.4375)}  # one bucket: the n saving


def test_distribution_saving_by_hand():
    from hf_partial_attention.cost import distribution_saving

    lengths, k, d = [32, 4, 16, 8], 6, 8  # any order
    # T = 3 -> bucket 4, exact: 9·8 = 72 either way
    # T = 7 -> bucket 8: dense 49·8 = 392, partial 7·(6·8 + 2·6) = 420
    # T = 12 -> bucket 16: dense 144·8 = 1152, partial 12·(48 + 10·6) = 1296
    # T = 32 -> bucket 32: dense 1024·8 = 8192, partial 32·(48 + 26·6) = 6528
    want = 1 - (72 + 420 + 1296 + 6528) / (72 + 392 + 1152 + 8192)  # 1 − 8316 / 9808
    assert distribution_saving(lengths, k, d, [3, 7, 12, 32]) == pytest.approx(want)
    assert distribution_saving(lengths, k, d, [1, 2, 4]) == 0.0  # exact buckets only
    assert distribution_saving([6, 16], k, d, [5, 6]) == 0.0  # b = k is exact too (not 5·48 + 6·48 vs 25·8 + 36·8)
    # T = 5 < k in bucket 8: 5·(48 + 12) = 300 against 5·5·8 = 200 dense, i.e. −50 %
    assert distribution_saving([8], k, d, [5]) == pytest.approx(-0.5)
    assert distribution_saving(lengths, k, d, []) == 0.0
    with pytest.raises(ValueError, match="an input of 33 tokens exceeds the longest bucket 32"):
        distribution_saving(lengths, k, d, [3, 33])
    # a k per bucket (aligned with lengths): 8 at k = 8 runs exactly, 16 at k = 4
    # T = 7 -> 392 either way; T = 12 -> bucket 16: 12·(4·8 + 12·4) = 960
    per_bucket = 1 - (72 + 392 + 960 + 6528) / (72 + 392 + 1152 + 8192)
    assert distribution_saving(lengths, [6, 4, 4, 8], d, [3, 7, 12, 32]) == pytest.approx(per_bucket)
    with pytest.raises(ValueError, match="one k per bucket"):
        distribution_saving(lengths, [6, 4], d, [3])


def test_bucket_savings_per_bucket_k():
    from hf_partial_attention.cost import bucket_savings, score_cost

    assert bucket_savings([16, 64, 128], [16, 24, 16], 32) == {16: 0.0, 64: score_cost(64, 24, 32).saving,
                                                               128: score_cost(128, 16, 32).saving}
    assert bucket_savings([64], 24, 32)[64] == pytest.approx(1 - (24 * 32 + 40 * 24) / (64 * 32))  # 15.6 %

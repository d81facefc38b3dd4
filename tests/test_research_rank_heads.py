"""Tests for research.rank_model / rank_heads (seed 004 analysis)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from research.exp_rank_heads import construction_check, verdicts
from research.rank_heads import TrainConfig, divisors, lr_lambda, run_sweep, train
from research.rank_model import (
    FullRankHead,
    RankHeadsModel,
    WideAttention,
    nn_target,
    sample_sphere,
    token_sq_error,
)


# These small problems run fastest on one thread (conftest.one_torch_thread restores the setting afterwards).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@settings(max_examples=20, deadline=None)
@given(d=st.integers(2, 12), n=st.integers(2, 20), seed=st.integers(0, 10_000),
       target=st.sampled_from(["farthest", "nearest"]))
def test_full_rank_hardmax_head_is_exact(d, n, seed, target):
    x = sample_sphere(8, n, d, torch.Generator().manual_seed(seed))
    out = FullRankHead.construct(d, target)(x)
    assert torch.equal(out, nn_target(x, target))


def test_targets_match_brute_force():
    x = sample_sphere(3, 7, 5, torch.Generator().manual_seed(0))
    far, near = nn_target(x, "farthest"), nn_target(x, "nearest")
    for b in range(3):
        for i in range(7):
            dist = [float((x[b, i] - x[b, j]).norm()) for j in range(7)]
            assert torch.equal(far[b, i], x[b, max(range(7), key=lambda j: dist[j])])
            others = [j for j in range(7) if j != i]
            assert torch.equal(near[b, i], x[b, min(others, key=lambda j: dist[j])])


def test_softmax_head_approaches_hardmax():
    rows = construction_check(8, n_values=(16,), betas=(1, 100), batch=256)
    for row in rows:
        assert row["hardmax"] == 0.0
        assert row["softmax beta=100"] < row["softmax beta=1"]


@pytest.mark.parametrize("r", [1, 2, 8])
def test_wide_attention_matches_torch_mha_for_w1(r):
    torch.manual_seed(0)
    wa = WideAttention(8, r, 1)
    mha = torch.nn.MultiheadAttention(8, 8 // r, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.copy_(wa.in_proj[0])
        mha.in_proj_bias.copy_(wa.in_bias[0] + 0.1)
        wa.in_bias.add_(0.1)
        mha.out_proj.weight.copy_(wa.out_proj[0])
        mha.out_proj.bias.copy_(wa.out_bias[0])
    x = sample_sphere(4, 6, 8)
    torch.testing.assert_close(wa(x), mha(x, x, x, need_weights=False)[0])


def test_width_averages_modules_and_head_count():
    torch.manual_seed(0)
    wide = WideAttention(8, 4, 3)
    x = sample_sphere(2, 5, 8)
    parts = []
    for m in range(3):
        single = WideAttention(8, 4, 1)
        with torch.no_grad():
            for name in ("in_proj", "in_bias", "out_proj", "out_bias"):
                getattr(single, name).copy_(getattr(wide, name)[m:m + 1])
        parts.append(single(x))
    torch.testing.assert_close(wide(x), torch.stack(parts).mean(0))
    assert RankHeadsModel(16, 2, layers=2, w=4).heads == 4 * 8


def test_model_output_shape_and_loss():
    model = RankHeadsModel(8, 2, layers=2, w=2, ffn=16)
    x = sample_sphere(3, 5, 8)
    assert model(x).shape == (3, 5, 8)
    assert token_sq_error(x, x).item() == 0.0


def test_token_sq_error_is_mean_over_tokens_of_squared_distance():
    # 2 sequences x 2 tokens x 3 dims; squared distances per token by hand: 1+4+4 = 9, 0, 9+0+16 = 25, 1+1+1 = 3
    pred = torch.tensor([[[1.0, 2.0, 2.0], [5.0, 5.0, 5.0]], [[3.0, 0.0, 4.0], [1.0, 1.0, 1.0]]])
    target = torch.tensor([[[0.0, 0.0, 0.0], [5.0, 5.0, 5.0]], [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
    assert token_sq_error(pred, target).item() == pytest.approx((9 + 0 + 25 + 3) / 4)
    assert token_sq_error(target, pred).item() == pytest.approx((9 + 0 + 25 + 3) / 4)
    # = d x the elementwise MSE (the paper's metric)
    assert token_sq_error(pred, target).item() == pytest.approx(3 * torch.nn.functional.mse_loss(pred, target).item())


def test_lr_schedule_warmup_then_cosine():
    assert lr_lambda(0, 100, 5) == pytest.approx(0.2)
    assert lr_lambda(4, 100, 5) == pytest.approx(1.0)
    assert lr_lambda(5, 100, 5) == pytest.approx(1.0)
    assert lr_lambda(100, 100, 5) == pytest.approx(0.0, abs=1e-12)


def test_train_reproducible_and_learns():
    cfg = TrainConfig(d=4, n_points=4, r=4, steps=60, steps_per_epoch=20, batch=32, eval_batch=64)
    a, b = train(cfg), train(cfg)
    assert a.epoch_losses == b.epoch_losses and a.final_eval_loss == b.final_eval_loss
    assert a.epoch_losses[-1] < a.epoch_losses[0]


def test_sweep_tiny_scale():
    base = TrainConfig(d=4, n_points=4, steps=12, steps_per_epoch=4, batch=8, eval_batch=16, ffn=8)
    rows = run_sweep(base, layers=(1, 2), widths=(1, 2), seeds=(0, 1), progress=False)
    assert len(rows) == 2 * 2 * len(divisors(4))
    assert {(r["layers"], r["w"], r["r"]) for r in rows} == {
        (n, w, r) for n in (1, 2) for w in (1, 2) for r in (1, 2, 4)}
    assert all(r["seeds"] == 2 and r["heads"] == r["w"] * 4 // r["r"] for r in rows)
    assert len(verdicts(rows)) == 4 + 2  # per (layers, w), plus full w=1 vs lower rank at w=2


@pytest.mark.parametrize("kwargs,field", [
    ({"d": 16, "r": 3}, "r="),
    ({"d": 16, "r": 16, "target": "middle"}, "target="),
    ({"d": 16, "r": 16, "lr": -1.0}, "lr="),
    ({"d": 16, "r": 16, "n_points": 1}, "n_points="),
])
def test_bad_config_raises_value_error(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**kwargs).validate()


def test_bad_model_arguments_raise_value_error():
    with pytest.raises(ValueError, match="w="):
        WideAttention(8, 2, 0)
    with pytest.raises(ValueError, match="ranks="):
        run_sweep(TrainConfig(d=4, r=4), ranks=[], progress=False)
    with pytest.raises(ValueError, match="target="):
        nn_target(sample_sphere(1, 3, 2), "middle")


def test_qk_angle_of_a_negative_identity_head_is_180():
    from research.rank_heads import qk_angle_deg

    model = RankHeadsModel(4, 4)
    with torch.no_grad():
        model.blocks[0].attn.in_proj.zero_()
        model.blocks[0].attn.in_proj[0, :4] = torch.eye(4)  # W_Q
        model.blocks[0].attn.in_proj[0, 4:8] = -3 * torch.eye(4)  # W_K
    assert qk_angle_deg(model) == pytest.approx(180.0)


@pytest.mark.slow
def test_cli_tiny_run_writes_summary(tmp_path):
    from research.cli import main

    out = tmp_path / "related"
    assert main(["all", "--out", str(out), "--setups", "1,1,1,0.1,64", "--L-grid", "32,64",
                 "--no-ablations", "--d", "4", "--n-points", "4", "--steps", "6", "--batch", "8",
                 "--layers", "1", "--widths-by-depth", "1:1"]) == 0
    text = (out / "summary.md").read_text()
    assert "python -m research all" in text and "Verdict" in text
    for name in ("expressivity_dmin.png", "expressivity_heatmap.png", "rank_heads_mse.png", "rank_heads.csv"):
        assert (out / name).stat().st_size > 0
    assert main(["rank-heads", "--out", str(out), "--d", "4", "--ranks", "3"]) == 2

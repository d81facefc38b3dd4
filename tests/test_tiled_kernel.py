"""The tiled kernel (blocks of rows sharing P and R) against the reference kernel, in float64, and its pieces."""

import json

import pytest
import torch
from torch import nn

import hf_partial_attention.tiled_kernel as tiled
from hf_partial_attention.auto_rule import auto_implementation, load_rule
from hf_partial_attention.partial_attention import PatternLayout, partial_attention_forward, resolve_implementation
from hf_partial_attention.tiled_kernel import shared_rows

DT = torch.float64


def shared_pattern(n, k, rows, seed=0):
    """P and R shared by every block of ``rows`` consecutive rows (random keys and values per block)."""
    g = torch.Generator().manual_seed(seed)
    nb = n // rows
    p = torch.stack([torch.randperm(n, generator=g)[:k].sort().values for _ in range(nb)])  # (nb, k)
    r = torch.randn(nb, n - k, k, generator=g, dtype=DT)
    return p.repeat_interleave(rows, 0), r.repeat_interleave(rows, 0)


def test_shared_rows_finds_the_largest_shared_block():
    p, r = shared_pattern(12, 3, 4)
    assert shared_rows(p, r) == 4
    p2, r2 = shared_pattern(12, 3, 12)
    assert shared_rows(p2, r2) == 12
    r_half = r.clone()
    r_half[2:4] += 1.0  # rows 2-3 get their own R: blocks of 2 still share
    assert shared_rows(p, r_half) == 2
    r_odd = r.clone()
    r_odd[1, 0, 0] += 1e-9  # a single row differs: nothing is shared
    assert shared_rows(p, r_odd) == 1
    p_odd = p.clone()
    p_odd[4:8] = p[0]  # P of block 1 = P of block 0 while R differs: still blocks of 4
    assert shared_rows(p_odd, r) == 4


def test_shared_rows_notices_an_in_place_change():
    p, r = shared_pattern(8, 2, 4)
    assert shared_rows(p, r) == 4
    r[5].add_(1.0)  # version counter moves: the cached answer is not reused
    assert shared_rows(p, r) == 1


def _inputs(t, seed=1, grad=True, heads=2):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(3, heads, t, 4, generator=g, dtype=DT).requires_grad_(grad) for _ in range(3))
    return q, k, v


def _run(impl, q, k, v, mask, p, r, bias, need_weights=True):
    return partial_attention_forward(nn.Module().eval(), q, k, v, mask, layout=PatternLayout.from_indices(p),
                                     reconstruction=r, bias=bias, scaling=0.4, implementation=impl,
                                     need_weights=need_weights)


@pytest.mark.parametrize("rows", [8, 4, 1])
@pytest.mark.parametrize("t", [8, 5])
@pytest.mark.parametrize("mask_kind", [None, "bool", "additive"])
@pytest.mark.parametrize("tile", [1 << 19, 24])  # one tile; many tiles (batch and head splits)
def test_tiled_matches_the_reference_in_float64(rows, t, mask_kind, tile, monkeypatch, attention_mask):
    monkeypatch.setattr(tiled, "TILE_ELEMENTS", tile)
    p, r = shared_pattern(8, 3, rows, seed=rows)
    r.requires_grad_(True)
    bias = torch.randn(8, 5, generator=torch.Generator().manual_seed(3), dtype=DT, requires_grad=True)
    q, k, v = _inputs(t)
    mask = attention_mask(mask_kind, t)
    results = []
    for impl in ("gather", "tiled"):
        out, probs = _run(impl, q, k, v, mask, p, r, bias)
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel(), dtype=DT).view_as(out)).sum()
                                    + (probs * probs).sum(), [q, k, v, r, bias])
        results.append((out, probs, *grads))
    names = ["out", "probs", "dq", "dk", "dv", "dR", "dbias"]
    for name, a, b in zip(names, *results):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("rows", [4, 1])
@pytest.mark.parametrize("t", [8, 6, 5])
@pytest.mark.parametrize("mask_kind", [None, "bool", "additive", "per_head"])
def test_tiled_without_autograd_and_without_weights(rows, t, mask_kind, monkeypatch, attention_mask):
    """The no-autograd path (tiles written into one output; without the map, each tile reconstructed, masked and
    normalised in one reused buffer) gives the reference output, with the map and without. TILE_ELEMENTS = 40:
    groups of (batch, head) pairs smaller at the edges; t = 5 leaves a last block of one row."""
    monkeypatch.setattr(tiled, "TILE_ELEMENTS", 40)
    p, r = shared_pattern(8, 2, rows)
    bias = torch.randn(8, 6, generator=torch.Generator().manual_seed(4), dtype=DT)
    q, k, v = _inputs(t, grad=False, heads=5)
    mask = attention_mask(mask_kind, t, heads=5)
    with torch.no_grad():
        ref, ref_probs = _run("gather", q, k, v, mask, p, r, bias)
        out, probs = _run("tiled", q, k, v, mask, p, r, bias)
        out_nw, none = _run("tiled", q, k, v, mask, p, r, bias, need_weights=False)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out_nw, ref, rtol=1e-10, atol=1e-12)
    assert none is None


def test_tiled_without_autograd_applies_dropout_with_and_without_the_map(monkeypatch):
    """Dropout in training mode without autograd: the reused-buffer path (no map) draws the same masks, tile by
    tile, as the path that keeps each tile's probabilities for the map, and dropout does change the output."""
    monkeypatch.setattr(tiled, "TILE_ELEMENTS", 40)
    p, r = shared_pattern(8, 2, 4)
    q, k, v = _inputs(8, grad=False, heads=5)
    module = nn.Module().train()

    def run(need_weights, dropout):
        torch.manual_seed(0)
        return partial_attention_forward(module, q, k, v, None, layout=PatternLayout.from_indices(p),
                                         reconstruction=r, scaling=0.4, dropout=dropout, implementation="tiled",
                                         need_weights=need_weights)[0]

    with torch.no_grad():
        with_map, without_map, no_dropout = run(True, 0.5), run(False, 0.5), run(False, 0.0)
    torch.testing.assert_close(without_map, with_map, rtol=0, atol=0)
    assert not torch.allclose(without_map, no_dropout)


def test_tiled_gradient_of_r_is_each_rows_own():
    """Rows of a block share R's values, yet each row's gradient is its own (not the block's sum), as in the
    reference: a loss on the output of one query row moves only that row's R."""
    p, r = shared_pattern(8, 2, 4)
    r.requires_grad_(True)
    q, k, v = _inputs(8)
    out, _ = _run("tiled", q, k, v, None, p, r, None)
    (grad,) = torch.autograd.grad(out[:, 5].sum(), [r])  # query row 5 only
    assert grad[5].abs().sum() > 0
    assert torch.count_nonzero(grad[torch.arange(8) != 5]) == 0


def test_tiled_in_the_model_matches_gather():
    from hf_partial_attention import AttentionPattern, PartialBertConfig, PartialBertModel
    from hf_partial_attention.modeling_partial_bert import initial_pattern

    p, r = shared_pattern(16, 4, 8)
    config = PartialBertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=37, partial_seq_len=16, partial_k=4, partial_implementation="tiled")
    torch.manual_seed(0)
    with initial_pattern(AttentionPattern(p, r.float())):
        model = PartialBertModel(config).eval()
    ids = torch.randint(1, 99, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 11:] = 0
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
        model.set_partial_implementation("gather")
        ref = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.attentions[0], ref.attentions[0], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the auto rule
RULE = {"machine": "test", "shared_min_rows": 4, "cells": [
    {"structure": "shared", "n": 128, "k_over_d": 0.25, "mode": "inference", "kernel": "tiled"},
    {"structure": "shared", "n": 128, "k_over_d": 0.25, "mode": "training", "kernel": "fused"},
    {"structure": "per_query", "n": 128, "k_over_d": 0.25, "mode": "inference", "kernel": "fused"},
    {"structure": "per_query", "n": 512, "k_over_d": 1.0, "mode": "inference", "kernel": "dense"},
    {"structure": "keys_shared", "n": 128, "k_over_d": 0.5, "mode": "inference", "kernel": "dense"}]}


def test_auto_takes_the_nearest_cell_of_the_same_structure_and_mode():
    assert auto_implementation(128, 16, 64, 4, 4, "inference", RULE) == "tiled"
    assert auto_implementation(128, 16, 64, 4, 4, "training", RULE) == "fused"
    assert auto_implementation(128, 16, 64, 4, 2, "inference", RULE) == "dense"  # 2 < shared_min_rows: keys_shared
    assert auto_implementation(128, 16, 64, None, 1, "inference", RULE) == "fused"
    assert auto_implementation(512, 56, 64, None, 1, "inference", RULE) == "dense"  # nearer (512, 1.0)
    assert auto_implementation(128, 16, 64, None, 1, "training", RULE) == "fused"  # no training cell: inference's


def test_auto_rule_from_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "rule.json"
    path.write_text(json.dumps({**RULE, "cells": [{**c, "kernel": "gather"} for c in RULE["cells"]]}))
    monkeypatch.setenv("HF_PARTIAL_ATTENTION_AUTO_RULE", str(path))
    p, r = shared_pattern(8, 2, 4)
    assert resolve_implementation("auto", PatternLayout.from_indices(p), 8, r) == "gather"
    assert load_rule()["machine"] == "test"
    (tmp_path / "bad.json").write_text(json.dumps({"cells": [{"structure": "diagonal", "mode": "inference"}]}))
    monkeypatch.setenv("HF_PARTIAL_ATTENTION_AUTO_RULE", str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="structure"):
        load_rule()
    monkeypatch.delenv("HF_PARTIAL_ATTENTION_AUTO_RULE")
    assert load_rule()["cells"]  # back to the committed table


# ---------------------------------------------------------------- fused, in groups of (batch, head) pairs
@pytest.mark.parametrize("t", [8, 5])
@pytest.mark.parametrize("mask_kind", [None, "bool", "additive", "per_head"])
@pytest.mark.parametrize("family", ["per_query", "columns"])
def test_fused_in_groups_matches_the_reference(t, mask_kind, family, monkeypatch, attention_mask):
    """Without autograd and without the attention map, fused runs groups of (batch, head) pairs (here groups of
    two pairs: TILE_ELEMENTS = 1, 3 batches × 5 heads) into one output; the numbers are the reference kernel's."""
    monkeypatch.setattr(tiled, "TILE_ELEMENTS", 1)
    g = torch.Generator().manual_seed(5)
    if family == "columns":
        p = torch.tensor([1, 4, 6]).expand(8, 3).clone()
    else:
        p = torch.stack([torch.randperm(8, generator=g)[:3].sort().values for _ in range(8)])
    r = torch.randn(8, 5, 3, generator=g, dtype=DT)
    bias = torch.randn(8, 5, generator=g, dtype=DT)
    q, k, v = _inputs(t, grad=False, heads=5)
    mask = attention_mask(mask_kind, t, heads=5)  # per_head: a mask that differs per head, (B, H, T, T)
    with torch.no_grad():
        ref, _ = _run("gather", q, k, v, mask, p, r, bias)
        out, none = _run("fused", q, k, v, mask, p, r, bias, need_weights=False)
        whole, probs = _run("fused", q, k, v, mask, p, r, bias)  # the map asked for: one group, map returned
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(whole, ref, rtol=1e-10, atol=1e-12)
    assert none is None and probs is not None


# ---------------------------------------------------------------- training a shared R tied
def _shared_model(tie, reconstruction="common"):
    from hf_partial_attention import AttentionPattern, PartialBertConfig, PartialBertModel
    from hf_partial_attention.modeling_partial_bert import initial_pattern

    p, r = shared_pattern(16, 4, 8, seed=3)
    config = PartialBertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                               intermediate_size=37, partial_seq_len=16, partial_k=4, reconstruction=reconstruction,
                               partial_tie_shared_rows=tie, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    with initial_pattern(AttentionPattern(p, r.float())):
        return PartialBertModel(config)


def _loss(model):
    ids = torch.randint(1, 99, (2, 16), generator=torch.Generator().manual_seed(1))
    return model(input_ids=ids).last_hidden_state.pow(2).mean()


@pytest.mark.parametrize("reconstruction", ["common", "per_layer"])
def test_tied_rows_get_the_block_sum_and_stay_shared(reconstruction):
    tied, free = _shared_model(True, reconstruction), _shared_model(False, reconstruction)
    free.load_state_dict(tied.state_dict())
    _loss(tied).backward()
    _loss(free).backward()
    for (name, t), f in zip(tied.reconstruction_tensors().items(), free.reconstruction_tensors().values()):
        block_sum = f.grad.view(2, 8, *f.grad.shape[1:]).sum(1, keepdim=True).expand(2, 8, *f.grad.shape[1:])
        torch.testing.assert_close(t.grad, block_sum.reshape(f.grad.shape), msg=name)
    for model, want in ((tied, 8), (free, 1)):  # three AdamW steps: tied rows stay equal, free rows drift
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            _loss(model).backward()
            opt.step()
        p = model.encoder.partial_pattern.indices
        assert {shared_rows(p, r) for r in model.reconstruction_tensors().values()} == {want}


@pytest.mark.parametrize("impl", ["tiled", "fused"])
def test_only_the_bias_trains(impl):
    """q, k, v and R frozen, the bias trainable: the kernels take their autograd path (not the in-place one)."""
    p, r = shared_pattern(8, 2, 4)
    bias = torch.randn(8, 6, generator=torch.Generator().manual_seed(2), dtype=DT, requires_grad=True)
    q, k, v = _inputs(8, grad=False)
    grads = [torch.autograd.grad(_run(name, q, k, v, None, p, r, bias, need_weights=False)[0].pow(2).sum(), [bias])[0]
             for name in ("gather", impl)]
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-10, atol=1e-12)

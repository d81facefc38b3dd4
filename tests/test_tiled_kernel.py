"""The tiled kernel (blocks of rows sharing P and R, inference) against the reference kernel, in float64, and its
pieces; the fused kernel in groups of (batch, head) pairs; training a shared R tied."""

import pytest
import torch
from torch import nn

import hf_partial_attention.attention_common as common
from hf_partial_attention.attention_common import DerivedState, PatternLayout, shared_rows
from hf_partial_attention.attention_dispatch import partial_attention_forward

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


def test_derived_shared_rows_notice_an_in_place_change():
    p, r = shared_pattern(8, 2, 4)
    state = DerivedState()
    assert state.shared_rows(p, r) == 4
    r[5].add_(1.0)  # version counter moves: the kept answer is not reused
    assert state.shared_rows(p, r) == 1


def _inputs(t, seed=1, grad=True, heads=2):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(3, heads, t, 4, generator=g, dtype=DT).requires_grad_(grad) for _ in range(3))
    return q, k, v


def _run(impl, q, k, v, mask, p, r, bias, need_weights=False):
    return partial_attention_forward(nn.Module().eval(), q, k, v, mask, layout=PatternLayout.from_indices(p, r),
                                     reconstruction=r, bias=bias, scaling=0.4, implementation=impl,
                                     need_weights=need_weights)


@pytest.mark.parametrize("rows", [8, 4, 1])
@pytest.mark.parametrize("t", [8, 6, 5])
@pytest.mark.parametrize("mask_kind", [None, "bool", "additive", "per_head"])
@pytest.mark.parametrize("tile", [1 << 19, 40])  # one tile; many (groups of pairs smaller at the edges)
def test_tiled_matches_the_reference_in_float64(rows, t, mask_kind, tile, monkeypatch, attention_mask):
    """Without autograd (tiled's only mode): tiles written into one output, each reconstructed, masked and
    normalised in one reused buffer; t = 5 leaves a last block of one row."""
    monkeypatch.setattr(common, "TILE_ELEMENTS", tile)
    import hf_partial_attention.attention_dispatch as dispatch

    calls = []
    monkeypatch.setattr(dispatch, "tiled_attention", lambda *a, f=dispatch.tiled_attention, **kw: calls.append(1)
                        or f(*a, **kw))
    p, r = shared_pattern(8, 2, rows)
    bias = torch.randn(8, 6, generator=torch.Generator().manual_seed(4), dtype=DT)
    q, k, v = _inputs(t, grad=False, heads=5)
    mask = attention_mask(mask_kind, t, heads=5)
    with torch.no_grad():
        ref, _ = _run("gather", q, k, v, mask, p, r, bias, need_weights=True)
        out, none = _run("tiled", q, k, v, mask, p, r, bias)
    assert calls, "the tiled kernel did not run"
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    assert none is None


def test_tiled_applies_dropout_in_training_mode(monkeypatch):
    """Dropout in training mode without autograd: with V the identity the output is the dropped-out map, each entry
    zero or the reference probability / (1 - p)."""
    monkeypatch.setattr(common, "TILE_ELEMENTS", 40)
    p, r = shared_pattern(8, 2, 4)
    q, k, _ = _inputs(8, grad=False, heads=5)
    eye = torch.eye(8, dtype=DT).expand(3, 5, 8, 8)  # V = I in every head
    layout = PatternLayout.from_indices(p, r)
    with torch.no_grad():
        probs = _run("gather", q, k, eye, None, p, r, None, need_weights=True)[1]  # (B, H, T, T)
        torch.manual_seed(0)
        dropped = partial_attention_forward(nn.Module().train(), q, k, eye, None, layout=layout, reconstruction=r,
                                            scaling=0.4, dropout=0.5, implementation="tiled",
                                            need_weights=False)[0].transpose(1, 2)  # (B, H, T, T)
    kept = dropped != 0
    assert 0.3 < kept.double().mean() < 0.7
    torch.testing.assert_close(dropped[kept], probs[kept] / 0.5, rtol=1e-10, atol=1e-12)


def test_tiled_under_autograd_runs_fused(monkeypatch):
    """tiled is inference only: under autograd the call runs fused, with the reference's gradients."""
    import hf_partial_attention.attention_tiled as attention_tiled

    monkeypatch.setattr(attention_tiled, "masked_exact_scores", lambda *a: pytest.fail("tiled ran under autograd"))
    p, r = shared_pattern(8, 2, 4)
    r.requires_grad_(True)
    q, k, v = _inputs(8)
    grads = [torch.autograd.grad(_run(impl, q, k, v, None, p, r, None)[0].pow(2).sum(), [q, k, v, r])
             for impl in ("gather", "tiled")]
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


def test_tiled_in_the_model_matches_gather():
    from hf_partial_attention import AttentionPattern, PartialBertConfig, PartialBertModel

    p, r = shared_pattern(16, 4, 8)
    config = PartialBertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=37, partial_seq_len=16, partial_k=4, partial_implementation="tiled")
    torch.manual_seed(0)
    model = PartialBertModel(config).eval()
    model.set_pattern(AttentionPattern(p, r.float()))
    ids = torch.randint(1, 99, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 11:] = 0
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask)
        model.set_partial_implementation("gather")
        ref = model(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- fused, in groups of (batch, head) pairs
@pytest.mark.parametrize("t", [8, 5])
@pytest.mark.parametrize("mask_kind", [None, "bool", "additive", "per_head"])
@pytest.mark.parametrize("family", ["per_query", "columns"])
def test_fused_in_groups_matches_the_reference(t, mask_kind, family, monkeypatch, attention_mask):
    """Without autograd and without the attention map, fused runs groups of (batch, head) pairs (here groups of
    two pairs: TILE_ELEMENTS = 1, 3 batches × 5 heads) into one output; the numbers are the reference kernel's."""
    monkeypatch.setattr(common, "TILE_ELEMENTS", 1)
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
        ref, _ = _run("gather", q, k, v, mask, p, r, bias, need_weights=True)
        out, none = _run("fused", q, k, v, mask, p, r, bias)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    assert none is None


# ---------------------------------------------------------------- training a shared R tied
def _shared_model(tie, reconstruction="common"):
    from hf_partial_attention import AttentionPattern, PartialBertConfig, PartialBertModel

    p, r = shared_pattern(16, 4, 8, seed=3)
    config = PartialBertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                               intermediate_size=37, partial_seq_len=16, partial_k=4, reconstruction=reconstruction,
                               partial_tie_shared_rows=tie, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = PartialBertModel(config)
    model.set_pattern(AttentionPattern(p, r.float()))
    return model


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

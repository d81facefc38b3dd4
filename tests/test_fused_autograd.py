"""The fused kernel's hand-written backward (per-query patterns with autograd) against the reference, in float64."""

import pytest
import torch
from torch import nn

import hf_partial_attention.attention_fused as fused_autograd
from hf_partial_attention.attention_common import PatternLayout
from hf_partial_attention.attention_dispatch import partial_attention_forward

DT = torch.float64
N, K = 8, 3


def _pattern(seed=0, family="per_query"):
    """P (every row its own keys, or blocks of 4 rows sharing theirs), R of each row, bias."""
    g = torch.Generator().manual_seed(seed)
    rows = 1 if family == "per_query" else 4
    p = torch.stack([torch.randperm(N, generator=g)[:K].sort().values for _ in range(N // rows)])
    p = p.repeat_interleave(rows, 0)  # (N, K)
    r = torch.randn(N, N - K, K, generator=g, dtype=DT)
    bias = torch.randn(N, N - K, generator=g, dtype=DT)
    return p, r, bias


def _inputs(t, heads=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    # (B, T, H, D) leaves seen as (B, H, T, D), as a model's projections reach the attention function
    return [torch.randn(3, t, heads, 4, generator=g, dtype=DT).requires_grad_() for _ in range(3)]


def _run(impl, leaves, mask, p, r, bias, module=None, dropout=0.0):
    q, k, v = (x.transpose(1, 2) for x in leaves)
    module = nn.Module().eval() if module is None else module
    return partial_attention_forward(module, q, k, v, mask, layout=PatternLayout.from_indices(p), reconstruction=r,
                                     bias=bias, scaling=0.4, dropout=dropout, implementation=impl,
                                     need_weights=False)[0]


@pytest.mark.parametrize("family", ["per_query", "blocks"])
@pytest.mark.parametrize("t", [8, 5])
@pytest.mark.parametrize("mask_kind", [None, "bool", "additive", "per_head"])
def test_matches_the_reference_in_values_and_gradients(family, t, mask_kind, monkeypatch, attention_mask):
    calls = []
    function = fused_autograd._ScoresFused if family == "per_query" else fused_autograd._RowsFused
    monkeypatch.setattr(function, "apply", lambda *a, f=function.apply: calls.append(1) or f(*a))
    p, r, bias = _pattern(family=family)
    r.requires_grad_(True)
    bias.requires_grad_(True)
    leaves = _inputs(t)
    mask = attention_mask(mask_kind, t, heads=2)
    results = []
    for impl in ("gather", "fused"):
        out = _run(impl, leaves, mask, p, r, bias)
        weight = torch.linspace(-1, 1, out.numel(), dtype=DT).view_as(out)
        results.append((out, *torch.autograd.grad((out * weight).sum(), [*leaves, r, bias])))
    assert calls == [1]  # fused took the hand-written path
    for name, a, b in zip(["out", "dq", "dk", "dv", "dR", "dbias"], *results):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("family", ["per_query", "blocks"])
@pytest.mark.parametrize("trained", ["q", "v", "r", "bias"])
def test_only_some_inputs_train(trained, family, attention_mask):
    """Frozen inputs get no gradient computed; the trained one gets the reference's (R frozen: W from the cache)."""
    p, r, bias = _pattern(2, family)
    leaves = [x.detach().requires_grad_(trained == name) for x, name in zip(_inputs(6), "qkv")]
    r.requires_grad_(trained == "r")
    bias.requires_grad_(trained == "bias")
    target = {"q": leaves[0], "v": leaves[2], "r": r, "bias": bias}[trained]
    grads = [torch.autograd.grad(_run(impl, leaves, attention_mask("bool", 6), p, r, bias).pow(2).sum(), [target])[0]
             for impl in ("gather", "fused")]
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("family", ["per_query", "blocks"])
def test_gradcheck(family, attention_mask):
    p, r, bias = _pattern(3, family)
    leaves = _inputs(6, heads=1)
    mask = attention_mask("additive", 6)

    def f(q, k, v, r, bias):
        return _run("fused", [q, k, v], mask, p, r, bias)

    assert torch.autograd.gradcheck(f, (*leaves, r.requires_grad_(), bias.requires_grad_()))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["per_query", "blocks"])
def test_dropout_scales_kept_probabilities_and_its_gradient_checks(family):
    """With V the identity, the output is the dropped-out attention map: each entry is either zero or the
    reference probability / (1 - p); the backward is checked numerically with the same dropout draws."""
    p, r, _ = _pattern(4, family)
    module = nn.Module().train()
    t = N
    eye = torch.eye(t, dtype=DT).expand(3, 2, t, t).transpose(1, 2)  # (B, T, H, T): V = I in every head
    q, k = _inputs(t)[:2]
    v = eye.clone().requires_grad_()
    probs = _run("gather", [q, k, eye], None, p, r, None).transpose(1, 2)  # (B, H, T, T) without dropout
    torch.manual_seed(0)
    dropped = _run("fused", [q, k, v], None, p, r, None, module=module, dropout=0.5).transpose(1, 2)
    kept = dropped != 0
    assert 0.3 < kept.double().mean() < 0.7
    torch.testing.assert_close(dropped[kept], probs[kept] / 0.5, rtol=1e-10, atol=1e-12)

    with torch.no_grad():  # without autograd (the in-place path) dropout drops too, and keeps the kept ones exact
        torch.manual_seed(1)
        in_place = _run("fused", [q, k, eye], None, p, r, None, module=module, dropout=0.5).transpose(1, 2)
    kept = in_place != 0
    assert 0.3 < kept.double().mean() < 0.7
    torch.testing.assert_close(in_place[kept], probs[kept] / 0.5, rtol=1e-10, atol=1e-12)

    def f(q, k, v, r):
        torch.manual_seed(0)  # the same dropout draws at every evaluation
        return _run("fused", [q, k, v], None, p, r, None, module=module, dropout=0.5)

    assert torch.autograd.gradcheck(f, (q, k, v, r.requires_grad_()))


def test_weights_asked_for_run_the_reference(monkeypatch):
    """Asked for the map, a fused call runs the reference kernel (the one that writes the map)."""
    for function in (fused_autograd._ScoresFused, fused_autograd._RowsFused):
        monkeypatch.setattr(function, "apply", lambda *a: pytest.fail("hand-written path taken"))
    for family in ("per_query", "blocks"):
        p, r, _ = _pattern(family=family)
        q, k, v = (x.transpose(1, 2) for x in _inputs(8))
        args = (nn.Module().eval(), q, k, v, None)
        kw = dict(layout=PatternLayout.from_indices(p), reconstruction=r, scaling=0.4)
        out, probs = partial_attention_forward(*args, **kw, implementation="fused", need_weights=True)
        ref, ref_probs = partial_attention_forward(*args, **kw, implementation="gather")
        assert torch.equal(out, ref) and torch.equal(probs, ref_probs)


@pytest.mark.parametrize("family", ["per_query", "blocks"])
def test_bfloat16_inputs_with_a_float32_r(family, attention_mask):
    """A bfloat16 model's q, k, v with R and the bias kept in float32 (as after `model.to(torch.bfloat16)` with a
    float32 pattern, or under autocast): gradients come back in each input's dtype, close to float32 ones."""
    p, r, bias = _pattern(5, family)
    r, bias = r.float().requires_grad_(), bias.float().requires_grad_()
    leaves = [x.detach().float().requires_grad_() for x in _inputs(8)]
    low = [x.detach().bfloat16().requires_grad_() for x in leaves]
    results = []
    for inputs in (leaves, low):
        out = _run("fused", inputs, attention_mask("bool", 8), p, r, bias)
        results.append((out, *torch.autograd.grad(out.float().pow(2).sum(), [*inputs, r, bias])))
    assert [g.dtype for g in results[1][1:]] == [torch.bfloat16] * 3 + [torch.float32] * 2
    for name, want, got in zip(["out", "dq", "dk", "dv", "dR", "dbias"], *results):
        torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05, msg=lambda m, name=name: f"{name}: {m}")

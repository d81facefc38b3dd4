"""The all-heads kernel of P and R per head under autograd (`attention_fused.all_heads_attention`, its hand-written
backward) against the reference kernel run head by head on each head's own P, R and bias, in float64."""

import pytest
import torch
from torch import nn

import hf_partial_attention.attention_fused as heads_kernel
from hf_partial_attention.attention_common import DerivedState, PartialTensors, PatternLayout
from hf_partial_attention.attention_dispatch import partial_attention_forward

DT = torch.float64
N, K, H = 8, 3, 3


def _heads(seed=0, family="per_query", bias=True, derived=False):
    """Each head's P (every row its own keys, or blocks of 4 rows sharing theirs), R and bias, all different."""
    g = torch.Generator().manual_seed(seed)
    rows = 1 if family == "per_query" else 4
    out = []
    for _ in range(H):
        p = torch.stack([torch.randperm(N, generator=g)[:K].sort().values for _ in range(N // rows)])
        p = p.repeat_interleave(rows, 0)  # (N, K)
        r = torch.randn(N, N - K, K, generator=g, dtype=DT)
        b = torch.randn(N, N - K, generator=g, dtype=DT) if bias else None
        out.append((p, r, b))
    return out, ([DerivedState() for _ in range(H)] if derived else [None] * H)


def _tensors(heads, states):
    return [PartialTensors(PatternLayout.from_indices(p), r, b, s) for (p, r, b), s in zip(heads, states)]


def _inputs(t, seed=1):
    g = torch.Generator().manual_seed(seed)
    # (B, T, H, D) leaves seen as (B, H, T, D), as a model's projections reach the attention function
    return [torch.randn(3, t, H, 4, generator=g, dtype=DT).requires_grad_() for _ in range(3)]


def _all_heads(leaves, mask, heads, states=None, module=None, dropout=0.0):
    q, k, v = (x.transpose(1, 2) for x in leaves)
    module = nn.Module().eval() if module is None else module
    states = [None] * H if states is None else states
    return heads_kernel.all_heads_attention(module, q, k, v, mask, 0.4, dropout, _tensors(heads, states))[0]


def _reference(leaves, mask, heads):
    """Head by head through the reference kernel: ``(B, T, H, D)``."""
    q, k, v = (x.transpose(1, 2) for x in leaves)
    outs = []
    for h, (p, r, b) in enumerate(heads):
        m = mask if mask is None or mask.shape[1] == 1 else mask[:, h:h + 1]  # (B|1, 1, T, T)
        outs.append(partial_attention_forward(nn.Module().eval(), q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1], m,
                                              layout=PatternLayout.from_indices(p), reconstruction=r, bias=b,
                                              scaling=0.4, implementation="gather", need_weights=False)[0])
    return torch.cat(outs, dim=2)


@pytest.mark.parametrize("family", ["per_query", "blocks"])
@pytest.mark.parametrize("t", [8, 5])
@pytest.mark.parametrize("mask_kind", [None, "bool", "additive", "per_head"])
def test_matches_the_reference_head_by_head(family, t, mask_kind, monkeypatch, attention_mask):
    calls = []
    monkeypatch.setattr(heads_kernel._ScoresFused, "apply",
                        lambda *a, f=heads_kernel._ScoresFused.apply: calls.append(1) or f(*a))
    heads, _ = _heads(family=family)
    for _, r, b in heads:
        r.requires_grad_(True)
        b.requires_grad_(True)
    trained = [x for _, r, b in heads for x in (r, b)]
    leaves = _inputs(t)
    mask = attention_mask(mask_kind, t, heads=H)
    results = []
    for run in (_reference, _all_heads):
        out = run(leaves, mask, heads)
        weight = torch.linspace(-1, 1, out.numel(), dtype=DT).view_as(out)
        results.append((out, *torch.autograd.grad((out * weight).sum(), [*leaves, *trained])))
    assert calls == [1]  # the hand-written path ran
    names = ["out", "dq", "dk", "dv"] + [f"d{x}{h}" for h in range(H) for x in ("R", "bias")]
    for name, a, b in zip(names, *results):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
    with torch.no_grad():  # without autograd: the same numbers
        torch.testing.assert_close(_all_heads(leaves, mask, heads), results[0][0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("trained", ["q", "k", "v", "r", "bias"])
def test_only_some_inputs_train(trained, attention_mask):
    """Frozen inputs get no gradient computed; the trained one gets the reference's (R frozen: W from the cache)."""
    heads, states = _heads(2, derived=True)
    leaves = [x.detach().requires_grad_(trained == name) for x, name in zip(_inputs(6), "qkv")]
    for _, r, b in heads:
        r.requires_grad_(trained == "r")
        b.requires_grad_(trained == "bias")
    target = {"q": [leaves[0]], "k": [leaves[1]], "v": [leaves[2]], "r": [r for _, r, _ in heads],
              "bias": [b for _, _, b in heads]}[trained]
    mask = attention_mask("bool", 6)
    ref = torch.autograd.grad(_reference(leaves, mask, heads).pow(2).sum(), target)
    got = torch.autograd.grad(_all_heads(leaves, mask, heads, states).pow(2).sum(), target)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_gradcheck(attention_mask):
    heads, _ = _heads(3)
    leaves = _inputs(6)
    mask = attention_mask("additive", 6)
    rs = [r.requires_grad_() for _, r, _ in heads]

    def f(q, k, v, *rs):
        return _all_heads([q, k, v], mask, [(p, r, b) for (p, _, b), r in zip(heads, rs)])

    assert torch.autograd.gradcheck(f, (*leaves, *rs))


@pytest.mark.slow
def test_dropout_drops_and_its_gradient_checks():
    """With V the identity, the output is the dropped-out attention map: each entry is zero or the reference
    probability / (1 - p); the backward is checked numerically with the same dropout draws."""
    heads, _ = _heads(4, bias=False)
    module = nn.Module().train()
    eye = torch.eye(N, dtype=DT).expand(3, H, N, N).transpose(1, 2)  # (B, T, H, T): V = I in every head
    q, k = _inputs(N)[:2]
    probs = _reference([q, k, eye], None, heads).transpose(1, 2)  # (B, H, T, T) without dropout
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            torch.manual_seed(0)
            dropped = _all_heads([q, k, eye.clone().requires_grad_(grad)], None, heads, module=module,
                                 dropout=0.5).transpose(1, 2)
        kept = dropped != 0
        assert 0.3 < kept.double().mean() < 0.7
        torch.testing.assert_close(dropped[kept], probs[kept] / 0.5, rtol=1e-10, atol=1e-12)

    def f(q, k, v):
        torch.manual_seed(0)
        return _all_heads([q, k, v], None, heads, module=module, dropout=0.5)

    assert torch.autograd.gradcheck(f, (q, k, eye.clone().requires_grad_()))


def test_frozen_w_comes_from_each_heads_cache(monkeypatch, attention_mask):
    """Where R is frozen, each head's W is built once (its owner's derived state) and again only for the head whose R
    changed in place; the numbers stay the reference's."""
    import hf_partial_attention.attention_common as common

    heads, states = _heads(5, derived=True)
    leaves = [x.detach().requires_grad_() for x in _inputs(7)]
    mask = attention_mask("per_head", 7, heads=H)
    built = []
    monkeypatch.setattr(common, "reconstruction_matrix", lambda *a, f=common.reconstruction_matrix:
                        built.append(1) or f(*a))
    first = _all_heads(leaves, mask, heads, states)
    torch.testing.assert_close(first, _reference(leaves, mask, heads), rtol=1e-10, atol=1e-12)
    built.clear()
    _all_heads(leaves, mask, heads, states)
    assert built == []  # every W from its head's cache
    heads[1][1].mul_(2.0)  # one head's R edited in place
    again = _all_heads(leaves, mask, heads, states)
    assert len(built) == 1
    torch.testing.assert_close(again, _reference(leaves, mask, heads), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("t", [8, 5])
@pytest.mark.parametrize("mask_kind", [None, "bool", "per_head"])
@pytest.mark.parametrize("with_extra", [False, True])
def test_without_autograd_every_head_in_one_pass(t, mask_kind, with_extra, monkeypatch, attention_mask):
    """Without autograd, per-query P per head runs every head in one pass (`attention_heads`), in groups of heads
    (two here), with the reference's numbers head by head: each head's P, R, bias and mask, and
    the score's other terms at P (DeBERTa-v2's) added before R."""
    from hf_partial_attention import attention_heads
    from hf_partial_attention.attention_gather import gather_attention

    calls = []
    monkeypatch.setattr(attention_heads, "_group", lambda *a, f=attention_heads._group: calls.append(1) or f(*a))
    # a group of 3 sequences (8·k is more than B) and 2 heads: H = 3 heads in two groups
    monkeypatch.setattr(attention_heads, "TILE_ELEMENTS", 2 * 3 * t * t)
    heads, states = _heads(6, derived=True)
    leaves = [x.detach() for x in _inputs(t)]
    mask = attention_mask(mask_kind, t, heads=H)
    extra = torch.randn(3, H, t, K, dtype=DT, generator=torch.Generator().manual_seed(9)) if with_extra else None
    q, k, v = (x.transpose(1, 2) for x in leaves)
    with torch.no_grad():
        got = heads_kernel.all_heads_attention(nn.Module().eval(), q, k, v, mask, 0.4, 0.0, _tensors(heads, states),
                                               extra)[0]
        want = torch.cat([gather_attention(
            nn.Module().eval(), q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1],
            mask if mask is None or mask.shape[1] == 1 else mask[:, h:h + 1], 0.4, 0.0,
            partial=_tensors([heads[h]], [None])[0], extra=None if extra is None else extra[:, h:h + 1])[0]
            for h in range(H)], dim=2)  # (B, T, H, D)
    assert calls == [1, 1]  # the one-pass path ran, in two groups of heads
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_blocks_and_dropout_keep_each_heads_own_kernel(monkeypatch):
    """The one-pass path takes per-query P without dropout only: blocks of rows sharing keys (scored by block GEMMs)
    and dropout in effect go elsewhere."""
    from hf_partial_attention import attention_heads

    per_query, blocks = (_tensors(_heads(family=f)[0], [None] * H) for f in ("per_query", "blocks"))
    assert attention_heads.heads_in_one_pass(per_query, 0.0)
    assert not attention_heads.heads_in_one_pass(blocks, 0.0)
    assert not attention_heads.heads_in_one_pass(per_query, 0.1)

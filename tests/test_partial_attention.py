"""The partial attention function against dense attention, in float64."""

import pytest
import torch
from torch import nn

from hf_partial_attention.partial_attention import (
    IMPLEMENTATIONS,
    PatternLayout,
    block_rows,
    exact_scores_method,
    partial_attention_forward,
)
from hf_partial_attention.reconstruction import solve_reconstruction

DT = torch.float64


class Dummy(nn.Module):
    pass


def dense(q, k, v, mask, scaling):
    s = q @ k.transpose(-1, -2) * scaling
    if mask is not None:
        s = s + mask
    p = s.softmax(-1)
    return (p @ v).transpose(1, 2), p


def random_pattern(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.sort(torch.randperm(n, generator=g)[:k]).values for _ in range(n)])
    return idx


def run(q, k, v, mask, idx, r, bias=None, impl="gather"):
    module = Dummy().eval()
    return partial_attention_forward(module, q, k, v, mask, layout=PatternLayout.from_indices(idx),
                                     reconstruction=r, bias=bias, scaling=0.3, implementation=impl)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_reconstructible_scores_give_dense_attention(impl):
    # Keys of rank k: every key is a linear combination of any k independent keys, so for each query i the
    # scores outside its own random P_i are exactly R_i times those in P_i, and the output must be dense.
    b, h, n, d, k = 2, 3, 12, 8, 4
    g = torch.Generator().manual_seed(0)
    basis = torch.randn(b, h, k, d, generator=g, dtype=DT)
    coeff = torch.randn(n, k, generator=g, dtype=DT)
    key = coeff @ basis  # (B, H, n, D) of rank k, identical combination in every batch/head
    q, v = torch.randn(b, h, n, d, generator=g, dtype=DT), torch.randn(b, h, n, d, generator=g, dtype=DT)
    idx = random_pattern(n, k, seed=1)
    gram = (coeff @ coeff.T).expand(n, n, n)  # any covariance whose column space is spanned by the coefficients
    r, _, err = solve_reconstruction(gram.clone(), idx, ridge=0.0)
    assert float(err.abs().max()) < 1e-8
    out, probs = run(q, key, v, None, idx, r, impl=impl)
    ref_out, ref_probs = dense(q, key, v, None, 0.3)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(probs, ref_probs, atol=1e-10, rtol=1e-10)


def test_implementations_agree_in_values_and_gradients():
    b, h, n, d, k = 2, 2, 10, 4, 3
    g = torch.Generator().manual_seed(2)
    tensors = [torch.randn(b, h, n, d, generator=g, dtype=DT, requires_grad=True) for _ in range(3)]
    idx = random_pattern(n, k, seed=3)
    r = torch.randn(n, n - k, k, generator=g, dtype=DT, requires_grad=True)
    grads = []
    for impl in IMPLEMENTATIONS:
        out, _ = run(*tensors, None, idx, r, impl=impl)
        grads.append((out, *torch.autograd.grad(out.pow(2).sum(), [*tensors, r])))
    for other in grads[1:]:
        for a, c in zip(grads[0], other):
            torch.testing.assert_close(a, c)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_gradcheck_q_k_v_r_bias(impl):
    b, h, n, d, k = 1, 2, 5, 3, 2
    g = torch.Generator().manual_seed(4)
    q, key, v = (torch.randn(b, h, n, d, generator=g, dtype=DT, requires_grad=True) for _ in range(3))
    idx = random_pattern(n, k, seed=5)
    r = torch.randn(n, n - k, k, generator=g, dtype=DT, requires_grad=True)
    bias = torch.randn(n, n - k, generator=g, dtype=DT, requires_grad=True)
    mask = torch.zeros(b, 1, n, n, dtype=DT)
    mask[..., -1] = torch.finfo(DT).min
    assert torch.autograd.gradcheck(lambda *t: run(*t[:3], mask, idx, t[3], t[4], impl=impl)[0],
                                    (q, key, v, r, bias))


def test_key_gradient_flows_only_through_p():
    # With P = {0, 1} for every query, keys 2.. never enter a score: their gradient is exactly zero.
    b, h, n, d, k = 1, 1, 6, 4, 2
    q, key, v = (torch.randn(b, h, n, d, dtype=DT, requires_grad=True) for _ in range(3))
    idx = torch.tensor([[0, 1]] * n)
    r = torch.randn(n, n - k, k, dtype=DT, requires_grad=True)
    out, _ = run(q, key, v, None, idx, r)
    out.sum().backward()
    assert key.grad[..., :2, :].abs().sum() > 0 and torch.all(key.grad[..., 2:, :] == 0)
    assert r.grad.abs().sum() > 0 and q.grad.abs().sum() > 0


def test_output_does_not_depend_on_padding_or_length():
    # A sequence of length 5 alone, in a batch padded to 7 (additive and bool masks), and padded to n = 8.
    n, d, k = 8, 4, 3
    g = torch.Generator().manual_seed(6)
    idx = random_pattern(n, k, seed=7)
    r = torch.randn(n, n - k, k, generator=g, dtype=DT)
    q, key, v = (torch.randn(1, 2, 5, d, generator=g, dtype=DT) for _ in range(3))
    alone, _ = run(q, key, v, None, idx, r)
    for total in (7, 8):
        pad = lambda t: torch.cat([t, torch.randn(1, 2, total - 5, d, dtype=DT)], 2)  # noqa: E731
        keep = torch.arange(total) < 5
        bool_mask = keep.expand(1, 1, total, total)
        add_mask = torch.zeros(1, 1, total, total, dtype=DT).masked_fill(~bool_mask, torch.finfo(DT).min)
        for mask in (bool_mask, add_mask):
            out, probs = run(pad(q), pad(key), pad(v), mask, idx, r)
            torch.testing.assert_close(out[:, :5], alone)
            assert torch.all(probs[..., 5:] == 0)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_longer_input_is_rejected_with_n_named(impl):
    idx = torch.tensor([[0], [1]])
    t = torch.zeros(1, 1, 3, 2)
    with pytest.raises(ValueError, match="Input length 3 exceeds the partial attention length n=2"):
        run(t, t, t, None, idx, torch.zeros(2, 1, 1), impl=impl)


def test_unknown_implementation():
    # a misspelt name (not a registered kernel, whose own checks could raise a ValueError of their own)
    idx = torch.tensor([[0], [1]])
    t = torch.zeros(1, 1, 2, 2)
    with pytest.raises(ValueError, match=r"implementation must be one of \(.*'fused'.*\), got 'fussed'"):
        run(t, t, t, None, idx, torch.zeros(2, 1, 1), impl="fussed")


def structured_patterns(n=8, k=2):
    cols = torch.tensor([1, 6]).expand(n, k).clone()  # one key set for every query
    blocks = torch.arange(n).view(n // k, k).repeat_interleave(k, 0)  # block-local windows of k
    return {"columns": (cols, n), "blocks": (blocks, k), "per_query": (random_pattern(n, k, seed=8), None)}


@pytest.mark.parametrize("family", ["columns", "blocks", "per_query"])
def test_block_rows_detects_structure(family):
    idx, rows = structured_patterns()[family]
    assert block_rows(idx) == rows


@pytest.mark.parametrize("family, structured", [("columns", "blocks"), ("blocks", "blocks"), ("per_query", "dense")])
def test_exact_scores_method_by_kernel_and_pattern(family, structured):
    # fused and tiled use block GEMMs where rows share keys, else the whole QKᵀ (what the benchmarks' cost counts)
    layout = PatternLayout.from_indices(structured_patterns()[family][0])
    methods = {impl: exact_scores_method(impl, layout) for impl in ("gather", "dense", "fused", "tiled", "triton")}
    assert methods == {"gather": "gather", "dense": "dense", "fused": structured, "tiled": structured,
                       "triton": "gather"}
    with pytest.raises(ValueError, match="implementation must be one of"):
        exact_scores_method("auto", layout)


@pytest.mark.parametrize("family", ["columns", "blocks"])
@pytest.mark.parametrize("t", [8, 5])
def test_fused_structured_path_matches_reference(family, t):
    idx, _ = structured_patterns()[family]
    n, k = idx.shape
    g = torch.Generator().manual_seed(9)
    q, key, v = (torch.randn(2, 2, t, 3, generator=g, dtype=DT, requires_grad=True) for _ in range(3))
    r = torch.randn(n, n - k, k, generator=g, dtype=DT, requires_grad=True)
    bias = torch.randn(n, n - k, generator=g, dtype=DT, requires_grad=True)
    mask = torch.ones(2, 1, t, t, dtype=torch.bool)
    mask[1, ..., t - 2:] = False
    results = []
    for impl in ("gather", "fused"):
        out, probs = run(q, key, v, mask, idx, r, bias, impl=impl)
        results.append((out, probs, *torch.autograd.grad(out.pow(2).sum(), [q, key, v, r, bias])))
    for a, c in zip(*results):
        torch.testing.assert_close(a, c)


def test_gradcheck_fused_blocks():
    idx, _ = structured_patterns(n=6, k=2)["blocks"]
    g = torch.Generator().manual_seed(10)
    q, key, v = (torch.randn(1, 2, 6, 3, generator=g, dtype=DT, requires_grad=True) for _ in range(3))
    r = torch.randn(6, 4, 2, generator=g, dtype=DT, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: run(*t[:3], None, idx, t[3], impl="fused")[0], (q, key, v, r))


def test_auto_implementation_choice():
    """The committed rule (auto_rule.RULE) answers for each structure with a kernel that runs it."""
    from hf_partial_attention.auto_rule import RULE, auto_implementation
    from hf_partial_attention.partial_attention import PARTIAL_KERNELS

    kernels = {auto_implementation(n, k, 64, rows, shared, mode)
               for n in (128, 512) for k in (16, 32, 64) for rows, shared in ((None, 1), (32, 1), (32, 32))
               for mode in ("inference", "training")}
    assert kernels <= set(PARTIAL_KERNELS) - {"triton", "gather"}
    assert {c["kernel"] for c in RULE["cells"]} <= set(PARTIAL_KERNELS)


def test_frozen_r_builds_w_once_and_notices_changes(monkeypatch):
    """W = [I | R] is reused while R is frozen and rebuilt when R (or P) changes; values equal a fresh build."""
    import hf_partial_attention.partial_scores as ps
    from hf_partial_attention import AttentionPattern, PartialBertConfig, PartialBertModel

    builds = []
    original = ps.reconstruction_matrix
    monkeypatch.setattr(ps, "reconstruction_matrix", lambda *a: builds.append(1) or original(*a))
    torch.manual_seed(0)
    config = PartialBertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                               intermediate_size=37, partial_seq_len=16, partial_k=4, reconstruction="fixed",
                               partial_implementation="fused")
    model = PartialBertModel(config).eval()
    ids = torch.randint(1, 99, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first = model(input_ids=ids).last_hidden_state
        assert len(builds) == 1  # one shared R, two partial layers: built once
        model(input_ids=ids)
        assert len(builds) == 1  # reused
        model.encoder.partial_pattern.reconstruction.mul_(0.5)  # R changed in place
        changed = model(input_ids=ids).last_hidden_state
        assert len(builds) == 2 and not torch.equal(changed, first)
    torch.manual_seed(0)
    fresh = PartialBertModel(config).eval()  # the same weights, its own W built from the changed R
    fresh.set_pattern(AttentionPattern(model.encoder.partial_pattern.indices, model.encoder.partial_pattern.reconstruction))
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).last_hidden_state, changed)
    common = PartialBertModel(PartialBertConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
        partial_seq_len=16, partial_k=4, reconstruction="common", partial_implementation="fused")).train()
    builds.clear()
    common(input_ids=ids).last_hidden_state.sum().backward()  # trainable R with autograd: never cached
    common(input_ids=ids)
    assert len(builds) == 4 and common.encoder.partial_pattern.reconstruction.grad is not None

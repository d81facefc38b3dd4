"""The partial attention function against dense attention, in float64."""

import pytest
import torch
from torch import nn

from hf_partial_attention.attention_common import PatternLayout, PatternStructure, block_rows, structured_scores
from hf_partial_attention.attention_dispatch import partial_attention_forward
from hf_partial_attention.reconstruction import solve_reconstruction

DT = torch.float64
# The kernels that run on any device in PyTorch alone (and in float64): the triton kernel is tested in
# tests/test_triton_kernel.py (float32, interpreter).
IMPLEMENTATIONS = ("gather", "fused", "tiled")


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
    """``(output, probabilities)`` of one kernel; a kernel other than the reference runs without the map (asked
    for, the map would send the call to the reference), so its probabilities are None."""
    module = Dummy().eval()
    return partial_attention_forward(module, q, k, v, mask, layout=PatternLayout.from_indices(idx, r),
                                     reconstruction=r, bias=bias, scaling=0.3, implementation=impl,
                                     need_weights=impl == "gather")


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
    if impl == "gather":
        torch.testing.assert_close(probs, ref_probs, atol=1e-10, rtol=1e-10)
    else:
        assert probs is None


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


@pytest.mark.parametrize("family, structure", [("columns", PatternStructure.BLOCKS_SHARING_KEYS),
                                               ("blocks", PatternStructure.BLOCKS_SHARING_KEYS),
                                               ("per_query", PatternStructure.PER_QUERY)])
def test_structured_scores_cost_what_the_cost_model_counts(family, structure):
    """The fast kernels' exact scores equal the gathered ones and cost k·d multiply-adds per query where rows share
    keys (one GEMM per block), n·d where they do not (QKᵀ then select): what `cost.forward_ratio` counts."""
    from torch.utils.flop_counter import FlopCounterMode

    from hf_partial_attention.attention_common import gathered_scores

    idx = structured_patterns()[family][0]
    layout = PatternLayout.from_indices(idx)
    assert layout.structure is structure
    b, h, n, d, k = 2, 3, 8, 5, idx.shape[1]
    g = torch.Generator().manual_seed(11)
    q, key = (torch.randn(b, h, n, d, generator=g, dtype=DT) for _ in range(2))
    with FlopCounterMode(display=False) as counter:
        scores = structured_scores(q, key, layout, 0.3)
    torch.testing.assert_close(scores, gathered_scores(q, key, idx, 0.3), rtol=1e-12, atol=1e-12)
    per_query = k if structure is PatternStructure.BLOCKS_SHARING_KEYS else n
    assert counter.get_total_flops() == 2 * b * h * n * per_query * d


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
        out, _ = run(q, key, v, mask, idx, r, bias, impl=impl)
        results.append((out, *torch.autograd.grad(out.pow(2).sum(), [q, key, v, r, bias])))
    for a, c in zip(*results):
        torch.testing.assert_close(a, c)


def test_gradcheck_fused_blocks():
    idx, _ = structured_patterns(n=6, k=2)["blocks"]
    g = torch.Generator().manual_seed(10)
    q, key, v = (torch.randn(1, 2, 6, 3, generator=g, dtype=DT, requires_grad=True) for _ in range(3))
    r = torch.randn(6, 4, 2, generator=g, dtype=DT, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: run(*t[:3], None, idx, t[3], impl="fused")[0], (q, key, v, r))


def _layout(structure: str, n: int, rows: int = 32, k: int = 4) -> PatternLayout:
    """A layout of each structure at length n: per-query keys; blocks of ``rows`` rows sharing keys, each row its own
    R; the same blocks sharing R too."""
    g = torch.Generator().manual_seed(12)
    if structure == "per_query":
        idx = random_pattern(n, k, seed=13)
    else:
        idx = torch.stack([torch.randperm(n, generator=g)[:k].sort().values for _ in range(n // rows)])
        idx = idx.repeat_interleave(rows, 0)  # (n, k)
    r = torch.randn(n // rows if structure == "shared" else n, n - k, k, generator=g)
    r = r.repeat_interleave(rows, 0) if structure == "shared" else r  # (n, n-k, k)
    return PatternLayout.from_indices(idx, r)


@pytest.mark.parametrize("structure", ["per_query", "blocks", "shared"])
@pytest.mark.parametrize("n", [128, 256, 512])
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("triton_installed", [False, True])
def test_auto_rule(structure, n, training, device, triton_installed, monkeypatch):
    """`auto`: triton on CUDA where triton is installed; else tiled for rows sharing P and R in inference at
    n >= 256; else fused. Never gather (no map asked for), never triton off CUDA."""
    from hf_partial_attention import attention_dispatch

    monkeypatch.setattr(attention_dispatch, "_triton_installed", lambda: triton_installed)
    layout = _layout(structure, n)
    if device == "cuda" and triton_installed:
        want = "triton"
    elif structure == "shared" and not training and n >= 256:
        want = "tiled"
    else:
        want = "fused"
    assert attention_dispatch.auto_kernel(layout, device, 64, training) == want
    if want == "triton":  # a head size or attention dropout the triton kernel refuses: the rule goes on
        assert attention_dispatch.auto_kernel(layout, device, 48, training) != "triton"
        assert attention_dispatch.auto_kernel(layout, device, 64, training, dropout=0.1) != "triton"


def test_structure_needs_blocks_of_min_shared_rows():
    from hf_partial_attention.attention_common import MIN_SHARED_ROWS

    assert _layout("shared", 256, rows=MIN_SHARED_ROWS).structure is PatternStructure.ROWS_SHARING_P_AND_R
    assert _layout("shared", 256, rows=MIN_SHARED_ROWS // 2).structure is PatternStructure.BLOCKS_SHARING_KEYS
    assert _layout("blocks", 256).structure is PatternStructure.BLOCKS_SHARING_KEYS
    assert _layout("per_query", 256).structure is PatternStructure.PER_QUERY


def test_auto_runs_its_choice_in_a_model_and_the_map_runs_the_reference(monkeypatch):
    """In a model: auto runs tiled for rows sharing P and R at n = 256 in inference, fused with autograd, and a call
    asking for the attention maps runs the reference kernel."""
    from hf_partial_attention import AttentionPattern, PartialBertConfig, PartialBertModel, attention_dispatch

    ran = []
    real = attention_dispatch.kernel_function
    monkeypatch.setattr(attention_dispatch, "kernel_function", lambda name: ran.append(name) or real(name))
    layout = _layout("shared", 256)
    g = torch.Generator().manual_seed(14)
    r = torch.randn(256 // 32, 252, 4, generator=g).repeat_interleave(32, 0) * 0.1
    config = PartialBertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=37, partial_seq_len=256, partial_k=4, max_position_embeddings=256,
                               reconstruction="fixed", attention_probs_dropout_prob=0.0)
    model = PartialBertModel(config).eval()
    model.set_pattern(AttentionPattern(layout.indices, r))
    ids = torch.randint(1, 99, (1, 256), generator=g)
    with torch.no_grad():
        model(input_ids=ids)
    model(input_ids=ids).last_hidden_state.sum().backward()
    with torch.no_grad():
        model(input_ids=ids, output_attentions=True)
    assert ran == ["tiled", "fused", "gather"]


def test_frozen_r_builds_w_once_and_notices_changes(monkeypatch):
    """W = [I | R] is reused while R is frozen and rebuilt when R (or P) changes; values equal a fresh build."""
    import hf_partial_attention.attention_common as ps
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
    fresh.set_pattern(AttentionPattern(model.encoder.partial_pattern.indices,
                                       model.encoder.partial_pattern.reconstruction))
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).last_hidden_state, changed)
    common = PartialBertModel(PartialBertConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
        partial_seq_len=16, partial_k=4, reconstruction="common", partial_implementation="fused")).train()
    builds.clear()
    common(input_ids=ids).last_hidden_state.sum().backward()  # trainable R with autograd: never cached
    common(input_ids=ids)
    assert len(builds) == 4 and common.encoder.partial_pattern.reconstruction.grad is not None

"""The fused Triton kernel under Triton's CPU interpreter (TRITON_INTERPRET=1, set in conftest) against the
reference kernel: outputs and gradients of Q, K, V, R and the bias, with masks, short inputs, any P."""

import pytest
import torch
import triton  # noqa: F401  (a dev dependency: missing, these tests fail instead of skipping)

from hf_partial_attention import PartialBertConfig, PartialBertModel
from hf_partial_attention import attention_triton as triton_kernel
from hf_partial_attention.attention_common import PatternLayout
from hf_partial_attention.attention_dispatch import partial_attention_forward
from hf_partial_attention.pattern import AttentionPattern


class _Layer(torch.nn.Module):
    pass


def _inputs(n, k, d, t, structured, seed=0, heads=2, batch=2):
    g = torch.Generator().manual_seed(seed)
    if structured:  # blocks of 16 rows sharing one key set (the chain-of-GEMMs family)
        idx = torch.cat([torch.sort(torch.randperm(n, generator=g)[:k]).values.expand(16, k) for _ in range(n // 16)])
    else:  # a per-query P
        idx = torch.sort(torch.argsort(torch.rand(n, n, generator=g), -1)[:, :k], -1).values
    q, key, v = (torch.randn(batch, heads, t, d, generator=g, dtype=torch.float64) for _ in range(3))
    r = torch.randn(n, n - k, k, generator=g, dtype=torch.float64) * 0.3
    bias = torch.randn(n, n - k, generator=g, dtype=torch.float64) * 0.1
    return PatternLayout.from_indices(idx), q, key, v, r, bias


def _run(impl, layout, tensors, mask, dtype, use_bias):
    layer = _Layer().eval()
    leaves = [x.detach().to(dtype).requires_grad_() for x in tensors]
    q, key, v, r, bias = leaves
    d = q.shape[-1]
    out, _ = partial_attention_forward(layer, q, key, v, mask, layout=layout, reconstruction=r,
                                       bias=bias if use_bias else None, scaling=d ** -0.5, implementation=impl,
                                       need_weights=False)  # asked for, the map would run the reference
    weights = torch.linspace(-1, 1, d, dtype=dtype)
    (out * weights).sum().backward()
    grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves]
    return [out.detach().double()] + [g.double() for g in grads]


@pytest.mark.parametrize("structured", [False, True])
@pytest.mark.parametrize("t, masked, use_bias", [(32, False, False), (27, True, True), (32, True, False)])
def test_triton_equals_the_reference_in_outputs_and_gradients(structured, t, masked, use_bias):
    n, k, d = 32, 8, 16
    layout, *tensors = _inputs(n, k, d, t, structured)
    mask = None
    if masked:  # a padding mask (the second sequence ends early) as transformers' sdpa_mask gives it
        mask = torch.ones(2, 1, t, t, dtype=torch.bool)
        mask[1, ..., t - 9:] = False
    reference = _run("gather", layout, tensors, mask, torch.float64, use_bias)
    ours = _run("triton", layout, tensors, mask, torch.float32, use_bias)
    for name, a, b in zip(["output", "dQ", "dK", "dV", "dR", "dbias"], reference, ours):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
    assert reference[4].abs().max() > 0.01  # R does receive gradient (the comparison is not of zeros)


def test_triton_in_bfloat16_is_close_to_the_reference():
    layout, *tensors = _inputs(32, 16, 32, 32, structured=False, seed=1)
    reference = _run("gather", layout, tensors, None, torch.float64, True)
    ours = _run("triton", layout, tensors, None, torch.bfloat16, True)
    torch.testing.assert_close(ours[0], reference[0], atol=3e-2, rtol=3e-2)  # bf16 inputs, fp32 accumulation


def test_triton_in_the_model_equals_the_reference_and_refuses_dropout():
    torch.manual_seed(0)
    config = PartialBertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=37, partial_seq_len=32, partial_k=8, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0, reconstruction="per_layer")
    model = PartialBertModel(config).eval()
    g = torch.Generator().manual_seed(0)
    n, k = 32, 8
    idx = torch.sort(torch.argsort(torch.rand(n, n, generator=g), -1)[:, :k], -1).values
    model.set_pattern(AttentionPattern(idx, torch.randn(n, n - k, k, generator=g) * 0.3))
    ids = torch.randint(1, 99, (2, 20), generator=g)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, 15:] = 0
    outs = {}
    for impl in ("gather", "triton"):
        model.set_partial_implementation(impl)
        outs[impl] = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(outs["triton"], outs["gather"], atol=1e-5, rtol=1e-5)
    model.config.attention_probs_dropout_prob = 0.1
    for layer in model.encoder.layer:
        layer.attention.self.dropout.p = 0.1
    model.train()
    with pytest.raises(ValueError, match="attention_probs_dropout_prob=0"):
        model(input_ids=ids, attention_mask=mask)


def test_triton_refuses_clearly_where_it_cannot_run(monkeypatch):
    layout, q, key, v, r, _ = _inputs(32, 8, 16, 32, structured=False)
    args = (q.float(), key.float(), v.float(), torch.zeros(32, 8, 32), None, None, None, layout.indices, 0.25)
    monkeypatch.setattr(triton_kernel, "_INTERPRETED", False)  # a CPU without the interpreter
    with pytest.raises(triton_kernel.TritonUnavailable, match="needs a CUDA GPU"):
        triton_kernel.triton_partial_attention(*args)
    monkeypatch.setattr(triton_kernel, "_INTERPRETED", True)
    bad = (q.float()[..., :12], key.float()[..., :12], v.float()[..., :12], *args[3:])
    with pytest.raises(ValueError, match="power of two"):
        triton_kernel.triton_partial_attention(*bad)
    monkeypatch.setattr(triton_kernel, "triton", None)
    with pytest.raises(triton_kernel.TritonUnavailable, match="pip install triton"):
        triton_kernel.triton_partial_attention(*args)

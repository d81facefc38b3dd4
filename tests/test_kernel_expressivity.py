"""What partial attention can express (docs/method.md, "What partial attention can express"), on every kernel.

Query i's score of a key j outside P_i is reconstructed as ``s_ij = Σ_p R_ijp q_i·k_p`` over p in P_i: key j's own
content never enters it. So in a one-layer model (each position's output depends on its own attention row only),
changing key j leaves the output of every query whose P does not hold j unchanged, in every kernel (gather, fused,
tiled, Triton under the interpreter, the compiled op), and changes it in the exact model. The key is changed by a
forward hook on the key projection, so the query and value of position j stay as they were.
"""

import pytest
import torch
from transformers import BertConfig, BertModel

from hf_partial_attention import AttentionPattern, PartialBertConfig, PartialBertModel, attention_common

N, K = 16, 4  # the window, P's size
TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
            partial_seq_len=N, partial_k=K, partial_layers=[0], partial_use_bias=True, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)


def _pattern(structured: bool) -> AttentionPattern:
    g = torch.Generator().manual_seed(0)
    if structured:  # blocks of 8 rows sharing keys: the fused and compiled kernels' block-GEMM path
        idx = torch.cat([torch.sort(torch.randperm(N, generator=g)[:K]).values.expand(8, K) for _ in range(N // 8)])
    else:
        idx = torch.sort(torch.argsort(torch.rand(N, N, generator=g), -1)[:, :K], -1).values
    # R large enough that a reconstructed score moves the output visibly
    return AttentionPattern(idx, torch.randn(N, N - K, K, generator=g), torch.randn(N, N - K, generator=g) * 0.1)


def _outputs(model: torch.nn.Module, key_module: torch.nn.Module, j: int, run=None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The last hidden state as it is, and with position j's key moved (B, T, hidden) each."""
    ids = torch.randint(1, 99, (2, N), generator=torch.Generator().manual_seed(1))
    run = model if run is None else run
    delta = torch.zeros(key_module.out_features)  # zero for the first run, then a move of key j
    # registered before the first call: a compiled model traces the hook (it does not guard on hooks added later)
    handle = key_module.register_forward_hook(lambda _module, _args, out: _move(out, j, delta))
    try:
        with torch.no_grad():
            before = run(input_ids=ids).last_hidden_state
            delta.copy_(50.0 * torch.randn(delta.shape, generator=torch.Generator().manual_seed(2)))
            after = run(input_ids=ids).last_hidden_state
    finally:
        handle.remove()
    return before, after


def _move(out: torch.Tensor, j: int, delta: torch.Tensor) -> torch.Tensor:
    """The key projection's output (B, T, H·D) with ``delta`` added at position j only."""
    moved = torch.zeros_like(out)
    moved[:, j] = delta
    return out + moved


def _partial(implementation: str, structured: bool) -> PartialBertModel:
    torch.manual_seed(0)
    model = PartialBertModel(PartialBertConfig(**TINY)).eval()
    model.set_pattern(_pattern(structured))
    model.set_partial_implementation(implementation)
    return model


def _key(pattern: AttentionPattern) -> int:
    """A key some queries' P holds and others' does not: query 0's first."""
    return int(pattern.indices[0, 0])


def _check(before, after, pattern: AttentionPattern):
    j = _key(pattern)
    holds_j = (pattern.indices == j).any(-1)  # (n,): the queries whose P holds key J
    assert 0 < int(holds_j.sum()) < N  # both kinds of query are tested
    moved = (after - before).abs().amax(dim=(0, 2))  # (T,): how far each query's output moved
    # outside P: bit for bit in most kernels; float32 reductions may regroup, hence the tolerance
    assert moved[~holds_j].max() <= 1e-5, f"key {j} moved queries whose P does not hold it: {moved[~holds_j]}"
    assert moved[holds_j].min() > 1e-3, f"key {j} did not move queries whose P holds it: {moved[holds_j]}"


@pytest.mark.parametrize("structured", [False, True])
@pytest.mark.parametrize("implementation", ["gather", "fused", "tiled", "triton"])
def test_a_key_outside_p_never_enters_its_queries_scores(implementation, structured):
    model = _partial(implementation, structured)
    before, after = _outputs(model, model.encoder.layer[0].attention.self.key, _key(_pattern(structured)))
    _check(before, after, _pattern(structured))


@pytest.mark.slow
@pytest.mark.parametrize("structured", [False, True])
def test_the_compiled_op_cannot_read_a_key_outside_p_either(structured, monkeypatch):
    model = _partial("auto", structured)
    calls = []  # the compiled op's runs (tests/test_compiled.py: it builds its layout at run time)
    real = attention_common.DerivedState.layout
    monkeypatch.setattr(attention_common.DerivedState, "layout", lambda self, *a: calls.append(1) or real(self, *a))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    before, after = _outputs(model, model.encoder.layer[0].attention.self.key, _key(_pattern(structured)), compiled)
    assert calls, "the compiled model did not run the partial op"
    _check(before, after, _pattern(structured))


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_in_the_exact_model_every_query_reads_every_key(attn_implementation):
    partial = _partial("gather", structured=False)
    config = BertConfig(**{k: v for k, v in TINY.items() if not k.startswith("partial_")},
                        attn_implementation=attn_implementation)
    exact = BertModel(config).eval()
    assert exact.config._attn_implementation == attn_implementation
    missing = exact.load_state_dict(partial.state_dict(), strict=False).missing_keys
    assert not missing  # the same weights: only P and R are left out
    j = _key(_pattern(structured=False))
    before, after = _outputs(exact, exact.encoder.layer[0].attention.self.key, j)
    moved = (after - before).abs().amax(dim=(0, 2))  # (T,)
    assert moved.min() > 1e-3, f"the exact model ignored key {j} at some query: {moved}"


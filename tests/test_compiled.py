"""The compiled fast path (`attention_dispatch.compiled_attention`): under torch.compile with R frozen a partial layer
runs its kernel as one custom op reading W and the blocks of rows sharing P and R from the owner's cache, outside the
graph; it equals eager, never reads a stale W after P or R change, and a trained R still gets its gradient."""

import copy
import sys
from pathlib import Path

import pytest
import torch

from hf_partial_attention import AttentionPattern, PartialBertConfig, PartialBertModel, attention_common
from hf_partial_attention import attention_dispatch

TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
            partial_seq_len=16, partial_k=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _pattern(seed=3, n=16, k=4):
    g = torch.Generator().manual_seed(seed)
    idx = torch.sort(torch.argsort(torch.rand(n, n, generator=g), -1)[:, :k], -1).values
    return AttentionPattern(idx, torch.randn(n, n - k, k, generator=g) * 0.3)


def _model(mode="fixed", implementation="auto", **extra):
    torch.manual_seed(0)
    model = PartialBertModel(PartialBertConfig(**TINY, reconstruction=mode, **extra)).eval()
    if extra.get("partial_granularity", "pooled") == "pooled":
        model.set_pattern(_pattern())
    model.set_partial_implementation(implementation)
    return model


def _batch():
    ids = torch.randint(1, 99, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _compiled(model, backend="aot_eager"):
    torch._dynamo.reset()
    return torch.compile(model, fullgraph=True, backend=backend)  # fullgraph: a graph break is an error


def _fresh(model):
    """A copy of the model whose derived states start empty (eager from scratch: neither its cache nor the
    original's can hide a stale W or layout)."""
    return copy.deepcopy(model)


@pytest.fixture
def op_calls(monkeypatch):
    """Every run of the op's implementation: the storages of the P and R it was given."""
    calls = []
    real = attention_common.DerivedState.layout

    def spy(self, indices, reconstruction):
        calls.append((indices.untyped_storage().data_ptr(), reconstruction.untyped_storage().data_ptr()))
        return real(self, indices, reconstruction)

    monkeypatch.setattr(attention_common.DerivedState, "layout", spy)
    return calls


def _storages(model):
    """The storages of P and of each partial layer's R (one R for all unless per_layer)."""
    module = model.encoder.partial_pattern
    rs = ([module.reconstruction] if model.config.reconstruction != "per_layer"
          else [model.encoder.layer[l].attention.self.reconstruction for l in model.config.partial_layers])
    return {(module.indices.untyped_storage().data_ptr(), r.untyped_storage().data_ptr()) for r in rs}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fixed", "common", "per_layer"])
@pytest.mark.parametrize("implementation", ["auto", "fused", "tiled"])
def test_compiled_inference_runs_the_op_on_the_models_own_p_and_r_and_equals_eager(mode, implementation, op_calls):
    model = _model(mode, implementation)
    batch = _batch()
    with torch.no_grad():
        ref = model(**batch).last_hidden_state
        op_calls.clear()
        out = _compiled(model)(**batch).last_hidden_state
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    # the partial layers (all but the last) ran the op at run time, on the model's P and R themselves (not copies,
    # whose fresh storage could meet a stale stamp)
    assert op_calls and set(op_calls) == _storages(model)


@pytest.mark.slow
def test_compiled_with_inductor_equals_eager(op_calls):
    model = _model("fixed")
    batch = _batch()
    with torch.no_grad():
        ref = model(**batch).last_hidden_state
        out = _compiled(model, "inductor")(**batch).last_hidden_state
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert set(op_calls) == _storages(model)


@pytest.mark.slow
def test_compiled_per_head_p_and_r_equals_eager(op_calls):
    model = _model("fixed", partial_granularity="head")
    batch = _batch()
    with torch.no_grad():
        module = model.encoder.partial_pattern_layer0
        module.reconstruction.mul_(1.5)  # away from the default
        ref = model(**batch).last_hidden_state
        out = _compiled(model)(**batch).last_hidden_state
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert op_calls


@pytest.mark.slow
def test_no_stale_w_after_r_or_p_change_between_compiled_calls():
    """R edited in place, a new P and R by set_pattern, P edited in place without refresh_layout: each compiled
    call after the change equals eager on the changed model."""
    model = _model("fixed")
    compiled = _compiled(model)
    batch = _batch()
    module = model.encoder.partial_pattern

    def check():
        with torch.no_grad():
            out = compiled(**batch).last_hidden_state
            ref = _fresh(model)(**batch).last_hidden_state
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        return out

    before = check()  # fills the cache
    with torch.no_grad():
        module.reconstruction.mul_(-2.0)
    assert not torch.allclose(check(), before)
    model.set_pattern(_pattern(seed=7))
    check()
    other = _pattern(seed=11).indices
    with torch.no_grad():
        module.indices.copy_(other)  # by hand: the compiled op derives P's layout itself
    check()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["common", "per_layer"])
def test_compiled_training_step_updates_a_trained_r_then_compiled_eval_reads_the_new_r(mode, op_calls):
    """A compiled training step differentiates R (W built in the graph: the op is not used under autograd) with
    eager's gradient; after the optimizer step, compiled inference reads the updated R, not the cached W."""
    model = _model(mode)
    eager_grad_model = _model(mode)
    batch = _batch()
    compiled = _compiled(model)
    with torch.no_grad():
        compiled(**batch)  # the cache holds W of the initial R
    r = (model.encoder.partial_pattern.reconstruction if mode == "common"
         else model.encoder.layer[0].attention.self.reconstruction)
    start = r.detach().clone()
    optimizer = torch.optim.SGD([r], lr=300.0)  # a step that moves the output well beyond tolerance
    model.train()
    op_calls.clear()
    weights = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(2))  # a loss LayerNorm does not fix
    (compiled(**batch).last_hidden_state * weights).sum().backward()
    assert not op_calls  # under autograd: no op
    eager_grad_model.train()
    (eager_grad_model(**batch).last_hidden_state * weights).sum().backward()
    eager_r = (eager_grad_model.encoder.partial_pattern.reconstruction if mode == "common"
               else eager_grad_model.encoder.layer[0].attention.self.reconstruction)
    assert r.grad is not None and r.grad.abs().max() > 1e-5
    torch.testing.assert_close(r.grad, eager_r.grad, rtol=1e-4, atol=1e-6)
    optimizer.step()
    assert not torch.equal(r.detach(), start)
    model.eval()
    with torch.no_grad():
        out = compiled(**batch).last_hidden_state
        ref = _fresh(model)(**batch).last_hidden_state
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert op_calls


@pytest.mark.slow
def test_compiled_auto_runs_tiled_for_rows_sharing_p_and_r(monkeypatch):
    """The blocks of rows sharing P and R are found at run time: under compile, auto runs tiled (n = 256) as eager."""
    ran = []
    real = attention_dispatch.kernel_function

    def spy(name):  # the kernels that run, not the graph's trace (dynamo would replay a traced append)
        if not torch.compiler.is_compiling():
            ran.append(name)
        return real(name)

    monkeypatch.setattr(attention_dispatch, "kernel_function", spy)
    n, k, rows = 256, 4, 32
    g = torch.Generator().manual_seed(14)
    idx = torch.sort(torch.randperm(n, generator=g)[:k]).values.expand(n, k).clone()
    r = torch.randn(n // rows, n - k, k, generator=g).repeat_interleave(rows, 0) * 0.1
    config = PartialBertConfig(**{**TINY, "partial_seq_len": n, "max_position_embeddings": n}, reconstruction="fixed")
    model = PartialBertModel(config).eval()
    model.set_pattern(AttentionPattern(idx, r))
    ids = torch.randint(1, 99, (1, n), generator=g)
    with torch.no_grad():
        ref = model(input_ids=ids).last_hidden_state
        ran.clear()
        out = _compiled(model)(input_ids=ids).last_hidden_state
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert "tiled" in ran and "fused" not in ran


def test_export_keeps_w_in_the_graph():
    """torch.export does not use the op: an exported program must not depend on this process's caches."""
    model = _model("fixed")
    batch = _batch()
    with torch.no_grad():
        exported = torch.export.export(model, (), batch)
        assert "frozen_attention" not in exported.graph_module.print_readable(print_output=False)
        torch.testing.assert_close(exported.module()(**batch).last_hidden_state, model(**batch).last_hidden_state)


@pytest.mark.slow
def test_fast_path_off_builds_w_in_the_graph(op_calls):
    model = _model("fixed")
    model.encoder.partial_pattern.compiled_fast_path = False
    with torch.no_grad():
        _compiled(model)(**_batch())
    assert not op_calls


@pytest.mark.slow
def test_quick_benchmark_writes_its_tables(tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        import compiled
    finally:
        sys.path.remove(str(BENCH))
    result = compiled.main(["--quick", "--repeats", "1", "--out", str(tmp_path)])
    row = result["rows"][0]
    assert set(row["ratios"]) == set(compiled.RATIOS)
    assert all(diff < 1e-4 for diff in row["max_abs_diff_to_uncompiled"].values())
    text = (tmp_path / "compiled.md").read_text()
    assert "compiled partial / compiled SDPA" in text and (tmp_path / "compiled.json").exists()

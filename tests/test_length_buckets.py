"""Length buckets (config.partial_lengths): each sequence runs the P and R of the smallest bucket >= its own length,
which equals a one-bucket model of that length; buckets with b <= k run exactly; checkpoints keep every bucket."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import BertConfig, BertModel

from hf_partial_attention import AttentionPattern, PartialBertConfig, PartialBertForMaskedLM, PartialBertModel
from hf_partial_attention.pattern_buckets import PatternBuckets

TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=64,
            initializer_range=0.3)
K = 6
LENGTHS = [4, 8, 16, 32]  # 4 <= k: exact
MODES = ("fixed", "common", "per_layer")
# k per bucket: one k for all (format 2), or a k of each bucket's own (format 3; 16's above n's, 8's below)
KS = {"uniform": {8: K, 16: K, 32: K}, "per_bucket": {8: 5, 16: 9, 32: K}}


def _random_pattern(n, k, seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    idx = torch.sort(torch.argsort(torch.rand(n, n, generator=g), -1)[:, :k], -1).values
    return AttentionPattern(idx, 0.3 * torch.randn(n, n - k, k, generator=g),
                            0.1 * torch.randn(n, n - k, generator=g) if bias else None)


def _buckets(bias=False, ks="uniform"):
    return PatternBuckets({b: _random_pattern(b, k, seed=b, bias=bias) for b, k in KS[ks].items()}, exact_lengths=[4])


def _model(mode="common", bias=False, cls=PartialBertModel, dtype=torch.float64, ks="uniform"):
    torch.manual_seed(0)
    config = PartialBertConfig(**TINY, partial_seq_len=32, partial_k=K, partial_lengths=LENGTHS, reconstruction=mode,
                               partial_use_bias=bias, partial_lengths_k=[4, *KS[ks].values()])
    model = cls(config, pattern=_buckets(bias, ks)).to(dtype).eval()
    return model


def _one_bucket_reference(model, b, dtype=torch.float64):
    """A one-bucket PartialBert of n = b with ``model``'s weights and its bucket-b P and R (per layer when R is)."""
    config = PartialBertConfig(**TINY, partial_seq_len=b, partial_k=model.config.bucket_k(b),
                               reconstruction=model.config.reconstruction,
                               partial_use_bias=model.config.partial_use_bias)
    ref = PartialBertModel(config, pattern=model.get_pattern(length=b)).to(dtype).eval()
    ref.load_state_dict({k: v for k, v in model.state_dict().items() if k in ref.state_dict()
                         and k not in ref._partial_tensor_names()}, strict=False)
    if model.config.reconstruction == "per_layer":
        with torch.no_grad():
            for layer in model.config.partial_layers:
                ref.encoder.layer[layer].attention.self.reconstruction.copy_(model.get_pattern(layer, b).reconstruction)
    return ref


def _batch():
    ids = torch.randint(1, 99, (4, 20), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    for row, t in enumerate([3, 7, 12, 20]):  # buckets 4 (exact), 8, 16, 32
        mask[row, t:] = 0
    return ids, mask, [3, 7, 12, 20]


def test_config_checks_the_buckets():
    base = dict(**TINY, partial_seq_len=32, partial_k=K)
    assert PartialBertConfig(**base).partial_lengths == [32]  # one bucket by default (format 1's behaviour)
    config = PartialBertConfig(**base, partial_lengths=LENGTHS)
    assert (config.partial_buckets, config.exact_lengths) == ([8, 16], [4])
    for bad, match in [([8, 16], "must end with partial_seq_len=32"), ([16, 8, 32], "increasing"),
                       ([8, 8, 32], "increasing"), ([0, 32], "positive ints"), ([], "non-empty")]:
        with pytest.raises(ValueError, match=match):
            PartialBertConfig(**base, partial_lengths=bad)
    assert config.partial_lengths_k == [4, K, K, K] and config.required_format_version == 2  # min(k, b) by default
    per_bucket = PartialBertConfig(**base, partial_lengths=LENGTHS, partial_lengths_k=[4, 8, 9, K])
    assert (per_bucket.partial_buckets, per_bucket.exact_lengths) == ([16], [4, 8])  # k = b: exact
    assert [per_bucket.bucket_k(b) for b in (16, None)] == [9, K] and per_bucket.required_format_version == 3
    for bad, match in [([4, K, K], "one k per bucket"), ([4, 9, K, K], r"in \[1, b\].*\(8, 9\)"),
                       ([4, K, K, 7], "must end with partial_k=6"), ([4, K, 0, K], r"\(16, 0\)")]:
        with pytest.raises(ValueError, match=match):
            PartialBertConfig(**base, partial_lengths=LENGTHS, partial_lengths_k=bad)


@pytest.mark.parametrize("ks", KS)
@pytest.mark.parametrize("implementation", ["gather", "fused", "tiled"])
@pytest.mark.parametrize("mode, bias", [("fixed", False), ("common", True), ("per_layer", False)])
def test_each_sequence_runs_its_own_bucket(implementation, mode, bias, ks):
    """In one mixed batch, a sequence of length T equals a one-bucket model of n = the smallest bucket >= T and that
    bucket's k (float64), for every kernel and R mode, one k or a k per bucket; the exact bucket equals BERT."""
    model = _model(mode, bias, ks=ks)
    model.set_partial_implementation(implementation)
    ids, mask, lengths = _batch()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state  # (4, 20, 32)
        for row, t in enumerate(lengths):
            bucket = model.get_patterns().bucket_for(t)
            if bucket in model.config.exact_lengths:
                bert = BertModel(BertConfig(**TINY), add_pooling_layer=False).to(torch.float64).eval()
                bert.load_state_dict(model.state_dict(), strict=False)
                want = bert(input_ids=ids[row:row + 1, :t]).last_hidden_state
            else:
                ref = _one_bucket_reference(model, bucket)
                ref.set_partial_implementation("gather")
                want = ref(input_ids=ids[row:row + 1, :t]).last_hidden_state
            torch.testing.assert_close(out[row:row + 1, :t], want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("ks", KS)
def test_gradients_flow_to_each_sequences_bucket_only(ks):
    """float64: the gradient of a mixed batch's loss w.r.t. each bucket's R equals that of its one-bucket reference on
    the sequences of that bucket; n's R gets none when no sequence is long enough for it."""
    model = _model("common", ks=ks)
    model.train()
    ids, mask, lengths = _batch()
    keep = [0, 1, 2]  # lengths 3, 7, 12: buckets 4, 8, 16 (none in 32)
    out = model(input_ids=ids[keep], attention_mask=mask[keep]).last_hidden_state
    loss = sum((out[i, :lengths[i]] ** 2).sum() for i in range(len(keep)))
    loss.backward()
    grad = model.encoder.partial_pattern.reconstruction.grad
    assert grad is None or not grad.any()
    for row, bucket in [(1, 8), (2, 16)]:
        ref = _one_bucket_reference(model, bucket).train()
        ref.set_partial_implementation("gather")
        r = ref(input_ids=ids[row:row + 1, :lengths[row]]).last_hidden_state
        (r ** 2).sum().backward()
        got = getattr(model.encoder, f"partial_pattern_len{bucket}").reconstruction.grad
        torch.testing.assert_close(got, ref.encoder.partial_pattern.reconstruction.grad, atol=1e-10, rtol=1e-9)


def test_output_attentions_are_each_buckets_maps_padded():
    model = _model("fixed")
    ids, mask, lengths = _batch()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    for layer in model.config.partial_layers:
        probs = out.attentions[layer]  # (4, H, 20, 20)
        assert probs.shape == (4, 4, 20, 20)
        for row, t in enumerate(lengths):
            rows = probs[row, :, :t, :t]
            torch.testing.assert_close(rows.sum(-1), torch.ones_like(rows.sum(-1)), atol=1e-12, rtol=0)
            assert not probs[row, :, :t, t:].any()  # padded keys get nothing


@pytest.mark.parametrize("ks, version", [("uniform", 2), ("per_bucket", 3)])
@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_keeps_every_bucket_and_refuses_missing_or_misshaped_ones(tmp_path, mode, ks, version):
    """Every bucket's P and R come back; format 3 only where the buckets differ in k (format 2 readers read the
    rest)."""
    model = _model(mode, cls=PartialBertForMaskedLM, dtype=torch.float32, ks=ks)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["partial_lengths"] == LENGTHS and config["partial_format_version"] == version
    assert config["partial_lengths_k"] == [4, *KS[ks].values()]
    loaded = PartialBertForMaskedLM.from_pretrained(tmp_path)
    for b in (8, 16, 32):
        for layer in model.config.partial_layers:
            want, got = model.get_pattern(layer, b), loaded.get_pattern(layer, b)
            assert torch.equal(want.indices, got.indices) and torch.equal(want.reconstruction, got.reconstruction)
    ids, mask, _ = _batch()
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids=ids, attention_mask=mask).logits,
                           model(input_ids=ids, attention_mask=mask).logits)
    state = load_file(tmp_path / "model.safetensors")
    name = ("bert.encoder.layer.0.attention.self.reconstruction_len16" if mode == "per_layer"
            else "bert.encoder.partial_pattern_len16.reconstruction")
    broken = {k: v for k, v in state.items() if k != name}
    save_file(broken, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"missing.*{name.removeprefix('bert.')}|missing.*{name}"):
        PartialBertForMaskedLM.from_pretrained(tmp_path)
    save_file({**broken, name: state[name][:, :-1].contiguous()}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="wrong shape"):
        PartialBertForMaskedLM.from_pretrained(tmp_path, ignore_mismatched_sizes=True)


def test_set_pattern_refuses_buckets_of_other_lengths():
    model = _model("common", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"length buckets \[4, 32\].*partial_lengths=\[4, 8, 16, 32\]"):
        model.set_pattern(PatternBuckets({32: _random_pattern(32, K, 0)}, exact_lengths=[4]))
    with pytest.raises(ValueError, match="length buckets"):
        model.set_pattern(_random_pattern(32, K, 0))  # one bucket for a model of four
    with pytest.raises(ValueError, match=r"a k per bucket of \[4, 5, 9, 6\].*partial_lengths_k=\[4, 6, 6, 6\]"):
        model.set_pattern(_buckets(ks="per_bucket"))
    model.set_pattern(_buckets())  # the right ones install


def test_pattern_buckets_file_round_trip_and_single_pattern_files(tmp_path):
    buckets = _buckets(bias=True)
    buckets.metadata["source_model"] = "x"
    buckets.save(tmp_path / "b.safetensors")
    back = PatternBuckets.load(tmp_path / "b.safetensors")
    assert back.lengths == LENGTHS and back.exact_lengths == [4] and back.metadata["source_model"] == "x"
    for b in (8, 16, 32):
        assert torch.equal(back[b].reconstruction, buckets[b].reconstruction)
        assert torch.equal(back[b].bias, buckets[b].bias)
    assert [back.bucket_for(t) for t in (1, 4, 5, 8, 9, 32)] == [4, 4, 8, 8, 16, 32]
    with pytest.raises(ValueError, match="exceeds the longest length bucket 32"):
        back.bucket_for(33)
    single = _random_pattern(32, K, 1)
    single.save(tmp_path / "p.safetensors")
    assert PatternBuckets.load(tmp_path / "p.safetensors").lengths == [32]
    # a k per bucket: each bucket keeps its own, and the file says so (version 2 only then)
    per_bucket = _buckets(ks="per_bucket")
    assert (per_bucket.lengths_k, per_bucket.k, per_bucket.uniform_k) == ([4, 5, 9, K], K, False)
    per_bucket.save(tmp_path / "kb.safetensors")
    back = PatternBuckets.load(tmp_path / "kb.safetensors")
    assert back.lengths_k == [4, 5, 9, K] and torch.equal(back[16].indices, per_bucket[16].indices)
    versions = [json.loads(safe_open(tmp_path / f, "pt").metadata()["hf_partial_attention_buckets"])["format_version"]
                for f in ("b.safetensors", "kb.safetensors")]
    assert versions == ["1", "2"]
    exact8 = PatternBuckets({32: single}, exact_lengths=[8])  # an exact bucket above n's k: its k is b
    assert exact8.lengths_k == [8, K] and exact8[8] is None
    with pytest.raises(ValueError, match="does not match the longest bucket's pattern"):
        PatternBuckets({32: single}, k=K + 1)


@pytest.mark.slow
@pytest.mark.parametrize("ks", KS)
@pytest.mark.parametrize("t, bucket", [(16, 16), (20, 32)])
def test_compile_fullgraph_and_export_run_the_bucket_of_the_padded_length(t, bucket, ks):
    """One specialisation per bucket: under compile/export the batch runs the bucket of its padded length; for a
    batch whose sequences share that bucket this is eager's output, bit for bit (one k, or bucket 16 at its own)."""
    model = _model("common", dtype=torch.float32, ks=ks)
    ids = torch.randint(1, 99, (2, t), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, t - 2:] = 0  # still in the same bucket
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        assert torch.equal(compiled(input_ids=ids, attention_mask=mask).last_hidden_state, ref)
        exported = torch.export.export(model, (), {"input_ids": ids, "attention_mask": mask})
        assert torch.equal(exported.module()(input_ids=ids, attention_mask=mask).last_hidden_state, ref)


@pytest.mark.slow
@pytest.mark.parametrize("ks", KS)
def test_onnx_export_of_a_bucketed_model_runs_its_bucket_in_onnxruntime(ks):
    """ONNX (dynamo exporter): one graph per bucket, of the padded length's bucket, run by onnxruntime."""
    model = _model("common", dtype=torch.float32, ks=ks)
    ids = torch.randint(1, 99, (2, 12), generator=torch.Generator().manual_seed(1))  # bucket 16
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    program = torch.onnx.export(model, (), kwargs={"input_ids": ids, "attention_mask": mask}, dynamo=True)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
        one_bucket = _one_bucket_reference(model, 16, torch.float32)(input_ids=ids,
                                                                     attention_mask=mask).last_hidden_state
    torch.testing.assert_close(ref, one_bucket, atol=1e-5, rtol=0)  # eager runs bucket 16 here
    torch.testing.assert_close(program(input_ids=ids, attention_mask=mask)[0], ref, atol=1e-5, rtol=0)

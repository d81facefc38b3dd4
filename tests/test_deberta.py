"""DeBERTa-v2, whose scores are a content term and position terms (content-to-position, position-to-content) that its
attention module computes itself (adapted to dispatch: `attention_adapters.DisentangledTerms`): a partial layer
computes every term at P only and R reconstructs the rest from their sum; the analysis captures the whole score; the
position projections train through every kernel; the cost model counts the three terms. What DeBERTa-v2 shares with
MPNet (every derive form, peft, compile, k = n = source in every head by remote code) is in
tests/test_position_encoders.py; what the table gives every encoder in tests/test_encoders.py."""


import pytest
import torch

from hf_partial_attention import AttentionPattern, partial_class_for

from test_encoders import tiny_config
from test_position_encoders import N, K, batch as _batch, source


def _source(auto="AutoModelForMaskedLM"):
    return source("deberta-v2", auto)


def _deberta_scores(module, hidden, encoder):
    """Layer ``module``'s whole pre-softmax scores ``(B, H, T, T)`` by DeBERTa's own code (its projections and
    `disentangled_attention_bias`), the reference the adapter is checked against."""
    b, t, _ = hidden.shape
    q = module.transpose_for_scores(module.query_proj(hidden), 4)  # (B·H, T, D)
    k = module.transpose_for_scores(module.key_proj(hidden), 4)
    scale = (8 * 3) ** 0.5  # d_h = 8, content + c2p + p2c
    content = torch.bmm(q, k.transpose(-1, -2) / scale)
    rel = module.disentangled_attention_bias(q, k, encoder.get_rel_pos(hidden), encoder.get_rel_embedding(), 3)
    return (content + rel).view(b, 4, t, t)


def test_every_term_at_p_then_r_from_their_sum():
    """A partial layer's map is softmax(R-completed scores + mask) where the exact scores at P are DeBERTa's whole
    scores there (content and both position terms, by DeBERTa's own code) and the rest R times them."""
    source = _source()
    pattern = AttentionPattern.local(N, K, correlation=0.5)
    model = partial_class_for("deberta-v2", "AutoModelForMaskedLM").from_source(source, pattern, partial_layers=[0])
    model = model.double().eval()
    ids, mask = _batch()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
        encoder = model.deberta.encoder
        hidden = model.deberta.embeddings(input_ids=ids, mask=mask)  # (B, T, hidden)
        whole = _deberta_scores(encoder.layer[0].attention.self, hidden, encoder)  # (B, H, T, T)
        p, r = pattern.indices, pattern.reconstruction.double()
        exact = whole.gather(-1, p.expand(2, 4, N, K))  # (B, H, T, k)
        padded = (mask == 0)[:, None, None, :].expand(2, 4, N, N).gather(-1, p.expand(2, 4, N, K))
        exact = exact.masked_fill(padded, 0.0)  # a padded key enters R as a zero score
        rest = torch.einsum("bhik,ijk->bhij", exact, r)  # (B, H, T, n-k)
        complement = torch.stack([torch.tensor([j for j in range(N) if j not in set(row.tolist())]) for row in p])
        scores = torch.zeros_like(whole).scatter(-1, p.expand(2, 4, N, K), exact)
        scores = scores.scatter(-1, complement.expand(2, 4, N, N - K), rest)
        pair = (mask[:, None, :, None] * mask[:, None, None, :]).bool()  # DeBERTa's mask: padded queries too
        expected = torch.softmax(scores.masked_fill(~pair, torch.finfo(torch.float64).min), dim=-1)
    # DeBERTa's scale is a float32 square root (`scaled_size_sqrt`): the maps agree to its roundoff
    torch.testing.assert_close(out.attentions[0], expected, atol=1e-8, rtol=0)


def test_analysis_captures_the_whole_score():
    """`capture_scores` on a source DeBERTa-v2 reports its whole pre-softmax score (content and position terms: what
    R reconstructs), by DeBERTa's own code, and leaves the source's modules as they were."""
    from transformers.models.deberta_v2.modeling_deberta_v2 import DisentangledSelfAttention

    from hf_partial_attention.analysis.capture import capture_scores

    source = _source("AutoModel")
    ids, mask = _batch()
    captured = {}
    with torch.no_grad():
        reference = source(input_ids=ids, attention_mask=mask).last_hidden_state
        with capture_scores(source, lambda layer, scores: captured.setdefault(layer, scores)):
            under = source(input_ids=ids, attention_mask=mask).last_hidden_state
        hidden = source.embeddings(input_ids=ids, mask=mask)
        whole = _deberta_scores(source.encoder.layer[0].attention.self, hidden, source.encoder)
    # DeBERTa's scale is a float32 square root (`scaled_size_sqrt`): the references agree to its roundoff
    torch.testing.assert_close(captured[0], whole, atol=1e-8, rtol=0)
    torch.testing.assert_close(under, reference, atol=1e-10, rtol=0)
    assert all(type(layer.attention.self) is DisentangledSelfAttention for layer in source.encoder.layer)


def test_the_position_projections_train_through_the_partial_layers():
    """The gradient of the relative embeddings and of every projection, by the fused kernel's hand-written backward
    (P per query and P per head), equals the reference kernel's; Triton, which scores q·k only, is refused in one
    line naming the fix."""
    from hf_partial_attention.pattern_layers import LayerPatterns

    heads = LayerPatterns({layer: [AttentionPattern.local(N, K, correlation=0.2 + 0.2 * h) for h in range(4)]
                           for layer in (0, 1)})
    for pattern in (AttentionPattern.local(N, K, correlation=0.5), heads):
        grads = {}
        for kernel in ("gather", "fused"):
            model = partial_class_for("deberta-v2", "AutoModelForMaskedLM").from_source(
                _source(), pattern, partial_implementation=kernel, reconstruction="fixed").double().train()
            ids, mask = _batch()
            model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
            grads[kernel] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert grads["fused"].keys() == grads["gather"].keys()
        assert grads["gather"]["deberta.encoder.rel_embeddings.weight"].abs().max() > 1e-8
        for name, grad in grads["gather"].items():
            torch.testing.assert_close(grads["fused"][name], grad, atol=1e-10, rtol=0, msg=name)
    model.set_partial_implementation("triton")
    with pytest.raises(ValueError, match="position terms") as error:
        model(input_ids=ids, attention_mask=mask, labels=ids)
    assert "\n" not in str(error.value)


def test_the_cost_model_counts_the_three_terms():
    """An exact DeBERTa-v2 score costs three dot products of d_h (content, c2p, p2c): the saving at k is that of
    d_h' = 3·d_h, which the model card states; BERT's scores stay one term."""
    from hf_partial_attention.cost import score_cost, score_dim
    from hf_partial_attention.model_card_text import partial_section

    model = partial_class_for("deberta-v2").from_source(_source("AutoModel"), AttentionPattern.local(N, K))
    assert score_dim(model.config) == 3 * 8 and score_dim(tiny_config("bert")) == 8
    card = partial_section(model.config, "deberta.")
    cost = score_cost(N, K, 24).per_query(N)
    assert f"{cost.total} instead of {cost.dense}" in card and "score's 3 terms" in card

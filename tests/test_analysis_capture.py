"""Capture of pre-softmax scores: model outputs unchanged, scores exact, unsupported models refused."""

import copy

import pytest
import torch
from transformers import (
    BertConfig,
    BertModel,
    BloomConfig,
    BloomModel,
    DistilBertConfig,
    DistilBertModel,
    ElectraConfig,
    ElectraModel,
    GPT2Config,
    GPT2Model,
    LlamaConfig,
    LlamaModel,
    RobertaConfig,
    RobertaModel,
)

from hf_partial_attention.analysis.capture import CAPTURE_IMPLEMENTATION, capture_scores, require_calls

TINY = dict(vocab_size=99)
MODELS = {
    "bert": (BertModel, lambda: BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=37, **TINY)),
    "roberta": (RobertaModel, lambda: RobertaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                    intermediate_size=37, **TINY)),
    "distilbert": (DistilBertModel, lambda: DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=37, **TINY)),
    "electra": (ElectraModel, lambda: ElectraConfig(embedding_size=16, hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=4, intermediate_size=37, **TINY)),
    "llama-causal-gqa": (LlamaModel, lambda: LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                         num_key_value_heads=2, intermediate_size=37, **TINY)),
    "gpt2-causal": (GPT2Model, lambda: GPT2Config(n_embd=32, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2,
                                                  **TINY)),
}


def _models(name):
    cls, make = MODELS[name]
    torch.manual_seed(0)
    eager = cls._from_config(make(), attn_implementation="eager").eval()
    other = copy.deepcopy(eager)
    other.set_attn_implementation("sdpa")
    return eager, other


@pytest.mark.parametrize("name", sorted(MODELS))
def test_outputs_unchanged_and_scores_are_pre_softmax_logits(name):
    eager, model = _models(name)
    ids = torch.randint(5, 99, (3, 10))
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0  # padding: the mask must still reach the attention
    captured = []
    with torch.no_grad():
        ref = eager(input_ids=ids, attention_mask=mask, output_attentions=True)
        with capture_scores(model, lambda layer, s: captured.append((layer, s))):
            out = model(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, atol=1e-5, rtol=0)
    assert [layer for layer, _ in captured] == [0, 1]
    for (layer, scores), probs in zip(captured, ref.attentions):
        assert scores.shape == (3, 4, 10, 10)
        # softmax(scores + mask) must be the eager attention probabilities
        keep = mask[:, None, None, :].bool()
        if "causal" in name:
            keep = keep & torch.ones(10, 10, dtype=torch.bool).tril()
        recomputed = scores.masked_fill(~keep, float("-inf")).softmax(-1)
        rows = keep.any(-1, keepdim=True)
        torch.testing.assert_close(recomputed * rows, probs * rows, atol=1e-5, rtol=0)
    assert model.config._attn_implementation == "sdpa"  # restored


def test_scores_match_hand_computed_qk(tiny_bert_config):
    torch.manual_seed(0)
    model = BertModel(tiny_bert_config).eval()
    ids = torch.randint(5, 99, (2, 8))
    captured = {}
    hidden = {}
    handle = model.encoder.layer[0].register_forward_pre_hook(lambda m, args: hidden.setdefault("x", args[0]))
    with torch.no_grad(), capture_scores(model, lambda layer, s: captured.setdefault(layer, s)):
        model(input_ids=ids)
    handle.remove()
    attn = model.encoder.layer[0].attention.self
    q = attn.query(hidden["x"]).view(2, 8, 4, 8).transpose(1, 2)
    k = attn.key(hidden["x"]).view(2, 8, 4, 8).transpose(1, 2)
    torch.testing.assert_close(captured[0], q @ k.transpose(-1, -2) / 8 ** 0.5, atol=1e-6, rtol=1e-5)


def test_real_minilm_outputs_unchanged(minilm_path):
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_path)
    batch = tok(["A short one.", "A somewhat longer sentence that needs no padding at all."], padding=True,
                return_tensors="pt")
    eager = AutoModel.from_pretrained(minilm_path, attn_implementation="eager").eval()
    model = AutoModel.from_pretrained(minilm_path).eval()
    layers = []
    with torch.no_grad():
        ref = eager(**batch).last_hidden_state
        with capture_scores(model, lambda layer, s: layers.append((layer, tuple(s.shape)))):
            out = model(**batch).last_hidden_state
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert [layer for layer, _ in layers] == list(range(6))
    assert layers[0][1][:2] == (2, 12)


def test_model_without_attention_interface_is_refused():
    model = BloomModel(BloomConfig(vocab_size=99, hidden_size=32, n_layer=2, n_head=4))
    with pytest.raises(ValueError, match="AttentionInterface"):
        with capture_scores(model, lambda layer, s: None):
            pass


def test_non_transformers_model_is_refused():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        with capture_scores(torch.nn.Linear(2, 2), lambda layer, s: None):
            pass


def test_require_calls_after_a_real_forward_pass(tiny_bert_config):
    torch.manual_seed(0)
    model = BertModel(tiny_bert_config).eval()
    ids = torch.randint(5, 99, (2, 6))
    layers = []
    with torch.no_grad(), capture_scores(model, lambda layer, s: layers.append(layer)) as state:
        assert model.config._attn_implementation == CAPTURE_IMPLEMENTATION
        model(input_ids=ids)
        require_calls(state, model)  # the forward went through the capture function: no error
    assert state.calls == tiny_bert_config.num_hidden_layers == 2 and layers == [0, 1]


def test_no_calls_is_a_clear_error(tiny_bert_config):
    # A forward pass that bypasses the capture function (the model switched back to eager inside the context,
    # as a model with its own attention code would): the sink sees nothing and require_calls says so.
    torch.manual_seed(0)
    model = BertModel(tiny_bert_config).eval()
    ids = torch.randint(5, 99, (2, 6))
    layers = []
    with torch.no_grad(), capture_scores(model, lambda layer, s: layers.append(layer)) as state:
        model.set_attn_implementation("eager")
        out = model(input_ids=ids).last_hidden_state
        assert out.shape == (2, 6, tiny_bert_config.hidden_size)  # the forward pass did run
        with pytest.raises(ValueError, match="No attention call of BertModel went through AttentionInterface.*"
                                             "no scores were captured"):
            require_calls(state, model)
    assert state.calls == 0 and layers == []

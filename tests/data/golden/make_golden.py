"""Write tiny PartialBert checkpoints with one release's code, one per R mode, plus reference outputs.

v0.1.0-*: written by 0.1.0; v0.2.0-*: by 0.2.0 (commit 4085891), before the attention path became one package.
Only config.json, model.safetensors and reference.pt are kept (the copied modeling code is not)."""
import sys
import torch
import hf_partial_attention as hpa
from hf_partial_attention import PartialBertConfig, PartialBertForMaskedLM
out = sys.argv[1]
for mode in ("fixed", "common", "per_layer"):
    torch.manual_seed(0)
    cfg = PartialBertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=3, num_attention_heads=2,
                            intermediate_size=8, max_position_embeddings=16, partial_seq_len=8, partial_k=3,
                            reconstruction=mode, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    m = PartialBertForMaskedLM(cfg).eval()
    # a non-default pattern and R, so a fallback to the default would be visible
    g = torch.Generator().manual_seed(1)
    idx = torch.sort(torch.argsort(torch.rand(8, 8, generator=g), -1)[:, :3], -1).values
    rec = torch.randn(8, 5, 3, generator=g) * 0.3
    m.set_pattern(hpa.AttentionPattern(idx, rec))
    if mode == "per_layer":
        with torch.no_grad():
            m.bert.encoder.layer[1].attention.self.reconstruction.add_(0.05)
    m.save_pretrained(f"{out}/{mode}")
    ids = torch.tensor([[2, 5, 7, 11, 13, 17, 19, 23], [2, 4, 6, 8, 10, 0, 0, 0]])
    mask = torch.tensor([[1]*8, [1]*5 + [0]*3])
    with torch.no_grad():
        logits = m(input_ids=ids, attention_mask=mask).logits
    torch.save({"input_ids": ids, "attention_mask": mask, "logits": logits}, f"{out}/{mode}/reference.pt")
print("ok")

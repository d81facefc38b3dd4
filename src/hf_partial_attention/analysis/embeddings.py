"""How far a converted model's sentence embeddings move: cosine of mean-pooled embeddings to the original."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

__all__ = ["mean_pooled_embeddings", "embedding_cosines", "summarize_cosines"]


@torch.no_grad()
def mean_pooled_embeddings(model, batches, progress: bool = False, desc: str = "embed") -> torch.Tensor:
    """Mean of the last hidden states over non-padding tokens (sentence-transformers' pooling): ``-> (N, hidden)``.

    Args:
        batches: iterable of dicts with ``input_ids`` and ``attention_mask`` ``(b, T)``.
    """
    out = []
    for batch in tqdm(batches, desc=desc, disable=not progress, leave=False):
        hidden = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (b, T, 1)
        out.append((hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0))  # (b, hidden)
    return torch.cat(out)


def embedding_cosines(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of matching rows: ``(N, d), (N, d) -> (N,)``."""
    return torch.nn.functional.cosine_similarity(reference.double(), other.double(), dim=-1)


def summarize_cosines(cosines: torch.Tensor) -> dict[str, float]:
    """Mean, median, 5th percentile and minimum."""
    c = cosines.double()
    return {"mean": float(c.mean()), "median": float(c.median()), "p05": float(torch.quantile(c, 0.05)),
            "min": float(c.min()), "count": int(c.numel())}


def window_batches(windows: torch.Tensor, batch_size: int = 16) -> list[dict]:
    """Full windows ``(S, n)`` as unpadded batches."""
    return [{"input_ids": windows[i:i + batch_size], "attention_mask": torch.ones_like(windows[i:i + batch_size])}
            for i in range(0, windows.shape[0], batch_size)]


def text_batches(tokenizer, texts, max_length: int, batch_size: int = 16) -> list[dict]:
    """Texts tokenized with special tokens, truncated to ``max_length`` and padded per batch."""
    out = []
    for i in range(0, len(texts), batch_size):
        enc = tokenizer(list(texts[i:i + batch_size]), padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt")
        out.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    return out


__all__ += ["window_batches", "text_batches"]

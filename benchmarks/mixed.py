"""A batch of mixed input lengths: length buckets vs zero-fill vs dense eager and SDPA, whole models, inference.

Real inputs are 10–75 tokens. A batch of them, padded to its longest member, runs in a one-bucket PartialBert
(zero-fill: every sequence in n's P and R, cut to the batch's padded length) or in a bucketed one (each sequence in
the smallest bucket >= its own length: sub-batches cut to their bucket). Issue 23's goal: the buckets cost no more
than zero-fill. With ``bucket_k`` in the spec (``{b: k_b}``), a fifth model runs those buckets at their own k
(``partial_lengths_k``: what `derive --bucket-k` makes). Every model has the same weights; timed side by side, round by
round (`timing.interleaved_times`).
"""

from __future__ import annotations

import statistics

import torch
from transformers import BertConfig, BertModel

from hf_partial_attention import AttentionPattern, PartialBertModel
from hf_partial_attention.pattern_buckets import PatternBuckets
from timing import interleaved_times, paired_ratios

__all__ = ["mixed_length_rows", "mixed_batch"]


def mixed_batch(b: int, low: int, high: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``b`` inputs of lengths drawn uniformly in [low, high], padded to the longest: ``(ids, mask)`` ``(b, T)``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (b,), generator=g)
    t = int(lengths.max())
    ids = torch.randint(1000, 30000, (b, t), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()  # (b, T): 1 on each input's own tokens
    return ids * mask, mask


def mixed_length_rows(spec: dict, repeats: int) -> list[dict]:
    """Rows for ``spec``: ``layers, hidden, heads, b, n, k, lengths`` (the buckets), ``t_range`` ([low, high]) and
    optionally ``bucket_k`` (``{b: k_b}``)."""
    torch.manual_seed(0)
    n, k, heads = spec["n"], spec["k"], spec["heads"]
    cfg = dict(num_hidden_layers=spec["layers"], hidden_size=spec["hidden"], num_attention_heads=heads,
               intermediate_size=4 * spec["hidden"], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
               max_position_embeddings=max(512, n))
    bert = BertModel(BertConfig(**cfg, attn_implementation="eager"))
    sdpa = BertModel(BertConfig(**cfg, attn_implementation="sdpa"))
    sdpa.load_state_dict(bert.state_dict())
    def buckets(own: dict) -> PatternBuckets:
        ks = {b: min(int(own.get(b, own.get(str(b), k))), b) for b in spec["lengths"]}
        return PatternBuckets({b: AttentionPattern.local(b, kb) for b, kb in ks.items() if kb < b or b == n},
                              exact_lengths=[b for b, kb in ks.items() if kb == b and b != n])

    models = {"BertModel eager": bert, "BertModel sdpa": sdpa,
              "PartialBert zero-fill": PartialBertModel.from_bert(bert, AttentionPattern.local(n, k),
                                                                  reconstruction="fixed", attn_implementation="sdpa"),
              "PartialBert buckets": PartialBertModel.from_bert(bert, buckets({}), reconstruction="fixed",
                                                                attn_implementation="sdpa")}
    if spec.get("bucket_k"):
        models["PartialBert buckets, own k"] = PartialBertModel.from_bert(bert, buckets(spec["bucket_k"]),
                                                                         reconstruction="fixed",
                                                                         attn_implementation="sdpa")
    ids, mask = mixed_batch(spec["b"], *spec["t_range"])

    def infer(model):
        model.eval()

        def run():
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask)
        return run

    times = interleaved_times({name: infer(m) for name, m in models.items()}, repeats)
    rows = []
    for name, model in models.items():
        eager, sdpa_r = paired_ratios(times, name, "BertModel eager"), paired_ratios(times, name, "BertModel sdpa")
        zero = paired_ratios(times, name, "PartialBert zero-fill")
        rows.append({"mode": "inference, mixed lengths", "model": name, "s": statistics.median(times[name]),
                     "round_s": times[name], "ratio": eager["median"], "sdpa_ratio": sdpa_r["median"],
                     "zero_fill_ratio": zero["median"], "zero_fill_ratio_range": [zero["low"], zero["high"]],
                     "rounds": repeats, "padded_length": int(ids.shape[1]),
                     "input_lengths": mask.sum(1).tolist(),
                     "lengths_k": model.config.partial_lengths_k if isinstance(model, PartialBertModel) else None,
                     **spec})
    return rows

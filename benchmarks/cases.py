"""The benchmarked computations: dense attention, every partial implementation, peers, whole models."""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import BertConfig, BigBirdConfig, NystromformerConfig
from transformers.models.bert.modeling_bert import BertSelfAttention
from transformers.models.big_bird.modeling_big_bird import BigBirdBlockSparseAttention, BigBirdModel
from transformers.models.nystromformer.modeling_nystromformer import NystromformerSelfAttention

from hf_partial_attention import AttentionPattern, PartialBertConfig, partial_class_for
from hf_partial_attention.architectures import ARCHITECTURES
from hf_partial_attention.cost import forward_ratio
from hf_partial_attention.modeling_partial_bert import PartialBertPattern
from hf_partial_attention.partial_layer import make_partial
from hf_partial_attention.analysis.selection import DEFAULT_BLOCK_ROWS
from hf_partial_attention.attention_common import DerivedState, PatternLayout, PatternStructure
from hf_partial_attention.attention_dispatch import auto_kernel, partial_attention_forward

# Pattern families, named as `derive --family` names them (their structure: `analysis.selection.FAMILY_STRUCTURE`).
PATTERNS = ("per_query", "columns", "blocks", "shared_blocks")
SHARED_ROWS = DEFAULT_BLOCK_ROWS  # rows per block sharing keys (blocks) and R too (shared_blocks)


def pattern_indices(family: str, n: int, k: int) -> torch.Tensor:
    """P for timing. Speed depends on the structure only, not on which keys: per_query uses each query's k
    nearest keys (every row its own set, like the greedy per-query pattern); columns one shared set;
    blocks: each block of gcd(n, 32) rows shares the k keys around it (block-local windows, any k);
    shared_blocks: the blocks' P, with R shared by the block's rows too (`shared_r`)."""
    if family == "per_query":
        return AttentionPattern.local(n, k).indices
    if family == "columns":
        return torch.linspace(0, n - 1, k).round().long().unique().expand(n, k).clone()
    if family in ("blocks", "shared_blocks"):
        rows = math.gcd(n, SHARED_ROWS)
        starts = (torch.arange(0, n, rows) + rows // 2 - k // 2).clamp(0, n - k)  # (n / rows,)
        block_keys = starts[:, None] + torch.arange(k)  # (n / rows, k)
        return block_keys.repeat_interleave(rows, 0)  # (n, k)
    raise ValueError(f"unknown pattern family {family!r}")


def mac_ratio(n: int, d: int, k: int, implementation: str, indices: torch.Tensor) -> float:
    """Multiply-adds of one kernel's partial attention forward over dense (`hf_partial_attention.cost.forward_ratio`),
    counting what the kernel computes: the whole QKᵀ where it gets the exact scores that way
    (every kernel but gather and triton for per-query patterns), all of [I | R] for fused and tiled."""
    per_query = PatternLayout.from_indices(indices).structure is PatternStructure.PER_QUERY
    dense_exact = per_query and implementation in ("fused", "tiled")
    return forward_ratio(n, k, d, dense_reconstruction=implementation in ("fused", "tiled"), dense_exact=dense_exact)


class AttentionInputs:
    """q, k, v (B, H, n, d) and R for one shape.

    q, k and v are laid out as a model's projections give them to the attention function: ``(B, n, H, d)``
    tensors seen as ``(B, H, n, d)`` (transposed views, not contiguous), so every kernel, eager and SDPA pay what
    they pay in a model for that layout."""

    def __init__(self, b: int, h: int, n: int, d: int, k: int, requires_grad: bool, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        # (B, n, H, d) leaves, as reshaped projections are; q/k/v are their (B, H, n, d) views
        self.leaves = [torch.randn(b, n, h, d, generator=g).requires_grad_(requires_grad) for _ in range(3)]
        self.r = (0.1 * torch.randn(n, n - k, k, generator=g)).requires_grad_(requires_grad)
        self.r_shared = shared_r(self.r.detach(), n).requires_grad_(requires_grad)
        self.scaling = d**-0.5
        self.module = nn.Module().train(requires_grad)  # dropout 0 either way

    q = property(lambda self: self.leaves[0].transpose(1, 2))  # (B, H, n, d) view
    k = property(lambda self: self.leaves[1].transpose(1, 2))
    v = property(lambda self: self.leaves[2].transpose(1, 2))

    def tensors(self) -> list[torch.Tensor]:
        """The leaves whose gradients a backward fills (cleared between repeats)."""
        return [*self.leaves, self.r, self.r_shared]

    def dense_eager(self):
        s = torch.matmul(self.q, self.k.transpose(-1, -2)) * self.scaling
        return torch.matmul(s.softmax(-1), self.v).transpose(1, 2).contiguous()

    def sdpa(self):
        out = nn.functional.scaled_dot_product_attention(self.q, self.k, self.v, scale=self.scaling)
        return out.transpose(1, 2).contiguous()

    def partial(self, implementation: str, indices: torch.Tensor, family: str = "per_query"):
        """Partial attention of one kernel; the attention map is not asked for (as in a model's forward)."""
        r = self.r_shared if family == "shared_blocks" else self.r
        layout = PatternLayout.from_indices(indices, r)  # built once, as a model's pattern module keeps it
        derived = DerivedState()  # W of a frozen R kept across calls, as in a model
        return lambda: partial_attention_forward(
            self.module, self.q, self.k, self.v, None, layout=layout, reconstruction=r,
            scaling=self.scaling, implementation=implementation, need_weights=False, derived=derived)[0]

    def resolved(self, indices: torch.Tensor, family: str, training: bool) -> str:
        """The kernel ``partial_implementation="auto"`` runs for this pattern."""
        r = self.r_shared if family == "shared_blocks" else self.r
        return auto_kernel(PatternLayout.from_indices(indices, r), self.q.device, self.q.shape[-1], training)


def shared_r(r: torch.Tensor, n: int) -> torch.Tensor:
    """R with every block of `SHARED_ROWS` rows sharing its first row's matrix."""
    rows = math.gcd(n, SHARED_ROWS)
    return r[::rows].repeat_interleave(rows, 0).clone()


def peer_modules(b: int, n: int, hidden: int, heads: int, k: int, seed: int = 0) -> dict[str, callable]:
    """Self-attention modules with their q/k/v projections (hidden states in, context out), same shapes."""
    torch.manual_seed(seed)
    x = torch.randn(b, n, hidden)
    bert_cfg = BertConfig(hidden_size=hidden, num_attention_heads=heads, attention_probs_dropout_prob=0.0,
                          max_position_embeddings=max(512, n))
    bert_cfg._attn_implementation = "eager"
    dense = BertSelfAttention(bert_cfg).eval()
    pcfg = PartialBertConfig(hidden_size=hidden, num_attention_heads=heads, attention_probs_dropout_prob=0.0,
                             partial_seq_len=n, partial_k=k, max_position_embeddings=max(512, n),
                             partial_implementation="fused")
    encoder = nn.Module()  # the layer reads P and R from its encoder's pattern module
    encoder.partial_pattern = PartialBertPattern(pcfg)
    with torch.no_grad():  # the columns pattern, installed as set_pattern does
        encoder.partial_pattern.indices.copy_(pattern_indices("columns", n, k))
        encoder.partial_pattern.reconstruction.copy_(0.1 * torch.randn(n, n - k, k))
        encoder.partial_pattern.refresh_layout()
    partial = BertSelfAttention(pcfg)  # made partial in place, as a PartialBert layer is
    make_partial(partial, encoder, None, pcfg)
    partial.eval()
    landmarks = min(64, n // 2)  # HF's default 64 landmarks; fewer for tiny test shapes
    nys_cfg = NystromformerConfig(hidden_size=hidden, num_attention_heads=heads, segment_means_seq_len=n,
                                  num_landmarks=landmarks, attention_probs_dropout_prob=0.0)
    nys = NystromformerSelfAttention(nys_cfg).eval()
    # Block-sparse attention needs n >= (5 + 2·random blocks)·block; below that HF falls back to dense.
    block, rand = (32, 2) if n > 256 else (8, 2) if n >= 128 else (2, 1)
    bb_cfg = BigBirdConfig(hidden_size=hidden, num_attention_heads=heads, block_size=block, num_random_blocks=rand,
                           attention_type="block_sparse", max_position_embeddings=max(4096, n))
    bigbird = BigBirdBlockSparseAttention(bb_cfg, seed=0).eval()
    blocked, band, from_mask, to_mask = BigBirdModel.create_masks_for_block_sparse_attn(torch.ones(b, n), block)
    return {
        "bert_eager": lambda: dense(x)[0],
        "partial_fused_columns": lambda: partial(x)[0],
        f"nystromformer_{landmarks}_landmarks": lambda: nys(x)[0],
        f"bigbird_block{block}_rand{rand}": lambda: bigbird(x, band, from_mask, to_mask, blocked, blocked)[0],
    }


def base_models(layers: int, hidden: int, heads: int, n: int, k: int, seed: int = 0, arch: str = "bert") -> dict:
    """The source model (eager and SDPA) and its partial models with identical weights: every layer but the last
    partial, the "shared" pattern (P and R shared by blocks of rows; R fixed: a trained R would get per-row gradients
    and stop being shared, see README) and, for BERT, for comparison, the per-query nearest-keys pattern;
    ``partial_implementation="auto"``, SDPA in the exact last layer. ``arch``: a source ``model_type`` of
    `architectures.ARCHITECTURES` (``"roberta"``: RobertaModel and PartialRobertaModel, named so)."""
    torch.manual_seed(seed)
    entry = ARCHITECTURES[arch]
    config_class, source_class = entry.config_class(), entry.source_class()
    cfg = dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, intermediate_size=4 * hidden,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
               max_position_embeddings=max(512, n) + (2 if arch != "bert" else 0))  # RoBERTa's positions start at 2
    eager = source_class(config_class(**cfg, attn_implementation="eager"))
    sdpa = source_class(config_class(**cfg, attn_implementation="sdpa"))
    sdpa.load_state_dict(eager.state_dict())
    local = AttentionPattern.local(n, k)
    shared = AttentionPattern(pattern_indices("shared_blocks", n, k), shared_r(local.reconstruction, n))
    name = source_class.__name__
    models = {f"{name} eager": eager, f"{name} sdpa": sdpa}
    patterns = (("shared", shared), ("per_query", local)) if arch == "bert" else (("shared", shared),)
    for kind, pattern in patterns:
        models[f"Partial{entry.prefix} {kind}"] = partial_class_for(arch).from_source(
            eager, pattern, reconstruction="fixed", attn_implementation="sdpa")
    return models

"""The cost model: multiply-adds of one head's attention scores, exact and reconstructed (docs/method.md#cost-model).

One exact score costs d_h multiply-adds (a dot product of a query and a key); one reconstructed score costs k
(a row of R times the k exact scores it is built from). The softmax and the product with V are the same for
every method and are not counted. Model cards, analysis reports, the baselines and the benchmarks all take
their numbers from here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ScoreCost", "score_cost", "score_terms", "score_dim", "dense_cost", "nystrom_cost", "forward_ratio",
           "saving_warning", "SCOPES", "bucket_savings", "distribution_saving", "reconstruction_bytes",
           "memory_warning"]

SCOPES = ("per_query", "whole")


@dataclass(frozen=True)
class ScoreCost:
    """Multiply-adds of one head's n×n scores: the exact part, the reconstruction and dense ``QKᵀ``."""

    exact: int
    reconstruction: int
    dense: int

    @property
    def total(self) -> int:
        return self.exact + self.reconstruction

    @property
    def relative(self) -> float:
        """``total / dense``: below 1 only when the method saves work."""
        return self.total / self.dense

    @property
    def saving(self) -> float:
        """``1 − total / dense`` (negative when reconstruction costs more than it saves)."""
        return 1.0 - self.relative

    def per_query(self, n: int) -> "ScoreCost":
        """The same cost for one query row (divides every count by n; exact for the per-query setting)."""
        return ScoreCost(self.exact // n, self.reconstruction // n, self.dense // n)


def score_terms(config) -> int:
    """Dot products of d_h in one attention score: 1 (q·k) but in DeBERTa-v2 with relative attention, 1 plus its
    position terms (content-to-position, position-to-content), each computed at P in a partial layer."""
    model_type = str(getattr(config, "model_type", ""))
    if model_type.replace("partial_", "").replace("_", "-") == "deberta-v2" and getattr(config, "relative_attention",
                                                                                         False):
        return 1 + sum(kind in (getattr(config, "pos_att_type", None) or []) for kind in ("c2p", "p2c"))
    return 1


def score_dim(config) -> int | None:
    """Multiply-adds of one exact score, the cost model's ``d_h``: the head dimension (``head_dim``, else hidden size
    over heads) times `score_terms` (DeBERTa-v2's three terms cost three dot products)."""
    explicit = getattr(config, "head_dim", None)
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    d_head = int(explicit) if explicit else (hidden // heads if hidden and heads else None)
    return None if d_head is None else d_head * score_terms(config)


def dense_cost(n: int, d_head: int) -> int:
    """Dense ``Q Kᵀ`` of one head: ``n²·d_h``."""
    return n * n * d_head


def score_cost(n: int, k: int, d_head: int, scope: str = "per_query") -> ScoreCost:
    """Cost of one head's scores with k exact scores per query (``per_query``) or in all (``whole``).

    - per_query: ``n·k·d_h`` exact + ``n·(n−k)·k`` reconstructed, so it saves work only for k < d_h;
    - whole: ``k·d_h`` exact + ``(n² − k)·k`` reconstructed (one R over all n² pairs).

    At n = 128, d_h = 64: k = 32 saves 37.5 %, k = 24 saves 50.8 %; at d_h = 32 (MiniLM) k = 16 saves 43.8 %.
    """
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}.")
    size = n if scope == "per_query" else n * n
    if n < 1 or d_head < 1 or not 1 <= k <= size:
        raise ValueError(f"Need n >= 1, d_head >= 1 and 1 <= k <= {size} for scope={scope!r}; "
                         f"got n={n}, k={k}, d_head={d_head}.")
    if scope == "per_query":
        return ScoreCost(n * k * d_head, n * (n - k) * k, dense_cost(n, d_head))
    return ScoreCost(k * d_head, (n * n - k) * k, dense_cost(n, d_head))


def saving_warning(n: int, k: int, d_head: int) -> str | None:
    """A sentence for the user when per-query k saves no work (``k·d_h + (n−k)·k ≥ n·d_h``), else None.

    Derive and convert log it: such a pattern is fine for analysis, but a checkpoint built from it computes at
    least as many multiply-adds as dense attention.
    """
    cost = score_cost(n, k, d_head).per_query(n)
    if cost.total < cost.dense:
        return None
    return (f"k={k} saves no attention work at n={n}, d_h={d_head}: k·d_h + (n−k)·k = {cost.total} >= "
            f"n·d_h = {cost.dense} multiply-adds per query (a saving of {100 * cost.saving:.1f} %). "
            f"Per-query partial attention pays only for k < d_h; pick a smaller k.")


def nystrom_cost(n: int, m: int, d_head: int) -> int:
    """Nyström CUR with m landmark rows and columns: the exact rows and columns (``2nm − m²`` scores),
    ``m³`` for the pseudo-inverse and the products filling the other ``(n − m)²`` scores."""
    exact = 2 * n * m - m * m
    return exact * d_head + m ** 3 + (n - m) * m * m + (n - m) ** 2 * m


def forward_ratio(n: int, k: int, d_head: int, *, dense_reconstruction: bool = False,
                  dense_exact: bool = False) -> float:
    """Multiply-adds of a partial attention forward over dense, per query: scores plus the product with V,
    ``(k·d_h + (n−k)·k + n·d_h) / (2·n·d_h)`` (the benchmarks' lower bound on the time ratio).

    ``dense_reconstruction`` counts what a kernel that multiplies the exact scores by the full ``[I | R]``
    (n·k per query, the fused kernel) does instead of ``(n−k)·k``. ``dense_exact`` counts what a kernel that
    gets the exact scores from the whole ``QKᵀ`` and then selects P does (n·d_h per query instead of k·d_h): every
    kernel but ``gather`` does so for per-query patterns, whose rows share no keys. Then the ratio exceeds 1 for
    every k (``(2·d_h + k) / (2·d_h)`` with ``[I | R]``), and only eager attention's own overheads leave room.
    """
    row = score_cost(n, k, d_head).per_query(n)
    exact = row.dense if dense_exact else row.exact
    recon = n * k if dense_reconstruction else row.reconstruction
    return (exact + recon + n * d_head) / (2 * n * d_head)


def _bucket_ks(lengths, k) -> dict[int, int]:
    """Bucket -> its k: ``k`` an int (every bucket's, as ``min(k, b)``) or one k per bucket of ``lengths``."""
    lengths = [int(b) for b in lengths]
    ks = [k] * len(lengths) if isinstance(k, int) else [int(v) for v in k]
    if len(ks) != len(lengths):
        raise ValueError(f"k must be an int or one k per bucket of {lengths}, got {k!r}.")
    return {b: min(kb, b) for b, kb in zip(lengths, ks)}


def bucket_savings(lengths, k, d_head: int) -> dict[int, float]:
    """Length bucket b -> the saving of its scores per query and head: ``score_cost(b, k_b, d_h)``'s for k_b < b, 0
    for the buckets that run exactly. ``k``: an int for every bucket, or one per bucket (``partial_lengths_k``)."""
    return {b: (score_cost(b, kb, d_head).saving if kb < b else 0.0) for b, kb in _bucket_ks(lengths, k).items()}


def distribution_saving(lengths, k, d_head: int, token_lengths) -> float:
    """The saving of QKᵀ multiply-adds over a set of inputs of ``token_lengths`` tokens, each run in its bucket (the
    smallest b >= T, as the model runs it) against dense attention at its own length T.

    An input of T < b tokens computes, per query, k·d_h exact and (b−k)·k reconstructed multiply-adds in bucket b
    (the reconstruction still fills b − k scores), against T·d_h for dense attention over its T keys; summed over
    its T queries. Exact buckets cost what dense does. A negative value: the partial model computes more. ``k``: an
    int for every bucket, or one per bucket of ``lengths`` (``partial_lengths_k``)."""
    ks = _bucket_ks(lengths, k)
    lengths = sorted(ks)
    partial = dense = 0
    for t in token_lengths:
        t = int(t)
        b = next((b for b in lengths if b >= t), None)
        if b is None:
            raise ValueError(f"an input of {t} tokens exceeds the longest bucket {lengths[-1]}; truncate inputs.")
        dense += t * t * d_head
        kb = ks[b]
        partial += t * t * d_head if kb == b else t * (kb * d_head + (b - kb) * kb)
    return 1.0 - partial / dense if dense else 0.0


# Above this, `memory_warning` speaks: R per (layer, head) grows as layers·heads·n²·k.
R_MEMORY_WARNING_BYTES = 1 << 30


def reconstruction_bytes(n: int, k: int, groups: int, bytes_per_value: int = 4, lengths_k=None) -> int:
    """Bytes of R (n, n−k, k) for ``groups`` distinct Rs (1 pooled, layers per layer, layers·heads per head), over
    every bucket ``{b: k_b}`` of ``lengths_k`` (default: n's alone)."""
    buckets = dict(lengths_k or {n: k})
    return groups * bytes_per_value * sum(b * (b - kb) * kb for b, kb in buckets.items() if kb < b)


def memory_warning(n: int, k: int, layers: int, heads: int | None, lengths_k=None) -> str | None:
    """A warning naming R's size and the alternatives when P and R per layer or per head take over 1 GiB in float32
    (BERT-base per head at n = 512, k = 32: 11 layers × 12 heads of (512, 480, 32), 3.9 GiB); None below."""
    groups = layers * (heads or 1)
    size = reconstruction_bytes(n, k, groups, 4, lengths_k)
    if size <= R_MEMORY_WARNING_BYTES:
        return None
    what = f"{layers} layers × {heads} heads" if heads else f"{layers} layers"
    return (f"R per {'head' if heads else 'layer'} takes {size / 2**30:.1f} GiB in float32 ({what} of ({n}, {n - k}, "
            f"{k})); the model holds it in memory (and W = [I | R] per group once it runs). For less: P and R per "
            "layer (--granularity layer) or pooled, a smaller n or k, or the shared_blocks family (R shared by "
            "blocks of rows).")

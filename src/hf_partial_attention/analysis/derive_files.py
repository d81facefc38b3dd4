"""What every `derive` writes alike, in one place: the tag in its file and section names, the check that the
analysis was collected finely enough for the granularity asked, the k range, and the report rows kept from an earlier
derive into the same folder. Used by `workflow.derive` (pooled), `lengths.derive_lengths` (buckets),
`layers.derive_layers` / `derive_layer_buckets` (per layer or head) and `budget.derive_budget` (a k per layer)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

__all__ = ["file_tag", "bucket_k_suffix", "check_granularity", "check_ks", "keep_previous_rows"]


def bucket_k_suffix(bucket_k: Mapping[int, int] | None) -> str:
    """The file-name part of a per-bucket k: ``"_b64k24"`` for ``{64: 24}``, ``""`` for none."""
    return "".join(f"_b{b}k{k}" for b, k in sorted((bucket_k or {}).items()))


def file_tag(scope: str = "per_query", family: str = "per_query", objective: str = "paper",
             granularity: str | None = None) -> str:
    """``<scope>[_<family>][_<objective>][_<granularity>]``: the part of a pattern file's name (and of its
    ``results.json`` section) that says how it was fitted; the defaults (per-query family, the paper's objective,
    pooled) are left out, so the pooled paper patterns keep their names ``per_query_k<k>``."""
    return "_".join([scope, *([family] if family != "per_query" else []),
                     *([objective] if objective != "paper" else []),
                     *([granularity] if granularity not in (None, "pooled") else [])])


def check_granularity(covs: Iterable, granularity: str, out: str, what: str, inputs: bool = False) -> None:
    """A ValueError naming ``analyze --granularity`` when any covariance of ``covs`` was collected more coarsely than
    ``granularity`` (``"layer"``: per layer or head; ``"head"``: per head) needs; ``what`` names the request."""
    allowed = {"head"} if granularity == "head" else {"layer", "head"}
    coarse = sorted({c.granularity for c in covs} - allowed)
    if coarse:
        raise ValueError(f"{out!r} holds {'bucket ' if inputs else ''}covariances collected with granularity "
                         f"{coarse}: {what} needs each {granularity}'s own; rerun `hf-partial-attention analyze "
                         f"{'--inputs ... ' if inputs else ''}--granularity {granularity}` into it.")


def check_ks(ks, limit: int, out: str, where: str) -> list[int]:
    """``ks`` as sorted distinct ints, each in [1, limit]; otherwise a ValueError naming the range and ``where`` it
    comes from (the seq_len of ``out``, the longest bucket)."""
    ks = sorted({int(k) for k in ks})
    if not ks or not 1 <= ks[0] <= ks[-1] <= limit:
        raise ValueError(f"k must be in [1, {limit}] ({where} of {out!r}), got {ks}; pass --k values in that range.")
    return ks


def keep_previous_rows(previous: dict | None, rows: list[dict], ks) -> list[dict]:
    """``rows`` with an earlier derive's rows of the same section for the ks not derived again whose files remain (a
    second ``derive --k`` adds to the report instead of hiding the first one's patterns), sorted by k."""
    if not previous:
        return rows
    kept = [r for r in previous.get("patterns", []) if r["k"] not in ks and os.path.isfile(r["path"])]
    return sorted([*kept, *rows], key=lambda r: r["k"])

"""What every part of `derive.derive_patterns` shares, in one place: the request (`DeriveRequest`, every axis), the
covariances a run fits on (`Source`) and the files it writes (`PatternSet`); the tag in its file and section names,
the check that the analysis was collected finely enough for the granularity asked, the k range, and the report rows
kept from an earlier derive into the same folder. Used by `derive` and by its parts for the pooled fixed windows
(`derive_windows`), the pooled buckets (`lengths`), groups (`layers`) and a budget over layers (`budget`)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .covariance import ScoreCovariance

__all__ = ["DeriveRequest", "Source", "PatternSet", "file_tag", "bucket_k_suffix", "check_granularity", "check_ks",
           "keep_previous_rows"]

Group = tuple  # (layer or None, head or None): (None, None) is the pooled group


@dataclasses.dataclass
class DeriveRequest:
    """What to derive: every axis of ``hf-partial-attention derive`` (its flags' names).

    ``inputs``: ``"windows"`` (``covariance.safetensors``), ``"buckets"`` (``covariance_len*``) or ``"auto"`` (the
    command line's choice: the buckets when the folder has them, and, pooled, the fixed windows first when it has
    them too, since the buckets' report compares with their patterns). ``batch_size``: held-out inputs per forward
    pass (default 8 windows, 16 bucketed inputs). The budget's fields (``saving`` .. ``name``) are
    `derive.derive_budget`'s."""

    ks: Sequence[int] = ()
    scope: str = "per_query"
    family: str = "per_query"
    objective: str = "paper"
    granularity: str = "pooled"
    bucket_k: Mapping[int, int] | None = None
    saving: str | float | None = None
    budget_layers: Sequence[int] | None = None
    exact_layers: Sequence[int] | None = None
    layer_weights: Mapping[int, float] | None = None
    name: str | None = None
    centered: bool | None = None
    evaluate: bool = True
    baselines: bool = True
    batch_size: int | None = None
    progress: bool = True
    seed: int = 0
    section: str | None = None
    curve_scopes: Sequence[str] | None = None
    inputs: str = "auto"

    @property
    def fit(self) -> dict[str, Any]:
        """The greedy's and R's arguments, the same for every group."""
        return dict(family=self.family, centered=self.centered, objective=self.objective)

    @property
    def tag(self) -> str:
        return file_tag(self.scope, self.family, self.objective, self.granularity)


@dataclasses.dataclass
class Source:
    """The covariances one run fits on: ``{b: covariance}``, the buckets' or the fixed windows' one (b = n)."""

    kind: str  # "windows" | "buckets"
    covs: dict[int, ScoreCovariance]

    @property
    def lengths(self) -> list[int]:
        return list(self.covs)

    @property
    def n(self) -> int:
        return max(self.covs)

    @property
    def meta(self) -> dict[str, Any]:
        return self.covs[self.n].metadata


@dataclasses.dataclass
class PatternSet:
    """One file: its name, the k of each (bucket, layer) (``k >= b``: exact in that bucket), the layers it holds (a
    budget's exact layers are left out) and what its metadata adds."""

    name: str
    k_of: Callable[[int, int | None], int]
    k: int | None = None
    layers: list[int] | None = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)  # the file's own, beside the source's



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

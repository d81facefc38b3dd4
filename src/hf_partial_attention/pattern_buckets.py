"""`PatternBuckets`: P and R for a set of input lengths (length buckets), stored as one safetensors file.

Real inputs are shorter than n. A bucket b holds a per-query pattern for inputs of b positions, fitted on inputs
of that length; an input of T tokens runs the smallest bucket b >= T (`bucket_for`), as if padded to b with keys
scoring zero (docs/method.md, "Length buckets"). A bucket with b <= k needs no pattern: it runs exactly. The file
format is `PatternBuckets.save`'s.

This file is part of the remote-code bundle (imports: torch, safetensors and siblings only).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file

from .pattern import AttentionPattern, open_tagged_file

__all__ = ["PatternBuckets", "PATTERN_BUCKETS_FORMAT_VERSION", "check_lengths", "bucket_for", "is_single_pattern_file"]

# 1: one k for every bucket with a pattern; 2: a k per bucket (header "lengths_k"), written only when they differ.
PATTERN_BUCKETS_FORMAT_VERSION = "2"
_READ_VERSIONS = ("1", "2")
_META_KEY = "hf_partial_attention_buckets"
_PATTERN_META_KEY = "hf_partial_attention"
_EXPECTED = ("a pattern file written by `hf-partial-attention derive` (<out>/patterns/per_query_k<k>.safetensors) "
             "or by PatternBuckets.save / AttentionPattern.save")


def check_lengths(lengths: Iterable[int], field: str = "lengths") -> list[int]:
    """``lengths`` as a sorted list of distinct positive ints; a ValueError naming ``field`` otherwise."""
    try:
        values = [int(b) for b in lengths]
    except (TypeError, ValueError) as err:
        raise ValueError(f"{field} must be a list of positive ints (bucket lengths), got {lengths!r}.") from err
    if not values or min(values) < 1:
        raise ValueError(f"{field} must be a non-empty list of positive ints (bucket lengths), got {lengths!r}.")
    if len(set(values)) != len(values):
        raise ValueError(f"{field} lists a bucket twice: {lengths!r}; give each length once.")
    return sorted(values)


def bucket_for(lengths: list[int], t: int) -> int:
    """The smallest bucket of ``lengths`` (sorted) that holds ``t`` tokens; a ValueError when none does."""
    for b in lengths:  # a plain loop (not bisect): torch.compile traces it
        if b >= t:
            return b
    raise ValueError(f"Input length {t} exceeds the longest length bucket {lengths[-1]} (partial_seq_len); "
                     f"truncate inputs to {lengths[-1]} tokens or use a pattern derived for a longer n.")


class PatternBuckets:
    """Per-query patterns for a set of bucket lengths, each bucket with its own k (by default one k for all).

    Args:
        patterns: ``{b: AttentionPattern}`` for every bucket that holds P and R (per-query, ``seq_len == b``, k < b
            except for the longest bucket; all with or all without bias).
        exact_lengths: buckets that run exactly (no pattern; their k is b).
        k: n's k: required when ``patterns`` is empty, else checked against the longest bucket's pattern.
        metadata: JSON-serialisable facts about the set (source model, inputs, ...).

    Raises:
        ValueError: patterns of another scope or length; a bucket given twice; no pattern for the longest bucket.
        TypeError: a value that is not an `AttentionPattern`.
    """

    def __init__(self, patterns: Mapping[int, AttentionPattern], exact_lengths: Iterable[int] = (),
                 k: int | None = None, metadata: dict[str, Any] | None = None):
        patterns = {int(b): p for b, p in patterns.items()}
        for b, p in patterns.items():
            if not isinstance(p, AttentionPattern):
                raise TypeError(f"patterns[{b}] must be an AttentionPattern, got {type(p).__name__}.")
            if p.scope != "per_query" or p.seq_len != b:
                raise ValueError(f"patterns[{b}] must be a per-query pattern of seq_len {b}, got scope={p.scope!r}, "
                                 f"seq_len={p.seq_len}.")
        if len({p.bias is not None for p in patterns.values()}) > 1:
            raise ValueError("either every bucket's pattern has a bias or none has; derive them with the same --bias.")
        exact = check_lengths(exact_lengths, "exact_lengths") if list(exact_lengths) else []
        longest = max([*patterns, *exact], default=0)
        if longest not in patterns:
            raise ValueError(f"the longest bucket ({longest}) needs a pattern (its P and R are n's); pass "
                             f"AttentionPattern.exact({longest}) for exact attention there.")
        n_k = patterns[longest].k
        if k is not None and int(k) != n_k:
            raise ValueError(f"k={k} does not match the longest bucket's pattern, k={n_k}.")
        at_k = [b for b, p in patterns.items() if p.k == b and b != longest]
        if at_k:  # b == k < n is the exact pattern: run it exactly (n keeps its pattern whatever k is, as in format 1)
            exact = sorted(set(exact) | set(at_k))
            patterns = {b: p for b, p in patterns.items() if b not in at_k}
        twice = sorted(set(exact) & set(patterns))
        if twice:
            raise ValueError(f"buckets {twice} are given both as exact and with a pattern.")
        self.k = int(n_k)
        self.patterns = dict(sorted(patterns.items()))
        self.exact_lengths = exact
        self.lengths = check_lengths([*exact, *self.patterns])
        self.metadata: dict[str, Any] = dict(metadata or {})

    # ------------------------------------------------------------------ properties
    @property
    def seq_len(self) -> int:
        """n: the longest bucket."""
        return self.lengths[-1]

    @property
    def has_bias(self) -> bool:
        return any(p.bias is not None for p in self.patterns.values())

    @property
    def partial_lengths(self) -> list[int]:
        """The buckets that hold a pattern (b > k)."""
        return list(self.patterns)

    def k_for(self, b: int) -> int:
        """k of bucket ``b``: its pattern's, or b for a bucket that runs exactly."""
        pattern = self[b]
        return b if pattern is None else pattern.k

    @property
    def lengths_k(self) -> list[int]:
        """The k of each bucket of `lengths` (``config.partial_lengths_k``)."""
        return [self.k_for(b) for b in self.lengths]

    @property
    def uniform_k(self) -> bool:
        """Whether every bucket with a pattern has n's k (what format 1 of the file, and checkpoint format 2, hold)."""
        return all(p.k == self.k for p in self.patterns.values())

    def bucket_for(self, t: int) -> int:
        """The bucket an input of ``t`` tokens runs (the smallest b >= t)."""
        return bucket_for(self.lengths, t)

    def __getitem__(self, b: int) -> AttentionPattern | None:
        """The pattern of bucket ``b`` (None for an exact bucket)."""
        if b not in self.lengths:
            raise KeyError(f"no bucket of length {b}; the buckets are {self.lengths}.")
        return self.patterns.get(b)

    @classmethod
    def single(cls, pattern: AttentionPattern) -> "PatternBuckets":
        """One bucket: the pattern's n (what a pattern of 0.1/0.2 means)."""
        return cls({pattern.seq_len: pattern})

    @classmethod
    def coerce(cls, pattern: "AttentionPattern | PatternBuckets") -> "PatternBuckets":
        """``pattern`` as buckets (an `AttentionPattern` is one bucket); a TypeError for anything else."""
        if isinstance(pattern, PatternBuckets):
            return pattern
        if isinstance(pattern, AttentionPattern):
            if pattern.scope != "per_query":
                raise ValueError(f"The model runs per-query patterns; got scope={pattern.scope!r}. "
                                 "Derive the pattern with scope='per_query'.")
            return cls.single(pattern)
        raise TypeError(f"pattern must be an AttentionPattern or PatternBuckets, got {type(pattern).__name__}.")

    # ------------------------------------------------------------------ io
    def to_parts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(tensors, header)`` of `save`: every partial bucket's P, R and bias, the lengths and metadata."""
        tensors = {}
        buckets = {}
        for b, p in self.patterns.items():
            tensors[f"len{b}.indices"] = p.indices
            tensors[f"len{b}.reconstruction"] = p.reconstruction
            if p.bias is not None:
                tensors[f"len{b}.bias"] = p.bias
            buckets[str(b)] = p.metadata
        header = {"format_version": "1" if self.uniform_k else PATTERN_BUCKETS_FORMAT_VERSION, "lengths": self.lengths,
                  "k": self.k, "lengths_k": self.lengths_k, "exact_lengths": self.exact_lengths,
                  "metadata": self.metadata, "bucket_metadata": buckets}
        return tensors, header

    @classmethod
    def from_parts(cls, tensors: dict[str, Any], header: dict[str, Any]) -> "PatternBuckets":
        """The buckets of `to_parts`' ``(tensors, header)``; a KeyError / ValueError / TypeError if invalid."""
        lengths = check_lengths(header["lengths"], "lengths")
        exact = [int(b) for b in header.get("exact_lengths", [])]
        meta = header.get("bucket_metadata", {})
        patterns = {}
        for b in lengths:
            if b in exact:
                continue
            missing = [f"len{b}.{name}" for name in ("indices", "reconstruction") if f"len{b}.{name}" not in tensors]
            if missing:
                raise ValueError(f"bucket {b} lacks {missing}")
            patterns[b] = AttentionPattern(tensors[f"len{b}.indices"], tensors[f"len{b}.reconstruction"],
                                           tensors.get(f"len{b}.bias"), metadata=meta.get(str(b), {}))
        return cls(patterns, exact, k=header.get("k"), metadata=header.get("metadata", {}))

    def save(self, path: str | os.PathLike) -> None:
        """Write one safetensors file: every partial bucket's P, R and bias, the lengths and metadata in its header.

        File format (``PATTERN_BUCKETS_FORMAT_VERSION``): tensors ``len{b}.indices``, ``len{b}.reconstruction`` and
        ``len{b}.bias`` for each partial bucket, header ``{"format_version", "lengths", "k", "lengths_k",
        "metadata"}`` (each bucket's k is its tensors' own; version 2 only where buckets differ in k). `load` also
        reads a single-pattern file (`AttentionPattern.save`) as one bucket of its n."""
        tensors, header = self.to_parts()
        save_file(tensors, os.fspath(path), metadata={_META_KEY: json.dumps(header)})

    @classmethod
    def load(cls, path: str | os.PathLike) -> "PatternBuckets":
        """Read a file of `save`, or a single-pattern file (`AttentionPattern.save`) as one bucket."""
        path = os.fspath(path)
        if is_single_pattern_file(path):
            return cls.single(AttentionPattern.load(path))
        with open_tagged_file(path, _META_KEY, "pattern", _READ_VERSIONS, expected=_EXPECTED) as (header, f):
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        try:
            return cls.from_parts(tensors, header)
        except (KeyError, ValueError, TypeError) as err:
            raise ValueError(f"{path!r} holds invalid pattern buckets: {err}. Pass {_EXPECTED}.") from err

    def __repr__(self) -> str:
        return (f"PatternBuckets(lengths={self.lengths}, k={self.lengths_k}, exact={self.exact_lengths}, "
                f"bias={self.has_bias})")


def is_single_pattern_file(path: str) -> bool:
    """Whether ``path`` is a safetensors file with `AttentionPattern`'s header (False for anything else: the
    buckets' loader then names what it found)."""
    if not os.path.isfile(path):
        return False
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
    except Exception:  # not safetensors: let open_tagged_file say so
        return False
    return _PATTERN_META_KEY in meta and _META_KEY not in meta

"""`AttentionPattern`: the index set P and the reconstruction R, stored as one safetensors file.

This file is part of the remote-code bundle (imports: torch, safetensors and siblings only).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .cost import SCOPES
from .reconstruction import complement_indices, local_prior

__all__ = ["AttentionPattern", "PATTERN_FORMAT_VERSION", "open_tagged_file"]

PATTERN_FORMAT_VERSION = "1"
_META_KEY = "hf_partial_attention"
_EXPECTED = ("a pattern file written by `hf-partial-attention derive` (<out>/patterns/per_query_k<k>.safetensors) "
             "or by AttentionPattern.save")


@contextlib.contextmanager
def open_tagged_file(path: str | os.PathLike, meta_key: str, what: str, format_version: str | tuple[str, ...],
                     expected: str | None = None) -> Iterator[tuple]:
    """Open a safetensors file whose JSON header sits under ``meta_key``; yields ``(header, handle)``.

    Raises FileNotFoundError for a missing file, ValueError for a file that is not safetensors, of another kind or
    of a format version this code does not read (each names the file, what was found and the fix). ``expected``
    says what a right file is and where it comes from (default: "a {what} file written by hf-partial-attention").
    """
    path = os.fspath(path)
    expected = expected or f"a {what} file written by hf-partial-attention"
    if not os.path.isfile(path):
        found = "a folder" if os.path.isdir(path) else "nothing"
        raise FileNotFoundError(f"No {what} file at {path!r} (found {found}); pass {expected}.")
    try:
        handle = safe_open(path, framework="pt")
    except SafetensorError as err:  # another kind of file: the Rust error speaks of headers, not of the fix
        raise ValueError(f"{path!r} is not a {what} file: it is not a safetensors file ({err}). "
                         f"Pass {expected}.") from err
    with handle as f:
        meta = f.metadata() or {}
        if meta_key not in meta:
            raise ValueError(f"{path!r} is a safetensors file but not a {what} file (no {meta_key!r} header). "
                             f"Pass {expected}.")
        try:
            header = json.loads(meta[meta_key])
        except ValueError as err:
            raise ValueError(f"{path!r}: the {meta_key!r} header is not valid JSON ({err}); write the {what} "
                             "file again.") from err
        found, readable = str(header.get("format_version")), (
            (format_version,) if isinstance(format_version, str) else format_version)
        if found not in readable:
            raise ValueError(f"{path!r} is a {what} file of format version {found}; this version of "
                             f"hf-partial-attention reads version {' or '.join(readable)}. Upgrade the package "
                             "(pip install -U hf-partial-attention) or write the file again with this one.")
        yield header, f


class AttentionPattern:
    """Which scores are computed exactly (P) and how the rest are reconstructed (R).

    Two scopes, as in the paper:

    - ``"per_query"`` (what the model runs): ``indices`` is ``(n, k)``: row i holds the k keys whose scores
      query i computes exactly, sorted and unique; ``reconstruction`` is ``(n, n−k, k)``: row i maps those k
      scores to the other n−k scores of row i, in increasing key order (``complement``); ``bias`` optional
      ``(n, n−k)``.
    - ``"whole"`` (analysis only): one set over the n² (query, key) pairs: ``indices`` ``(k,)`` of
      flattened positions ``i·n + j``, ``reconstruction`` ``(n²−k, k)``, ``bias`` ``(n²−k,)``.

    Args:
        indices: int64 tensor as above.
        reconstruction: float tensor as above (stored as float32).
        bias: optional float tensor as above.
        scope: ``"per_query"`` or ``"whole"``.
        seq_len: n; required for ``"whole"``, inferred for ``"per_query"``.
        metadata: JSON-serialisable facts about the pattern. Well-known keys: ``source_model``,
            ``num_sequences``, ``normalized_error`` (error predicted from the covariance divided by its
            trace), ``covariance`` (``"centered"`` or ``"second_moment"``), ``method``.

    Raises:
        ValueError: on wrong shapes, out-of-range or duplicate indices, unsorted rows, NaN/Inf values.
        TypeError: on tensors of the wrong dtype or non-tensor inputs.
    """

    def __init__(
        self,
        indices: torch.Tensor,
        reconstruction: torch.Tensor,
        bias: torch.Tensor | None = None,
        scope: str = "per_query",
        seq_len: int | None = None,
        metadata: dict[str, Any] | None = None,
    ):
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}.")
        for name, value in (("indices", indices), ("reconstruction", reconstruction)):
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}.")
        if bias is not None and not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}.")
        if indices.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise TypeError(f"indices must be an integer tensor, got dtype {indices.dtype}.")
        if not reconstruction.is_floating_point():
            raise TypeError(f"reconstruction must be a float tensor, got dtype {reconstruction.dtype}.")
        self.scope = scope
        self.indices = indices.detach().to("cpu", torch.int64).contiguous()
        self.reconstruction = reconstruction.detach().to("cpu", torch.float32).contiguous()
        self.bias = None if bias is None else bias.detach().to("cpu", torch.float32).contiguous()
        if scope == "per_query":
            if self.indices.dim() != 2:
                raise ValueError(f"per_query indices must be (n, k), got shape {tuple(self.indices.shape)}.")
            n = self.indices.shape[0]
            if seq_len is not None and seq_len != n:
                raise ValueError(f"seq_len={seq_len} does not match indices with {n} rows.")
            self.seq_len = n
        else:
            if seq_len is None:
                raise ValueError("seq_len is required for scope='whole' (indices index the n² flattened pairs).")
            if self.indices.dim() != 1:
                raise ValueError(f"whole-matrix indices must be (k,), got shape {tuple(self.indices.shape)}.")
            self.seq_len = int(seq_len)
        self.metadata: dict[str, Any] = dict(metadata or {})
        self._validate()

    # ------------------------------------------------------------------ properties
    @property
    def k(self) -> int:
        """Number of exact scores per query (per_query) or in total (whole)."""
        return int(self.indices.shape[-1])

    @property
    def size(self) -> int:
        """Length of one score vector: n (per_query) or n² (whole)."""
        return self.seq_len if self.scope == "per_query" else self.seq_len * self.seq_len

    @property
    def complement(self) -> torch.Tensor:
        """Indices not in P, sorted: the row order of ``reconstruction``."""
        return complement_indices(self.indices, self.size)

    @property
    def normalized_error(self) -> float | None:
        value = self.metadata.get("normalized_error")
        return None if value is None else float(value)

    @property
    def heldout_error(self) -> float | None:
        """Normalised error measured on held-out windows (``metadata["heldout_normalized_error"]``, written by
        `derive`), or None when not measured."""
        value = self.metadata.get("heldout_normalized_error")
        return None if value is None else float(value)

    def _validate(self) -> None:
        l, k = self.size, self.k
        if k < 1 or k > l:
            raise ValueError(f"k={k} exact scores per vector must be in [1, {l}].")
        idx = self.indices
        if idx.numel() and (idx.min() < 0 or idx.max() >= l):
            raise ValueError(
                f"indices must lie in [0, {l}), found values in [{int(idx.min())}, {int(idx.max())}]."
            )
        if k > 1:
            sorted_idx = torch.sort(idx, dim=-1).values
            dup = (sorted_idx[..., 1:] == sorted_idx[..., :-1]).reshape(-1, k - 1).any(-1)  # (rows,)
            if bool(dup.any()):
                row = int(torch.nonzero(dup)[0])
                raise ValueError(f"indices contain duplicates (first in row {row}); each entry of P must be unique.")
            if not torch.equal(sorted_idx, idx):
                raise ValueError("indices rows must be sorted in increasing order; use torch.sort(indices, dim=-1).")
        want = (*idx.shape[:-1], l - k, k)
        if tuple(self.reconstruction.shape) != want:
            raise ValueError(f"reconstruction must have shape {want} for indices {tuple(idx.shape)}, "
                             f"got {tuple(self.reconstruction.shape)}.")
        if not bool(torch.isfinite(self.reconstruction).all()):
            raise ValueError("reconstruction contains NaN or Inf values.")
        if self.bias is not None:
            if tuple(self.bias.shape) != want[:-1]:
                raise ValueError(f"bias must have shape {want[:-1]}, got {tuple(self.bias.shape)}.")
            if not bool(torch.isfinite(self.bias).all()):
                raise ValueError("bias contains NaN or Inf values.")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def exact(cls, n: int) -> "AttentionPattern":
        """k = n: every score is computed exactly and nothing is reconstructed (dense attention)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}.")
        indices = torch.arange(n).expand(n, n).clone()  # (n, n)
        return cls(indices, torch.zeros(n, 0, n), metadata={"method": "exact"})

    @classmethod
    def local(cls, n: int, k: int, correlation: float = 0.9) -> "AttentionPattern":
        """The deterministic default used for a model built from a config alone.

        P_i: the k keys nearest to query i (ties to the lower position). R_i: optimal for the prior
        covariance ``correlation**|j − j'|`` between a row's scores (see `reconstruction.local_prior`).
        """
        if not 1 <= k <= n:
            raise ValueError(f"k must be in [1, n={n}], got {k}.")
        indices, recon = local_prior(n, k, correlation)
        return cls(indices, recon, metadata={"method": "local_prior", "correlation": correlation})

    # ------------------------------------------------------------------ io
    def save(self, path: str | os.PathLike) -> None:
        """Write one safetensors file; the scope, n and metadata go in its header."""
        tensors = {"indices": self.indices, "reconstruction": self.reconstruction}
        if self.bias is not None:
            tensors["bias"] = self.bias
        header = {"format_version": PATTERN_FORMAT_VERSION, "scope": self.scope, "seq_len": self.seq_len,
                  "k": self.k, "metadata": self.metadata}
        save_file(tensors, os.fspath(path), metadata={_META_KEY: json.dumps(header)})

    @classmethod
    def load(cls, path: str | os.PathLike) -> "AttentionPattern":
        """Read a file written by `save` (validated again on load)."""
        path = os.fspath(path)
        with open_tagged_file(path, _META_KEY, "pattern", PATTERN_FORMAT_VERSION, expected=_EXPECTED) as (header, f):
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        missing = [name for name in ("indices", "reconstruction") if name not in tensors]
        missing += [key for key in ("scope", "seq_len") if key not in header]
        if missing:
            raise ValueError(f"{path!r} is a damaged pattern file: it lacks {missing}. Pass {_EXPECTED}.")
        try:
            return cls(tensors["indices"], tensors["reconstruction"], tensors.get("bias"), scope=header["scope"],
                       seq_len=header["seq_len"], metadata=header.get("metadata", {}))
        except (ValueError, TypeError) as err:  # name the file: the checks speak of tensors only
            raise type(err)(f"{path!r} holds an invalid pattern: {err}") from err

    def __repr__(self) -> str:
        err, held = self.normalized_error, self.heldout_error
        err_s = "" if err is None else f", normalized_error={err:.4g}"
        if held is not None:  # the predicted error alone can flatter a pattern fitted on little text
            err_s += f" (held-out {held:.4g})" if err is not None else f", heldout_error={held:.4g}"
        return (f"AttentionPattern(scope={self.scope!r}, seq_len={self.seq_len}, k={self.k}, "
                f"bias={self.bias is not None}{err_s})")

"""The file format of `covariance.ScoreCovariance`: one safetensors file holding every group's float64 accumulators
under its group's name (``pooled``, ``L<layer>``, ``L<layer>.H<head>``), with a JSON header of counts and settings.

Format 1 holds one count per group (every query row reached by every score matrix); format 2 adds each group's
per-row counts (``<group>.rows``, written when ``update(..., lengths=...)`` was used). Both read."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from ..pattern import open_tagged_file

__all__ = ["write_file", "read_file", "key_name", "name_key"]

_META_KEY = "hf_partial_attention_covariance"
_FORMAT_VERSION = "1"  # one count per group (every row reached by every score matrix)
_ROWS_FORMAT_VERSION = "2"  # with per-row counts (`update(..., lengths=...)`)
_READ_VERSIONS = (_FORMAT_VERSION, _ROWS_FORMAT_VERSION)


def write_file(path: str | os.PathLike, header: dict, tensors: dict[str, torch.Tensor], row_counts: bool) -> None:
    """Write ``tensors`` (``<group>.sum`` etc.) with ``header`` atomically: an interrupted save never leaves a
    half-written file. Format 2 only with per-row counts, so files without them stay as version 1 always was."""
    header = {"format_version": _ROWS_FORMAT_VERSION if row_counts else _FORMAT_VERSION, **header}
    tmp = os.fspath(path) + ".tmp"
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={_META_KEY: json.dumps(header)})
    os.replace(tmp, os.fspath(path))


def read_file(path: str | os.PathLike) -> tuple[dict, dict[tuple[int, ...], tuple]]:
    """The header (with ``row_counts``: whether the file is of format 2) and, per group key, ``(count, sum,
    per_query, whole, rows)`` (None where the file's scopes or format hold none)."""
    with open_tagged_file(path, _META_KEY, "ScoreCovariance", _file_version(path)) as (header, f):
        header = {**header, "row_counts": str(header["format_version"]) == _ROWS_FORMAT_VERSION}
        groups = {}
        for name, count in header["counts"].items():
            groups[name_key(name)] = (
                int(count), f.get_tensor(f"{name}.sum"),
                f.get_tensor(f"{name}.per_query") if "per_query" in header["scopes"] else None,
                f.get_tensor(f"{name}.whole") if "whole" in header["scopes"] else None,
                f.get_tensor(f"{name}.rows") if header["row_counts"] else None)
    return header, groups


def _file_version(path) -> str:
    """The format version a covariance file declares when this code reads it, else the current one (so that
    `open_tagged_file` names the mismatch or the wrong file)."""
    try:
        from safetensors import safe_open

        with safe_open(os.fspath(path), framework="pt") as f:
            found = str(json.loads((f.metadata() or {})[_META_KEY]).get("format_version"))
    except Exception:  # noqa: BLE001 - missing, not safetensors, no header: open_tagged_file says which
        return _ROWS_FORMAT_VERSION
    return found if found in _READ_VERSIONS else _ROWS_FORMAT_VERSION


def key_name(key: tuple[int, ...]) -> str:
    """A group's name in the file: ``()`` → ``pooled``, ``(l,)`` → ``L<l>``, ``(l, h)`` → ``L<l>.H<h>``."""
    if not key:
        return "pooled"
    return f"L{key[0]}" if len(key) == 1 else f"L{key[0]}.H{key[1]}"


def name_key(name: str) -> tuple[int, ...]:
    """The group key of a name written by `key_name`."""
    if name == "pooled":
        return ()
    return tuple(int(p[1:]) for p in name.split("."))

"""Least-squares growth fits for d_min(L) and our JL-type shape (not the paper's bound (5))."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from .conditions import _bad


def fit_log(Ls: Iterable[float], ds: Iterable[float]) -> tuple[float, float, float]:
    """Least-squares ``d ~ a ln L + b`` [I: the paper's fit method was not read]; returns (a, b, rmse)."""
    x, y = np.log(np.asarray(list(Ls), float)), np.asarray(list(ds), float)
    return _lstsq(x, y)


def fit_linear(Ls: Iterable[float], ds: Iterable[float]) -> tuple[float, float, float]:
    """Least-squares ``d ~ a L + b`` (our comparison model); returns (a, b, rmse)."""
    return _lstsq(np.asarray(list(Ls), float), np.asarray(list(ds), float))


def _lstsq(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    if x.size < 2:
        raise _bad("number of points", x.size, "fit needs at least two (L, d_min) points")
    design = np.stack([x, np.ones_like(x)], axis=1)  # (n, 2)
    (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
    rmse = float(np.sqrt(np.mean((design @ np.array([a, b]) - y) ** 2)))
    return float(a), float(b), rmse


def jl_bound_shape(L: float, k: int, gamma: float, eps1: float, eps2: float, margin: float,
                   C: float = 1.0) -> float:
    """Our JL-type shape ``C k (ln gamma + ln 1/eps2 + m)^2 ln L / ln^2(1+eps1)`` -- NOT the paper's (5)."""
    return C * k * (math.log(gamma) + math.log(1 / eps2) + margin) ** 2 * math.log(L) \
        / math.log1p(eps1) ** 2

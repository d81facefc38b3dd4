"""Approximation conditions (6)-(7) of seed 002 in our operational form [I], plus shared validators.

For every row ``i``, with ``j, j'`` in the support of ``A_i``:
(6) ratio preservation ``|ln(M_ij/M_ij') - ln(A_ij/A_ij')| <= ln(1+eps1)`` (``"log"``) or
``1-eps1 <= (M_ij/M_ij')/(A_ij/A_ij') <= 1+eps1`` (``"multiplicative"``); (7) zero suppression
``M_ij/M_ij' <= eps2`` for ``j`` off the support.  The paper's exact (6)-(7) were not recovered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

RATIO_FORMS = ("log", "multiplicative")


def _bad(name: str, value: object, fix: str) -> ValueError:
    return ValueError(f"{name}={value!r} is invalid: {fix}")


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise _bad(name, value, f"pass an integer >= {minimum}")
    return int(value)


def _check_eps(eps1: float, eps2: float) -> None:
    if not (isinstance(eps1, (int, float)) and eps1 > 0 and math.isfinite(eps1)):
        raise _bad("eps1", eps1, "pass a finite ratio tolerance > 0, e.g. 0.5")
    if not (isinstance(eps2, (int, float)) and 0 < eps2 < 1):
        raise _bad("eps2", eps2, "pass a zero-suppression level in (0, 1), e.g. 0.1")


def validate_target(A: np.ndarray) -> np.ndarray:
    """Return ``A`` as a float array after checking it is square, nonnegative, with a nonzero per row."""
    A = np.asarray(A, dtype=np.float64)
    if A.ndim != 2 or A.shape[0] != A.shape[1] or A.shape[0] < 1:
        raise _bad("A.shape", A.shape, "pass a square (L, L) matrix")
    if not np.all(np.isfinite(A)) or np.any(A < 0):
        raise _bad("A", "negative or non-finite entries", "pass a nonnegative finite matrix")
    if np.any((A > 0).sum(axis=1) == 0):
        raise _bad("A", "a row without nonzeros", "give every row at least one positive entry")
    return A


@dataclass
class ConditionReport:
    """Worst-case statistics behind :func:`satisfies` (all in natural-log units)."""

    ratio_error: float  # max |ln(M_ij/M_ij') - ln(A_ij/A_ij')| over supported pairs
    zero_log_ratio: float  # max ln(M_ij/M_ij') over j off-support, j' on-support
    ok_ratio: bool
    ok_zero: bool

    @property
    def ok(self) -> bool:
        return self.ok_ratio and self.ok_zero


def _ratio_limit(eps1: float, ratio_form: str) -> float:
    """Log-domain bound on |log ratio error| for each ratio form.

    ``"log"``: ``ln(1+eps1)``.  ``"multiplicative"``: ``1-eps1 <= r <= 1+eps1`` over all ordered
    pairs; because the pair set is symmetric (``r(j', j) = 1/r(j, j')``) and
    ``1/(1+eps1) >= 1-eps1``, this is the same set as the log form -- we keep both for the record.
    """
    if ratio_form not in RATIO_FORMS:
        raise _bad("ratio_form", ratio_form, f"use one of {RATIO_FORMS}")
    upper = math.log1p(eps1)
    if ratio_form == "multiplicative" and eps1 < 1:
        return min(upper, -math.log1p(-eps1))
    return upper


def condition_report(A: np.ndarray, log_M: np.ndarray, eps1: float, eps2: float, *,
                     ratio_form: str = "log") -> ConditionReport:
    """Check conditions (6) and (7) [I] from ``log M`` (any per-row additive shift is allowed)."""
    _check_eps(eps1, eps2)
    pos = A > 0
    log_A = np.log(np.where(pos, A, 1.0))
    # ratio error of pair (j, j') is e_ij - e_ij' with e = log M - log A on the support
    e = np.where(pos, log_M - log_A, np.nan)
    with np.errstate(invalid="ignore"):
        spread = np.nanmax(e, axis=1) - np.nanmin(e, axis=1)  # (L,) max pairwise error per row
    ratio_error = float(np.max(np.nan_to_num(spread, nan=np.inf)))
    on_min = np.where(pos, log_M, np.inf).min(axis=1)  # (L,)
    off_max = np.where(pos, -np.inf, log_M).max(axis=1)  # (L,)
    with np.errstate(invalid="ignore"):
        zero = off_max - on_min
    zero_log_ratio = float(np.max(np.nan_to_num(zero, nan=np.inf, neginf=-np.inf)))
    ok_ratio = ratio_error <= _ratio_limit(eps1, ratio_form) + 1e-12
    ok_zero = zero_log_ratio <= math.log(eps2) + 1e-12
    return ConditionReport(ratio_error, zero_log_ratio, bool(ok_ratio), bool(ok_zero))


def satisfies(A: np.ndarray, M: np.ndarray, eps1: float, eps2: float, *,
              ratio_form: str = "log") -> bool:
    """True when ``M`` preserves ``A``'s ratios within ``eps1`` and suppresses zeros below ``eps2``.

    (6) for all i and j, j' in supp(A_i): ``|ln(M_ij/M_ij') - ln(A_ij/A_ij')| <= ln(1+eps1)``
    (``ratio_form="log"``) or ``1-eps1 <= (M_ij/M_ij')/(A_ij/A_ij') <= 1+eps1``
    (``"multiplicative"``); (7) for j off and j' on the support: ``M_ij/M_ij' <= eps2``.
    Formulas are our reading of the paper's (6)-(7) [I].
    """
    A = validate_target(A)
    M = np.asarray(M, dtype=np.float64)
    if M.shape != A.shape:
        raise _bad("M.shape", M.shape, f"pass M with the shape of A, {A.shape}")
    with np.errstate(divide="ignore"):
        log_M = np.log(M)
    return condition_report(A, log_M, eps1, eps2, ratio_form=ratio_form).ok

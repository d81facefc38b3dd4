"""Expressivity of low-dimensional self-attention (seed 002, Likhosherstov et al., arXiv 2106.03764).

The paper proves that fixed selector weights ``W_Q, W_K`` of inner dimension ``d = O(log L)`` can
approximate every k-nonzero-bounded, gamma-variation-bounded pattern ``A`` by changing only the
input ``X``.  Its equations were not available to us, so the concrete formulas below are *our*
reading of the proof sketch (tagged ``[I]`` in ``docs/related.md``); every such choice
is a keyword option:

* ``offset`` / ``margin``  -- the constant ``c = ln(1/eps2) + m`` added to the support of ``B`` [I];
* ``ratio_form``          -- ``"log"`` or ``"multiplicative"`` ratio preservation [I];
* ``column_order``        -- one inner permutation per pass or a fresh one per outer index [I];
* ``redraws``             -- the paper uses ``ceil(Q*L)`` with ``Q = 1``; we default to fewer [ours].

Conventions: ``A`` is an ``(L, L)`` nonnegative numpy array; every row has a nonzero.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .conditions import (
    RATIO_FORMS,
    ConditionReport,
    _bad,
    _check_eps,
    _check_int,
    condition_report,
    satisfies,
    validate_target,
)
from .fits import fit_linear, fit_log, jl_bound_shape

logger = logging.getLogger(__name__)

__all__ = ["AttentionConstruction", "ConditionReport", "DMinResult", "auto_margin", "build_B",
           "condition_report", "construct_attention", "default_d_grid", "draw_seed", "find_d_min",
           "fit_linear", "fit_log", "jl_bound_shape", "redraws_from_q", "sample_sparse_target",
           "sample_stiefel", "satisfies", "validate_target"]

COLUMN_ORDERS = ("per_pass", "per_row")


# --------------------------------------------------------------------------- sampling A
def _fill_pass(mask: np.ndarray, out_cnt: np.ndarray, in_cnt: np.ndarray, k: int,
               rng: np.random.Generator, column_order: str) -> None:
    """One pass of the sampler over ``mask`` (outer index = axis 0), updating counts in place."""
    n_out, n_in = mask.shape
    outer = rng.permutation(n_out)
    inner = rng.permutation(n_in)
    for i in outer:
        need = k - out_cnt[i]
        if need <= 0:
            continue
        if column_order == "per_row":
            inner = rng.permutation(n_in)
        ok = (~mask[i, inner]) & (in_cnt[inner] < k)  # (n_in,) eligible, in visiting order
        chosen = inner[np.flatnonzero(ok)[:need]]
        mask[i, chosen] = True
        out_cnt[i] += chosen.size
        in_cnt[chosen] += 1


def sample_sparse_target(L: int, k: int, gamma: float, seed: int, *,
                         column_order: str = "per_pass") -> np.ndarray:
    """Sample a k-nonzero-bounded, gamma-variation-bounded ``(L, L)`` target by the two-pass procedure.

    Pass 1 visits permuted rows and, inside, permuted columns; pass 2 visits permuted columns and,
    inside, permuted rows.  A cell becomes nonzero when its row and column both stay at <= ``k``
    nonzeros; its value is 1 or ``gamma`` by a fair coin.  ``column_order="per_pass"`` (one inner
    permutation per pass, the spec's [I] default) or ``"per_row"`` (fresh per outer index, ours).
    Every row ends with at least one nonzero.
    """
    L = _check_int("L", L, 1)
    k = _check_int("k", k, 1)
    if not (isinstance(gamma, (int, float)) and gamma >= 1 and math.isfinite(gamma)):
        raise _bad("gamma", gamma, "pass a finite variation bound >= 1")
    if column_order not in COLUMN_ORDERS:
        raise _bad("column_order", column_order, f"use one of {COLUMN_ORDERS}")
    rng = np.random.default_rng(seed)
    mask = np.zeros((L, L), dtype=bool)
    row_cnt = np.zeros(L, dtype=np.int64)
    col_cnt = np.zeros(L, dtype=np.int64)
    _fill_pass(mask, row_cnt, col_cnt, k, rng, column_order)
    _fill_pass(mask.T, col_cnt, row_cnt, k, rng, column_order)  # mask.T is a view: writes go through
    coin = rng.random((L, L)) < 0.5
    return np.where(mask, np.where(coin, float(gamma), 1.0), 0.0)


# --------------------------------------------------------------------------- construction
@dataclass
class AttentionConstruction:
    """Inputs, selector weights and attention matrix of the random-projection construction.

    Shapes: ``B (L, L)``, ``Y (L, d)``, ``X1 = X @ W_Q`` and ``X2 = X @ W_K`` are ``(L, d)``,
    ``X (L, d_hid)``, ``W_Q, W_K (d_hid, d)``, ``logits = X1 @ X2.T (L, L)``, ``M (L, L)``.
    """

    B: np.ndarray
    Y: np.ndarray
    X1: np.ndarray
    X2: np.ndarray
    X: np.ndarray
    W_Q: np.ndarray
    W_K: np.ndarray
    logits: np.ndarray
    M: np.ndarray
    offset: float


def build_B(A: np.ndarray, offset: float) -> np.ndarray:
    """``B_ij = ln(A_ij / min_j' A_ij') + offset`` on the support of row ``i``, 0 elsewhere [I]."""
    A = validate_target(A)
    pos = A > 0
    row_min = np.where(pos, A, np.inf).min(axis=1, keepdims=True)  # (L, 1)
    with np.errstate(divide="ignore"):
        return np.where(pos, np.log(A / row_min) + offset, 0.0)


def default_offset(eps2: float, margin: float) -> float:
    """``c = ln(1/eps2) + m`` so that ``exp(B)`` is ``A`` up to a row factor [I]."""
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 0:
        raise _bad("margin", margin, "pass a margin m >= 0 (or 'auto' where accepted)")
    if not (0 < eps2 < 1):
        raise _bad("eps2", eps2, "pass a zero-suppression level in (0, 1)")
    return math.log(1.0 / eps2) + float(margin)


def auto_margin(L: int, k: int, gamma: float, eps1: float, eps2: float, m_max: float = 8.0) -> float:
    """Our heuristic margin ``m`` (not from the paper): minimise a Gaussian noise model of ``d_min``.

    The logit noise of the construction is roughly ``sqrt(k) (c + ln gamma) / sqrt(d)`` per entry
    with ``c = ln(1/eps2) + m``.  Zero suppression needs the max over ~``L^2`` entries (``z0``) plus
    the on-support deviation (``z1``) below ``m``; ratio preservation (only when ``k >= 2``) needs
    pairwise differences over ~``k^2 L`` pairs below ``ln(1+eps1)``.  We pick ``m`` in
    ``(0, m_max]`` minimising ``k (c + ln gamma)^2 max((z0+z1)^2/m^2, 2 z1^2/ln^2(1+eps1))``.
    """
    _check_eps(eps1, eps2)
    z0 = math.sqrt(2 * math.log(max(L, 2) ** 2))
    z1 = math.sqrt(2 * math.log(max(k * k * L, 2)))
    ms = np.linspace(m_max / 400, m_max, 400)
    c = math.log(1 / eps2) + ms + math.log(gamma)
    ratio_term = 2 * z1 ** 2 / math.log1p(eps1) ** 2 if k >= 2 else 0.0
    cost = c ** 2 * np.maximum((z0 + z1) ** 2 / ms ** 2, ratio_term)
    return float(ms[int(np.argmin(cost))])


def resolve_margin(margin: float | str, A: np.ndarray, eps1: float, eps2: float) -> float:
    """Return the numeric margin: ``margin`` itself, or :func:`auto_margin` with k, gamma read off ``A``."""
    if isinstance(margin, str):
        if margin != "auto":
            raise _bad("margin", margin, "pass a number >= 0 or 'auto'")
        pos = A > 0
        k = int(pos.sum(axis=1).max())
        ratios = np.where(pos, A, -np.inf).max(axis=1) / np.where(pos, A, np.inf).min(axis=1)
        return auto_margin(A.shape[0], k, float(ratios.max()), eps1, eps2)
    default_offset(eps2, margin)  # validates
    return float(margin)


def sample_stiefel(L: int, d: int, seed: int) -> np.ndarray:
    """Uniform ``(L, d)`` matrix with orthonormal columns: QR of a Gaussian, signs fixed by diag(R).

    Computed with torch (float64) so that ``torch.set_num_threads`` bounds the CPU use.
    """
    L, d = _check_int("L", L, 1), _check_int("d", d, 1)
    if d > L:
        raise _bad("d", d, f"a Stiefel (L, d) matrix needs d <= L={L}")
    return _stiefel_torch(L, d, seed).numpy()


def _stiefel_torch(L: int, d: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(int(seed) % (2 ** 63))
    G = torch.randn(L, d, generator=gen, dtype=torch.float64)
    Q, R = torch.linalg.qr(G)  # Q (L, d), R (d, d)
    signs = torch.sign(torch.diagonal(R))
    signs[signs == 0] = 1.0
    return Q * signs[None, :]


def draw_seed(seed: int, L: int, d: int, t: int) -> int:
    """Seed of draw ``t`` at ``(L, d)`` in :func:`find_d_min`; feed it to :func:`construct_attention`."""
    return int(np.random.SeedSequence([int(seed), 1, int(L), int(d), int(t)]).generate_state(1,
                                                                                          np.uint64)[0])


def _check_d(d: int, L: int) -> int:
    d = _check_int("d", d, 1)
    if d > L:
        raise _bad("d", d, f"use 1 <= d <= L={L} (d >= L is the regime of the paper's ref [6])")
    return d


def construct_attention(A: np.ndarray, d: int, seed: int, *,
                        eps1: float = 1.0, eps2: float = 0.1, margin: float | str = "auto",
                        offset: float | None = None, d_hid: int | None = None
                        ) -> AttentionConstruction:
    """Random-projection construction of ``M`` approximating ``A`` with fixed selector weights.

    Steps (docs/related.md A4, concrete formulas ours [I]): ``B`` from :func:`build_B` with
    ``offset = ln(1/eps2) + margin`` unless given (``margin="auto"``: :func:`auto_margin`, which
    also reads ``eps1``); ``Y`` Stiefel ``(L, d)``;
    ``X1 = sqrt(L/d) B Y``, ``X2 = sqrt(L/d) Y`` (so ``E[X1 X2^T] = B``);
    ``X = [X1 | X2 | 0]`` with ``W_Q = [I; 0; 0]``, ``W_K = [0; I; 0]``; ``M = rowsoftmax(X1 X2^T)``.
    """
    A = validate_target(A)
    L = A.shape[0]
    d = _check_d(d, L)
    c = default_offset(eps2, resolve_margin(margin, A, eps1, eps2)) if offset is None \
        else float(offset)
    d_hid = 2 * d if d_hid is None else _check_int("d_hid", d_hid, 2 * d)
    B = build_B(A, c)
    Y = sample_stiefel(L, d, seed)
    scale = math.sqrt(L / d)
    X1 = scale * (B @ Y)  # (L, d)
    X2 = scale * Y  # (L, d)
    X = np.zeros((L, d_hid))
    X[:, :d], X[:, d:2 * d] = X1, X2
    W_Q = np.zeros((d_hid, d))
    W_K = np.zeros((d_hid, d))
    W_Q[:d] = np.eye(d)
    W_K[d:2 * d] = np.eye(d)
    logits = (X @ W_Q) @ (X @ W_K).T  # (L, L), equals X1 @ X2.T
    M = np.exp(logits - logits.max(axis=1, keepdims=True))
    M /= M.sum(axis=1, keepdims=True)
    return AttentionConstruction(B, Y, X1, X2, X, W_Q, W_K, logits, M, c)


# --------------------------------------------------------------------------- conditions
# --------------------------------------------------------------------------- d_min search
@dataclass
class DMinResult:
    """Outcome of :func:`find_d_min` on one target.

    ``d_min``: first grid ``d`` with a success within ``redraws`` draws (the paper's definition);
    ``d_stable``: smallest grid ``d`` from which every larger grid value succeeded (ours; only when
    ``scan_all``); ``trials``: ``(d, success, draws_used)`` per scanned grid value.
    """

    L: int
    d_min: int | None
    d_stable: int | None
    offset: float = float("nan")
    trials: list[tuple[int, bool, int]] = field(default_factory=list)


def redraws_from_q(q: float, L: int) -> int:
    """The paper's redraw count ``ceil(Q * L)`` (Q = 1 in the paper)."""
    if not (q > 0):
        raise _bad("q", q, "pass Q > 0")
    return max(1, math.ceil(q * L))


def _try_d(A: np.ndarray, B_idx: torch.Tensor, B_val: torch.Tensor, d: int, redraws: int,
           seed: int, eps1: float, eps2: float, ratio_form: str, chunk: int) -> tuple[bool, int]:
    """Try up to ``redraws`` Stiefel draws at this ``d``; rows are checked in chunks (early exit).

    Common random numbers: draw ``t`` depends only on ``(seed, L, d, t)``, never on the conditions.
    """
    L = A.shape[0]
    scale = L / d
    for t in range(redraws):
        Y = _stiefel_torch(L, d, draw_seed(seed, L, d, t))  # (L, d)
        BY = (B_val[:, :, None] * Y[B_idx]).sum(dim=1)  # (L, k, d) -> (L, d): B @ Y, B sparse
        ok = True
        for start in range(0, L, chunk):
            rows = slice(start, start + chunk)
            logits = (scale * (BY[rows] @ Y.T)).numpy()  # (chunk, L) = X1[rows] @ X2.T
            if not condition_report(A[rows], logits, eps1, eps2, ratio_form=ratio_form).ok:
                ok = False
                break
        if ok:
            return True, t + 1
    return False, redraws


def _sparse_rows(B: np.ndarray, A: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad each row's support to the max row count: indices and values of shape ``(L, kmax)``."""
    pos = A > 0
    kmax = int(pos.sum(axis=1).max())
    order = np.argsort(~pos, axis=1, kind="stable")[:, :kmax]  # support columns first
    vals = np.take_along_axis(np.where(pos, B, 0.0), order, axis=1)
    return torch.from_numpy(order), torch.from_numpy(vals)


def find_d_min(L: int, k: int, gamma: float, eps1: float, eps2: float, d_grid: Sequence[int] | None,
               redraws: int, seed: int, *, margin: float | str = "auto", offset: float | None = None,
               ratio_form: str = "log", column_order: str = "per_pass", scan_all: bool = False,
               A: np.ndarray | None = None, chunk: int = 128) -> DMinResult:
    """Smallest ``d`` on an ascending grid for which the construction meets (6)-(7) within ``redraws``.

    One target ``A = sample_sparse_target(L, k, gamma, seed)`` (or the given ``A``).  ``Y`` draws use
    common random numbers keyed by ``(seed, L, d, draw)``, so at a fixed ``offset`` (hence fixed
    ``B``) a looser ``(eps1, eps2)`` can never give a larger ``d_min`` than a tighter one; with
    ``margin`` the offset itself moves with ``eps2`` (and with ``eps1`` when ``"auto"``).
    ``d_grid=None`` means ``8, 16, ..., L``.  With ``scan_all`` the scan continues past ``d_min`` to
    report ``d_stable``.  ``d_min`` is ``None`` when nothing on the grid succeeds.  At ``d = L`` the
    projection is exact, so a grid reaching ``L`` always succeeds there.
    """
    L = _check_int("L", L, 2)
    redraws = _check_int("redraws", redraws, 1)
    chunk = _check_int("chunk", chunk, 1)
    _check_eps(eps1, eps2)
    if ratio_form not in RATIO_FORMS:
        raise _bad("ratio_form", ratio_form, f"use one of {RATIO_FORMS}")
    grid = default_d_grid(L) if d_grid is None else [int(x) for x in d_grid]
    if not grid or any(b <= a for a, b in itertools.pairwise(grid)):
        raise _bad("d_grid", d_grid, "pass a non-empty strictly ascending sequence of ints")
    for d in grid:
        _check_d(d, L)
    A = sample_sparse_target(L, k, gamma, seed, column_order=column_order) if A is None \
        else validate_target(A)
    m = resolve_margin(margin, A, eps1, eps2)
    c = default_offset(eps2, m) if offset is None else float(offset)
    B = build_B(A, c)
    B_idx, B_val = _sparse_rows(B, A)
    result = DMinResult(L=L, d_min=None, d_stable=None, offset=c)
    for d in grid:
        ok, used = _try_d(A, B_idx, B_val, d, redraws, seed, eps1, eps2, ratio_form, chunk)
        result.trials.append((d, ok, used))
        logger.debug("L=%d d=%d ok=%s draws=%d", L, d, ok, used)
        if ok and result.d_min is None:
            result.d_min = d
            if not scan_all:
                break
    if scan_all:
        for d, ok, _ in reversed(result.trials):
            if not ok:
                break
            result.d_stable = d
    return result


def default_d_grid(L: int, step: int = 8) -> list[int]:
    """Uniform grid ``step, 2*step, ...`` capped by and always including ``L`` [I: paper's grid NF]."""
    step = _check_int("step", step, 1)
    grid = list(range(step, L + 1, step))
    if not grid or grid[-1] != L:
        grid.append(L)
    return grid

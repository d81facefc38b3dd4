"""What every partial-attention kernel shares: P's layout and structure (`attention_layout`, re-exported here),
W = [I | R] and its cache, masks, the exact scores at P, the in-place softmax and the one tiling driver.

Part of the remote-code bundle (imports: torch and siblings only). The kernels are `attention_gather` (the
reference), `attention_fused`, `attention_tiled` and `attention_triton`; `attention_dispatch` chooses one.

Padding and short inputs. P and R are defined for positions 0..n−1. An input of length T < n behaves as if padded
to n with keys whose scores are zero; a key masked out by the attention mask also enters the reconstruction with
score zero. Both make a sequence's output independent of how much padding its batch carries (the exact scores of
padding tokens would otherwise leak into the reconstructed scores of real keys). Masked keys then receive no
probability, as in dense attention.
"""

from __future__ import annotations

import itertools
import weakref
from typing import NamedTuple

import torch
from torch import nn

from .attention_layout import (MIN_SHARED_ROWS, PatternLayout, PatternStructure, bias_in_key_order, block_rows,
                               shared_rows)

__all__ = ["PatternStructure", "MIN_SHARED_ROWS", "TILE_ELEMENTS", "PatternLayout", "PartialTensors", "DerivedState",
           "block_rows", "shared_rows", "reconstruction_matrix", "bias_in_key_order", "check_length", "full_length",
           "first_keys", "masked_keys", "masked_out", "sum_to_shape",
           "masked_at_p", "gathered_scores", "structured_scores", "masked_exact_scores", "rows_first", "needs_grad",
           "softmax_in_place", "normalised_in_place", "tile_groups", "broadcast_slice", "tie_rows",
           "STATES"]

# Scores per tile (float32: 2 MiB): large enough for efficient GEMMs, small enough to stay in a core's L2/L3 while
# the tile is reconstructed, normalised and multiplied by V.
TILE_ELEMENTS = 1 << 19


def reconstruction_matrix(layout: PatternLayout, reconstruction: torch.Tensor) -> torch.Tensor:
    """W ``(n, k, n)`` with ``W[i, m, P_i[m]] = 1`` and ``W[i, :, P̄_i[j]] = R_i[j, :]``: row i of the scores is
    ``exact_i @ W_i``, in key order. Differentiable in R.

    Built by two scatters into one uninitialised tensor (every entry is written once: P_i and P̄_i partition the
    keys), rather than ``[I | R_iᵀ]`` concatenated and gathered into key order: fewer passes over n·k·n values and
    one fresh allocation instead of three.
    """
    n, k = layout.indices.shape
    eye = torch.eye(k, dtype=reconstruction.dtype, device=reconstruction.device).expand(n, k, k)
    w = reconstruction.new_empty(n, k, n)
    w.scatter_(2, layout.complement[:, None, :].expand(n, k, n - k), reconstruction.transpose(1, 2))  # R_iᵀ at P̄_i
    return w.scatter_(2, layout.indices[:, None, :].expand(n, k, k), eye)  # I at P_i


# Every live `DerivedState` by its key: a compiled graph names its state by this int (a custom op takes no Python
# object), and `attention_dispatch.compiled_attention` looks it up at run time, outside the graph.
STATES: "weakref.WeakValueDictionary[int, DerivedState]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()


class DerivedState:
    """What the kernels derive from P and one R: the blocks of rows sharing P and R, and W = [I | R] of a frozen R
    (and, for the compiled path, P's layout).

    Owned by the module that owns R (`partial_pattern.PartialBertPattern` holds one for a common or fixed R and one
    per partial layer for per-layer R), and rebuilt when P or R changes: their storage or version counter moves
    with `set_pattern`, loading, an optimizer step or any in-place edit. Memory: at most one W per state, n·k·n
    values in the dtype last asked for (per distinct R: one for a common or fixed R, one per layer for per-layer R).

    ``key`` names the state in `STATES`; a copy (deepcopy, pickle) starts empty under a key of its own.
    """

    def __init__(self):
        self.key = next(_KEYS)
        STATES[self.key] = self
        self.clear()

    def __getstate__(self) -> dict:
        return {"cache": "not copied"}  # not empty: pickle calls __setstate__ only for a true state

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def clear(self) -> None:
        self._rows: tuple | None = None
        self._w: tuple | None = None
        self._layout: tuple | None = None

    @staticmethod
    def _stamp(indices: torch.Tensor, reconstruction: torch.Tensor) -> tuple:
        return (reconstruction.data_ptr(), reconstruction._version, tuple(reconstruction.shape), indices.data_ptr(),
                indices._version)

    def layout(self, indices: torch.Tensor, reconstruction: torch.Tensor) -> PatternLayout:
        """The layout of this P with the blocks of rows sharing P and R, derived again only when P or R changed
        (from P itself, not from its owner's buffers: a P edited in place between compiled calls is seen)."""
        stamp = (indices.data_ptr(), indices._version, tuple(indices.shape), indices.device)
        if self._layout is None or self._layout[0] != stamp:
            self._layout = (stamp, PatternLayout.from_indices(indices))
        return self._layout[1]._replace(shared_rows=self.shared_rows(indices, reconstruction))

    def shared_rows(self, indices: torch.Tensor, reconstruction: torch.Tensor) -> int:
        """`shared_rows` of this P and R, computed again only when either changed."""
        stamp = self._stamp(indices, reconstruction)
        if self._rows is None or self._rows[0] != stamp:
            self._rows = (stamp, shared_rows(indices, reconstruction.detach()))
        return self._rows[1]

    def matrix(self, layout: PatternLayout, reconstruction: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """W of this P and R in ``dtype``, built again only when P, R, the dtype or inference mode changed."""
        stamp = (*self._stamp(layout.indices, reconstruction), dtype, reconstruction.device,
                 torch.is_inference_mode_enabled())  # inference tensors stay inside inference mode
        if self._w is None or self._w[0] != stamp:
            self._w = (stamp, reconstruction_matrix(layout, reconstruction.detach().to(dtype)))
        return self._w[1]


class PartialTensors(NamedTuple):
    """What a partial layer reconstructs with (`attention_layer.layer_tensors`), passed to every kernel as
    ``partial=``."""

    layout: PatternLayout
    reconstruction: torch.Tensor  # R (n, n-k, k)
    bias: torch.Tensor | None  # (n, n-k) or None
    derived: DerivedState | None = None  # the cache of R's owner; None: W is built at every call

    def matrix(self, dtype: torch.dtype, fresh: bool = False) -> torch.Tensor:
        """W ``(n, k, n)`` in ``dtype`` without autograd where R is frozen (from the owner's cache), else built
        (differentiable in R unless grad mode is off); ``fresh``: always built (an R trained at every step)."""
        r = self.reconstruction
        if fresh or self.derived is None or torch.compiler.is_compiling() or needs_grad(r):
            return reconstruction_matrix(self.layout, r.to(dtype))
        return self.derived.matrix(self.layout, r, dtype)


def full_length(t, n: int) -> bool:
    """Whether an input of ``t`` tokens fills the pattern's n, for the shortcuts that skip padding to n. A symbolic
    length (``torch.export`` with a dynamic sequence dimension) takes the general path, which is also right at t = n
    (it pads by zero positions), so the exported program serves every length up to n instead of specialising."""
    return not isinstance(t, torch.SymInt) and t == n


def first_keys(scores: torch.Tensor, t) -> torch.Tensor:
    """``scores[..., :t]``, the first ``t`` keys; for a symbolic ``t`` (a dynamic exported length) as a fresh tensor
    (index_select), since a slice's contiguity (t = n or not) would be a guard that specialises the length."""
    if isinstance(t, torch.SymInt):
        return scores.index_select(-1, torch.arange(t, device=scores.device))
    return scores[..., :t]


def check_length(t: int, n: int) -> None:
    """Refuse an input of ``t`` tokens longer than the pattern's ``n`` (P and R exist for n positions only)."""
    if t > n:
        raise ValueError(f"Input length {t} exceeds the partial attention length n={n} (config.partial_seq_len); "
                         f"truncate inputs to {n} tokens or use a pattern derived for a longer n.")


def masked_keys(attention_mask: torch.Tensor | None, t: int, dtype: torch.dtype):
    """From a bool (True = attend) or additive float mask ``(B|1, 1|H, T, T)``: (additive mask, bool masked-out)."""
    if attention_mask is None:
        return None, None
    if attention_mask.dtype == torch.bool:
        additive = torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device)
        return additive.masked_fill(~attention_mask, torch.finfo(dtype).min), ~attention_mask
    return attention_mask.to(dtype), masked_out(attention_mask)


def masked_out(attention_mask: torch.Tensor) -> torch.Tensor:
    """The keys a bool (True = attend) or additive float mask masks out, bool of its shape: the one decoding of the
    masks the attention functions get (additive masks hold 0 for kept keys and a large negative value, finfo.min, for
    masked ones)."""
    if attention_mask.dtype == torch.bool:
        return ~attention_mask
    return attention_mask < torch.finfo(attention_mask.dtype).min / 2


def masked_at_p(masked: torch.Tensor | None, indices: torch.Tensor, t: int) -> torch.Tensor | None:
    """The exact scores that enter R as zero, bool ``(B|1, 1|H, T, k)``: keys masked out (``masked``, bool
    ``(B|1, 1|H, T, T)``, True = masked, or None) and keys at positions >= T; None when there are none. ``indices``:
    P ``(n, k)``, or each head's ``(H, n, k)`` (then the result has H heads)."""
    n, k = indices.shape[-2:]
    heads = indices.shape[:-2]  # () or (H,)
    if masked is None:
        if full_length(t, n):
            return None
        beyond = indices[..., :t, :] >= t  # (T, k) or (H, T, k)
        return beyond[None] if heads else beyond[None, None]  # (1, H|1, T, k)
    masked = nn.functional.pad(masked, (0, n - t), value=True)  # (B|1, 1|H, T, n)
    if heads:
        masked = masked.expand(-1, heads[0], -1, -1)  # (B|1, H, T, n)
        return masked.gather(-1, indices[:, :t].expand(masked.shape[0], heads[0], t, k))
    return masked.gather(-1, indices[:t].expand(*masked.shape[:2], t, k))


def _padded_keys(key: torch.Tensor, n: int) -> torch.Tensor:
    t = key.shape[2]
    return key if full_length(t, n) else nn.functional.pad(key, (0, 0, 0, n - t))  # (B, H, n, D): zero keys beyond T


def gathered_scores(query: torch.Tensor, key: torch.Tensor, indices: torch.Tensor, scaling: float) -> torch.Tensor:
    """The k scores of each query at P, only those: ``(B, H, T, D), (B, H, T, D), (n, k) -> (B, H, T, k)`` (k·d
    multiply-adds per query; keys at positions >= T score zero)."""
    t = query.shape[2]
    k_sel = _padded_keys(key, indices.shape[0])[:, :, indices[:t]]  # (B, H, T, k, D)
    return torch.einsum("bhtd,bhtkd->bhtk", query, k_sel) * scaling


def structured_scores(query: torch.Tensor, key: torch.Tensor, layout: PatternLayout, scaling: float) -> torch.Tensor:
    """The scores at P as the fast kernels compute them: one GEMM per block of rows sharing keys, else the whole QKᵀ
    then select P (gathering each query's keys would move B·H·n·k·d values): ``(B, H, T, k)``, zero beyond T."""
    b, h, t, d = query.shape
    n, k = layout.indices.shape
    key = _padded_keys(key, n)
    rows = layout.block_rows
    if rows is None:
        full = torch.matmul(query, key.transpose(-1, -2))  # (B, H, T, n); scaled after the selection (n·k, not n²)
        return full.gather(-1, layout.indices[:t].expand(b, h, t, k)) * scaling
    nb = n // rows
    query = query if full_length(t, n) else nn.functional.pad(query, (0, 0, 0, n - t))  # (B, H, n, D)
    # index_select rather than key[:, :, indices[::rows]]: faster on CPU, and so is its backward (index_add).
    cols = key.index_select(2, layout.indices[::rows].flatten()).view(b, h, nb, k, d)  # (B, H, nb, k, D)
    exact = torch.matmul(query.view(b, h, nb, rows, d), cols.transpose(-1, -2)) * scaling  # (B, H, nb, rows, k)
    return exact.view(b, h, n, k)[:, :, :t]  # (B, H, T, k)


def masked_exact_scores(query, key, attention_mask, layout: PatternLayout, scaling: float, structured: bool,
                        extra: torch.Tensor | None = None):
    """Exact scores at P with masked keys set to zero, and the additive mask: ``(B, H, T, k)``,
    ``(B|1, 1|H, T, T)`` or None. ``structured``: by `structured_scores`, else `gathered_scores`. ``extra``: the
    score's other terms at P, ``(B|1, H, T, k)`` (DeBERTa's position terms: `attention_adapters`), added to q·k."""
    t = query.shape[2]
    check_length(t, layout.indices.shape[0])
    additive, masked = masked_keys(attention_mask, t, query.dtype)
    if structured:
        exact = structured_scores(query, key, layout, scaling)
    else:
        exact = gathered_scores(query, key, layout.indices, scaling)  # (B, H, T, k)
    if extra is not None:
        exact = exact + extra
    # Masked keys, and keys at or beyond T, enter R with score zero (q·k is zero beyond T already; extra is not)
    zero_at = masked_at_p(masked, layout.indices, t)  # (B|1, 1|H, T, k) or None
    if zero_at is not None:
        exact = exact.masked_fill(zero_at, 0.0)
    return exact, additive


def rows_first(exact: torch.Tensor) -> torch.Tensor:
    """``(B, H, T, k) -> (T, B·H, k)``: the layout in which the product with each row's W is one bmm over rows."""
    b, h, t, k = exact.shape
    return exact.permute(2, 0, 1, 3).reshape(t, b * h, k)  # (T, B·H, k)


def sum_to_shape(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``grad`` summed over the dimensions ``shape`` broadcasts (size 1 there): the gradient of a broadcast input
    (an additive mask ``(B|1, 1|H, T, T)`` from the ``(B, H, T, T)`` scores')."""
    dims = [i for i, (g, s) in enumerate(zip(grad.shape, shape)) if s == 1 and g != 1]
    return grad.sum(dims, keepdim=True) if dims else grad


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will record an op on these tensors (grad mode on and one of them requires grad): the one
    test the kernels use to choose between their autograd and their in-place paths."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# CPU's softmax kernels read a row before writing it, so their output may alias their input (tested in float64,
# against the reference kernel, through `tiled` and `fused`); elsewhere they run out of place.
def softmax_in_place(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, written into ``scores`` on CPU (a new tensor elsewhere); no autograd."""
    if scores.device.type != "cpu":
        return torch.softmax(scores, dim=-1)
    return torch.ops.aten._softmax.out(scores, -1, False, out=scores)


def normalised_in_place(scores: torch.Tensor, bias: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
    """``softmax(scores + bias + mask)`` over the last dimension, written into ``scores`` on CPU (bias and mask
    broadcast to it, or None); no autograd."""
    if bias is not None:
        scores += bias
    if mask is not None:
        scores += mask
    return softmax_in_place(scores)


def tile_groups(b: int, h: int, rows: int, t: int, min_pairs: int = 1) -> list[tuple[slice, slice]]:
    """The (batch, head) slices of the groups a kernel works on one at a time: each group's ``rows`` × ``t``
    scores per pair fill about `TILE_ELEMENTS` values (or ``min_pairs`` pairs, if more), so that a group's n×n
    tensors stay in cache and no kernel allocates B·H·n² values at once."""
    pairs = max(1, max(TILE_ELEMENTS, min_pairs * rows * t) // max(rows * t, 1))
    bc, hc = (max(1, min(b, pairs // h)), h) if pairs >= h else (1, pairs)
    return [(slice(b0, b0 + bc), slice(h0, h0 + hc)) for b0 in range(0, b, bc) for h0 in range(0, h, hc)]


def broadcast_slice(group: tuple[slice, slice], tensor: torch.Tensor) -> tuple[slice, slice]:
    """The (batch, head) slices of ``group`` for a tensor ``(B|1, H|1, ...)``: whole where it broadcasts."""
    return tuple(g if size > 1 else slice(None) for g, size in zip(group, tensor.shape[:2]))


def tie_rows(reconstruction: torch.Tensor, rows: int) -> torch.Tensor:
    """R, whose gradient is summed over each block of ``rows`` rows and given to every row of the block (the
    gradient of one R per block): R that starts shared stays shared under elementwise optimizers.

    The value is R's, bit for bit (``x − x`` is exactly zero); the gradient flows through the block sums only."""
    if rows <= 1 or not needs_grad(reconstruction):
        return reconstruction
    n = reconstruction.shape[0]
    blocks = reconstruction.reshape(n // rows, rows, *reconstruction.shape[1:])  # (n / rows, rows, n-k, k)
    summed = blocks.sum(1, keepdim=True).expand_as(blocks).reshape(reconstruction.shape)  # (n, n-k, k)
    return reconstruction.detach() + (summed - summed.detach())

"""The partial attention function: exact scores at P, the rest reconstructed by R, then mask, softmax, ·V.

Part of the remote-code bundle (imports: torch only).

Padding and short inputs. P and R are defined for positions 0..n−1. An input of length T < n behaves as
if padded to n with keys whose scores are zero; a key masked out by the attention mask also enters the
reconstruction with score zero. Both make a sequence's output independent of how much padding its batch
carries (the exact scores of padding tokens would otherwise leak into the reconstructed scores of real
keys). Masked keys then receive no probability, as in dense attention.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .auto_rule import auto_implementation
from .configuration_partial_bert import PARTIAL_IMPLEMENTATIONS
from .reconstruction import complement_indices, inverse_permutation
from . import tiled_kernel
from .tiled_kernel import _tile_sizes, shared_rows, tiled_attention

__all__ = [
    "PatternLayout",
    "auto_implementation",
    "check_implementation",
    "resolve_implementation",
    "attention_function_name",
    "partial_attention_forward",
    "exact_partial_scores",
    "reconstruct_scores",
    "reconstruction_matrix",
    "block_rows",
    "IMPLEMENTATIONS",
    "PARTIAL_KERNELS",
    "register_attention_functions",
]


def block_rows(indices: torch.Tensor) -> int | None:
    """The largest r >= 2 dividing n such that each block of r consecutive rows shares one key set, else None.

    ``n`` means one key set for every query (shared columns); smaller values are block-local patterns.
    """
    n, k = indices.shape
    for rows in sorted((r for r in range(2, n + 1) if n % r == 0), reverse=True):
        blocks = indices.view(n // rows, rows, k)  # (n / rows, rows, k)
        if bool((blocks == blocks[:, :1]).all()):
            return rows
    return None


class PatternLayout(NamedTuple):
    """Index tensors derived from P once (the model caches them): build with `PatternLayout.from_indices`."""

    indices: torch.Tensor  # (n, k) P
    complement: torch.Tensor  # (n, n-k) P̄, sorted
    inverse_permutation: torch.Tensor  # (n, n) slot of each key in cat(P_i, P̄_i)
    block_rows: int | None  # rows per block sharing one key set, or None

    @classmethod
    def from_indices(cls, indices: torch.Tensor) -> "PatternLayout":
        n = indices.shape[0]
        return cls(indices, complement_indices(indices, n), inverse_permutation(indices, n), block_rows(indices))


def reconstruction_matrix(layout: "PatternLayout", reconstruction: torch.Tensor) -> torch.Tensor:
    """W ``(n, k, n)`` with ``W[i, m, P_i[m]] = 1`` and ``W[i, :, P̄_i[j]] = R_i[j, :]``: row i of the scores is
    ``exact_i @ W_i``, in key order. Differentiable in R.

    Built as ``[I | R_iᵀ]`` (the order cat(P_i, P̄_i)) gathered into key order by the inverse permutation: the
    same values as scattering R into zeros, at a fraction of the time (the scatter took 75 ms at n = 512, k = 32).
    """
    n, k = layout.indices.shape
    eye = torch.eye(k, dtype=reconstruction.dtype, device=reconstruction.device).expand(n, k, k)
    both = torch.cat([eye, reconstruction.transpose(1, 2)], dim=-1)  # (n, k, n) in the order cat(P_i, P̄_i)
    return both.gather(-1, layout.inverse_permutation.unsqueeze(1).expand(n, k, n))  # (n, k, n) in key order


# W of frozen R tensors (fixed R, or any R in inference without autograd), by the R tensor's id (tensors compare
# elementwise, so no weak-key dict), dropped when R is freed and rebuilt when R or P changes (their version counters
# and storage) or another dtype is asked for.
_FROZEN_W: dict[int, tuple] = {}


def _reconstruction_matrix_for(layout: "PatternLayout", reconstruction: torch.Tensor, dtype: torch.dtype):
    """`reconstruction_matrix`, reused across calls while R is frozen (not under torch.compile, which traces it)."""
    if torch.compiler.is_compiling() or (reconstruction.requires_grad and torch.is_grad_enabled()):
        return reconstruction_matrix(layout, reconstruction.to(dtype))
    stamp = (reconstruction.data_ptr(), reconstruction._version, layout.indices.data_ptr(), layout.indices._version,
             dtype, reconstruction.device, torch.is_inference_mode_enabled())  # inference tensors stay inside
    key = id(reconstruction)
    cached = _FROZEN_W.get(key)
    if cached is None or cached[0]() is not reconstruction or cached[1] != stamp:
        w = reconstruction_matrix(layout, reconstruction.detach().to(dtype))
        ref = weakref.ref(reconstruction, lambda _, key=key: _FROZEN_W.pop(key, None))
        cached = _FROZEN_W[key] = (ref, stamp, w)
    return cached[2]


def _masked_keys(attention_mask: torch.Tensor | None, t: int, dtype: torch.dtype):
    """From a bool (True = attend) or additive float mask, return (additive mask, bool masked-out)."""
    if attention_mask is None:
        return None, None
    if attention_mask.dtype == torch.bool:
        additive = torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device)
        additive = additive.masked_fill(~attention_mask, torch.finfo(dtype).min)
        return additive, ~attention_mask
    # Additive masks hold 0 for kept keys and a large negative value (finfo.min) for masked ones.
    return attention_mask.to(dtype), attention_mask < torch.finfo(attention_mask.dtype).min / 2


def _gather_scores(query, key, indices, scaling, rows):
    t = query.shape[2]
    k_sel = key[:, :, indices[:t]]  # (B, H, T, k, D)
    return torch.einsum("bhtd,bhtkd->bhtk", query, k_sel) * scaling


def _dense_scores(query, key, indices, scaling, rows):
    b, h, t, _ = query.shape
    full = torch.matmul(query, key.transpose(-1, -2))  # (B, H, T, n); scaled after the selection (n·k, not n²)
    return full.gather(-1, indices[:t].expand(b, h, t, indices.shape[1])) * scaling


def _block_scores(query, key, indices, scaling, rows):
    if rows is None:
        raise ValueError("implementation='blocks' needs a pattern whose rows share key sets in equal blocks.")
    b, h, t, d = query.shape
    n, k = indices.shape
    nb = n // rows
    if t < n:
        query = nn.functional.pad(query, (0, 0, 0, n - t))  # (B, H, n, D)
    cols = key[:, :, indices[::rows]]  # (B, H, nb, k, D): each block's shared keys
    exact = torch.matmul(query.view(b, h, nb, rows, d), cols.transpose(-1, -2)) * scaling  # (B, H, nb, rows, k)
    return exact.view(b, h, n, k)[:, :, :t]


# How the k exact scores of each query are computed; all give the same values and gradients.
# gather: only these B·H·T·k dot products; dense: QKᵀ, then select P; blocks: one GEMM per block of rows
# sharing their keys (needs `block_rows`).
_EXACT_SCORES = {"gather": _gather_scores, "dense": _dense_scores, "blocks": _block_scores}


def exact_partial_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    indices: torch.Tensor,
    scaling: float,
    implementation: str = "gather",
    rows: int | None = None,
) -> torch.Tensor:
    """Scores of each query with its k keys in P: ``(B, H, T, D), (B, H, T, D), (n, k) -> (B, H, T, k)``.

    Keys at positions >= T (the input is shorter than n) score zero. ``implementation`` is one of
    ``"gather"``, ``"dense"``, ``"blocks"`` (which needs ``rows``, see `block_rows`).
    """
    if implementation not in _EXACT_SCORES:
        raise ValueError(f"implementation must be one of {tuple(_EXACT_SCORES)}, got {implementation!r}.")
    t, n = query.shape[2], indices.shape[0]
    if t < n:
        key = nn.functional.pad(key, (0, 0, 0, n - t))  # (B, H, n, D): zero keys beyond the input
    return _EXACT_SCORES[implementation](query, key, indices, scaling, rows)


def _fused_scores(exact, w, bias_full, t):
    """``(B, H, T, k) -> (T, B·H, T)`` full scores, rows first so the per-row matmul is one bmm."""
    b, h, _, k = exact.shape
    rows_first = exact.permute(2, 0, 1, 3).reshape(t, b * h, k)  # (T, B·H, k)
    scores = torch.bmm(rows_first, w[:t, :, :t])  # (T, B·H, T)
    if bias_full is not None:
        scores = scores + bias_full[:t, None, :t]
    return scores


def reconstruct_scores(
    exact: torch.Tensor,
    reconstruction: torch.Tensor,
    bias: torch.Tensor | None,
    inverse_permutation: torch.Tensor,
) -> torch.Tensor:
    """Full rows from the exact scores: ``(B, H, T, k) -> (B, H, T, n)`` in key order.

    ``reconstruction`` is ``(n, n−k, k)``, ``bias`` ``(n, n−k)``, ``inverse_permutation`` ``(n, n)`` maps each
    key position to its slot in ``cat(P_i, P̄_i)``.
    """
    b, h, t, k = exact.shape
    n = inverse_permutation.shape[-1]
    rest = torch.einsum("bhtk,tmk->bhtm", exact, reconstruction[:t])  # (B, H, T, n-k)
    if bias is not None:
        rest = rest + bias[:t]
    both = torch.cat([exact, rest], dim=-1)  # (B, H, T, n) in the order cat(P_i, P̄_i)
    return both.gather(-1, inverse_permutation[:t].expand(b, h, t, n))  # (B, H, T, n) in key order


def _exact_masked(query, key, attention_mask, layout, scaling, exact_impl):
    """Exact scores at P with masked keys set to zero, and the additive mask: ``(B, H, T, k)``, ``(B|1, 1|H, T, T)``."""
    t = query.shape[2]
    indices = layout.indices
    n = indices.shape[0]
    if t > n:
        raise ValueError(
            f"Input length {t} exceeds the partial attention length n={n} (config.partial_seq_len); "
            f"truncate inputs to {n} tokens or use a pattern derived for a longer n."
        )
    additive, masked = _masked_keys(attention_mask, t, query.dtype)
    exact = exact_partial_scores(query, key, indices, scaling, exact_impl, layout.block_rows)  # (B, H, T, k)
    if masked is not None:
        masked = nn.functional.pad(masked, (0, n - t), value=True)  # (B|1, 1|H, T, n)
        masked_sel = masked.gather(-1, indices[:t].expand(*masked.shape[:2], t, indices.shape[1]))
        exact = exact.masked_fill(masked_sel, 0.0)  # masked keys enter R with score zero
    return exact, additive


def _softmax_times_value(module, scores, additive, value, dropout):
    """``(B, H, T, T)`` scores -> ``(output (B, T, H, D), probabilities (B, H, T, T))``."""
    if additive is not None:
        scores = scores + additive
    probs = nn.functional.softmax(scores, dim=-1)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs, value)  # (B, H, T, D)
    return out.transpose(1, 2).contiguous(), probs  # (B, T, H, D)


def _scatter_kernel(exact_impl: str):
    """Exact scores by ``exact_impl``, full rows by concatenation and one gather into key order."""

    def kernel(module, query, key, value, attention_mask, layout, reconstruction, bias, scaling, dropout,
               need_weights=True):
        exact, additive = _exact_masked(query, key, attention_mask, layout, scaling, exact_impl)
        scores = reconstruct_scores(exact, reconstruction.to(exact.dtype),
                                    None if bias is None else bias.to(exact.dtype), layout.inverse_permutation)
        t = query.shape[2]
        scores = scores[..., :t]  # (B, H, T, T): reconstructed scores of keys beyond the input are dropped
        return _softmax_times_value(module, scores, additive, value, dropout)

    return kernel


def _bias_full(layout: "PatternLayout", bias: torch.Tensor | None, dtype: torch.dtype, device) -> torch.Tensor | None:
    """The bias ``(n, n−k)`` scattered to key order ``(n, n)`` (zero at P), or None."""
    if bias is None:
        return None
    n = layout.indices.shape[0]
    full = torch.zeros(n, n, dtype=dtype, device=device)
    return full.scatter(-1, layout.complement, bias.to(dtype))  # (n, n) in key order


def _fused_kernel(module, query, key, value, attention_mask, layout, reconstruction, bias, scaling, dropout,
                  need_weights=True):
    """Exact part by block GEMMs when rows share keys (else QKᵀ then select), full rows by one batched matmul
    with ``W_i = [I at P_i | R_iᵀ at P̄_i]`` (no scatter).

    Without autograd and without a request for the attention map, it runs on groups of (batch, head) pairs
    whose n×n tensors hold about `tiled_kernel.TILE_ELEMENTS` values each, written into one output: the same
    numbers, without allocating B·H·n² values at once (which glibc serves with fresh pages on every call)."""
    grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad
                                        or reconstruction.requires_grad or (bias is not None and bias.requires_grad))
    w = _reconstruction_matrix_for(layout, reconstruction, query.dtype)  # (n, k, n)
    bias_full = _bias_full(layout, bias, query.dtype, query.device)
    if grad or need_weights:
        return _fused_group(module, query, key, value, attention_mask, layout, w, bias_full, scaling, dropout)
    b, h, t, d = query.shape
    k = layout.indices.shape[1]
    # Every group reads all of W (n·k·n values): where W does not stay in cache (over 8 MiB), groups hold at least
    # 8·k pairs so that reading W costs at most an eighth of the scores they write.
    pairs = 8 * k if w.numel() * w.element_size() > 8 * 2**20 else 2
    bc, hc = _tile_sizes(b, h, t, t, max(tiled_kernel.TILE_ELEMENTS, pairs * t * t))
    out = value.new_empty(b, t, h, d)  # (B, T, H, D)
    for b0 in range(0, b, bc):
        for h0 in range(0, h, hc):
            group = (slice(b0, b0 + bc), slice(h0, h0 + hc))
            mask = None
            if attention_mask is not None:  # (B|1, 1|H, T, T): slice the dimensions that do not broadcast
                mask = attention_mask[tuple(g if size > 1 else slice(None)
                                            for g, size in zip(group, attention_mask.shape[:2]))]
            out[b0:b0 + bc, :, h0:h0 + hc] = _fused_group(module, query[group], key[group], value[group], mask,
                                                          layout, w, bias_full, scaling, dropout)[0]
    return out, None


def _fused_group(module, query, key, value, attention_mask, layout, w, bias_full, scaling, dropout):
    """`_fused_kernel` on one group of (batch, head) pairs: ``(output (B, T, H, D), probabilities (B, H, T, T))``."""
    exact_impl = "blocks" if layout.block_rows is not None else "dense"
    exact, additive = _exact_masked(query, key, attention_mask, layout, scaling, exact_impl)
    b, h, t, k = exact.shape
    scores = _fused_scores(exact, w, bias_full, t).view(t, b, h, t)  # (T, B, H, T)
    if additive is not None:
        scores = scores + additive.permute(2, 0, 1, 3)  # (T, B|1, 1|H, T)
    probs = nn.functional.softmax(scores, dim=-1)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    probs = probs.permute(1, 2, 0, 3)  # (B, H, T, T) view
    out = torch.matmul(probs, value)  # (B, H, T, D)
    return out.transpose(1, 2).contiguous(), probs


def _tiled_kernel(module, query, key, value, attention_mask, layout, reconstruction, bias, scaling, dropout,
                  need_weights=True):
    """Exact part as in `_fused_kernel`; then `tiled_kernel.tiled_attention` over the blocks of rows that share
    P and R (`shared_rows`; blocks of one row when none do)."""
    exact_impl = "blocks" if layout.block_rows is not None else "dense"
    exact, additive = _exact_masked(query, key, attention_mask, layout, scaling, exact_impl)  # (B, H, T, k)
    rows = shared_rows(layout.indices, reconstruction)
    w = _reconstruction_matrix_for(layout, reconstruction, exact.dtype)  # (n, k, n)
    bias_full = _bias_full(layout, bias, exact.dtype, exact.device)
    return tiled_attention(query, key, value, exact, additive, w, bias_full, rows, dropout=dropout,
                           training=module.training, need_weights=need_weights)


def _triton_kernel(module, query, key, value, attention_mask, layout, reconstruction, bias, scaling, dropout,
                   need_weights=True):
    """The fused Triton kernel (`triton_kernel`): the n×n scores never reach memory; GPUs, or CPU under
    ``TRITON_INTERPRET=1``. Returns no attention map (like SDPA)."""
    from .triton_kernel import triton_partial_attention

    if module.training and dropout > 0:
        raise ValueError(f"partial_implementation='triton' has no attention dropout (got p={dropout} in training); "
                         "set config.attention_probs_dropout_prob=0, or use partial_implementation='fused'.")
    t = query.shape[2]
    n, k = layout.indices.shape
    if t > n:
        raise ValueError(f"Input length {t} exceeds the partial attention length n={n} (config.partial_seq_len); "
                         f"truncate inputs to {n} tokens or use a pattern derived for a longer n.")
    additive, masked = _masked_keys(attention_mask, t, torch.float32)
    masked_at_p = None
    if masked is not None:
        masked = nn.functional.pad(masked, (0, n - t), value=True)  # (B|1, 1|H, T, n)
        masked_at_p = masked.gather(-1, layout.indices[:t].expand(*masked.shape[:2], t, k))  # (B|1, 1|H, T, k)
        additive = additive if additive.stride(-1) == 1 else additive.contiguous()
    w = _reconstruction_matrix_for(layout, reconstruction, torch.float32)  # (n, k, n), float32 whatever the input
    bias_full = _bias_full(layout, bias, torch.float32, query.device)
    out = triton_partial_attention(query, key, value, w, bias_full, additive, masked_at_p, layout.indices, scaling)
    return out.transpose(1, 2).contiguous(), None  # (B, T, H, D)


# The kernels, by name (`config.partial_implementation`, or "auto": see `auto_implementation`).
# gather: only the k scores per query, assembled by scatter (the reference).
# dense: QKᵀ then select P, assembled by scatter.
# fused: see `_fused_kernel`.
# tiled: see `_tiled_kernel` (fast when blocks of rows share P and R: the shared_blocks family).
# triton: see `_triton_kernel` (GPU; `auto` never picks it).
PARTIAL_KERNELS: dict[str, Callable] = {
    "gather": _scatter_kernel("gather"),
    "dense": _scatter_kernel("dense"),
    "fused": _fused_kernel,
    "tiled": _tiled_kernel,
    "triton": _triton_kernel,
}
# The kernels that run on any device in PyTorch alone (and in float64): the ones tested against each other.
IMPLEMENTATIONS = tuple(name for name in PARTIAL_KERNELS if name != "triton")


def check_implementation(name: str) -> None:
    """Raise a ValueError naming the choices unless ``name`` is ``"auto"`` or a kernel of `PARTIAL_KERNELS`."""
    if name not in PARTIAL_IMPLEMENTATIONS or (name != "auto" and name not in PARTIAL_KERNELS):
        raise ValueError(f"partial_implementation must be one of {PARTIAL_IMPLEMENTATIONS}, got {name!r}.")


def resolve_implementation(name: str, layout: "PatternLayout", head_dim: int,
                           reconstruction: torch.Tensor | None = None, training: bool = False) -> str:
    """The kernel ``name`` runs: itself, or for ``"auto"`` the choice of `auto_rule.auto_implementation` (which
    needs R to see whether blocks of rows share it, else assumes they do not; ``training``: a backward follows)."""
    check_implementation(name)
    if name != "auto":
        return name
    shared = 1 if reconstruction is None else shared_rows(layout.indices, reconstruction)
    n, k = layout.indices.shape
    return auto_implementation(n, k, head_dim, layout.block_rows, shared, "training" if training else "inference")


def partial_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    layout: PatternLayout,
    reconstruction: torch.Tensor,
    bias: torch.Tensor | None = None,
    scaling: float,
    dropout: float = 0.0,
    implementation: str = "gather",
    need_weights: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention with partial computation, in the calling convention of transformers' attention functions.

    Args:
        query, key, value: ``(B, H, T, D)`` with T <= n.
        attention_mask: ``None``, bool ``(B|1, 1|H, T, T)`` (True = attend) or additive float of that shape.
        layout: P and the index tensors derived from it (`PatternLayout.from_indices`).
        reconstruction: R, ``(n, n−k, k)``. bias: ``(n, n−k)`` or None.
        implementation: a key of `PARTIAL_KERNELS`; every kernel gives the same numbers and gradients.
        need_weights: whether the caller uses the probabilities; ``False`` lets the ``tiled`` kernel skip writing
            them (it then returns None for them, like SDPA; the other kernels return them anyway).

    Returns:
        ``(output (B, T, H, D), probabilities (B, H, T, T) or None)`` like ``eager_attention_forward``.
    """
    if implementation not in PARTIAL_KERNELS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}.")
    return PARTIAL_KERNELS[implementation](module, query, key, value, attention_mask, layout, reconstruction, bias,
                                           scaling, dropout, need_weights=need_weights)


# ---------------------------------------------------------------- transformers' attention dispatch
_PREFIX = "partial_"


def attention_function_name(implementation: str) -> str:
    """The `AttentionInterface` name of a kernel: ``"partial_fused"`` and so on."""
    return _PREFIX + implementation


def _interface_function(implementation: str) -> Callable:
    """The `AttentionInterface` function of a kernel; ``"auto"`` picks one per call from the layer's P."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, need_weights=True,
                  **kwargs):
        # P and R belong to the layer: a partial layer exposes them through `partial_tensors()`.
        tensors = getattr(module, "partial_tensors", None)
        if tensors is None:
            raise TypeError(
                f"attention {attention_function_name(implementation)!r} runs only in PartialBert's partial layers "
                f"(got {type(module).__name__}); set attn_implementation to 'sdpa' or 'eager' for exact layers."
            )
        layout, reconstruction, bias = tensors()
        training = torch.is_grad_enabled() and (query.requires_grad or reconstruction.requires_grad)
        kernel = PARTIAL_KERNELS[resolve_implementation(implementation, layout, query.shape[-1], reconstruction,
                                                        training)]
        return kernel(module, query, key, value, attention_mask, layout, reconstruction, bias,
                      module.scaling if scaling is None else scaling, dropout, need_weights=need_weights)

    attention.__name__ = f"{attention_function_name(implementation)}_attention_forward"
    return attention


def register_attention_functions() -> None:
    """Register every kernel with transformers' `AttentionInterface` (and a mask builder for its name, so a mask
    is never silently dropped); safe to call more than once."""
    for name in PARTIAL_IMPLEMENTATIONS:  # every kernel, and "auto"
        AttentionInterface.register(attention_function_name(name), _interface_function(name))
        AttentionMaskInterface.register(attention_function_name(name), sdpa_mask)


register_attention_functions()

"""The partial attention function: exact scores at P, the rest reconstructed by R, then mask, softmax, ·V.

Part of the remote-code bundle (imports: torch, transformers and siblings).

Padding and short inputs. P and R are defined for positions 0..n−1. An input of length T < n behaves as
if padded to n with keys whose scores are zero; a key masked out by the attention mask also enters the
reconstruction with score zero. Both make a sequence's output independent of how much padding its batch
carries (the exact scores of padding tokens would otherwise leak into the reconstructed scores of real
keys). Masked keys then receive no probability, as in dense attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .auto_rule import auto_implementation
from .configuration_partial_bert import PARTIAL_IMPLEMENTATIONS
from . import tiled_kernel
from .fused_autograd import fused_attention_with_autograd, rows_first_attention
from .partial_scores import (
    PatternLayout,
    _bias_full,
    _exact_masked,
    _fused_scores,
    _masked_keys,
    _reconstruction_matrix_for,
    block_rows,
    check_length,
    exact_partial_scores,
    masked_at_p,
    reconstruct_scores,
    reconstruction_matrix,
    structured_exact_method,
)
from .tiled_kernel import _broadcast_slice, _tile_sizes, needs_grad, shared_rows, tiled_attention

__all__ = [
    "PatternLayout",
    "auto_implementation",
    "check_implementation",
    "exact_scores_method",
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


def _fused_kernel(module, query, key, value, attention_mask, layout, reconstruction, bias, scaling, dropout,
                  need_weights=True):
    """Exact part by block GEMMs when rows share keys (else QKᵀ then select), full rows by one batched matmul
    with ``W_i = [I at P_i | R_iᵀ at P̄_i]`` (no scatter).

    With autograd and without a request for the attention map, it runs `fused_autograd.fused_attention_with_autograd`
    (the same numbers, a backward written out by hand).
    Without autograd and without a request for the attention map, it runs on groups of (batch, head) pairs
    whose n×n tensors hold about `tiled_kernel.TILE_ELEMENTS` values each, written into one output: the same
    numbers, without allocating B·H·n² values at once (which glibc serves with fresh pages on every call)."""
    grad = needs_grad(query, key, value, reconstruction, bias)
    if grad and not need_weights:
        return fused_attention_with_autograd(query, key, value, attention_mask, layout, reconstruction, bias,
                                             scaling, dropout if module.training else 0.0), None
    w = _reconstruction_matrix_for(layout, reconstruction, query.dtype)  # (n, k, n)
    bias_full = _bias_full(layout, bias, query.dtype, query.device)
    if need_weights or grad:
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
            # (B|1, 1|H, T, T): slice the dimensions that do not broadcast
            mask = None if attention_mask is None else attention_mask[_broadcast_slice(group, attention_mask)]
            out[b0:b0 + bc, :, h0:h0 + hc] = _fused_group(module, query[group], key[group], value[group], mask,
                                                          layout, w, bias_full, scaling, dropout)[0]
    return out, None


def _fused_group(module, query, key, value, attention_mask, layout, w, bias_full, scaling, dropout):
    """`_fused_kernel` on one group of (batch, head) pairs: ``(output (B, T, H, D), probabilities (B, H, T, T))``."""
    if not needs_grad(query, key, value, w, bias_full):
        return rows_first_attention(query, key, value, attention_mask, layout, w, bias_full, scaling,
                                    dropout if module.training else 0.0)
    exact, additive = _exact_masked(query, key, attention_mask, layout, scaling,
                                    exact_scores_method("fused", layout))  # (B, H, T, k)
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
    exact, additive = _exact_masked(query, key, attention_mask, layout, scaling,
                                    exact_scores_method("tiled", layout))  # (B, H, T, k)
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
    check_length(t, layout.indices.shape[0])
    additive, masked = _masked_keys(attention_mask, t, torch.float32)
    zero_at = None
    if masked is not None:
        zero_at = masked_at_p(masked, layout.indices, t)  # (B|1, 1|H, T, k)
        additive = additive if additive.stride(-1) == 1 else additive.contiguous()
    w = _reconstruction_matrix_for(layout, reconstruction, torch.float32)  # (n, k, n), float32 whatever the input
    bias_full = _bias_full(layout, bias, torch.float32, query.device)
    out = triton_partial_attention(query, key, value, w, bias_full, additive, zero_at, layout.indices, scaling)
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


def exact_scores_method(implementation: str, layout: PatternLayout) -> str:
    """How a kernel gets the exact scores at P, as `exact_partial_scores` names it: ``"gather"`` (only the k
    scores per query: k·d multiply-adds), ``"blocks"`` (one GEMM per block of rows that share keys: k·d) or
    ``"dense"`` (the whole QKᵀ, then select P: n·d). ``fused`` and ``tiled`` use blocks when rows share keys and
    QKᵀ for per-query patterns (gathering each query's keys moves B·H·n·k·d values); ``triton`` gathers in its
    kernel."""
    if implementation not in PARTIAL_KERNELS:
        raise ValueError(f"implementation must be one of {tuple(PARTIAL_KERNELS)}, got {implementation!r}.")
    if implementation in ("gather", "dense"):
        return implementation
    if implementation == "triton":
        return "gather"
    return structured_exact_method(layout)


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
        need_weights: whether the caller uses the probabilities; ``False`` lets ``tiled`` and ``fused`` skip
            writing them and return None for them, like SDPA; ``gather`` and ``dense`` return them anyway.

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
        training = needs_grad(query, key, value, reconstruction, bias)
        if training and torch.compiler.is_exporting():
            # An exported program keeps a kernel's forward ops, not its autograd.Function, and replays them under
            # autograd: only the reference kernel's out-of-place ops run there (in-place `out=` ops refuse to).
            kernel = PARTIAL_KERNELS["gather"]
        else:
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

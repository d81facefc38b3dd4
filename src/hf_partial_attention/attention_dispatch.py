"""Which kernel runs (its registration with transformers' ``AttentionInterface`` is `partial_layer`'s).

Part of the remote-code bundle (imports: torch, transformers and siblings).

The kernels (`configuration_partial_bert.KERNEL_NAMES`), one function each, all in transformers' calling
convention and all giving the reference's numbers and gradients:

- ``gather`` (`attention_gather`): the reference; the only one that returns the attention map.
- ``fused`` (`attention_fused`): full rows by one batched matmul with W = [I | R], a hand-written backward.
- ``tiled`` (`attention_tiled`): inference in cache-sized tiles, for rows sharing P and R.
- ``triton`` (`attention_triton`): one GPU kernel, the n×n scores never in memory.

Whatever the setting, a call that asks for the attention map runs ``gather`` (as transformers runs eager attention
for ``output_attentions``), ``tiled`` under autograd runs ``fused``, a dynamic (symbolic) batch or length of
``torch.export(..., dynamic_shapes=...)`` runs the reference (its shapes follow the input's, where the fast kernels'
tile sizes would specialise the length), and under ``torch.export`` with autograd on the reference runs (an exported program keeps a kernel's forward ops, not its autograd Function, and replays them under
autograd, where the in-place ``out=`` ops refuse to run).

``"auto"`` (`auto_kernel`): ``triton`` on a CUDA device when triton is installed (head size a power of two >= 16,
no attention dropout); otherwise ``tiled`` in inference at n >= 256 for rows sharing P and R; otherwise ``fused``.
docs/method.md#kernels names the committed benchmark results behind it; ``make bench`` prints a "rule miss" for any
case where another kernel beats its choice by more than 10 %.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
from torch import nn

from .attention_common import DerivedState, PartialTensors, PatternLayout, PatternStructure, needs_grad
from .attention_fused import fused_attention
from .attention_gather import gather_attention
from .attention_tiled import tiled_attention
from .configuration_partial import KERNEL_NAMES, PARTIAL_IMPLEMENTATIONS

__all__ = ["TILED_MIN_LENGTH", "auto_kernel", "kernel_for", "kernel_function", "check_implementation",
           "partial_attention_forward", "attention_function_name"]

# The shortest n at which `auto` runs `tiled` for rows sharing P and R (below it `fused` is as fast or faster).
TILED_MIN_LENGTH = 256


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def auto_kernel(layout: PatternLayout, device: torch.device | str, head_dim: int, training: bool,
                dropout: float = 0.0) -> str:
    """The kernel ``"auto"`` runs for this pattern on ``device`` (``training``: a backward follows; ``dropout``:
    the attention dropout in effect)."""
    if (torch.device(device).type == "cuda" and _triton_installed() and head_dim >= 16
            and head_dim & (head_dim - 1) == 0 and dropout == 0.0):
        return "triton"
    if (not training and layout.structure is PatternStructure.ROWS_SHARING_P_AND_R
            and layout.indices.shape[0] >= TILED_MIN_LENGTH):
        return "tiled"
    return "fused"


def check_implementation(name: str) -> None:
    """Raise a ValueError naming the choices unless ``name`` is ``"auto"`` or a kernel."""
    if name not in PARTIAL_IMPLEMENTATIONS:
        raise ValueError(f"partial_implementation must be one of {PARTIAL_IMPLEMENTATIONS}, got {name!r}.")


def kernel_for(implementation: str, partial: PartialTensors, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, *, need_weights: bool, dropout: float = 0.0) -> str:
    """The kernel a call runs for the setting ``implementation`` (see the module docstring)."""
    check_implementation(implementation)
    grad = needs_grad(query, key, value, partial.reconstruction, partial.bias)
    # A dynamic (symbolic) batch or length, as torch.export with dynamic_shapes traces it: the reference, whose
    # shapes follow the input's (the fast kernels' tile sizes would specialise the length to the example's).
    dynamic = torch.compiler.is_exporting() and any(isinstance(size, torch.SymInt) for size in query.shape[:3])
    if need_weights or dynamic or (grad and torch.compiler.is_exporting()):
        return "gather"
    if implementation == "auto":
        implementation = auto_kernel(partial.layout, query.device, query.shape[-1], grad, dropout)
    return "fused" if implementation == "tiled" and grad else implementation


def kernel_function(name: str) -> Callable:
    """The attention function of a kernel (of `KERNEL_NAMES`)."""
    if name == "triton":  # imported at first use: it reads TRITON_INTERPRET and imports triton
        from .attention_triton import triton_attention

        return triton_attention
    functions = {"gather": gather_attention, "fused": fused_attention, "tiled": tiled_attention}
    if name not in functions:
        raise ValueError(f"implementation must be one of {KERNEL_NAMES}, got {name!r}.")
    return functions[name]


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
    derived: DerivedState | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Partial attention outside a model (tests, benchmarks): the kernel ``implementation`` chooses
    (`kernel_for`) on this P and R.

    Args:
        query, key, value: ``(B, H, T, D)`` with T <= n.
        attention_mask: ``None``, bool ``(B|1, 1|H, T, T)`` (True = attend) or additive float of that shape.
        layout: P and the index tensors derived from it (`PatternLayout.from_indices`; pass R there too, or rows
            sharing P and R are not seen). reconstruction: R, ``(n, n−k, k)``. bias: ``(n, n−k)`` or None.
        need_weights: whether the caller uses the probabilities (then the reference kernel runs).
        derived: the state that keeps W of a frozen R across calls, as a model's pattern module does (one per P and
            R); None: W is built at every call.

    Returns:
        ``(output (B, T, H, D), probabilities (B, H, T, T) or None)``.
    """
    partial = PartialTensors(layout, reconstruction, bias, derived)
    name = kernel_for(implementation, partial, query, key, value, need_weights=need_weights,
                      dropout=dropout if module.training else 0.0)
    return kernel_function(name)(module, query, key, value, attention_mask, scaling, dropout, partial=partial)


def attention_function_name(implementation: str) -> str:
    """The `AttentionInterface` name of a setting: ``"partial_fused"``, ``"partial_auto"`` and so on."""
    return "partial_" + implementation

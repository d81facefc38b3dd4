"""What the hand-written backward passes of `attention_fused` share: R's and the bias's gradient gathered from W's,
the softmax backward in place, dropout's kept probabilities.

Part of the remote-code bundle (imports: torch and siblings only).
"""

from __future__ import annotations

import torch

from .attention_common import PatternLayout, full_length

__all__ = ["scatter_to_complement", "softmax_backward_in_place", "dropped_probabilities"]


def scatter_to_complement(full: torch.Tensor, layout: PatternLayout, t: int, dim_k: bool) -> torch.Tensor:
    """A gradient in key order, ``(T, k, T)`` (W) or ``(T, T)`` (bias), to R's ``(n, n−k, k)`` or the bias's
    ``(n, n−k)``: the entries at P̄_i, zero for rows and keys beyond the input (the backward kernels' last step)."""
    n, k = layout.indices.shape
    comp = layout.complement  # (n, n-k)
    if not full_length(t, n):
        padded = full.new_zeros((n, k, n) if dim_k else (n, n))
        padded[(slice(t), slice(None), slice(t)) if dim_k else (slice(t), slice(t))] = full
        full = padded
    if dim_k:
        return full.gather(-1, comp[:, None, :].expand(n, k, n - k)).transpose(1, 2)  # (n, n-k, k)
    return full.gather(-1, comp)  # (n, n-k)


# Under glibc's default malloc every fresh n×n tensor above the mmap threshold costs page faults, so the forward
# and the backward each allocate one and work in it in place (`attention_common.normalised_in_place`; the softmax
# backward likewise, on CPU only).
def softmax_backward_in_place(grad: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """The softmax's backward over the last dimension (``probs``: its output), written into ``grad`` on CPU (a new
    tensor elsewhere); no autograd."""
    if grad.device.type != "cpu":
        return torch._softmax_backward_data(grad, probs, -1, probs.dtype)
    return torch.ops.aten._softmax_backward_data.out(grad, probs, -1, probs.dtype, grad_input=grad)


def dropped_probabilities(probs: torch.Tensor, keep: torch.Tensor | None, dropout: float) -> torch.Tensor:
    """The probabilities after dropout (kept ones scaled by 1 / (1 - p)): what multiplies V."""
    return probs if keep is None else probs * keep / (1.0 - dropout)

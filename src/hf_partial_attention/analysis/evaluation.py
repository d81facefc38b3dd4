"""Measured reconstruction error on held-out score matrices, for patterns and baselines alike.

A reconstructor maps score matrices ``(S, n, n)`` (float64) to their reconstruction; `ErrorMeter` streams
batches through several reconstructors and reports, for each, the mean squared error normalised by the
held-out total variance, and the same error modulo a per-row constant (softmax ignores such shifts),
normalised by the variance that is left after removing each row's mean.
"""

from __future__ import annotations

import torch

from ..pattern import AttentionPattern
from ._threads import single_thread

__all__ = ["LinearReconstructor", "MeanFill", "NystromCUR", "ErrorMeter"]


class LinearReconstructor:
    """Apply an `AttentionPattern`: exact scores on P, ``R a_P (+ b)`` elsewhere (either scope)."""

    def __init__(self, pattern: AttentionPattern):
        self.scope = pattern.scope
        self.n = pattern.seq_len
        self.indices = pattern.indices
        self.complement = pattern.complement
        self._params = {torch.float64: (pattern.reconstruction.to(torch.float64),
                                        None if pattern.bias is None else pattern.bias.to(torch.float64))}

    def params(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """R and bias in ``dtype`` (cached)."""
        if dtype not in self._params:
            recon, bias = self._params[torch.float64]
            self._params[dtype] = (recon.to(dtype), None if bias is None else bias.to(dtype))
        return self._params[dtype]

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        s, n, _ = scores.shape
        recon, bias = self.params(scores.dtype)
        if self.scope == "whole":
            flat = scores.reshape(s, n * n)  # (S, n²)
            rest = flat[:, self.indices] @ recon.T  # (S, n²−k)
            if bias is not None:
                rest = rest + bias
            return flat.clone().index_copy_(1, self.complement, rest).reshape(s, n, n)
        exact = scores.gather(-1, self.indices.expand(s, *self.indices.shape))  # (S, n, k)
        rest = torch.einsum("sik,imk->sim", exact, recon)  # (S, n, n−k)
        if bias is not None:
            rest = rest + bias
        return scores.clone().scatter_(-1, self.complement.expand(s, *self.complement.shape), rest)


class MeanFill:
    """No reconstruction: exact scores on P (``(n, k)``), the training mean ``(n, n)`` elsewhere."""

    def __init__(self, indices: torch.Tensor, mean: torch.Tensor):
        self.indices = indices
        self.mean = mean.to(torch.float64)

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        s = scores.shape[0]
        idx = self.indices.expand(s, *self.indices.shape)  # (S, n, k)
        return self.mean.to(scores.dtype).expand_as(scores).clone().scatter_(-1, idx, scores.gather(-1, idx))


class NystromCUR:
    """Landmark rows and columns L, ``Â = A[:, L] A[L, L]⁺ A[L, :]``, exact on the landmark rows and columns.

    A per-input (data-dependent) reconstruction; since ``QKᵀ`` has rank ≤ d_h it is exact once |L| ≥ d_h
    (for generic inputs). Below that the core ``A[L, L]`` is ill-conditioned and its pseudo-inverse must be
    truncated: ``rcond`` (relative to the largest singular value) defaults to 1e-2, the best of
    {1e-10, 1e-6, 1e-4, 1e-3, 1e-2, 1e-1} for m = 24 on 16 *fitting* windows of MiniLM at n = 128
    (errors 114, 76, 0.58, 0.083, 0.037, 0.13); 1e-10 is right only once m ≥ d_h.
    """

    def __init__(self, landmarks: torch.Tensor, rcond: float = 1e-2):
        self.landmarks = landmarks
        self.rcond = rcond

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        lm = self.landmarks
        cols = scores[:, :, lm]  # (S, n, m)
        rows = scores[:, lm, :]  # (S, m, n)
        with single_thread():  # S small problems: see _threads
            core = torch.linalg.pinv(scores[:, lm][:, :, lm], rtol=self.rcond, hermitian=False)  # (S, m, m)
        out = cols @ core @ rows  # (S, n, n)
        out[:, :, lm] = cols
        out[:, lm, :] = rows
        return out


class ErrorMeter:
    """Streams held-out score matrices through named reconstructors and accumulates their errors.

    Reconstructions and residuals are computed in ``dtype`` (float32 by default, the precision the model's
    scores come in; twice as fast as float64); every sum is accumulated in float64. Reconstructors must
    return a new tensor.
    """

    def __init__(self, methods: dict, dtype: torch.dtype = torch.float32):
        self.methods = dict(methods)
        self.dtype = dtype
        self.count = 0
        self._sum = None  # (n, n) Σ a
        self._sq = 0.0  # Σ ‖a‖²
        self._row_sum = None  # (n, n) Σ J a (row-centred)
        self._row_sq = 0.0  # Σ ‖J a‖²
        self.sse = {name: 0.0 for name in self.methods}
        self.sse_shift = {name: 0.0 for name in self.methods}

    def update(self, scores: torch.Tensor, layer: int | None = None) -> None:
        """Add ``(S, n, n)`` or ``(B, H, n, n)`` score matrices (``layer`` is ignored: errors are pooled)."""
        x64 = scores.detach().to("cpu", torch.float64)
        x64 = x64.reshape(-1, *x64.shape[-2:])  # (S, n, n)
        n = x64.shape[-1]
        centred = x64 - x64.mean(-1, keepdim=True)  # (S, n, n): J a_i for each row
        if self._sum is None:
            self._sum = torch.zeros(n, n, dtype=torch.float64)
            self._row_sum = torch.zeros(n, n, dtype=torch.float64)
        self.count += x64.shape[0]
        self._sum += x64.sum(0)
        self._sq += float(x64.pow(2).sum())
        self._row_sum += centred.sum(0)
        self._row_sq += float(centred.pow(2).sum())
        x = x64.to(self.dtype)
        for name, method in self.methods.items():
            r = method(x)
            r = r - x if r.data_ptr() == x.data_ptr() else r.sub_(x)  # (S, n, n) residual (sign irrelevant)
            row_sum = r.sum(-1).double()  # (S, n): 128-term float32 row sums are accurate enough
            sq = r.square_().sum(-1).double()  # (S, n)
            self.sse[name] += float(sq.sum())
            self.sse_shift[name] += float((sq - row_sum.square() / n).sum())

    def sink(self, layer: int, scores: torch.Tensor) -> None:
        """Capture sink signature (``capture_scores``)."""
        self.update(scores, layer)

    @property
    def total_variance(self) -> float:
        """Tr of the held-out covariance (per score matrix)."""
        return self._sq / self.count - float((self._sum / self.count).pow(2).sum())

    @property
    def shift_invariant_variance(self) -> float:
        """Variance left after removing each row's mean (per score matrix)."""
        return self._row_sq / self.count - float((self._row_sum / self.count).pow(2).sum())

    def results(self) -> dict[str, dict[str, float]]:
        """Per method: ``mse`` (per matrix), ``normalized_error`` (/ total variance) and ``normalized_error_shift``
        (error modulo a per-row constant / shift-invariant variance)."""
        if self.count == 0:
            raise ValueError("ErrorMeter saw no scores; run held-out windows through it first.")
        tv, sv = self.total_variance, self.shift_invariant_variance
        return {name: {"mse": self.sse[name] / self.count,
                       "normalized_error": self.sse[name] / self.count / tv,
                       "normalized_error_shift": self.sse_shift[name] / self.count / sv}
                for name in self.methods}

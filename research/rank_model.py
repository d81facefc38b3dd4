"""Attention model, targets and the full-rank hardmax construction for the rank-vs-heads study.

Seed 004 (Amsel, Yehudai, Bruna, arXiv 2407.16153).  The model follows the authors' code as
summarised in docs/related.md B4: post-norm encoder layers, ReLU feed-forward, biases on, dropout 0, LayerNorm
replaced by ``x -> s * x / ||x||`` (learnable scalar ``s``), no embedding (points are the tokens).
The query/key rank per head is ``r = d / nhead``; a width multiplier ``w`` averages ``w`` parallel
attention modules, so the total number of heads is ``H = w * d / r``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

TARGETS = ("farthest", "nearest")


def _bad(name: str, value: object, fix: str) -> ValueError:
    return ValueError(f"{name}={value!r} is invalid: {fix}")


def check_rank(d: int, r: int) -> int:
    """Validate ``r`` as a divisor of ``d`` and return ``nhead = d // r``."""
    for name, v in (("d", d), ("r", r)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise _bad(name, v, "pass a positive integer")
    if d % r:
        raise _bad("r", r, f"the rank per head must divide d={d} (r = d / nhead)")
    return d // r


# --------------------------------------------------------------------------- data and targets
def sample_sphere(batch: int, n: int, d: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``(batch, n, d)`` points i.i.d. uniform on the unit sphere (normalised Gaussians)."""
    x = torch.randn(batch, n, d, generator=generator)
    return x / x.norm(dim=-1, keepdim=True)


def nn_target(x: torch.Tensor, target: str = "farthest") -> torch.Tensor:
    """Target for every token of ``x`` ``(B, N, d)``.

    ``"farthest"``: ``x_{argmin_j <x_i, x_j>}`` (nearest neighbour of ``-x_i``; the authors' task).
    ``"nearest"``: ``x_{argmax_{j != i} <x_i, x_j>}`` (plain nearest neighbour among the others).
    """
    if target not in TARGETS:
        raise _bad("target", target, f"use one of {TARGETS}")
    gram = x @ x.transpose(1, 2)  # (B, N, N)
    if target == "farthest":
        idx = gram.argmin(dim=-1)
    else:
        eye = torch.eye(x.shape[1], dtype=torch.bool, device=x.device)
        idx = gram.masked_fill(eye, -math.inf).argmax(dim=-1)
    return torch.gather(x, 1, idx[..., None].expand_as(x))  # (B, N, d)


# --------------------------------------------------------------------------- hardmax construction
class FullRankHead(nn.Module):
    """One full-rank (``r = d``) attention head ``W_O W_V X phi(X^T W_K^T W_Q x_i)``.

    :meth:`construct` sets ``W_Q = I``, ``W_K = -I`` (farthest) or ``+I`` (nearest, with the query
    itself masked), ``W_V = W_O = I``.  With ``hardmax=True`` it equals :func:`nn_target` exactly
    for any ``N``; with softmax at inverse temperature ``beta`` it approaches it as ``beta -> inf``.
    """

    def __init__(self, d: int, hardmax: bool = True, beta: float = 1.0, mask_self: bool = False):
        super().__init__()
        self.W_Q = nn.Parameter(torch.eye(d))
        self.W_K = nn.Parameter(torch.eye(d))
        self.W_V = nn.Parameter(torch.eye(d))
        self.W_O = nn.Parameter(torch.eye(d))
        self.hardmax, self.beta, self.mask_self = hardmax, float(beta), mask_self

    @classmethod
    def construct(cls, d: int, target: str = "farthest", hardmax: bool = True,
                  beta: float = 1.0) -> FullRankHead:
        if target not in TARGETS:
            raise _bad("target", target, f"use one of {TARGETS}")
        head = cls(d, hardmax=hardmax, beta=beta, mask_self=target == "nearest")
        with torch.no_grad():
            head.W_K.mul_(-1.0 if target == "farthest" else 1.0)
        return head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = x @ self.W_Q.T, x @ self.W_K.T, x @ self.W_V.T  # each (B, N, d)
        scores = self.beta * (q @ k.transpose(1, 2))  # (B, N, N): query i, key j
        if self.mask_self:
            eye = torch.eye(x.shape[1], dtype=torch.bool, device=x.device)
            scores = scores.masked_fill(eye, -math.inf)
        if self.hardmax:
            weights = F.one_hot(scores.argmax(dim=-1), x.shape[1]).to(x.dtype)
        else:
            weights = scores.softmax(dim=-1)
        return (weights @ v) @ self.W_O.T


# --------------------------------------------------------------------------- trainable model
class ScaleNorm(nn.Module):
    """``x -> s * x / ||x||`` with one learnable scalar ``s`` (replaces LayerNorm, docs/related.md B4)."""

    def __init__(self, init: float = 1.0, eps: float = 1e-6):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(float(init)))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x / x.norm(dim=-1, keepdim=True).clamp_min(self.eps)


class WideAttention(nn.Module):
    """``w`` parallel multi-head attention modules (``nhead = d / r`` heads of rank ``r``), averaged.

    Each module matches ``nn.MultiheadAttention`` (in-projection with bias, scores scaled by
    ``1/sqrt(r)``, output projection with bias); total heads ``H = w * d / r``.
    """

    def __init__(self, d: int, r: int, w: int):
        super().__init__()
        self.nhead = check_rank(d, r)
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise _bad("w", w, "pass a width multiplier >= 1")
        self.d, self.r, self.w = d, r, w
        self.in_proj = nn.Parameter(torch.empty(w, 3 * d, d))
        self.in_bias = nn.Parameter(torch.zeros(w, 3 * d))
        self.out_proj = nn.Parameter(torch.empty(w, d, d))
        self.out_bias = nn.Parameter(torch.zeros(w, d))
        for m in range(w):
            nn.init.xavier_uniform_(self.in_proj[m])
            nn.init.kaiming_uniform_(self.out_proj[m], a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = torch.einsum("bnd,wed->bwne", x, self.in_proj) + self.in_bias[None, :, None, :]
        qkv = qkv.view(b, self.w, n, 3, self.nhead, self.r)  # (B, w, N, 3, nhead, r)
        q, k, v = qkv.permute(3, 0, 1, 4, 2, 5).unbind(0)  # each (B, w, nhead, N, r)
        if self.r == 1:  # outer products: cheaper than B*w*nhead tiny bmm calls on CPU
            scores = q * k.transpose(-1, -2)  # (.., N, 1) * (.., 1, N) -> (B, w, nhead, N, N)
            heads = (scores.softmax(dim=-1) * v.transpose(-1, -2)).sum(-1, keepdim=True)
        else:
            scores = q @ k.transpose(-1, -2) / math.sqrt(self.r)  # (B, w, nhead, N, N)
            heads = scores.softmax(dim=-1) @ v  # (B, w, nhead, N, r)
        merged = heads.permute(0, 1, 3, 2, 4).reshape(b, self.w, n, d)  # (B, w, N, d)
        out = torch.einsum("bwnd,wed->bwne", merged, self.out_proj) + self.out_bias[None, :, None, :]
        return out.mean(dim=1)  # (B, N, d): average of the w modules


class EncoderLayer(nn.Module):
    """Post-norm layer: ``x = n1(x + attn(x)); x = n2(x + ffn(x))`` with ReLU feed-forward."""

    def __init__(self, d: int, r: int, w: int, ffn: int, norm_init: float = 1.0):
        super().__init__()
        self.attn = WideAttention(d, r, w)
        self.ff = nn.Sequential(nn.Linear(d, ffn), nn.ReLU(), nn.Linear(ffn, d))
        self.norm1, self.norm2 = ScaleNorm(norm_init), ScaleNorm(norm_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.attn(x))
        return self.norm2(x + self.ff(x))


class RankHeadsModel(nn.Module):
    """Stack of ``layers`` :class:`EncoderLayer`; input and output are ``(B, N, d)`` point sets."""

    def __init__(self, d: int, r: int, layers: int = 1, w: int = 1, ffn: int = 64,
                 norm_init: float | None = None, out_norm_init: float = 1.0):
        super().__init__()
        for name, v in (("layers", layers), ("ffn", ffn)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise _bad(name, v, "pass a positive integer")
        self.d, self.r, self.w = d, r, w
        self.heads = w * check_rank(d, r)
        norm_init = math.sqrt(d) if norm_init is None else float(norm_init)
        for name, v in (("norm_init", norm_init), ("out_norm_init", out_norm_init)):
            if not (v > 0 and math.isfinite(v)):
                raise _bad(name, v, "pass a positive initial norm scale")
        self.blocks = nn.ModuleList(EncoderLayer(d, r, w, ffn, norm_init) for _ in range(layers))
        with torch.no_grad():  # the output lives on the unit sphere: start its scale at out_norm_init
            self.blocks[-1].norm2.scale.fill_(float(out_norm_init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def token_sq_error(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of the squared Euclidean error (= d x elementwise MSE, the paper's metric)."""
    return (pred - target).pow(2).sum(dim=-1).mean()

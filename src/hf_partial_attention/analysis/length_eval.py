"""Running a model over inputs of their own length, and the reconstruction error at their real positions.

`run_inputs` forwards inputs padded to their bucket b with the real attention mask (and token types), reporting
every attention call's pre-mask scores ``(B, H, b, b)`` with the inputs' lengths. `RealPositionMeter` measures
reconstructors on such scores **at real positions only**: a t-token input counts rows i < t and keys j < t; its
reconstruction is computed from the scores with keys >= t zero (as the model runs). The normalised error is
``Σ ‖Â − A‖² / Σ ‖A − μ‖²`` over those positions, μ the held-out mean of each position over the inputs that have
it: the share of the held-out variance at real positions that the reconstruction misses.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from ..pattern import AttentionPattern
from .capture import capture_scores, require_calls
from .evaluation import LinearReconstructor
from .inputs import TokenizedInputs

__all__ = ["run_inputs", "PaddedPattern", "RealPositionMeter", "zero_padding"]

LengthSink = Callable[[int, torch.Tensor, torch.Tensor], None]


def zero_padding(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``scores`` ``(B, ..., b, b)`` with rows and keys >= lengths[s] of sequence s set to zero."""
    b = scores.shape[-1]
    real = torch.arange(b, device=scores.device) < lengths.to(scores.device)[:, None]  # (B, b)
    shape = (scores.shape[0],) + (1,) * (scores.dim() - 3)
    keep = real.view(*shape, b, 1) & real.view(*shape, 1, b)  # (B, ..., b, b)
    return scores * keep


@torch.no_grad()
def run_inputs(model, tokens: TokenizedInputs, index, width: int, sink: LengthSink, batch_size: int = 16,
               pad_id: int = 0, progress: bool = True, desc: str = "capture", full_width: bool = True) -> None:
    """Forward the inputs ``tokens[index]`` of bucket ``width``, reporting every attention call as ``sink(layer,
    scores (B, H, width, width), lengths (B,))``: pre-mask scores, zero past each batch's longest input (the sink
    zeroes every position past each input's own length).

    The inputs run sorted by length, each batch padded only to its longest input: a real position's score does not
    depend on padding past the input (the mask keeps it out), and the batch's scores are padded with zeros to
    ``width``, so the sink sees what a batch padded to ``width`` gives at every real position, for about a third
    fewer tokens than padding every input to its bucket. ``full_width=False``: the scores as the batch ran,
    ``(B, H, w, w)`` with w its longest input, for a sink that takes them (`ScoreCovariance.update` with lengths)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    index = torch.as_tensor(index, dtype=torch.long)
    index = index[torch.argsort(tokens.lengths[index], stable=True)]  # similar lengths share a batch
    device = next(model.parameters()).device
    takes_types = "token_type_ids" in inspect.signature(model.forward).parameters
    current = {}

    def report(layer: int, scores: torch.Tensor) -> None:
        pad = width - scores.shape[-1] if full_width else 0
        sink(layer, torch.nn.functional.pad(scores, (0, pad, 0, pad)) if pad else scores, current["lengths"])

    with capture_scores(model, report) as state:
        for start in tqdm(range(0, len(index), batch_size), desc=desc, disable=not progress, unit="batch",
                          leave=False):
            part = index[start:start + batch_size]
            current["lengths"] = tokens.lengths[part]
            batch = tokens.batch(part, min(width, int(current["lengths"].max())), pad_id)
            if not takes_types:
                batch.pop("token_type_ids")
            model(**{name: value.to(device) for name, value in batch.items()})
            if start == 0:
                require_calls(state, model)


class PaddedPattern:
    """An `AttentionPattern` of n applied to ``(S, b, b)`` scores (b <= n) of t-token inputs: zero keys up to n, the
    pattern's exact scores and ``R a_P (+ b)`` (the zero fill the model runs), cropped back to b."""

    def __init__(self, pattern: AttentionPattern):
        self.n = pattern.seq_len
        self.apply = LinearReconstructor(pattern)

    def __call__(self, scores: torch.Tensor, t: int) -> torch.Tensor:
        s, b, _ = scores.shape
        if b > self.n:
            raise ValueError(f"a pattern of n={self.n} cannot reconstruct scores of {b} positions; use a pattern "
                             f"of n >= {b}.")
        if b == self.n:
            return self.apply(scores)
        padded = scores.new_zeros(s, self.n, self.n)
        padded[:, :b, :b] = scores
        return self.apply(padded)[:, :b, :b]


class RealPositionMeter:
    """Errors of named reconstructors ``method(scores (S, b, b), t) -> (S, b, b)`` on scores of one bucket b,
    over real positions only (rows and keys < t of each t-token input). Reconstructions run in float32, sums in
    float64."""

    def __init__(self, width: int, methods: dict[str, Callable]):
        self.width = width
        self.methods = dict(methods)
        self.count = 0  # score matrices
        self._n = torch.zeros(width, width, dtype=torch.float64)  # matrices with position (i, j) real
        self._sum = torch.zeros(width, width, dtype=torch.float64)
        self._sq = torch.zeros(width, width, dtype=torch.float64)
        self.sse = {name: 0.0 for name in self.methods}

    def update(self, layer: int, scores: torch.Tensor, lengths: torch.Tensor) -> None:
        """Add the scores ``(B, H, b, b)`` of one layer for inputs of ``lengths`` ``(B,)``."""
        x = zero_padding(scores.detach().to("cpu", torch.float32), lengths.cpu())  # (B, H, b, b)
        for t in torch.unique(lengths).tolist():
            xs = x[lengths.cpu() == t].reshape(-1, self.width, self.width)  # (S, b, b)
            real = xs[:, :t, :t].double()  # (S, t, t)
            self.count += xs.shape[0]
            self._n[:t, :t] += xs.shape[0]
            self._sum[:t, :t] += real.sum(0)
            self._sq[:t, :t] += real.square().sum(0)
            for name, method in self.methods.items():
                residual = method(xs, t)[:, :t, :t] - xs[:, :t, :t]  # (S, t, t): real positions only
                self.sse[name] += float(residual.double().square().sum())

    @property
    def total_variance(self) -> float:
        """Σ over real positions of the held-out variance (each position over the matrices that have it) × their
        count: the denominator of the normalised error."""
        seen = self._n > 0
        return float((self._sq[seen] - self._sum[seen].square() / self._n[seen]).sum())

    def results(self) -> dict[str, float]:
        """Normalised error of each method (None before any score)."""
        total = self.total_variance
        return {name: (sse / total if self.count and total > 0 else None) for name, sse in self.sse.items()}

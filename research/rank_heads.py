"""Rank vs number of heads (seed 004, Amsel et al., arXiv 2407.16153): training and sweep.

Training follows docs/related.md B4 (the authors' code): AdamW with betas (0.9, 0.95) and no weight decay,
linear warm-up for ``steps/20`` then cosine decay to 0, a fresh batch of points on the sphere at
every step, metric = mean squared Euclidean error per token.  The paper reports the minimum over
epochs of the training loss and over seeds; an "epoch" is ``steps_per_epoch`` steps (100 in the
paper).  CPU-scale defaults (d = 16, a few thousand steps, FFN width 4d instead of 2048) are ours.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch
from tqdm.auto import tqdm

from .rank_model import TARGETS, RankHeadsModel, check_rank, nn_target, sample_sphere, token_sq_error

logger = logging.getLogger(__name__)


def _bad(name: str, value: object, fix: str) -> ValueError:
    return ValueError(f"{name}={value!r} is invalid: {fix}")


@dataclass(frozen=True)
class TrainConfig:
    """One training run.  Fields marked [ours] are CPU-scale choices, not the paper's values."""

    d: int = 16  # [ours] paper: 64
    n_points: int = 16  # N, as the paper's Fig. 1
    r: int | None = None  # rank per head (nhead = d / r); None: full rank r = d
    layers: int = 1
    w: int = 1  # width multiplier: w parallel attention modules averaged
    ffn: int = 64  # [ours] paper: 2048
    norm_init: float | None = None  # [I] initial s of x -> s x/||x||; None = sqrt(d) (LayerNorm scale)
    target: str = "farthest"
    steps: int = 2000  # [ours] paper: 100k
    steps_per_epoch: int = 100
    batch: int = 256
    lr: float = 0.01
    warmup_frac: float = 0.05  # max_epochs / 20
    eval_batch: int = 2048  # [ours] held-out batch for a final evaluation
    seed: int = 0

    def validate(self) -> TrainConfig:
        check_rank(self.d, self.rank)
        for name in ("d", "n_points", "layers", "w", "ffn", "steps", "steps_per_epoch", "batch",
                     "eval_batch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise _bad(name, v, "pass a positive integer")
        if self.n_points < 2:
            raise _bad("n_points", self.n_points, "the target needs at least 2 points")
        if self.target not in TARGETS:
            raise _bad("target", self.target, f"use one of {TARGETS}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise _bad("lr", self.lr, "pass a positive finite learning rate")
        if not (0 <= self.warmup_frac < 1):
            raise _bad("warmup_frac", self.warmup_frac, "pass a fraction in [0, 1)")
        return self

    @property
    def rank(self) -> int:
        return self.d if self.r is None else self.r

    @property
    def heads(self) -> int:
        return self.w * (self.d // self.rank)


@dataclass
class TrainResult:
    """Outcome of :func:`train`: ``best_epoch_loss`` is the paper's statistic (min epoch mean)."""

    config: TrainConfig
    best_epoch_loss: float
    final_eval_loss: float
    epoch_losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    qk_params_per_layer: int = 0
    qk_angle_deg: float = float("nan")

    def row(self) -> dict:
        c = self.config
        return {"layers": c.layers, "w": c.w, "r": c.rank, "heads": c.heads, "d": c.d,
                "N": c.n_points, "target": c.target, "steps": c.steps, "seed": c.seed,
                "qk_params_per_layer": self.qk_params_per_layer,
                "best_epoch_loss": self.best_epoch_loss, "final_eval_loss": self.final_eval_loss,
                "qk_angle_deg": round(self.qk_angle_deg, 2),
                "seconds": round(self.seconds, 2)}


def lr_lambda(step: int, total: int, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay from 1 to 0 at ``total``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def train(config: TrainConfig, progress: bool = False) -> TrainResult:
    """Train one :class:`RankHeadsModel` on a fresh-batch stream; deterministic given ``config.seed``."""
    c = config.validate()
    torch.manual_seed(c.seed)
    model = RankHeadsModel(c.d, c.rank, layers=c.layers, w=c.w, ffn=c.ffn, norm_init=c.norm_init)
    opt = torch.optim.AdamW(model.parameters(), lr=c.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = round(c.warmup_frac * c.steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, c.steps, warmup))
    data_gen = torch.Generator().manual_seed(10_000 + c.seed)
    epoch_losses: list[float] = []
    running, count = 0.0, 0
    start = time.perf_counter()
    bar = tqdm(range(c.steps), desc=f"L{c.layers} w{c.w} r{c.rank}", disable=not progress, leave=False)
    for step in bar:
        x = sample_sphere(c.batch, c.n_points, c.d, data_gen)  # (batch, N, d)
        loss = token_sq_error(model(x), nn_target(x, c.target))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        running += loss.item()
        count += 1
        if count == c.steps_per_epoch or step == c.steps - 1:
            epoch_losses.append(running / count)
            bar.set_postfix(loss=f"{epoch_losses[-1]:.3g}")
            running, count = 0.0, 0
    final = evaluate(model, c)
    qk = c.w * 2 * c.d * c.d  # per layer: w modules x (W_Q, W_K) each d x d (= nhead heads of rank r)
    result = TrainResult(c, min(epoch_losses), final, epoch_losses, time.perf_counter() - start, qk,
                         qk_angle_deg(model))
    logger.info("layers=%d w=%d r=%d: best epoch loss %.4g, eval %.4g (%.1fs)", c.layers, c.w,
                c.rank, result.best_epoch_loss, final, result.seconds)
    return result


@torch.no_grad()
def qk_angle_deg(model: RankHeadsModel) -> float:
    """Angle (degrees) between the first layer's score matrix ``sum_h W_Q,h^T W_K,h`` and ``I``.

    Averaged over the ``w`` modules; ~180 deg means a sharp ``-c I`` head (the paper's "perfect"
    figure reports ~179.5 deg for one full-rank layer at w = 1).
    """
    attn = model.blocks[0].attn
    d = attn.d
    w_q, w_k = attn.in_proj[:, :d], attn.in_proj[:, d:2 * d]  # (w, d, d) each
    score = (w_q.transpose(1, 2) @ w_k).mean(dim=0)  # (d, d): x_i^T score x_j is the logit
    cos = torch.trace(score) / (score.norm() * math.sqrt(d)).clamp_min(1e-12)
    return math.degrees(math.acos(float(cos.clamp(-1.0, 1.0))))


@torch.no_grad()
def evaluate(model: RankHeadsModel, config: TrainConfig, seed: int = 12345) -> float:
    """Loss on one held-out batch of ``config.eval_batch`` point sets (ours, not in the paper)."""
    x = sample_sphere(config.eval_batch, config.n_points, config.d,
                      torch.Generator().manual_seed(seed))
    return float(token_sq_error(model(x), nn_target(x, config.target)))


def divisors(d: int) -> list[int]:
    """All divisors of ``d`` in ascending order (the admissible ranks ``r = d / nhead``)."""
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise _bad("d", d, "pass a positive integer")
    return [r for r in range(1, d + 1) if d % r == 0]


def run_sweep(base: TrainConfig | None = None, ranks: Sequence[int] | None = None,
              layers: Iterable[int] = (1, 3), widths: Iterable[int] = (1,),
              seeds: Iterable[int] = (0,), progress: bool = True) -> list[dict]:
    """Train every (layers, w, r, seed) combination; return one row per (layers, w, r).

    Each row holds the paper's statistic (min over seeds of the min epoch loss) as
    ``best_epoch_loss`` and the mean held-out loss over seeds as ``final_eval_loss``.
    ``ranks=None`` means all divisors of ``base.d``.
    """
    base = (base or TrainConfig()).validate()
    ranks = divisors(base.d) if ranks is None else list(ranks)
    layers, widths, seeds = list(layers), list(widths), list(seeds)
    for name, values in (("ranks", ranks), ("layers", layers), ("widths", widths), ("seeds", seeds)):
        if not values:
            raise _bad(name, values, "pass at least one value")
    configs = [replace(base, layers=n, w=w, r=r, seed=s)
               for n in layers for w in widths for r in ranks for s in seeds]
    for cfg in configs:
        cfg.validate()
    results: dict[tuple[int, int, int], list[TrainResult]] = {}
    for cfg in tqdm(configs, desc="rank-heads sweep", disable=not progress):
        results.setdefault((cfg.layers, cfg.w, cfg.rank), []).append(train(cfg))
    rows = []
    for runs in results.values():
        row = min(runs, key=lambda res: res.best_epoch_loss).row()
        row["final_eval_loss"] = sum(res.final_eval_loss for res in runs) / len(runs)
        row["seconds"] = round(sum(res.seconds for res in runs), 2)
        row["seeds"] = len(runs)
        row.pop("seed")
        row["epoch_losses"] = [min(v) for v in zip(*(res.epoch_losses for res in runs))]
        row["qk_angle_deg"] = round(sum(res.qk_angle_deg for res in runs) / len(runs), 2)
        rows.append(row)
    return rows


def config_dict(config: TrainConfig) -> dict:
    """Plain-dict view of a config, for summaries."""
    return asdict(config)

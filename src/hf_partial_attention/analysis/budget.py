"""`derive --saving S`: a k per layer that spends a QKᵀ budget where the greedy's error falls most.

One k for every layer spends the same exact scores where a layer's error is already small and where it is large. The
budgeted choice gives exact scores to the layers whose greedy error falls most per multiply-add, at no more cost than
the uniform k in every length bucket. `budget_sets` describes the allocation, budget layers left exact included;
`parse_saving` the forms of S; `_Budget` the files and report section written.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Any

import torch

from ..cost import score_cost
from .covariance import ScoreCovariance
from .derive_files import PatternSet, Source, check_granularity
from .folder import COVARIANCE_FILE, load_results
from .score_metrics import objective_metric
from .selection import covariance_for, greedy_order

logger = logging.getLogger(__name__)

__all__ = ["parse_saving", "uniform_k", "objective_curve", "allocate", "budget_sets"]

_K_SAVING = re.compile(r"^k(\d+)$")


def parse_saving(text: str | float) -> str | float:
    """``"k16"`` (kept as the string) or a fraction in (0, 1); a ValueError naming both forms otherwise.

    A fraction S (``0.4``) is the fraction of the partial layers' QKᵀ multiply-adds to save in every length bucket.
    ``"k16"`` is the saving of k = 16 in every bucket (``min(16, b)``: buckets b <= 16 run exactly), so that the
    budgeted file compares with ``derive --k 16`` at its cost."""
    if isinstance(text, str) and _K_SAVING.match(text.strip()):
        return text.strip()
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = None
    if value is None or not 0.0 < value < 1.0:
        raise ValueError(f"saving must be a fraction in (0, 1) (e.g. 0.4: save 40 % of the partial layers' QKᵀ "
                         f"multiply-adds in every bucket) or k<K> (e.g. k16: the saving of k = 16), got {text!r}.")
    return value


def uniform_k(b: int, d_head: int, saving: str | float) -> int:
    """The one k of bucket ``b`` at ``saving``: ``min(K, b)`` for ``"k<K>"``, else the largest k in [1, b] whose
    saving at b is at least ``saving`` (b itself, exact attention, when none below b does)."""
    saving = parse_saving(saving)
    if isinstance(saving, str):
        return min(int(saving[1:]), b)
    fits = [k for k in range(1, b) if score_cost(b, k, d_head).saving >= saving]
    if not fits:
        raise ValueError(f"saving={saving} is out of reach in bucket {b} at d_h={d_head}: k = 1 saves "
                         f"{score_cost(b, 1, d_head).saving:.3f}; ask for less.")
    return max(fits)


def objective_curve(cov: ScoreCovariance, k_max: int, *, layer: int, head: int | None = None,
                    objective: str = "paper", family: str = "per_query", centered: bool | None = None) -> torch.Tensor:
    """``(k_max,)``: the greedy's residual ``Tr(M S)`` (summed over the query rows) after k = 1 .. k_max picks, for
    layer ``layer`` (head ``head``) of ``cov``, in the objective's units (one nested run)."""
    return _greedy_run(cov, k_max, layer, head, dict(objective=objective, family=family, centered=centered))[1].sum(0)


def _greedy_run(cov: ScoreCovariance, k_max: int, layer: int, head: int | None, kwargs) -> tuple[torch.Tensor, ...]:
    """`selection.greedy_order` of one group, refused in one line for a family without an error curve."""
    if kwargs["family"] not in ("per_query", "columns", "blocks", "bands"):
        raise ValueError(f"--saving needs the greedy's error curve; family={kwargs['family']!r} has none (use "
                         "per_query, columns, blocks or bands).")
    return greedy_order(cov, k_max, layer=layer, head=head, **kwargs)  # (n, k_max) each


def allocate(curves: dict[int, torch.Tensor], b: int, d_head: int, budget: int) -> dict[int, int]:
    """A k per layer (``curves[l][k − 1]``: layer l's error at k) whose summed cost per query row ``k·d_h + (b−k)·k``
    is at most ``budget``: from k = 1 everywhere, one more exact score at a time to the layer whose error falls most
    per multiply-add added."""
    cost = lambda k: k * d_head + (b - k) * k  # noqa: E731  (score_cost(b, k, d_head).total / b)
    ks = {layer: 1 for layer in curves}
    spent = sum(cost(1) for _ in curves)
    if spent > budget:
        raise ValueError(f"a budget of {budget} multiply-adds per query row cannot give {len(curves)} layers k = 1 "
                         f"each (bucket {b}); ask for a smaller saving.")
    while True:
        best, best_rate = None, -1.0
        for layer, curve in curves.items():
            k = ks[layer]
            if k + 1 > min(len(curve), b - 1):
                continue
            added = cost(k + 1) - cost(k)
            if added <= 0 or spent + added > budget:
                continue
            rate = float(curve[k - 1] - curve[k]) / added
            if rate > best_rate:
                best, best_rate = layer, rate
        if best is None:
            return ks
        spent += cost(ks[best] + 1) - cost(ks[best])
        ks[best] += 1


def _label(saving: str | float) -> str:
    return saving if isinstance(saving, str) else f"{saving:g}"


def budget_sets(out: str, req) -> tuple[Source, list[tuple], list[PatternSet], "_Budget"]:
    """The budget's part of `derive.derive_patterns`: its source, groups and two sets (the budgeted k per layer and
    the uniform k), each bucket's k per layer allocated from the greedy runs (kept for the fit), and what writes its
    section.

    The uniform k of bucket b is the largest k whose saving at b is at least S (`uniform_k`; a bucket where only
    k = b qualifies runs exactly); its cost over the partial layers is the budget. The budgeted choice starts every
    layer at k = 1 and adds one exact score per query at a time to the layer whose greedy error (the objective's
    residual ``Tr(M S)``, summed over the layer's heads when P and R are per head) falls most per multiply-add added
    (`allocate`), while the budget allows: so it never costs more than the uniform k, and its saving in every bucket
    is at least S. That allocation is optimal when the curves are convex; where it would predict more error than the
    uniform k (curves that are not), the bucket keeps the uniform k. The greedy is nested, so one run to a large k
    gives every layer's whole curve (`objective_curve`).

    ``exact_layers`` (``derive --exact-layers``) leaves budget layers exact: each pays dense attention's cost (b·d_h
    per query row) out of the same budget, the other layers share the rest, and a conversion leaves them out of
    ``partial_layers``. The greedy's error curves cannot weigh an exact layer against the others (a unit of objective
    does not cost the same embedding error in every layer): which layer to leave exact is measured at the output
    (`experiments.granularity.layers`)."""
    saving = parse_saving(req.saving)
    plan = _plan(out, saving, req.granularity, req.budget_layers, req.layer_weights, req.exact_layers, req.name)
    runs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (b, layer, head) -> the greedy's order and path
    chosen: dict[int, dict[int, int]] = {}  # bucket -> layer -> k
    rows = [_allocate_bucket(plan, b, saving, req.fit, runs, chosen) for b in plan.lengths]
    uniform = {b: uniform_k(b, plan.d_head, saving) for b in plan.lengths}
    meta = {"saving": saving, "budget_layers": plan.budget_layers}
    stem = f"{'' if plan.windows else 'buckets_'}{req.tag}_saving{_label(saving)}"
    sets = [PatternSet(f"{stem}_{plan.name}", lambda b, layer: chosen[b][layer],
                       layers=[layer for layer in plan.model_layers if layer not in plan.exact_layers],
                       # read by `conversion.partial_config`: these layers are left out of partial_layers
                       meta={**meta, **({"exact_layers": plan.exact_layers} if plan.exact_layers else {}),
                             "k_choice": plan.name}),
            PatternSet(f"{stem}_uniform", lambda b, layer: uniform[b], meta={**meta, "k_choice": "uniform"})]
    source = Source("windows" if plan.windows else "buckets", plan.bucket_cov)
    groups = [(layer, head) for layer in plan.model_layers for head in plan.heads]
    return source, groups, sets, _Budget(plan, saving, req, rows, runs, sets)


@dataclasses.dataclass
class _Budget:
    """The budget's allocation (its rows and greedy runs) and its ``budget_<tag>`` section.

    Writes ``patterns/[buckets_]<tag>_saving<S>_budget.safetensors`` (`LayerPatterns`, each layer its own k) beside
    ``..._uniform.safetensors`` (the uniform k at the same saving) and the ``budget_<tag>`` section of
    ``results.json``: each layer's k per bucket, each bucket's saving and the greedy's predicted error of both."""

    plan: "_Plan"
    saving: str | float
    req: Any
    rows: list[dict[str, Any]]
    orders: dict[tuple, tuple[torch.Tensor, torch.Tensor]]
    sets: list[PatternSet]

    def write(self, out: str, built: dict, path) -> dict[str, Any]:
        plan, req, name = self.plan, self.req, self.plan.name
        budgeted = built[self.sets[0].name]
        result: dict[str, Any] = {
            "saving": self.saving, "granularity": req.granularity, "objective": req.objective,
            "lengths": plan.lengths, "layers": plan.model_layers, "budget_layers": plan.budget_layers,
            "head_dim": plan.d_head, "buckets": self.rows, "exact_layers": plan.exact_layers,
            "layers_k": {str(layer): budgeted.layer_lengths_k(layer) if layer in budgeted.layers else list(plan.lengths)
                         for layer in plan.model_layers},
            "layer_weights": None if plan.layer_weights is None else
            {str(layer): float(plan.layer_weights[layer]) for layer in plan.budget_layers}}
        for s in self.sets:
            built[s.name].save(path(s))
            choice = s.meta["k_choice"]
            result[f"{'budget' if choice == name else choice}_path"] = path(s)
        section = f"budget_{req.tag}"
        stored = dict(load_results(out).get(section) or {})
        stored[_label(self.saving) + ("" if name == "budget" else f"_{name}")] = result  # its run time added later
        result.update(_section=section, _stored=stored)
        return result


@dataclasses.dataclass
class _Plan:
    """What `derive_budget` spreads and over what, checked: the covariance of each bucket (the windows' one bucket
    of n when ``windows``), the groups, and the layers the budget covers."""

    bucket_cov: dict[int, ScoreCovariance]
    granularity: str
    windows: bool
    longest: ScoreCovariance
    heads: list
    d_head: int
    model_layers: list[int]
    budget_layers: list[int]
    exact_layers: list[int]
    layer_weights: dict[int, float] | None
    name: str

    @property
    def lengths(self) -> list[int]:
        return list(self.bucket_cov)

    @property
    def spread(self) -> list[int]:
        """The budget layers that get a k (the others are exact)."""
        return [layer for layer in self.budget_layers if layer not in self.exact_layers]

    def weight(self, layer: int) -> float:
        return 1.0 if self.layer_weights is None else float(self.layer_weights[layer])


def _plan(out, saving, granularity, layers, layer_weights, exact_layers, name) -> _Plan:
    """The covariances of ``out`` and the budget's layers, each argument checked (a ValueError naming it)."""
    from .lengths import bucket_covariance_files

    if granularity not in ("layer", "head"):
        raise ValueError(f"--saving gives each layer its own k, which needs P per layer: use --granularity layer or "
                         f"head, got {granularity!r}.")
    paths = bucket_covariance_files(out)
    windows = not paths
    if windows:
        paths = {None: os.path.join(out, COVARIANCE_FILE)}
        if not os.path.isfile(paths[None]):
            raise ValueError(f"{out!r} holds no covariance; run `hf-partial-attention analyze` into it first.")
    covs = {b: ScoreCovariance.load(p) for b, p in paths.items()}
    check_granularity(covs.values(), granularity, out, "a k per layer")
    longest = covs[max(covs, key=lambda b: -1 if b is None else b)]
    n, model_layers = longest.seq_len, list(longest.layers)
    bucket_cov = {n: longest} if windows else dict(sorted(covs.items()))
    d_head = longest.metadata.get("head_dim")
    if not d_head:
        raise ValueError(f"{out!r}'s covariance records no head_dim; rerun `hf-partial-attention analyze` into it.")
    budget_layers = sorted(model_layers[:-1] if layers is None else {int(layer) for layer in layers})
    if not budget_layers or not set(budget_layers) <= set(model_layers):
        raise ValueError(f"layers={budget_layers}: give layers of {model_layers} to spread the budget over.")
    if layer_weights is not None:
        bad = {layer: layer_weights.get(layer) for layer in budget_layers
               if not (isinstance(layer_weights.get(layer), (int, float)) and layer_weights[layer] > 0)}
        if bad:
            raise ValueError(f"layer_weights must give every budget layer {budget_layers} a positive weight; got {bad} "
                             "for these layers.")
    exact_layers = sorted({int(layer) for layer in exact_layers or ()})
    if not set(exact_layers) <= set(budget_layers) or len(exact_layers) >= len(budget_layers):
        raise ValueError(f"exact_layers={exact_layers}: give some, not all, of the budget layers {budget_layers} (the "
                         "layers an exact one's cost is taken from).")
    if name is None:
        name = "exact" + "and".join(map(str, exact_layers)) if exact_layers else "budget"
    if name == "uniform" or not re.fullmatch(r"[A-Za-z0-9]+", name):
        raise ValueError(f"name must be letters and digits, not 'uniform' (the baseline's file), got {name!r}.")
    if uniform_k(n, d_head, saving) >= n:
        raise ValueError(f"saving={saving} leaves the longest bucket ({n}) exact: nothing to derive; "
                         "ask for a k below n.")
    return _Plan(bucket_cov, granularity, windows, longest, list(longest.heads) if granularity == "head" else [None],
                 d_head, model_layers, budget_layers, exact_layers, layer_weights, name)


def _allocate_bucket(plan: _Plan, b: int, saving, kwargs, runs: dict, chosen: dict) -> dict[str, Any]:
    """Bucket ``b``'s k per layer into ``chosen[b]`` (the greedy runs it made into ``runs``), and its row of the
    result: the ks, both savings and both predicted errors."""
    d_head, budget_layers, exact_layers, spread = plan.d_head, plan.budget_layers, plan.exact_layers, plan.spread
    k_u = uniform_k(b, d_head, saving)
    if k_u >= b:  # exact in every layer
        chosen[b] = {layer: b for layer in plan.model_layers}
        return {"length": b, "exact": True, "uniform_k": b, "saving": 0.0}
    # the curves' reach: a layer may take up to 3x the uniform k, but not k >= d_h, which costs more than exact
    # attention (k·d_h + (b−k)·k >= b·d_h)
    k_max = min(b - 1, 3 * k_u, max(d_head - 1, k_u))
    for layer in budget_layers:
        for head in plan.heads:
            runs[(b, layer, head)] = _greedy_run(plan.bucket_cov[b], k_max, layer, head, kwargs)
    # the weighted error the allocation spends on: the objective's residual summed over the layer's heads and rows
    curves = {layer: sum(runs[(b, layer, head)][1].sum(0) for head in plan.heads) * plan.weight(layer)
              for layer in budget_layers}  # (k_max,) each
    per_row = k_u * d_head + (b - k_u) * k_u
    # an exact layer costs what dense attention costs (b scores of d_h multiply-adds a query row), adds no error
    try:
        ks = allocate({layer: curves[layer] for layer in spread}, b, d_head,
                      per_row * len(budget_layers) - b * d_head * len(exact_layers))
    except ValueError as refused:
        if not exact_layers:
            raise
        raise ValueError(f"{refused} Layers {exact_layers} exact take {b * d_head * len(exact_layers)} of it: leave "
                         "fewer layers exact.") from None
    error = lambda k_of: sum(float(curves[l][k_of(l) - 1]) for l in spread)  # noqa: E731
    uniform_error = sum(float(curves[l][k_u - 1]) for l in budget_layers)
    if exact_layers and error(ks.get) > uniform_error:
        logger.warning("bucket %d: with layers %s exact, the other layers' ks %s predict more error than k = %d in "
                       "every layer.", b, exact_layers, ks, k_u)
    elif error(ks.get) > uniform_error:
        # marginal allocation is optimal for convex curves only; on others it can end above the one k: keep that
        logger.info("bucket %d: the budgeted ks %s predict more error than k = %d in every layer; keeping it.", b,
                    ks, k_u)
        ks = {layer: k_u for layer in budget_layers}
    chosen[b] = {layer: b if layer in exact_layers else ks.get(layer, k_u) for layer in plan.model_layers}
    spent = sum(score_cost(b, chosen[b][layer], d_head).total for layer in budget_layers)
    total = sum(float(_total_objective(plan.bucket_cov[b], layer, plan.heads, kwargs)) * plan.weight(layer)
                for layer in budget_layers)
    row = {"length": b, "exact": False, "uniform_k": k_u,
           "k_per_layer": {str(l): chosen[b][l] for l in budget_layers},
           "saving_uniform": score_cost(b, k_u, d_head).saving,
           "saving": 1.0 - spent / (len(budget_layers) * score_cost(b, b, d_head).dense),
           "predicted_objective_uniform": uniform_error / total, "predicted_objective": error(ks.get) / total}
    logger.info("bucket %d: k per layer %s (uniform %d); predicted objective error %.4f (uniform %.4f)", b, ks, k_u,
                row["predicted_objective"], row["predicted_objective_uniform"])
    return row


def _total_objective(cov: ScoreCovariance, layer: int, heads, kwargs) -> torch.Tensor:
    """The objective's error with no exact score (``Tr(M C)``) of ``layer``, summed over ``heads``: the curves'
    denominator."""
    total = 0.0
    for head in heads:
        c, mean, _ = covariance_for(cov, "per_query", kwargs.get("centered"), None, layer, head)
        metric = objective_metric(kwargs.get("objective", "paper"), c.shape[0], mean)
        total = total + (torch.diagonal(c, dim1=-2, dim2=-1).sum() if metric is None else (metric * c).sum())
    return total


"""Evaluation metrics that also work offline.

`load_metric("accuracy")` returns the Hub's ``evaluate`` metric when it can be reached and the local module
shipped in this folder (``metrics/accuracy/accuracy.py``, same results) when it cannot, for example under
``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["LOCAL_METRICS", "load_metric", "classification_metrics"]

_HERE = os.path.dirname(os.path.abspath(__file__))
LOCAL_METRICS = {"accuracy": os.path.join(_HERE, "accuracy")}


def _offline() -> bool:
    from huggingface_hub import constants

    evaluate_offline = os.environ.get("HF_EVALUATE_OFFLINE", "0").upper() in ("1", "ON", "YES", "TRUE")
    return bool(constants.HF_HUB_OFFLINE) or evaluate_offline


def load_metric(name: str = "accuracy", prefer_local: bool = False):
    """An ``evaluate`` metric by name: the Hub module if reachable, else the bundled local module.

    Args:
        name: a metric name; only names in `LOCAL_METRICS` have an offline fallback.
        prefer_local: skip the Hub and load the bundled module directly.

    Raises:
        ValueError: if `name` has no local module and the Hub cannot be reached.
    """
    import evaluate

    local = LOCAL_METRICS.get(name)
    if local is not None and (prefer_local or _offline()):
        return evaluate.load(local)
    try:
        return evaluate.load(name)
    except Exception as err:  # noqa: BLE001 - any Hub failure (offline, DNS, HTTP) falls back
        if local is None:
            raise ValueError(f"Metric {name!r} could not be loaded ({err}) and has no local module; "
                             f"local metrics: {sorted(LOCAL_METRICS)}.") from err
        logger.warning("Hub metric %r unavailable (%s); using the bundled module %s", name, type(err).__name__, local)
        return evaluate.load(local)


def classification_metrics(metric=None) -> Callable:
    """A ``compute_metrics`` function for `Trainer`: argmax of the logits, then `metric` (accuracy by default)."""
    metric = load_metric("accuracy") if metric is None else metric

    def compute_metrics(eval_pred) -> dict[str, float]:
        logits = eval_pred.predictions[0] if isinstance(eval_pred.predictions, tuple) else eval_pred.predictions
        preds = np.argmax(logits, axis=-1)  # (N,)
        return metric.compute(predictions=preds, references=eval_pred.label_ids)

    return compute_metrics

"""Accuracy as a local `evaluate` metric module, so evaluation works without the Hugging Face Hub.

Load it with ``evaluate.load("<path to this folder>")``; its results match the Hub's ``accuracy`` metric:
the fraction of predictions equal to their references (optionally weighted, optionally as a count).
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "Accuracy: the proportion of predictions equal to their references, (TP + TN) / (TP + TN + FP + FN)."

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): predicted labels.
    references (`list` of `int`): ground-truth labels.
    normalize (`bool`, defaults to `True`): return the fraction correct (`True`) or the number correct.
    sample_weight (`list` of `float`, *optional*): per-example weights.

Returns:
    accuracy (`float` or `int`): in [0, 1] when normalized, else the (weighted) count of correct predictions.

Examples:
    >>> metric = evaluate.load("path/to/metrics/accuracy")
    >>> metric.compute(predictions=[0, 1, 2], references=[0, 1, 1])
    {'accuracy': 0.6666666666666666}
"""

_CITATION = ""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    """Accuracy of integer class predictions (the Hub metric ``accuracy``, computed with numpy)."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}
            ),
            reference_urls=["https://huggingface.co/spaces/evaluate-metric/accuracy"],
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        correct = np.asarray(predictions) == np.asarray(references)  # (N,)
        weights = np.ones(correct.shape) if sample_weight is None else np.asarray(sample_weight, dtype=float)
        total = float((correct * weights).sum())
        if normalize:
            return {"accuracy": total / float(weights.sum()) if weights.sum() else 0.0}
        return {"accuracy": total}

"""Eigen analysis of attention scores and patterns from it (paper sections 2–3, Fig. 3–9).

Imports flow one way: this subpackage uses the package's core (`pattern`, `reconstruction`, the models),
never the reverse. Plotting (matplotlib) is imported only by `plots`.
"""

from __future__ import annotations

from .baselines import build_methods
from .capture import CAPTURE_IMPLEMENTATION, capture_scores
from .collect import collect_covariance
from .conditional import conditional_reconstruction
from .corpus import default_texts, load_texts, make_windows
from .covariance import ScoreCovariance
from .distributed import reduce_covariance
from .evaluation import ErrorMeter, LinearReconstructor
from .inputs import load_inputs, tokenize_inputs
from .selection import FAMILIES, error_curve, fit_pattern, greedy_select, select_pattern

__all__ = [
    "CAPTURE_IMPLEMENTATION",
    "ErrorMeter",
    "LinearReconstructor",
    "ScoreCovariance",
    "build_methods",
    "capture_scores",
    "collect_covariance",
    "conditional_reconstruction",
    "default_texts",
    "error_curve",
    "fit_pattern",
    "greedy_select",
    "select_pattern",
    "FAMILIES",
    "load_inputs",
    "load_texts",
    "tokenize_inputs",
    "make_windows",
    "reduce_covariance",
]

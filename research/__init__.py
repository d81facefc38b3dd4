"""Small reproducible analyses of two related papers (not part of the plugin's runtime path).

* :mod:`.expressivity` -- seed 002 (Likhosherstov et al., arXiv 2106.03764): sparse targets,
  the random-projection construction, conditions (6)-(7) and the ``d_min`` search.
* :mod:`.rank_heads` / :mod:`.rank_model` -- seed 004 (Amsel et al., arXiv 2407.16153): rank vs
  heads on the farthest-point target.

Run ``python -m research --help``.  This subpackage imports nothing else from
``hf_partial_attention``.
"""

from .expressivity import (
    AttentionConstruction,
    DMinResult,
    construct_attention,
    find_d_min,
    sample_sparse_target,
    satisfies,
)
from .rank_heads import TrainConfig, run_sweep, train
from .rank_model import FullRankHead, RankHeadsModel, nn_target

__all__ = ["AttentionConstruction", "DMinResult", "FullRankHead", "RankHeadsModel", "TrainConfig",
           "construct_attention", "find_d_min", "nn_target", "run_sweep", "sample_sparse_target",
           "satisfies", "train"]

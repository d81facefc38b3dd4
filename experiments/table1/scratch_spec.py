"""The from-scratch Table 1 study's arguments and arms (`scratch`).

An arm is named ``exact`` or ``k<k>_<kind>``, kind one of:

- ``fixed``, ``common``, ``per_layer``: pretrained from scratch with pooled P and R built in (R fixed at its optimum,
  one trained R, a trained R per layer), every layer partial but the last: the paper's Table 1;
- ``head_budget``: P and R per head with a k per layer at k's saving (`derive_budget`), R trained per layer;
- ``p_only``: the same pooled P, every other key masked, no R (sparse attention), from scratch: what R adds beyond P;
- ``convert``: the exact model converted at the end (R fixed, no training with P and R): the paper's control;
- ``convert_train``: that conversion followed by MLM training with P and R built in (R per layer) for
  ``convert_train_fraction`` of the pretraining steps: the practitioner's road.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from .scratch_data import DOCS_DIR

__all__ = ["ScratchArm", "ScratchArguments", "parse_scratch_arm", "COMMAND", "KINDS"]

COMMAND = "python -m experiments table1-scratch"
KINDS = ("fixed", "common", "per_layer", "head_budget", "p_only", "convert", "convert_train")
_ARM = re.compile(r"^k(\d+)_(" + "|".join(sorted(KINDS, key=len, reverse=True)) + r")$")
# k = 24's arms first: a run stopped early has the paper's middle point, P alone and the conversions at one k
DEFAULT_ARMS = ("exact,k24_per_layer,k24_p_only,k24_convert,k24_convert_train,k24_common,k24_fixed,k24_head_budget,"
                "k32_fixed,k32_common,k32_per_layer,k32_p_only,k32_convert,k32_convert_train,k16_per_layer,k16_p_only,"
                "k16_convert,k16_convert_train")
_NOT_RESULTS = ("output_dir", "run_dir", "cards_dir", "threads", "progress", "docs_dir")


@dataclass(frozen=True)
class ScratchArm:
    name: str
    k: int | None  # None: exact
    kind: str  # "exact" or one of KINDS

    @property
    def reconstruction(self) -> str | None:
        """R's mode in training (None: no R)."""
        return {"fixed": "fixed", "common": "common", "per_layer": "per_layer", "head_budget": "per_layer",
                "convert": "fixed", "convert_train": "per_layer"}.get(self.kind)

    @property
    def from_scratch(self) -> bool:
        """Pretrained from scratch for the full number of steps (the exact arm, trained-in arms, P alone)."""
        return self.kind in ("exact", "fixed", "common", "per_layer", "head_budget", "p_only")

    @property
    def trains_r(self) -> bool:
        """R trained (common, per layer, per head budget, converted and trained)."""
        return self.kind in ("common", "per_layer", "head_budget", "convert_train")

    @property
    def trained_in(self) -> bool:
        """P and R built in from the first step."""
        return self.kind in ("fixed", "common", "per_layer", "head_budget")


def parse_scratch_arm(text: str) -> ScratchArm:
    text = text.strip()
    if text == "exact":
        return ScratchArm("exact", None, "exact")
    match = _ARM.match(text)
    if not match:
        raise ValueError(f"arm {text!r} is not 'exact' or k<k>_<kind> with kind one of {KINDS} (e.g. k24_per_layer).")
    return ScratchArm(text, int(match.group(1)), match.group(2))


@dataclass
class ScratchArguments:
    """Every number of the study (``python -m experiments table1-scratch -h``)."""

    output_dir: str = field(default="results/table1_scratch", metadata={"help": "table1.md, table1.json, figures"})
    run_dir: str = field(default="runs/table1_scratch", metadata={"help": "jobs and models (resumable)"})
    cards_dir: str = field(default="model_cards/table1_scratch",
                           metadata={"help": "model cards of the trained-in checkpoints ('' for none)"})
    corpus: str = field(default="python-docs", metadata={"help": "python-docs (make python-docs) or pydoc",
                                                         "choices": ("python-docs", "pydoc")})
    docs_dir: str = field(default=DOCS_DIR, metadata={"help": "CPython's HTML documentation"})
    tokenizer_name: str | None = field(default=None, metadata={
        "help": "default: the MiniLM's (BERT uncased); 'wordpiece': a WordPiece vocabulary of vocab_size trained on "
                "the training documents"})
    vocab_size: int = field(default=6000, metadata={"help": "the trained WordPiece vocabulary's size"})
    window_passes: int = field(default=1, metadata={
        "help": "cuts of the training text into windows, each at its own offset (scratch_data.window_passes)"})
    dropout: float = field(default=0.1, metadata={"help": "hidden and attention dropout of the pretrained model"})
    test_every: int = field(default=8, metadata={"help": "every test_every-th document is held out"})
    validation_every: int = field(default=0, metadata={
        "help": "every validation_every-th training document is held out to choose the best R mode (0: none; the "
                "choice is then made on the test windows, and the report says so)"})
    max_train_windows: int = field(default=0, metadata={"help": "cap on training windows, of each pass (0: all)"})
    test_windows: int = field(default=1024, metadata={"help": "held-out windows of the final MLM losses"})
    curve_windows: int = field(default=256, metadata={"help": "held-out windows of the losses against steps"})
    test_pairs: int = field(default=4000, metadata={"help": "held-out pairs of the pair task"})
    max_seq_length: int = 128
    num_hidden_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = field(default=2, metadata={"help": "d_h = hidden_size / heads (64: BERT-base's)"})
    intermediate_size: int = 512
    arms: str = field(default=DEFAULT_ARMS, metadata={"help": "comma-separated arms (module docstring)"})
    pretrain_steps: int = 2500
    pretrain_batch_size: int = 32
    pretrain_learning_rate: float = 1e-3
    reconstruction_learning_rates: str = field(default="", metadata={
        "help": "R's own learning rates to choose from (comma-separated) on the validation split, for each arm with "
                "trained R, on the first pretraining seed (default: R at the body's rate; needs --validation_every)"})
    mlm_probability: float = field(default=0.15, metadata={
        "help": "fraction of tokens masked and predicted in pretraining (held-out losses always mask 0.15)"})
    eval_every: int = field(default=250, metadata={"help": "steps between held-out losses of the curves"})
    convert_train_fraction: float = 0.1
    covariance_windows: int = field(default=1024, metadata={"help": "training windows of the covariances"})
    finetune_steps: int = 400
    finetune_batch_size: int = 32
    finetune_learning_rate: float = 2e-4
    seeds: str = "0,1,2"
    seed: int = field(default=0, metadata={"help": "initialisation, data order and masks of pretraining"})
    pretrain_seeds: str = field(default="", metadata={
        "help": "pretraining seeds (comma-separated; default: seed alone): each pretrains every arm from its own "
                "initialisation, data order and masks, so standard errors include run-to-run variance"})
    timing_repeats: int = 20
    timing_batch_size: int = 16
    threads: int = 0
    progress: bool = True

    def __post_init__(self):
        self.arm_list()  # a ValueError naming a malformed arm
        self.pretrain_seed_list()
        if self.reconstruction_lr_list() and not self.validation_every:
            raise ValueError("reconstruction_learning_rates are chosen on the validation split: pass "
                             "--validation_every (e.g. 8).")
        for name in ("pretrain_steps", "finetune_steps", "eval_every", "covariance_windows", "test_windows",
                     "test_pairs", "curve_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if not 0 < self.mlm_probability < 1:
            raise ValueError(f"mlm_probability must be in (0, 1), got {self.mlm_probability}.")
        if not 0 < self.convert_train_fraction <= 1:
            raise ValueError(f"convert_train_fraction must be in (0, 1], got {self.convert_train_fraction}.")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of num_attention_heads="
                             f"{self.num_attention_heads}.")

    def arm_list(self) -> list[ScratchArm]:
        arms = [parse_scratch_arm(a) for a in self.arms.split(",") if a.strip()]
        if not arms or arms[0].kind != "exact":
            raise ValueError(f"arms must start with 'exact' (every other arm is compared with it), got {self.arms!r}.")
        if len({a.name for a in arms}) < len(arms):
            raise ValueError(f"arms lists an arm twice: {self.arms!r}.")
        return arms

    def reconstruction_lr_list(self) -> list[float]:
        return [float(x) for x in self.reconstruction_learning_rates.split(",") if x.strip()]

    def pretrain_seed_list(self) -> list[int]:
        """The pretraining seeds, ``seed`` first (the default: ``seed`` alone)."""
        seeds = [int(x) for x in self.pretrain_seeds.split(",") if x.strip()] or [self.seed]
        if seeds[0] != self.seed or len(set(seeds)) < len(seeds):
            raise ValueError(f"pretrain_seeds={self.pretrain_seeds!r} must start with seed={self.seed} and list each "
                             "seed once.")
        return seeds

    def seed_list(self) -> list[int]:
        return [int(s) for s in self.seeds.split(",") if s.strip()]

    @property
    def d_head(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def config_overrides(self) -> str:
        return (f"num_hidden_layers={self.num_hidden_layers},hidden_size={self.hidden_size},num_attention_heads="
                f"{self.num_attention_heads},intermediate_size={self.intermediate_size},max_position_embeddings="
                f"{self.max_seq_length},hidden_dropout_prob={self.dropout},attention_probs_dropout_prob={self.dropout}")

    def convert_train_steps(self) -> int:
        return max(1, round(self.pretrain_steps * self.convert_train_fraction))

    def result_fields(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in _NOT_RESULTS}

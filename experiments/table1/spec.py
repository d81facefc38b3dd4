"""What the Table-1 study runs, as types: its flags (`StudyArguments`), its arms (`Arm`) and its jobs.

The runner (`table1`) and the report (`report`) both import this module, and the report never imports
the runner: the runner builds the arms with `study_arms`, the report reads the same arms back from the same
arguments. An arm's `name` (``exact``, ``k16_common_mlm``, ``k8_fixed_none``, ``k16_common_distill_zerofill``) is
only an output, the key of its job files under ``run_dir/jobs`` and of its row in ``table1.json``; nothing parses
it back. Arms spelled on the command line (``--zero_fill_control``, ``--rlr_arm``) are ``k:mode:recovery``.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace

from hf_partial_attention.configuration_partial_bert import RECONSTRUCTION_MODES

__all__ = ["Arm", "layers_key", "StudyArguments", "StudyArms", "study_arms", "job_names", "parse_arm",
           "RECONSTRUCTION_MODES", "RECOVERIES", "LENGTH_MODES", "GRANULARITY_FORMS", "BUCKET_OBJECTIVE", "COMMAND"]

# How the study is run (`experiments.cli`); the report and the cards cite it.
COMMAND = "python -m experiments table1"

# Phase 2 of an arm: none (converted and fine-tuned at once), MLM, or attention transfer + distillation from the
# exact phase-1 model (`--distill_objective`).
RECOVERIES = ("none", "mlm", "distill")
# How a partial arm treats inputs shorter than n: P and R per length bucket, or n's P and R with zero scores for the
# missing keys (one bucket: the paper's fixed-window pattern).
LENGTH_MODES = ("buckets", "zero_fill")
# P and R of a partial arm: one for every layer and head (the paper's), per layer or per head (issue 34).
GRANULARITY_FORMS = ("pooled", "layer", "head")
# The greedy objective of the length buckets (`analysis.derive.derive_lengths`); the zero-fill pattern keeps the
# paper's.
BUCKET_OBJECTIVE = "fisher"

# Arguments that do not change any result: changing them on resume is allowed.
_NOT_RESULTS = ("output_dir", "cards_dir", "threads", "run_dir", "progress")


@dataclass(frozen=True)
class Arm:
    """One arm of the study.

    Attributes:
        k: exact scores per query of the partial layers; None for the exact model.
        reconstruction: R of the converted model (one of `RECONSTRUCTION_MODES`); None for the exact model.
        recovery: phase 2 before fine-tuning, one of `RECOVERIES`: ``none`` (the phase-1 exact model converted and
            fine-tuned at once: the paper's "performs poorly"), ``mlm`` or ``distill``. The exact arm continues
            MLM for as many steps (``mlm``).
        lengths: ``buckets`` (P and R per length bucket) or ``zero_fill`` (n's P and R for every length); the
            exact arm has no pattern and keeps the default.
        granularity: ``pooled`` (one P and R for every layer and head, the paper's), ``layer`` or ``head`` (each
            its own, issue 34; with buckets, R fixed or per_layer).
        budget: each layer its own k at k's saving in every bucket (`analysis.budget`, ``derive --saving k<k>``).
        exact_layers: with ``budget``, layers left exact at the same saving (``derive --exact-layers``): each pays
            dense attention's cost out of the budget, the other partial layers share the rest.
    """

    k: int | None = None
    reconstruction: str | None = None
    recovery: str = "mlm"
    lengths: str = "buckets"
    granularity: str = "pooled"
    budget: bool = False
    exact_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if self.exact_layers and not self.budget:
            raise ValueError(f"Arm(exact_layers={self.exact_layers}) leaves layers exact within a budget: set "
                             "budget=True (form '<granularity>_exact<l>').")
        if self.granularity not in GRANULARITY_FORMS:
            raise ValueError(f"Arm(granularity={self.granularity!r}): use one of {GRANULARITY_FORMS}.")
        if self.granularity != "pooled" or self.budget:
            if self.k is None or self.lengths != "buckets":
                raise ValueError(f"Arm(granularity={self.granularity!r}, budget={self.budget}) is a partial arm with "
                                 "length buckets: give k and keep lengths='buckets'.")
            if self.reconstruction == "common":
                raise ValueError("Arm(reconstruction='common') has no meaning with P per layer or head (one R "
                                 "would map every layer's own P): use fixed or per_layer.")
            if self.budget and self.granularity == "pooled":
                raise ValueError("Arm(budget=True) gives each layer its own k: it needs granularity 'layer' or "
                                 "'head'.")
        if (self.k is None) != (self.reconstruction is None):
            raise ValueError(f"Arm(k={self.k!r}, reconstruction={self.reconstruction!r}): give both (a partial "
                             "arm) or neither (the exact arm).")
        if self.recovery not in RECOVERIES:
            raise ValueError(f"Arm(recovery={self.recovery!r}): use one of {RECOVERIES}.")
        if self.lengths not in LENGTH_MODES:
            raise ValueError(f"Arm(lengths={self.lengths!r}): use one of {LENGTH_MODES}.")
        if self.k is None:
            if self.recovery != "mlm":
                raise ValueError(f"Arm(recovery={self.recovery!r}) needs a k: the exact arm continues MLM "
                                 "(recovery='mlm'); a model without recovery or distilled is a converted one, "
                                 "Arm(k=K, reconstruction='common', recovery=...).")
            if self.lengths != "buckets":
                raise ValueError(f"Arm(lengths={self.lengths!r}) needs a k: the exact arm has no pattern; leave "
                                 "lengths at its default.")
            return
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"Arm(k={self.k!r}): k must be an int >= 1 (exact scores per query).")
        if self.reconstruction not in RECONSTRUCTION_MODES:
            raise ValueError(f"Arm(reconstruction={self.reconstruction!r}): use one of {RECONSTRUCTION_MODES}.")

    @property
    def is_exact(self) -> bool:
        return self.k is None

    @property
    def trains(self) -> bool:
        """Whether the arm has a phase-2 job (``mlm_<name>``): every arm but those with recovery ``none``."""
        return self.recovery != "none"

    @property
    def trains_r(self) -> bool:
        """Whether R is a parameter (``common`` / ``per_layer``)."""
        return self.reconstruction in ("common", "per_layer")

    @property
    def name(self) -> str:
        """The key of the arm's jobs and report row: ``exact`` or ``k<k>_<reconstruction>_<recovery>``, with
        ``_zerofill`` for the zero-fill arm."""
        if self.k is None:
            return "exact"
        return (f"k{self.k}_{self.reconstruction}_{self.recovery}"
                + ("_zerofill" if self.lengths == "zero_fill" else "")
                + ("" if self.granularity == "pooled" else f"_{self.granularity}") + self._budget_suffix)

    @property
    def _budget_suffix(self) -> str:
        """``_budget``, ``_exact4`` (a budget with layer 4 exact; ``_exact1and4``) or nothing (one k)."""
        if self.exact_layers:
            return "_exact" + "and".join(map(str, self.exact_layers))
        return "_budget" if self.budget else ""

    @property
    def budget_name(self) -> str:
        """The suffix of `derive_budget`'s file for the arm: ``budget``, ``exact4``, ... (``uniform`` for one k)."""
        return self._budget_suffix.removeprefix("_") or "uniform"

    @property
    def form(self) -> str:
        """P and R as the report shows them: ``pooled``, ``head``, ``head_budget``, ..."""
        return self.granularity + self._budget_suffix

    @property
    def mode(self) -> str:
        """R as the report's table shows it (``-`` for the exact arm)."""
        return self.reconstruction or "-"

    def twin(self, **changes) -> Arm:
        """The arm with some fields changed (``twin(lengths="buckets")``: the zero-fill arm's buckets twin)."""
        return replace(self, **changes)


def layers_key(k: int, granularity: str, exact_layers=()) -> str:
    """The key of an arm's per-layer ks in the study's patterns record: ``k16_head``, ``k16_head_exact4``."""
    return f"k{k}_{granularity}" + ("_exact" + "and".join(map(str, exact_layers)) if exact_layers else "")


def parse_arm(text: str, field_name: str, lengths: str = "buckets") -> Arm:
    """``"16:common:distill"`` (k, R mode, recovery) or ``"16:per_layer:distill:head_budget"`` (and P and R's form:
    ``pooled``, ``layer``, ``head``, with ``_budget`` for a k per layer) as an `Arm`; a ValueError naming
    ``field_name`` otherwise."""
    parts = text.split(":")
    try:
        if len(parts) not in (3, 4):
            raise ValueError("three or four fields")
        form = parts[3] if len(parts) == 4 else "pooled"
        match = re.fullmatch(r"([a-z]+)(?:_(budget)|_exact(\d+(?:and\d+)*))?", form)
        if match is None:
            raise ValueError(f"form {form!r}")
        exact = tuple(int(layer) for layer in match[3].split("and")) if match[3] else ()
        return Arm(int(parts[0]), parts[1], parts[2], lengths, match[1], bool(match[2] or exact), exact)
    except ValueError as err:
        raise ValueError(f"--{field_name} {text!r} is not an arm k:mode:recovery[:form] ({err}); write e.g. "
                         f"'16:common:distill' or '16:per_layer:distill:head_budget' (mode in {RECONSTRUCTION_MODES}, "
                         f"recovery in {RECOVERIES}, form in {GRANULARITY_FORMS} with an optional _budget or "
                         "_exact<l>)."
                         ) from err


@dataclass(frozen=True)
class StudyArms:
    """The arms of one study, in the order of the report's rows: `finetune` (every arm), `mlm` (those with a
    phase-2 job: exact and every arm with recovery mlm or distill) and `converted` (recovery none: a ``conv_``
    job, converted losses only)."""

    finetune: tuple[Arm, ...]

    @property
    def mlm(self) -> tuple[Arm, ...]:
        return tuple(arm for arm in self.finetune if arm.trains)

    @property
    def converted(self) -> tuple[Arm, ...]:
        return tuple(arm for arm in self.finetune if not arm.trains)

    def by_name(self) -> dict[str, Arm]:
        """Every arm by its `name` (names are unique: `study_arms` checks it)."""
        return {arm.name: arm for arm in self.finetune}


def study_arms(ks, modes, recoveries=RECOVERIES, zero_fill_control: Arm | None = None, extra=()) -> StudyArms:
    """The exact arm; per k, per recovery, per R mode one arm with length buckets; the ``extra`` arms (P and R per
    layer or head: ``--granularity_arms``); then the zero-fill control."""
    arms = [Arm(), *(Arm(k, mode, recovery) for k in ks for recovery in recoveries for mode in modes), *extra]
    if zero_fill_control is not None:
        if zero_fill_control.twin(lengths="buckets") not in arms:
            raise ValueError(f"--zero_fill_control {zero_fill_control.name}: its buckets twin "
                             f"{zero_fill_control.twin(lengths='buckets').name} is not an arm of the study; pick k "
                             "from --ks, a mode from --modes and a recovery from --recoveries, or pass ''.")
        arms.append(zero_fill_control.twin(lengths="zero_fill"))
    names = [arm.name for arm in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"The study's arms {names} repeat a name; list each k once in --ks, each mode once in "
                         "--modes and each recovery once in --recoveries.")
    return StudyArms(tuple(arms))


@dataclass
class StudyArguments:
    # Sized for <= 3 h on 2 cores in all (`budget.estimate_seconds`: about 2.4 h for these defaults, from
    # step times measured on 2 cores at n = 128: an MLM step 0.095 s per window, attention transfer + distill 0.63 s
    # per window (its KL needs the vocabulary logits at every token, teacher and student), fine-tuning 0.035 s per
    # pair, evaluation 0.022 s per window and 0.009 s per pair). 20 arms x 3 seeds of fine-tuning are more than half
    # of it: hence batch 16, 100 steps and 1,600 held-out pairs (the first study: batch 32, 120 steps, 2,600 pairs).
    output_dir: str = field(default="results/table1", metadata={"help": "table1.md / table1.json go here."})
    run_dir: str = field(default="runs/table1", metadata={"help": "Jobs, checkpoints (resumable; not committed)."})
    cards_dir: str = field(default="model_cards", metadata={"help": "Model cards go to <cards_dir>/table1-<arm>/."})
    model_name_or_path: str | None = field(default=None, metadata={
        "help": "Exact BERT-family model to start from (default: the packaged all-MiniLM-L6-v2)."})
    pretrain_dataset_name: str | None = field(default=None, metadata={
        "help": "Hub text dataset for MLM (default: Python's own English prose, offline)."})
    pretrain_dataset_config_name: str | None = None
    pretrain_train_file: str | None = None
    task: str = field(default="next_sentence", metadata={"choices": ("next_sentence", "sentence_order", "mnli")})
    finetune_dataset_name: str = "nyu-mll/glue"
    finetune_dataset_config_name: str = "mnli"
    finetune_train_file: str | None = None
    finetune_validation_file: str | None = None
    train_every: int = field(default=3, metadata={
        "help": "Document i is a training document when i %% train_every == 0; the others are held out (test)."})
    selection_every: int = field(default=10, metadata={
        "help": "Every selection_every-th training document is the validation split of the R learning-rate "
                "selection, and used for nothing else."})
    max_seq_length: int = 128
    lengths: str = field(default="16,32,64,128", metadata={
        "help": "Length buckets of the partial arms (ending with --max_seq_length)."})
    bucket_fit_inputs: int | None = field(default=None, metadata={
        "help": "At most this many training sentences and paragraphs for the bucket fit (default: all)."})
    ks: str = "8,16"
    modes: str = "fixed,common,per_layer"
    recoveries: str = field(default="none,mlm,distill", metadata={
        "help": "Phase 2 of the partial arms: none, mlm and/or distill (--distill_objective)."})
    zero_fill_control: str = field(default="16:common:distill", metadata={
        "help": "k:mode:recovery of the one zero-fill arm, the control of the length buckets ('' for none)."})
    distill_objective: str = field(default="attention_transfer,distill", metadata={
        "help": "--recovery_objective of the distill arms (every weight trains; the teacher is the phase-1 model)."})
    reconstruction_learning_rates: str = field(default="1e-3,1e-2", metadata={
        "help": "Candidate learning rates of R; the one of lowest MLM loss on the selection split is used for "
                "every trained R (phase 2 and fine-tuning)."})
    granularity_arms: str = field(default="", metadata={
        "help": "Comma-separated arms k:mode:recovery:form with P and R per layer or head (form layer, head, "
                "layer_budget or head_budget; mode fixed or per_layer), e.g. '16:per_layer:distill:head_budget'."})
    rlr_arm: str = field(default="16:common:distill", metadata={
        "help": "k:mode:recovery of the arm trained once per candidate R learning rate ('' with one candidate)."})
    covariance: str = field(default="second_moment", metadata={"choices": ("second_moment", "centered")})
    covariance_windows: int = 256
    phase1_steps: int = 150
    phase1_batch_size: int = 32
    phase1_learning_rate: float = field(default=5e-4, metadata={
        "help": "Peak lr of phase 1 (the MLM head is new: higher than the arms' --pretrain_learning_rate)."})
    arm_steps: int = field(default=32, metadata={"help": "Phase-2 steps of every arm (MLM and distill alike)."})
    pretrain_batch_size: int = field(default=16, metadata={"help": "Batch of phase 2 and of the R-lr selection."})
    pretrain_learning_rate: float = 1e-4
    mlm_eval_windows: int = field(default=256, metadata={
        "help": "Test windows whose MLM loss is measured, and at most as many selection windows."})
    mlm_eval_pairs: int = field(default=512, metadata={
        "help": "Held-out pairs (spread over their lengths) whose MLM loss is measured (0: all)."})
    finetune_steps: int = 100
    finetune_batch_size: int = 16
    finetune_learning_rate: float = 1e-4
    finetune_seeds: str = "0,1,2"
    max_finetune_eval: int | None = field(default=1600, metadata={"help": "Held-out pairs (0: all)."})
    timing_batch_size: int = 32
    timing_repeats: int = 3
    seed: int = 0
    threads: int = field(default=0, metadata={"help": "torch threads (0: torch's default)."})
    bf16: bool = False
    progress: bool = True

    def __post_init__(self):
        from hf_partial_attention.pattern_buckets import check_lengths
        from hf_partial_attention.training.recovery import parse_recovery_objective

        for name in ("phase1_steps", "covariance_windows", "mlm_eval_windows", "mlm_eval_pairs"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}.")
        if self.arm_steps < 1:  # phase 2 is the study: every recovered arm starts from its checkpoint
            raise ValueError(f"arm_steps must be >= 1 (phase 2 trains each arm), got {self.arm_steps}.")
        if self.finetune_steps < 1 or not self.seeds:
            raise ValueError("Fine-tuning needs finetune_steps >= 1 and at least one seed in --finetune_seeds.")
        if self.selection_every < 2:
            raise ValueError(f"selection_every must be >= 2 (some training documents train), got "
                             f"{self.selection_every}.")
        if self.bucket_fit_inputs is not None and self.bucket_fit_inputs < 1:
            raise ValueError(f"bucket_fit_inputs must be >= 1 or unset (all), got {self.bucket_fit_inputs}.")
        bad = [m for m in self.mode_list if m not in RECONSTRUCTION_MODES]
        if bad:
            raise ValueError(f"--modes has {bad}; use fixed, common and/or per_layer.")
        bad = [r for r in self.recovery_list if r not in RECOVERIES]
        if bad or not self.recovery_list:
            raise ValueError(f"--recoveries {self.recoveries!r}: use one or more of {RECOVERIES}, comma-separated.")
        lengths = check_lengths(self.length_list, "--lengths")
        if lengths[-1] != self.max_seq_length:
            raise ValueError(f"--lengths {self.lengths} must end with --max_seq_length {self.max_seq_length} (the "
                             f"longest bucket is n); add {self.max_seq_length}.")
        parse_recovery_objective(self.distill_objective)  # a ValueError naming the term
        try:
            rates = self.learning_rate_list
        except ValueError as err:
            raise ValueError(f"--reconstruction_learning_rates {self.reconstruction_learning_rates!r} must be "
                             "comma-separated numbers, e.g. '1e-3,1e-2'.") from err
        if not rates or min(rates) <= 0 or len(set(rates)) != len(rates):
            raise ValueError(f"--reconstruction_learning_rates {self.reconstruction_learning_rates!r}: give one or "
                             "more distinct positive rates, e.g. '1e-3,1e-2'.")
        arms = self.arms()  # every arm valid, no name twice
        if self.rlr_arm:
            arm = self.selection_arm
            if arm not in arms.finetune or not arm.trains or not arm.trains_r:
                raise ValueError(f"--rlr_arm {self.rlr_arm!r} must be an arm of the study that trains R in phase 2 "
                                 "(mode common or per_layer, recovery mlm or distill); pick one from --ks, --modes "
                                 "and --recoveries, or pass '' with a single --reconstruction_learning_rates.")
        elif len(rates) > 1:
            raise ValueError(f"--rlr_arm '' selects no R learning rate, but --reconstruction_learning_rates "
                             f"{self.reconstruction_learning_rates!r} has {len(rates)}; give one rate or an arm "
                             "such as '16:common:distill'.")

    @property
    def k_list(self) -> list[int]:
        return _ints(self.ks)

    @property
    def mode_list(self) -> list[str]:
        return [m for m in self.modes.split(",") if m]

    @property
    def recovery_list(self) -> list[str]:
        return [r for r in self.recoveries.split(",") if r]

    @property
    def length_list(self) -> list[int]:
        return _ints(self.lengths)

    @property
    def learning_rate_list(self) -> list[float]:
        return [float(x) for x in self.reconstruction_learning_rates.split(",") if x.strip()]

    @property
    def seeds(self) -> list[int]:
        return _ints(self.finetune_seeds)

    @property
    def control_arm(self) -> Arm | None:
        """The zero-fill control (None without one)."""
        return parse_arm(self.zero_fill_control, "zero_fill_control", "zero_fill") if self.zero_fill_control else None

    @property
    def selection_arm(self) -> Arm | None:
        """The arm of the R learning-rate selection (None without one)."""
        return parse_arm(self.rlr_arm, "rlr_arm") if self.rlr_arm else None

    @property
    def granularity_arm_list(self) -> list[Arm]:
        return [parse_arm(text, "granularity_arms") for text in self.granularity_arms.split(",") if text.strip()]

    def arms(self) -> StudyArms:
        return study_arms(self.k_list, self.mode_list, self.recovery_list, self.control_arm, self.granularity_arm_list)

    def result_fields(self) -> dict:
        fields = {k: v for k, v in asdict(self).items() if k not in _NOT_RESULTS}
        if not fields["granularity_arms"]:  # a study without them is the one run before the field existed
            del fields["granularity_arms"]
        return fields


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def job_names(a: StudyArguments) -> list[str]:
    """Every job of the study in the order it runs, by the name of its JSON file under ``run_dir/jobs``. ``rlr``
    (the R learning rate, chosen on the selection split) comes before every job that reads the test split."""
    arms = a.arms()
    return (["phase1", "patterns", "rlr", "phase1_eval"] + [f"conv_{arm.name}" for arm in arms.converted]
            + [f"mlm_{arm.name}" for arm in arms.mlm]
            + [f"ft_{arm.name}_s{s}" for arm in arms.finetune for s in a.seeds] + ["timing"])

"""What the Table-1 study runs, as types: its flags (`StudyArguments`) and its jobs; its arms are `arms`'.

The runner (`table1`) and the report (`report`) both import this module, and the report never imports
the runner: the runner builds the arms with `study_arms`, the report reads the same arms back from the same
arguments.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hf_partial_attention.configuration_partial_bert import RECONSTRUCTION_MODES

from .arms import GRANULARITY_FORMS, LENGTH_MODES, RECOVERIES, Arm, StudyArms, layers_key, parse_arm, study_arms

__all__ = ["Arm", "layers_key", "StudyArguments", "StudyArms", "study_arms", "job_names", "parse_arm",
           "RECONSTRUCTION_MODES", "RECOVERIES", "LENGTH_MODES", "GRANULARITY_FORMS", "BUCKET_OBJECTIVE", "COMMAND"]

# How the study is run (`experiments.cli`); the report and the cards cite it.
COMMAND = "python -m experiments table1"

# The greedy objective of the length buckets (`analysis.derive.derive_lengths`); the zero-fill pattern keeps the
# paper's.
BUCKET_OBJECTIVE = "fisher"

# Arguments that do not change any result: changing them on resume is allowed.
_NOT_RESULTS = ("output_dir", "cards_dir", "threads", "run_dir", "progress")


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

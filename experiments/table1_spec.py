"""What the Table-1 study runs, as types: its flags (`StudyArguments`), its arms (`Arm`) and its jobs.

The runner (`table1`) and the report (`table1_report`) both import this module, and the report never imports
the runner: the runner builds the arms with `study_arms`, the report reads the same arms back from the same
arguments. An arm's `name` (``exact``, ``k16_common``, ``k8_converted``) is only an output, the key of its job
files under ``run_dir/jobs`` and of its row in ``table1.json``; nothing parses it back.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hf_partial_attention.configuration_partial_bert import RECONSTRUCTION_MODES

__all__ = ["Arm", "StudyArguments", "StudyArms", "study_arms", "job_names", "RECONSTRUCTION_MODES", "COMMAND"]

# How the study is run (`experiments.cli`); the report and the cards cite it.
COMMAND = "python -m experiments table1"

# Arguments that do not change any result: changing them on resume is allowed.
_NOT_RESULTS = ("output_dir", "cards_dir", "threads", "run_dir", "progress")


@dataclass(frozen=True)
class Arm:
    """One arm of the study.

    Attributes:
        k: exact scores per query of the partial layers; None for the exact model.
        reconstruction: R of the converted model (one of `RECONSTRUCTION_MODES`); None for the exact model.
        recovery: whether phase 2 (MLM with partial attention built in) runs before fine-tuning; False is the
            phase-1 exact model converted and fine-tuned at once (the paper's "performs poorly").
    """

    k: int | None = None
    reconstruction: str | None = None
    recovery: bool = True

    def __post_init__(self):
        if (self.k is None) != (self.reconstruction is None):
            raise ValueError(f"Arm(k={self.k!r}, reconstruction={self.reconstruction!r}): give both (a partial "
                             "arm) or neither (the exact arm).")
        if self.k is None:
            if not self.recovery:
                raise ValueError("Arm(recovery=False) needs a k: the exact arm always runs phase 2; a model "
                                 "without recovery is a converted one, Arm(k=K, reconstruction='common', "
                                 "recovery=False).")
            return
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"Arm(k={self.k!r}): k must be an int >= 1 (exact scores per query).")
        if self.reconstruction not in RECONSTRUCTION_MODES:
            raise ValueError(f"Arm(reconstruction={self.reconstruction!r}): use one of {RECONSTRUCTION_MODES}.")
        if not self.recovery and self.reconstruction != "common":
            raise ValueError(f"Arm(k={self.k}, reconstruction={self.reconstruction!r}, recovery=False): arms without "
                             "recovery are converted with a common R (reconstruction='common'), which their name "
                             "kK_converted implies.")

    @property
    def is_exact(self) -> bool:
        return self.k is None

    @property
    def name(self) -> str:
        """The key of the arm's jobs and report row: ``exact``, ``k<k>_<reconstruction>`` or ``k<k>_converted``."""
        if self.k is None:
            return "exact"
        return f"k{self.k}_{self.reconstruction if self.recovery else 'converted'}"

    @property
    def mode(self) -> str:
        """R as the report's table shows it (``-`` for the exact arm)."""
        return self.reconstruction or "-"

    def recovered(self) -> Arm:
        """The arm with phase 2: for an arm without recovery, the one whose converted model is the same weights."""
        return Arm(self.k, self.reconstruction, recovery=True)


@dataclass(frozen=True)
class StudyArms:
    """The arms of one study: `mlm` (phase 2: exact and one per k and R) and `finetune` (those plus the arms
    fine-tuned without recovery), each in the order of the report's rows."""

    mlm: tuple[Arm, ...]
    finetune: tuple[Arm, ...]

    def by_name(self) -> dict[str, Arm]:
        """Every arm by its `name` (names are unique: `study_arms` checks it)."""
        return {arm.name: arm for arm in self.finetune}


def study_arms(ks, modes, no_recovery_ks=()) -> StudyArms:
    """The exact arm, one arm per (k, R mode) in that order, then one converted arm per k in `no_recovery_ks`."""
    mlm = (Arm(), *(Arm(k, mode) for k in ks for mode in modes))
    finetune = (*mlm, *(Arm(k, "common", recovery=False) for k in no_recovery_ks))
    names = [arm.name for arm in finetune]
    if len(set(names)) != len(names):
        raise ValueError(f"The study's arms {names} repeat a name; list each k once in --ks and --no_recovery_ks "
                         "and each mode once in --modes.")
    return StudyArms(mlm, finetune)


@dataclass
class StudyArguments:
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
        "help": "Document i is a training document when i %% train_every == 0; the others are held out."})
    max_seq_length: int = 128
    ks: str = "8,16"
    modes: str = "fixed,common,per_layer"
    no_recovery_ks: str = field(default="8", metadata={
        "help": "k of the arms fine-tuned right after conversion (common R), without MLM recovery."})
    covariance: str = field(default="second_moment", metadata={"choices": ("second_moment", "centered")})
    covariance_windows: int = 256
    phase1_steps: int = 150
    phase1_learning_rate: float = field(default=5e-4, metadata={
        "help": "Peak lr of phase 1 (the MLM head is new: higher than the arms' --pretrain_learning_rate)."})
    arm_steps: int = 60
    pretrain_batch_size: int = 32
    pretrain_learning_rate: float = 1e-4
    reconstruction_learning_rate: float | None = None
    mlm_eval_windows: int = 256
    finetune_steps: int = 120
    finetune_batch_size: int = 32
    finetune_learning_rate: float = 1e-4
    finetune_seeds: str = "0,1,2"
    max_finetune_eval: int | None = field(default=2600, metadata={"help": "Held-out pairs (0: all)."})
    timing_batch_size: int = 32
    timing_repeats: int = 5
    seed: int = 0
    threads: int = field(default=0, metadata={"help": "torch threads (0: torch's default)."})
    bf16: bool = False
    progress: bool = True

    def __post_init__(self):
        for name in ("phase1_steps", "covariance_windows", "mlm_eval_windows"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}.")
        if self.arm_steps < 1:  # phase 2 is the study: every fine-tuning arm starts from its checkpoint
            raise ValueError(f"arm_steps must be >= 1 (phase 2 trains each arm), got {self.arm_steps}.")
        if self.finetune_steps < 1 or not self.seeds:
            raise ValueError("Fine-tuning needs finetune_steps >= 1 and at least one seed in --finetune_seeds.")
        bad = [m for m in self.mode_list if m not in RECONSTRUCTION_MODES]
        if bad:
            raise ValueError(f"--modes has {bad}; use fixed, common and/or per_layer.")
        if not set(self.no_recovery_k_list) <= set(self.k_list):
            raise ValueError(f"--no_recovery_ks {self.no_recovery_ks} must be among --ks {self.ks}.")
        self.arms()  # every arm valid, no name twice

    @property
    def k_list(self) -> list[int]:
        return _ints(self.ks)

    @property
    def mode_list(self) -> list[str]:
        return [m for m in self.modes.split(",") if m]

    @property
    def no_recovery_k_list(self) -> list[int]:
        return _ints(self.no_recovery_ks)

    @property
    def seeds(self) -> list[int]:
        return _ints(self.finetune_seeds)

    def arms(self) -> StudyArms:
        return study_arms(self.k_list, self.mode_list, self.no_recovery_k_list)

    def result_fields(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in _NOT_RESULTS}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def job_names(a: StudyArguments) -> list[str]:
    """Every job of the study, by the name of its JSON file under ``run_dir/jobs``."""
    arms = a.arms()
    return (["phase1", "patterns", "timing"] + [f"mlm_{arm.name}" for arm in arms.mlm]
            + [f"ft_{arm.name}_s{s}" for arm in arms.finetune for s in a.seeds])
